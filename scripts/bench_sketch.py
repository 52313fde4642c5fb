"""scripts/bench.py, measurements 6–8: sketched statistics (statistics.sketch, docs/design.md §12) beside the full
ones. Their step costs are variants of measurement 2 (bench_steps.StatsRig); here their memory per shape, the width
where they start to pay (sketch_crossover, κ of callback/checks.py's SKETCH_CROSSOVER) and a Llama-3.2-1B-shaped stack.

Statistics memory = the sums' bytes (the units' own sums_numel + tests_numel, checked against the allocated sums)
+ the statistics step's allocation peak above a plain step's (bench_memory.cpu_allocation_peak).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bench_memory import allocation_peak
from bench_setup import SKETCH, Env, Preset, Shape, auto_capture, median
from bench_steps import StatsRig, lm_rig

from lit_growattn.contract import NamedForm

MEMORY_VARIANTS = ("normal", "both", "sketch_both")  # both sides: full (capture "auto") and sketched


def sums_bytes(units, sums, sketched: bool) -> int:
    """Bytes of `units`' sums (and a sketch's test matrices) as the units estimate them, checked against `sums`."""
    if sketched:
        numel = sum(u.sums_numel("natural", sketch=SKETCH) + u.tests_numel(SKETCH) for _, _, u in units)
        held = sum(t.numel() for s in sums for t in [*s.tensors(), *s.tests.matrices.values()])
    else:
        numel = sum(u.sums_numel("natural") for _, _, u in units)
        held = sum(t.numel() for s in sums for t in s.tensors())
    held -= 2 * len(sums)  # the scalars instances and weight, which sums_numel leaves out
    if numel != held:
        raise RuntimeError(f"the units estimate {numel} numbers of statistics, the sums hold {held}")
    return numel * sums[0].tensors()[0].element_size()


def statistics_memory(rig: StatsRig) -> dict:
    """Both sides' statistics memory, full vs sketch, of `rig`'s model (its variants: MEMORY_VARIANTS)."""
    for v in MEMORY_VARIANTS:  # first steps: sums, optimizer state and lazily created state exist before the peaks
        rig.step(v)
    peak = {v: allocation_peak(lambda: rig.step(v), rig.device) for v in MEMORY_VARIANTS}
    units = rig.forms + rig.values
    sums = {"full": sums_bytes(units, rig.stats["natural"] + rig.stats["value"], False),
            "sketch": sums_bytes(units, rig.windows["qk"].stats + rig.windows["value"].stats, True)}
    extra = {"full": peak["both"] - peak["normal"], "sketch": peak["sketch_both"] - peak["normal"]}
    total = {k: sums[k] + extra[k] for k in sums}
    return {
        "stats_sums_bytes": sums,
        "stats_extra_peak_bytes": extra,
        "stats_memory_bytes": total,
        "plain_step_peak_bytes": peak["normal"],
        "sketch_sums_ratio": sums["sketch"] / sums["full"],
        "sketch_memory_ratio": total["sketch"] / total["full"],
    }


# -- 6. memory per shape ---------------------------------------------------------------------------
def measure_sketch_memory(shape: Shape, env: Env) -> dict:
    return statistics_memory(lm_rig(shape, MEMORY_VARIANTS))


# -- 7. crossover: the width where the sketched statistics step gets cheaper than the full one -----
def crossing(widths: list[int], ratios: list[float]) -> float | None:
    """The width where sketch/full falls through 1, interpolated in log width and log ratio (None: no crossing)."""
    for (e1, r1), (e2, r2) in zip(zip(widths, ratios), zip(widths[1:], ratios[1:])):
        if r1 >= 1 > r2:
            t = math.log(r1) / (math.log(r1) - math.log(r2))
            return math.exp(math.log(e1) + t * (math.log(e2) - math.log(e1)))
    return None


def measure_crossover(p: Preset, env: Env, device: torch.device = torch.device("cpu")) -> dict:
    """One-layer GPTs at each p.crossover_widths (heads n_embd/32, d_head 8) on `device`, both sides: full vs sketch
    step."""
    seq_len, batch = p.crossover_tokens
    rows, widths, ratios = {}, [], []
    for n in p.crossover_widths:
        shape = Shape(n_layer=1, n_embd=n, n_head=max(1, n // 32), d_head=8, seq_len=seq_len, batch=batch)
        rig = lm_rig(shape, ("both", "sketch_both"), device)
        times, _ = rig.interleaved(("both", "sketch_both"), p.repeats, env.log, f"crossover n_embd {n}")
        per_repeat = [s / f for s, f in zip(times["sketch_both"], times["both"])]
        e_in = rig.forms[0][2].e_in
        rows[f"n_embd{n}"] = {"e_in": e_in, "n_head": shape.n_head, "full_step_s": median(times["both"]),
                              "sketch_step_s": median(times["sketch_both"]), "sketch_vs_full": median(per_repeat),
                              "per_repeat": per_repeat}
        widths.append(e_in)
        ratios.append(median(per_repeat))
    e_star = crossing(widths, ratios)
    return {
        "device": str(device),
        "shape": f"1 layer, heads n_embd/32, d_head 8, s {seq_len}, b {batch}, both sides, capture {rig.auto}",
        "sketch_size": {"k": SKETCH.k, "l": SKETCH.l, "k_c": SKETCH.k_c},
        "widths": rows,
        "e_in_crossing": e_star if e_star is not None else "none in range",
        "kappa": e_star / (SKETCH.k + SKETCH.l) if e_star is not None else "none in range",
    }


# -- 8. Llama-3.2-1B-shaped stack (--llama1b) -------------------------------------------------------
def measure_llama1b(repeats: int, env: Env, layers: int = 2, hidden: int = 2048, heads: int = 32, kv_heads: int = 8,
                    seq_len: int = 1024, device: torch.device = torch.device("cpu")) -> dict:
    """`layers` Llama layers (head_dim hidden/heads, intermediate 4·hidden, vocabulary 256, random weights) made
    growable, on `device`: plain vs full (capture auto) vs sketch, both sides, at batch 1."""
    from bench_hf import llama  # the bench's HF model builder (transformers only when asked)
    from lit_growattn.hf import GrowableAttention, make_growable

    model = llama(layers, hidden, heads, kv_heads)
    make_growable(model)
    model.to(device)
    forms = [NamedForm(m.layer_idx, name, m) for name, m in model.named_modules() if isinstance(m, GrowableAttention)]
    values = [NamedForm(f.layer, f"{f.name}.value", f.form.value) for f in forms]
    ids = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)

    def loss() -> torch.Tensor:
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    rig = StatsRig(loss, forms, values, torch.optim.AdamW(model.parameters(), lr=1e-4), MEMORY_VARIANTS,
                   auto_capture(ids))
    times, _ = rig.interleaved(MEMORY_VARIANTS, repeats, env.log, "llama1b")
    ratio = lambda a, b: [x / y for x, y in zip(times[a], times[b])]  # noqa: E731
    memory = statistics_memory(rig)
    return {
        "device": str(device),
        "shape": {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                  "head_dim": hidden // heads, "intermediate": 4 * hidden, "seq_len": seq_len, "batch": 1},
        "auto_capture": rig.auto,
        "step_s": {v: median(t) for v, t in times.items()},
        "step_cost_ratio": {"full": median(ratio("both", "normal")), "sketch": median(ratio("sketch_both", "normal"))},
        "sketch_vs_full": median(ratio("sketch_both", "both")),
        "per_repeat_sketch_vs_full": ratio("sketch_both", "both"),
        **memory,
        "target": {"sketch_memory_ratio <= 1/16": memory["sketch_memory_ratio"] <= 1 / 16},
    }
