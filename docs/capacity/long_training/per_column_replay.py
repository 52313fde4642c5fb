"""Replays the logged checks of docs/capacity/fresh_seeds (750 steps, seeds 3–5) under the per-column bar of
per_column.patch (a candidate against what an average existing column can still gain: the existing columns' gain
over d_head) and prints, per run, the first check where each layer would want more columns than the logged rule
did, and for how many checks it would want any column at all (started at d_head 16: all of them would go to the
spare-width gate). With a power p, the divisor is d_head ** p instead (0.5: ../sqrt_bar/sqrt_bar.patch).

    python docs/capacity/long_training/per_column_replay.py [p]
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from lit_growattn.growth.capacity import (  # noqa: E402
    CapacityRule, as_one_window, leading_block, poolable, pooled_with)

RULE = CapacityRule()
POWER = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0


def wanted(decision: dict, earlier: list[dict], power: float) -> int:
    held_out, in_sample, existing = as_one_window(poolable(earlier, decision), torch.float64)
    return leading_block(held_out, in_sample, existing / decision["d_head"] ** power, RULE)[2]


runs = json.loads((Path(__file__).parents[1] / "fresh_seeds" / "runs.json").read_text())
for size, corpora in runs.items():
    for corpus, seeds in corpora.items():
        for seed, rows in seeds.items():
            for row in ("auto from d_head 1", "auto from d_head 16"):
                if row not in rows:
                    continue
                events, first_more, wanting, checks = rows[row]["events"], {}, 0, 0
                for i, event in enumerate(events):
                    for d in event.get("decisions", []):
                        earlier = pooled_with(events[:i], d["layer"], d["d_head"], RULE.pool)
                        logged, replayed = wanted(d, earlier, 0.0), wanted(d, earlier, POWER)
                        assert logged == d["wanted"], "the replay must reproduce the logged rule"
                        checks, wanting = checks + 1, wanting + (replayed > 0)
                        if replayed > logged:
                            first_more.setdefault(d["layer"], (event["step"], d["d_head"], logged, replayed))
                print(f"{size} {corpus} seed {seed}, {row}: wants columns at {wanting} of {checks} layer checks; "
                      f"first check wanting more, per layer (step, d_head, logged, replayed): {first_more}")
