#!/usr/bin/env python
"""Benchmarks of lit_growattn, side by side in one process (docs/design.md §4, §9). Prints ONE JSON object on stdout.

Measurements (one function each):
1. lightning_vs_plain_throughput: tokens/s of GrowAttentionLM under a lightning.Trainer (GrowAttentionCallback
   attached, its growth scheduled beyond the measured steps, so no statistics step is timed) ÷ tokens/s of a
   plain PyTorch loop on the same GPT with the same AdamW, param groups and schedule;
   budget_spent_vs_lightning_step_ratio: a step under AutoSchedule once its K-cache budget is spent ÷ that step
   (no statistics capture after the budget: ≈ 1, against stats_step_cost_ratio while it is being spent).
2. stats_step_cost_ratio & co.: a full training step with statistics capture (forward, backward, folding the
   captured (X′, G X′) pairs into FormStats as the callback's on_after_backward does, optimizer step) ÷ a
   normal step; for capture "extend" (SDPA zero-extension) and "explicit" (score map with retained gradient),
   and for the `pinv` method (per-instance pseudo-inverses in FormStats.update) beside the others;
   round_robin_step_cost_ratio: capture="auto" on a third of the layers (the callback's layers_per_step);
   value_step_cost_ratio, both_sides_step_cost_ratio: the value maps' capture (A·X′ and ∂L/∂Y, folded into
   ValueStats), alone and with the query/key capture="auto" (growth.grow: value, both; docs/value.md).
3. growth_event_seconds: GrowthPlan build + factorisation at one α for all forms (6 layers, e 256, 8 heads,
   d_head 8 → 16, statistics from b 32, s 256), per method; plus one full event driven through
   GrowAttentionCallback in a real fit, timed by the event itself (all-reduce, plan, line search, optimizer rebuild).
4. stats_peak_memory_ratio: bytes of tensors saved for backward in a statistics step ÷ a normal step
   (saved_tensors_hooks, deterministic); beside it the allocation peak of the whole step (profiler memory
   events, *_alloc_peak_ratio) and the captured G X′ pairs held until on_after_backward.
5. capture_sweep: one attention layer (QKForm.attend fwd+bwd+fold) at a fixed token count over sequence
   lengths, to check the callback's capture="auto" rule.
6. sketched statistics (statistics.sketch, size k 24, l 36, k_c 24): variants sketch_qk, sketch_value, sketch_both of
   measurement 2 (sketch_*_step_cost_ratio, sketch_vs_full_*_ratio), and per shape their memory (sums + the extra
   peak of a statistics step, full vs sketch, sketch_memory_ratio) (bench_sketch.py).
7. sketch_crossover: one-layer GPTs over n_embd, both sides, sketch vs full statistics step; κ = e′*/(k + l) at the
   width e′* where they cost the same (callback/checks.py SKETCH_CROSSOVER).
8. llama1b (--llama1b only, several CPU-minutes): two Llama-3.2-1B-shaped layers, plain vs full vs sketch.

Timing rules (docs/design.md §9): warm-up excluded, variants interleaved in rotating order inside one process,
per-repeat ratios against the normal step of the same repeat, medians over repeats. The machine may be
shared, so absolute times are only context; the ratios are the result. CPU runs use one intra-op thread by
default (--threads): see its help for why.

    python scripts/bench.py            # full CPU run (several minutes on 2 cores)
    python scripts/bench.py --quick    # small shapes, < 1 minute, same keys
    python scripts/bench.py --llama1b  # the full run and measurement 8
    python scripts/bench.py --accelerator gpu   # the GPU benchmark (bf16): runs scripts/bench_gpu.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import lightning as L
import torch

from bench_common import json_only_stdout
from bench_setup import PRESETS, Env
from bench_steps import measure_growth_event, measure_lightning_vs_plain, measure_stats_steps
from bench_memory import measure_capture_sweep, measure_memory
from bench_sketch import measure_crossover, measure_llama1b, measure_sketch_memory


SKETCH_KEYS = ("sketch_qk_step_cost_ratio", "sketch_value_step_cost_ratio", "sketch_both_sides_step_cost_ratio",
               "sketch_vs_full_qk_ratio", "sketch_vs_full_value_ratio", "sketch_vs_full_both_sides_ratio",
               "sketch_memory_ratio", "sketch_sums_ratio")


# -- driver ----------------------------------------------------------------------------------------
def run(preset_name: str, env: Env, llama1b: bool = False) -> dict:
    p = PRESETS[preset_name]
    default = p.shapes[0]
    started = time.perf_counter()
    result: dict = {
        "preset": preset_name,
        "device": f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "lightning": L.__version__,
        "logger": env.logger,
        "default_shape": {**asdict(default), "name": default.name},
    }
    env.log("1. lightning vs plain")
    throughput = measure_lightning_vs_plain(default, p, env)
    env.log("2. statistics steps")
    per_shape = {s.name: {"shape": asdict(s), **measure_stats_steps(s, p, env)} for s in p.shapes}
    first = per_shape[default.name]
    env.log("3. growth event")
    event = measure_growth_event(p, env, throughput["lightning_step_s"], first["auto_step_cost_ratio"])
    env.log("4. memory")
    for s in p.shapes:
        per_shape[s.name].update(measure_memory(s, env))
        per_shape[s.name].update(measure_sketch_memory(s, env))
    env.log("5. capture sweep")
    sweep = measure_capture_sweep(default, p, env)
    env.log("7. sketch crossover")
    result["sketch_crossover"] = measure_crossover(p, env)
    if llama1b:
        env.log("8. llama1b")
        result["llama1b"] = measure_llama1b(p.repeats, env)

    top_keys = ("stats_step_cost_ratio", "explicit_step_cost_ratio", "stats_vs_naive_cost_ratio",
                "stats_step_cost_ratio_pinv", "explicit_step_cost_ratio_pinv", "stats_vs_naive_cost_ratio_pinv",
                "auto_capture", "auto_step_cost_ratio", "round_robin_step_cost_ratio", "value_step_cost_ratio",
                "both_sides_step_cost_ratio", "stats_peak_memory_ratio", "explicit_peak_memory_ratio",
                "stats_alloc_peak_ratio", "explicit_alloc_peak_ratio", *SKETCH_KEYS)
    result.update({key: throughput.pop(key) for key in ("lightning_vs_plain_throughput",
                                                        "budget_spent_vs_lightning_step_ratio")})
    result.update({k: first[k] for k in top_keys})
    result.update({k: event[k] for k in ("growth_event_seconds", "growth_event_full_seconds",
                                         "growth_event_epoch_share", "growth_compute_epoch_share")})
    # The memory of the path the callback's capture="auto" takes at the default shape ("stats_" is extend).
    auto_prefix = "explicit" if first["auto_capture"] == "explicit" else "stats"
    result["auto_peak_memory_ratio"] = first[f"{auto_prefix}_peak_memory_ratio"]
    result["throughput"] = throughput
    result["growth_event"] = event
    result["shapes"] = per_shape
    result["capture_sweep"] = sweep
    result["capture_rule"] = {
        name: {"faster": "extend" if r["stats_vs_naive_cost_ratio"] < 1 else "explicit",
               "smaller_saved": "extend" if r["stats_peak_memory_ratio"] < r["explicit_peak_memory_ratio"] else "explicit",
               "smaller_peak": "extend" if r["stats_alloc_peak_ratio"] < r["explicit_alloc_peak_ratio"] else "explicit",
               "auto_picks": r["auto_capture"]}
        for name, r in per_shape.items()
    }
    result["targets"] = {
        "lightning_vs_plain_throughput >= 0.95": result["lightning_vs_plain_throughput"] >= 0.95,
        "auto_step_cost_ratio <= 1.5": result["auto_step_cost_ratio"] <= 1.5,
        "budget_spent_vs_lightning_step_ratio <= 1.05": result["budget_spent_vs_lightning_step_ratio"] <= 1.05,
        "round_robin_step_cost_ratio <= 1.5": result["round_robin_step_cost_ratio"] <= 1.5,
        "both_sides_step_cost_ratio <= 1.5": result["both_sides_step_cost_ratio"] <= 1.5,
        "stats_step_cost_ratio (extend) <= 1.5": result["stats_step_cost_ratio"] <= 1.5,
        "growth_event_seconds <= 2": result["growth_event_seconds"] <= 2.0,
        "growth_event_full_seconds <= 2": result["growth_event_full_seconds"] <= 2.0,
        "stats_peak_memory_ratio <= 1.3": result["stats_peak_memory_ratio"] <= 1.3,
        "auto_peak_memory_ratio <= 1.3": result["auto_peak_memory_ratio"] <= 1.3,
        **{f"sketch_both_sides_step_cost_ratio <= 1.5 ({name})": r["sketch_both_sides_step_cost_ratio"] <= 1.5
           for name, r in per_shape.items()},
    }
    if llama1b:
        result["targets"].update(result["llama1b"]["target"])
    result["bench_seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and fewer repeats (< 1 minute on 2 cores); "
                        "with --accelerator gpu: bench_gpu.py --dry-run's tiny shapes")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: the GPU benchmark, scripts/bench_gpu.py (bf16-mixed)")
    parser.add_argument("--bf16", action="store_true", help="bf16-mixed: the GPU benchmark's precision, so only "
                        "with --accelerator gpu (the CPU benchmark runs in float32)")
    parser.add_argument("--logger", choices=("none", "tensorboard"), default="none",
                        help="Lightning logger of the throughput fits (TensorBoard writes to a temp dir)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (0: torch's default). Default 1: on a busy machine a 2-thread "
                             "OpenMP team stalls at every barrier while another job holds a core, which swamps the "
                             "differences measured here (docs/performance.md)")
    parser.add_argument("--llama1b", action="store_true", help="also measurement 8, two Llama-3.2-1B-shaped layers "
                        "(several CPU-minutes; not with --quick)")
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu":  # fused kernels, bf16, grown vs static
        cpu_only = [flag for flag, given in (("--logger", args.logger != "none"), ("--threads", args.threads != 1),
                                             ("--verbose", args.verbose)) if given]
        if cpu_only:
            parser.error(f"{', '.join(cpu_only)}: options of the CPU benchmark; the GPU benchmark "
                         "(scripts/bench_gpu.py) takes --dry-run, --compile and --out")
        import bench_gpu

        return bench_gpu.main(["--dry-run"] if args.quick else [])
    if args.bf16:
        parser.error("--bf16 is the GPU benchmark's precision: add --accelerator gpu (the CPU benchmark runs in float32)")
    if args.llama1b and args.quick:
        parser.error("--llama1b is a full-size measurement: leave out --quick (the tests smoke it at a reduced size)")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    env = Env(args.logger, log=(lambda msg: print(msg, file=sys.stderr, flush=True)) if args.verbose else (lambda msg: None))
    with json_only_stdout():
        result = run("quick" if args.quick else "full", env, llama1b=args.llama1b)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
