#!/usr/bin/env python
"""Hugging Face models, side by side in one process (docs/hf.md). Prints ONE JSON object on stdout.

1. converted_vs_native_throughput: a training step (forward, cross-entropy, backward, AdamW step) of the converted
   (growable) Llama ÷ the same step of the unconverted model with the same weights, as tokens/s (≥ 0.95 wanted).
2. stats_step_cost_ratio: a step of the converted model with statistics capture on every layer and the captured
   pairs folded into FormStats, as the callback does ÷ a normal step of the converted model (≤ 1.5 wanted), for
   capture `explicit` (the score map's gradient, what capture=auto picks on CPU) and `extend` (the queries'
   zero-extension, docs/design.md §4).

Timing rules (docs/design.md §9): warm-up excluded, the variants interleaved in rotating order, per-repeat ratios, medians.

    HF_HUB_OFFLINE=1 python scripts/bench_hf.py [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lit_growattn.growth import FormStats  # noqa: E402
from lit_growattn.hf import GrowableAttention, make_growable  # noqa: E402


def llama(layers: int, hidden: int, heads: int, kv_heads: int, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def step_fn(model, ids: torch.Tensor, capture: str | None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forms = [m for m in model.modules() if isinstance(m, GrowableAttention)]
    sums = [FormStats.empty_like(f) for f in forms] if capture else []

    def step() -> None:
        for f in forms:
            f.capture = capture
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        for f, s in zip(forms, sums):
            for xa, gx in f.take_captured():
                s.update(xa, gx)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds), same keys")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: stable on a shared machine)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = dict(layers=2, hidden=64, heads=4, kv_heads=2) if args.quick else dict(layers=4, hidden=256, heads=8, kv_heads=4)
    batch, seq = (4, 64) if args.quick else (8, 256)
    native = llama(**shape)
    converted = copy.deepcopy(native)
    make_growable(converted)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    steps = {"native": step_fn(native, ids, None), "converted": step_fn(converted, ids, None),
             "stats_explicit": step_fn(converted, ids, "explicit"), "stats_extend": step_fn(converted, ids, "extend")}
    for fn in steps.values():  # warm-up
        fn(), fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timed(steps[name]))
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    print(json.dumps({
        "shape": {**shape, "batch": batch, "seq": seq, "threads": args.threads, "dtype": "float32", "device": "cpu"},
        "converted_vs_native_throughput": round(ratio("native", "converted"), 3),
        "stats_step_cost_ratio": {c: round(ratio(f"stats_{c}", "converted"), 3) for c in ("explicit", "extend")},
        "median_step_seconds": {name: round(statistics.median(t), 4) for name, t in times.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
