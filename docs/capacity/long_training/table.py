"""Prints the table of docs/experiments_capacity.md, "Four times the steps", from runs.json, beside the same seeds'
750-step runs (docs/capacity/fresh_seeds/runs.json).

    python docs/capacity/long_training/table.py
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import above, current_rule_runs, signed  # noqa: E402

runs = current_rule_runs()
long_runs, short_runs = runs["3000"], runs["750"]


print("| corpus | seed | steps | static 16 | static 17 (vs 16) | auto: found d_head | auto (vs 16) | "
      "static at the found widths (vs 16) | auto vs static at its widths | last growth / last check | "
      "started at 16 |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
summaries = []
for corpus, seeds in long_runs.items():
    gaps = {"auto": [], "width": [], "path": [], "noise": []}
    for seed, run in seeds.items():
        for steps, rows in (("750", short_runs[corpus][seed]), ("3000", run)):
            static16 = rows["static d_head 16"]["final"]["loss"]
            grown, found = rows["auto from d_head 1"], rows["static at the auto sizes"]["final"]["loss"]
            loss = grown["final"]["loss"]
            grew = [e["step"] for e in grown["events"] if e["d_head"] != e["d_head_before"]]
            last_check = grown["events"][-1]["step"]  # before the run's last possible check: the schedule ended
            static17 = rows.get("static d_head 17")
            noise = "—" if static17 is None else (
                f"{static17['final']['loss']:.4f} ({signed(above(static17['final']['loss'], static16))} %)")
            ample = rows.get("auto from d_head 16")
            started_at_16 = "—" if ample is None else (
                "no growth" if set(ample["final"]["d_head"]) == {16} else f"grew to {ample['final']['d_head']}")
            print(f"| {corpus} | {seed} | {steps} | {static16:.4f} | {noise} | {grown['final']['d_head']} | "
                  f"{loss:.4f} ({signed(above(loss, static16))} %) | {found:.4f} ({signed(above(found, static16))} %) | "
                  f"{signed(above(loss, found))} % | {max(grew, default='—')} / {last_check} | {started_at_16} |")
            if steps == "3000":
                gaps["auto"].append(above(loss, static16))
                gaps["width"].append(above(found, static16))
                gaps["path"].append(above(loss, found))
                if static17 is not None:
                    gaps["noise"].append(above(static17["final"]["loss"], static16))
    summaries.append(f"{corpus}, 3000 steps, mean over seeds: auto vs static 16 {signed(statistics.mean(gaps['auto']))} % "
                     f"(within 1 % on {sum(g <= 1 for g in gaps['auto'])} of {len(gaps['auto'])}); static at the "
                     f"found widths vs 16 {signed(statistics.mean(gaps['width']))} %; auto vs static at its widths "
                     f"{signed(statistics.mean(gaps['path']))} %; static 17 vs 16 "
                     f"{', '.join(map(signed, gaps['noise']))} %")
print("", *summaries, sep="\n")
