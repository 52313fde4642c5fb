"""Prints the table of docs/experiments_capacity.md, "What half the K cache costs a static model": static d_head 8
and, on usrdoc, the unequal widths [6, 10] and [10, 6] (runs.json) against static d_head 16 of the same seed and
length, beside the automatic schedule under the current rule (750 steps: ../fresh_seeds/runs.json; 3000 steps:
../long_training/runs.json) and under the √d_head bar (../sqrt_bar/runs.json).

    python docs/capacity/half_k_cache/table.py
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import above, current_rule_runs, signed  # noqa: E402

here = Path(__file__).parent
static8 = json.loads((here / "runs.json").read_text())
current_runs = current_rule_runs()
sqrt_runs = json.loads((here.parent / "sqrt_bar" / "runs.json").read_text())


def final(run: dict) -> float:
    return run["final"]["loss"]


UNEQUAL = ("static d_head [6, 10]", "static d_head [10, 6]")
print("| corpus | steps | seed | static 16 | static 8 (vs 16) | static [6, 10], [10, 6] (vs 16) | "
      "auto, current rule (vs 16) | auto, √d_head bar (vs 16) |")
print("|---|---|---|---|---|---|---|---|")
summaries = []
for steps, corpora in static8.items():
    for corpus, seeds in corpora.items():
        gaps, unequal = [], []
        for seed, rows in seeds.items():
            run = rows["static d_head 8"]
            reference = final(current_runs[steps][corpus][seed]["static d_head 16"])
            current = current_runs[steps][corpus][seed]["auto from d_head 1"]
            sqrt = sqrt_runs[steps][corpus][seed]["auto from d_head 1"]
            gaps.append(above(final(run), reference))
            split = [above(final(rows[name]), reference) for name in UNEQUAL if name in rows]
            unequal += split
            print(f"| {corpus} | {steps} | {seed} | {reference:.4f} | {final(run):.4f} ({signed(gaps[-1])} %) | "
                  f"{', '.join(signed(g) + ' %' for g in split) or '—'} | "
                  f"{current['final']['d_head']}, {signed(above(final(current), reference))} % | "
                  f"{sqrt['final']['d_head']}, {signed(above(final(sqrt), reference))} % |")
        summaries.append(f"{corpus}, {steps} steps: static 8 vs static 16 on the mean {signed(statistics.mean(gaps))} %, "
                         f"within 1 % on {sum(g <= 1 for g in gaps)} of {len(gaps)}"
                         + (f"; unequal widths within 1 % on {sum(g <= 1 for g in unequal)} of {len(unequal)}"
                            if unequal else ""))
print("", *summaries, sep="\n")
