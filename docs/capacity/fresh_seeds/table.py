"""Prints the tables of docs/experiments_capacity.md, "Seeds the rule was not developed on", from runs.json.

    python docs/capacity/fresh_seeds/table.py
"""

import json
import statistics
from pathlib import Path

runs = json.loads((Path(__file__).parent / "runs.json").read_text())
for size, corpora in runs.items():
    print(f"\n{size}\n")
    print("| corpus | seed | static d_head 16 | auto: found d_head | val loss (vs static 16) | K cache share | "
          "static at the found widths | started at 16 |")
    print("|---|---|---|---|---|---|---|---|")
    summaries = []  # after the table, which they would otherwise split
    for corpus, seeds in corpora.items():
        widths, relative, auto, static_at_found = [], [], [], []
        for seed, run in seeds.items():
            static16 = run["static d_head 16"]["final"]["loss"]
            grown, found = run["auto from d_head 1"]["final"], run["static at the auto sizes"]["final"]["loss"]
            widths.append(grown["d_head"])
            relative.append(100 * (grown["loss"] / static16 - 1))
            auto.append(grown["loss"])
            static_at_found.append(found)
            k_cache = 100 * sum(grown["d_head"]) / (16 * len(grown["d_head"]))
            ample = run.get("auto from d_head 16")
            started_at_16 = "—" if ample is None else (
                "no growth" if set(ample["final"]["d_head"]) == {16} else f"grew to {ample['final']['d_head']}")
            print(f"| {corpus} | {seed} | {static16:.4f} | {grown['d_head']} | {grown['loss']:.4f} "
                  f"({relative[-1]:+.2f} %) | {k_cache:.0f} % | {found:.4f} | {started_at_16} |")
        spread = [max(layer) / min(layer) for layer in zip(*widths)]
        summaries.append(f"{corpus}: within 1 % on {sum(r <= 1 for r in relative)} of {len(relative)}, mean "
              f"{statistics.mean(relative):+.2f} %; auto {statistics.mean(auto):.4f} against static at the found "
              f"widths {statistics.mean(static_at_found):.4f} on the mean, lower on "
              f"{sum(a < s for a, s in zip(auto, static_at_found))}; widest spread {max(spread):.2f}× "
              f"(layer {spread.index(max(spread))})")
    print("", *summaries, sep="\n")
