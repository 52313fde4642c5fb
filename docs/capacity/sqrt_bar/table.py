"""Prints the table of docs/experiments_capacity.md, "A bar between the two: existing gain over √d_head", from
runs.json, beside the current rule's runs of the same seeds (750 steps: ../fresh_seeds/runs.json; 3000 steps:
../long_training/runs.json), and per corpus and length the criteria's summary.

    python docs/capacity/sqrt_bar/table.py
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import above, current_rule_runs, signed  # noqa: E402

here = Path(__file__).parent
sqrt_runs = json.loads((here / "runs.json").read_text())
current_runs = current_rule_runs()


print("| corpus | steps | seed | current rule: found, vs static 16 | √d bar: found | √d bar vs static 16 | "
      "static at its widths vs 16 | √d bar vs static at its widths | K cache | last growth | started at 16 |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
summaries = []
for steps, corpora in sqrt_runs.items():
    for corpus, seeds in corpora.items():
        gaps, k_caches, widths = {"auto": [], "width": [], "path": []}, [], []
        for seed, rows in seeds.items():
            current = current_runs[steps][corpus][seed]
            static16 = current["static d_head 16"]
            grown, found = rows["auto from d_head 1"], rows["static at the auto sizes"]["final"]["loss"]
            loss, was = grown["final"]["loss"], current["auto from d_head 1"]["final"]
            k_cache = grown["kcache_bytes"] / static16["kcache_bytes"]
            grew = [e["step"] for e in grown["events"] if e["d_head"] != e["d_head_before"]]
            ample = rows.get("auto from d_head 16")
            started_at_16 = "—" if ample is None else (
                "no growth" if set(ample["final"]["d_head"]) == {16} else f"grew to {ample['final']['d_head']}")
            reference = static16["final"]["loss"]
            print(f"| {corpus} | {steps} | {seed} | {was['d_head']}, {signed(above(was['loss'], reference))} % | "
                  f"{grown['final']['d_head']} | {loss:.4f} ({signed(above(loss, reference))} %) | "
                  f"{signed(above(found, reference))} % | {signed(above(loss, found))} % | {100 * k_cache:.0f} % | "
                  f"{max(grew, default='—')} | {started_at_16} |")
            gaps["auto"].append(above(loss, reference))
            gaps["width"].append(above(found, reference))
            gaps["path"].append(above(loss, found))
            k_caches.append(k_cache)
            widths.append(grown["final"]["d_head"])
        spreads = [max(layer) / min(layer) for layer in zip(*widths)]
        summaries.append(
            f"{corpus}, {steps} steps: √d bar vs static 16 on the mean {signed(statistics.mean(gaps['auto']))} % "
            f"(within 1 % on {sum(g <= 1 for g in gaps['auto'])} of {len(gaps['auto'])}); K cache over half on "
            f"{sum(k > 0.5 for k in k_caches)}; both within 1 % and at most half on "
            f"{sum(g <= 1 and k <= 0.5 for g, k in zip(gaps['auto'], k_caches))}; spread per layer "
            f"{', '.join(f'{s:.2f}×' for s in spreads)}; static at "
            f"its widths vs 16 {signed(statistics.mean(gaps['width']))} %; √d bar vs static at its widths "
            f"{signed(statistics.mean(gaps['path']))} %")
print("", *summaries, sep="\n")
