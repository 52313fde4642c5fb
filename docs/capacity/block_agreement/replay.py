"""Replays the logged decisions of earlier capacity-study runs under the current rule and lists, per run, the checks
whose `wanted` count would differ. A run none of whose decisions differ would be the same run under the current
rule (its training depends on the decisions only).

    python docs/capacity/block_agreement/replay.py docs/capacity/spare_width/gate_2layer.json \
        docs/capacity/spare_width/gate_8layer.json
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from lit_growattn.growth.capacity import (  # noqa: E402
    CapacityRule, as_one_window, leading_block, poolable, pooled_with)

RULE = CapacityRule()


def wanted(decision: dict, earlier: list[dict]) -> int:
    """The current rule's count from the raw gains of this check and the earlier ones it pools, as `decide` takes it."""
    return leading_block(*as_one_window(poolable(earlier, decision), torch.float64), RULE)[2]


for path in sys.argv[1:]:
    for kind, corpora in json.loads(Path(path).read_text()).items():
        if kind not in ("auto", "ample"):
            continue
        for corpus, runs in corpora.items():
            for seed, run in enumerate(runs):
                events = run["events"]
                differ = [(e["step"], d["layer"], d["d_head"], d["wanted"], now) for i, e in enumerate(events)
                          for d in e.get("decisions", [])
                          if (now := wanted(d, pooled_with(events[:i], d["layer"], d["d_head"], RULE.pool))) != d["wanted"]]
                print(Path(path).name, kind, corpus, seed,
                      "unchanged" if not differ else f"differs at (step, layer, d_head, wanted, now): {differ}")
