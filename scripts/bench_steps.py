"""scripts/bench.py, measurements 1–3: Lightning vs plain PyTorch, statistics steps, the growth event."""

from __future__ import annotations

import copy
import os
import tempfile
import time
import warnings
from dataclasses import asdict
from typing import Callable

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from bench_common import StepTimer, plain_step_times, sync
from bench_setup import (CPU, ROUND_ROBIN_SHARE, SKETCH, SKETCH_SIDES, VARIANTS, Env, Preset, Shape, auto_capture,
                         fold, make_lm, make_trainer, median, named_forms, named_values, set_capture, token_data)

from lit_growattn import growth, AtEpochs, AutoSchedule, GrowAttentionCallback, GrowthSettings, StatisticsSettings, StepSearch
from lit_growattn.callback.event import plan_growth
from lit_growattn.callback.window import NamedForms, StatsWindow
from lit_growattn.module import GrowAttentionLM


# -- 1. Lightning vs plain PyTorch -----------------------------------------------------------------
class BareLM(GrowAttentionLM):
    """GrowAttentionLM with a training_step that only computes the loss: separates what Lightning's loop costs
    from what the module's own per-step bookkeeping (4 + n_layer self.log calls, accuracy metric, FLOP count)
    costs."""

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        return self.loss(self(inputs), labels)


def measure_lightning_vs_plain(shape: Shape, p: Preset, env: Env) -> dict:
    data = token_data(shape, p.fit_warmup + p.fit_steps)
    lit = make_lm(shape)
    bare = make_lm(shape, cls=BareLM)
    plain = copy.deepcopy(lit)  # same GPT, same initial weights

    def lightning_run(module: GrowAttentionLM, tmp: str, spent: bool = False) -> list[float]:
        timer = StepTimer(CPU)
        # Growth scheduled at epoch 2 of a 1-epoch fit: its statistics window (end of epoch 1) is never reached,
        # but every hook of the callback still runs on every step. `spent`: an automatic schedule whose K-cache
        # budget is already spent (the model starts at it), as every step after the last purchase runs.
        schedule = AutoSchedule(budget=shape.d_head, check_every=2, spend_until=1.0) if spent else AtEpochs([2])
        grow = GrowAttentionCallback(schedule, statistics=StatisticsSettings(batches=2))
        trainer = make_trainer(env, [grow, timer], tmp, max_epochs=1)
        trainer.fit(module, DataLoader(data, batch_size=shape.batch))
        return timer.step_times(p.fit_warmup)

    spent = copy.deepcopy(lit)
    sides = {"lightning": lambda tmp: lightning_run(lit, tmp), "bare": lambda tmp: lightning_run(bare, tmp),
             "budget_spent": lambda tmp: lightning_run(spent, tmp, spent=True),
             "plain": lambda tmp: plain_step_times(plain, DataLoader(data, batch_size=shape.batch), CPU, False,
                                                   p.fit_warmup)}
    steps = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(p.fit_repeats):
            # Rotate which side runs first, so a drift in the machine's load does not favour one side.
            order = list(sides)[r % len(sides):] + list(sides)[: r % len(sides)]
            for name in order:
                steps[name].append(median(sides[name](tmp)))
            env.log(f"  throughput repeat {r}: " + " ".join(f"{k} {v[-1]:.4f}s" for k, v in steps.items()))
    ratio = lambda a: median(x / y for x, y in zip(steps["plain"], steps[a]))  # noqa: E731
    step_s = {name: median(v) for name, v in steps.items()}
    return {
        "lightning_vs_plain_throughput": ratio("lightning"),
        "lightning_bare_vs_plain_throughput": ratio("bare"),
        # AutoSchedule once its budget is spent: no statistics step, so a step costs what a plain one does.
        "budget_spent_vs_lightning_step_ratio": median(a / b for a, b in zip(steps["budget_spent"], steps["lightning"])),
        "tokens_per_s": {name: shape.tokens / t for name, t in step_s.items()},
        "step_s": step_s,
        "lightning_step_s": step_s["lightning"],
        # Absolute per-step costs: the module's bookkeeping, and Lightning's loop itself (both independent of the
        # model size, so the ratio approaches 1 as steps get longer).
        "module_bookkeeping_ms_per_step": 1e3 * median(a - b for a, b in zip(steps["lightning"], steps["bare"])),
        "lightning_loop_ms_per_step": 1e3 * median(a - b for a, b in zip(steps["bare"], steps["plain"])),
        "per_repeat_step_s": steps,
    }


# -- 2. statistics step vs normal step -------------------------------------------------------------
class StatsRig:
    """A model's training step per variant (VARIANTS): capture set before it, the captured tuples folded after the
    backward as the callback's on_after_backward does, the optimizer step. The sketched variants go through the
    callback's own StatsWindow (test matrices handed to the units, sums of size SKETCH)."""

    def __init__(self, loss: Callable[[], torch.Tensor], forms: NamedForms, values: NamedForms, optimizer,
                 variants: tuple[str, ...] = VARIANTS, auto: str = "explicit"):
        self.loss, self.forms, self.values, self.opt, self.auto = loss, forms, values, optimizer, auto
        dtype, self.device = forms[0][2].leading_tensor.dtype, forms[0][2].leading_tensor.device
        self.stats = {  # only the sums the variants use (the full value sums are large at wide shapes)
            "natural": [f.empty_sums("natural", dtype) for _, _, f in forms],  # gradient: same sums
            "pinv": [f.empty_sums("pinv", dtype) for _, _, f in forms] if any("pinv" in v for v in variants) else [],
            "value": [v.empty_sums("natural", dtype) for _, _, v in values]
            if any(v in ("value", "both") for v in variants) else [],
        }
        self.windows = {"qk": StatsWindow("natural", sketch=SKETCH), "value": StatsWindow("natural", sketch=SKETCH)}
        self.layers = {layer for layer, _, _ in forms}
        n_layer = len(self.layers)
        self.per_step = max(1, n_layer // ROUND_ROBIN_SHARE)
        self.in_turn = [(layer, name, f) for layer, name, f in forms if layer < self.per_step]
        self.round_robin_layers = f"{self.per_step} of {n_layer}"

    def sides(self, variant: str) -> tuple[str | None, str, bool, bool]:
        """(query/key capture mode or None, its sums' method, value side captured, sketched)."""
        if variant.startswith("sketch_"):
            side = variant.removeprefix("sketch_")
            return (self.auto if side != "value" else None), "natural", side != "qk", True
        mode, _, method = (self.auto, "", "") if variant in ("round_robin", "both") else variant.partition("_")
        qk = None if variant in ("normal", "value") else mode
        return qk, method or "natural", variant in ("value", "both"), False

    def sums(self, variant: str) -> tuple[list, list]:
        """The query/key and value sums a variant folds into."""
        _, method, _, sketched = self.sides(variant)
        if sketched:
            return self.windows["qk"].stats or [], self.windows["value"].stats or []
        return self.stats[method], self.stats["value"]

    def step(self, variant: str) -> tuple[float, float]:
        """One training step; returns (step seconds, of which folding seconds)."""
        mode, method, value, sketched = self.sides(variant)
        if sketched:
            for key, units, on in (("qk", self.forms, mode is not None), ("value", self.values, value)):
                if on:
                    self.windows[key].begin_step("bench", units, self.layers, self.auto, {})
        else:
            set_capture(self.in_turn if variant == "round_robin" else self.forms, mode)
            set_capture(self.values, self.auto if value else None)
        t0 = time.perf_counter()
        loss = self.loss()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        sync(self.device)
        t1 = time.perf_counter()
        qk_sums, value_sums = self.sums(variant)
        if mode is not None:
            fold(self.forms, qk_sums)
        if value:
            fold(self.values, value_sums)
        sync(self.device)
        t2 = time.perf_counter()
        self.opt.step()
        sync(self.device)
        t3 = time.perf_counter()
        for key, units in (("qk", self.forms), ("value", self.values)):
            self.windows[key].end_step(units)  # capture and test matrices off, anything left dropped
        return t3 - t0, t2 - t1

    def interleaved(self, variants: tuple[str, ...], repeats: int, log: Callable[[str], None] = lambda m: None,
                    label: str = "") -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """Per variant the step and fold seconds of each repeat: one warm-up step each, then the variants in an
        order rotated every repeat (docs/design.md §9)."""
        for v in variants:  # warm-up: first use of each path (allocator, AdamW state, kernels, sums)
            self.step(v)
        times, folds = {v: [] for v in variants}, {v: [] for v in variants}
        for r in range(repeats):
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:  # rotate: no fixed position
                t, f = self.step(v)
                times[v].append(t)
                folds[v].append(f)
            log(f"  {label} repeat {r}: " + " ".join(f"{v} {times[v][-1]:.3f}" for v in variants))
        return times, folds


def lm_rig(shape: Shape, variants: tuple[str, ...] = VARIANTS, device: torch.device = CPU) -> StatsRig:
    lm = make_lm(shape).to(device)
    inputs, labels = (t.to(device) for t in token_data(shape, 1).tensors)
    return StatsRig(lambda: lm.loss(lm(inputs), labels), named_forms(lm), named_values(lm),
                    lm.configure_optimizers()["optimizer"], variants, auto_capture(inputs))


def measure_stats_steps(shape: Shape, p: Preset, env: Env) -> dict:
    rig = lm_rig(shape)
    auto = rig.auto
    times, folds = rig.interleaved(VARIANTS, p.repeats, env.log, shape.name)

    def ratio(a: str, b: str) -> float:
        return median(x / y for x, y in zip(times[a], times[b]))

    return {
        "step_s": {v: median(times[v]) for v in VARIANTS},
        "fold_s": {v: median(folds[v]) for v in VARIANTS if v != "normal"},
        "stats_step_cost_ratio": ratio("extend", "normal"),
        "explicit_step_cost_ratio": ratio("explicit", "normal"),
        "stats_vs_naive_cost_ratio": ratio("extend", "explicit"),
        "stats_step_cost_ratio_pinv": ratio("extend_pinv", "normal"),
        "explicit_step_cost_ratio_pinv": ratio("explicit_pinv", "normal"),
        "stats_vs_naive_cost_ratio_pinv": ratio("extend_pinv", "explicit_pinv"),
        "auto_capture": auto,
        "auto_step_cost_ratio": ratio(auto, "normal"),
        "auto_step_cost_ratio_pinv": ratio(f"{auto}_pinv", "normal"),
        "round_robin_step_cost_ratio": ratio("round_robin", "normal"),
        "value_step_cost_ratio": ratio("value", "normal"),
        "both_sides_step_cost_ratio": ratio("both", "normal"),
        "round_robin_layers_per_step": rig.round_robin_layers,
        **sketch_ratios(times, folds, auto),
    }


def sketch_ratios(times: dict[str, list[float]], folds: dict[str, list[float]], auto: str) -> dict:
    """The sketched variants' keys: ÷ the normal step and ÷ the full statistics of the same side, medians of the
    per-repeat ratios (listed, so that their spread can be read)."""
    full = {"qk": auto, "value": "value", "both": "both"}  # the full statistics of each side, capture "auto"
    out: dict = {}
    per_repeat: dict = {}
    for side, key in SKETCH_SIDES.items():
        sk = f"sketch_{side}"
        for name, base in ((f"sketch_{key}_step_cost_ratio", "normal"), (f"sketch_vs_full_{key}_ratio", full[side])):
            if sk in times and base in times:
                per_repeat[name] = [x / y for x, y in zip(times[sk], times[base])]
                out[name] = median(per_repeat[name])
        if sk in folds:
            out.setdefault("sketch_fold_s", {})[side] = median(folds[sk])
    out["sketch_per_repeat_ratios"] = per_repeat
    return out


# -- 3. growth event -------------------------------------------------------------------------------
def gather_stats(lm: GrowAttentionLM, forms, p: Preset, env: Env) -> dict[str, list[growth.FormStats]]:
    """Statistics of growth_micro_batches micro-batches (weight 1/k each, as under accumulate_grad_batches=k),
    for the sums without (natural, gradient) and with (pinv) per-instance pseudo-inverses."""
    shape = p.growth_shape
    data = token_data(shape, p.growth_micro_batches, seed=1)
    sums = {
        "natural": [growth.FormStats.empty_like(f, "natural") for _, _, f in forms],
        "pinv": [growth.FormStats.empty_like(f, "pinv") for _, _, f in forms],
    }
    set_capture(forms, auto_capture(data.tensors[0]))
    for inputs, labels in DataLoader(data, batch_size=shape.batch):
        loss = lm.loss(lm(inputs), labels) / p.growth_micro_batches
        loss.backward()
        captured = [(name, f.take_captured()) for _, name, f in forms]
        for key, stats in sums.items():
            for st, (_, pairs) in zip(stats, captured):
                for xa, gx in pairs:
                    st.update(xa, gx, 1.0 / p.growth_micro_batches)
    set_capture(forms, None)
    lm.zero_grad(set_to_none=True)
    return sums


def growth_compute_seconds(forms: NamedForms, stats, method: str, alphas: list[float], grow_by: int, env: Env) -> float:
    """One growth computation as the callback's growth event does it, minus the forward passes: flat buffer
    round trip (the all-reduce is the identity on one rank), the plan, plan.grow for every form at every α in
    `alphas`. The callback's defaults otherwise: append, keep, euclidean, low_rank."""
    settings = GrowthSettings(columns=grow_by, method=method, max_d_head=forms[0][2].w_q.shape[1])
    t = time.perf_counter()
    reduced = growth.unflatten_stats(growth.flatten_stats(stats), stats)
    plan = plan_growth(forms, reduced, settings, "low_rank", sized_later=False, seed=1)
    for alpha in alphas:
        grown = {name: plan.grow(name, alpha) for _, name, _ in forms}
    assert all(g.w_q.shape[-1] == forms[0][2].d_head + grow_by for g in grown.values())
    return time.perf_counter() - t


class StopAfterGrowth(Callback):
    """Ends the fit once the growth callback has grown: nothing after the event is measured."""

    def __init__(self, grow: GrowAttentionCallback):
        self.grow = grow

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.grow.history:
            trainer.should_stop = True


def measure_growth_event(p: Preset, env: Env, step_s: float, stats_ratio: float) -> dict:
    shape = p.growth_shape
    lm = make_lm(shape)
    forms = named_forms(lm)
    sums = gather_stats(lm, forms, p, env)
    alphas = StepSearch().candidates
    compute = {}
    for method in ("natural", "gradient", "pinv"):
        stats = sums["pinv" if method == "pinv" else "natural"]
        one = [growth_compute_seconds(forms, stats, method, [1.0], p.grow_by, env) for _ in range(p.growth_repeats)]
        every = [growth_compute_seconds(forms, stats, method, alphas, p.grow_by, env) for _ in range(p.growth_repeats)]
        compute[method] = {"one_alpha_s": median(one), "all_candidates_s": median(every)}
        env.log(f"  growth compute {method}: {compute[method]}")
    # The same computation on all cores (torch's default in training), for context: the batched float64 SVDs gain
    # nothing from a second thread, and MKL's OpenMP team spin-waits when another job holds a core
    # (docs/performance.md).
    threads = torch.get_num_threads()
    if (os.cpu_count() or 1) > threads:
        torch.set_num_threads(os.cpu_count())
        try:
            all_cores = median(growth_compute_seconds(forms, sums["natural"], "natural", [1.0], p.grow_by, env)
                               for _ in range(p.growth_repeats))
        finally:
            torch.set_num_threads(threads)
    else:
        all_cores = compute["natural"]["one_alpha_s"]

    # The full event through the real callback: statistics window of growth_micro_batches steps at the training
    # batch size (so the statistics count the same instances), growth at the start of epoch 1, then stop.
    data = token_data(shape, p.growth_micro_batches, seed=2)
    cb = GrowAttentionCallback(AtEpochs([1]), GrowthSettings(columns=p.grow_by),
                               StatisticsSettings(batches=p.growth_micro_batches), StepSearch(batches=2))
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(env, [cb, StopAfterGrowth(cb)], tmp, max_epochs=2).fit(
            make_lm(shape), DataLoader(data, batch_size=shape.batch))
    event = cb.history[0]
    # The event's own stopwatch: plan (GrowthPlan build), rating (factorisation of every candidate and the forward
    # passes over the kept batches), apply (broadcast, install, optimizer and scheduler rebuild).
    full_s, pieces = event["seconds"], event["timings"]
    epoch_s = p.epoch_steps * step_s
    natural = compute["natural"]["one_alpha_s"]
    # Statistics window cost inside an epoch: the callback's default 8 statistics steps at the measured ratio.
    window_s = StatisticsSettings().batches * max(stats_ratio - 1.0, 0.0) * step_s
    return {
        "growth_event_seconds": natural,
        "growth_event_seconds_per_method": {m: c["one_alpha_s"] for m, c in compute.items()},
        "growth_event_all_candidates_seconds_per_method": {m: c["all_candidates_s"] for m, c in compute.items()},
        "growth_event_seconds_all_cores": all_cores,
        "growth_event_full_seconds": full_s,
        "growth_event_full_pieces": {
            **pieces, "rest_s": full_s - sum(pieces.values()), "alpha": event["alpha"],
            "rating_forwards": (len(alphas) + 1) * cb.line_search_batches, "d_head_after": event["d_head"],
        },
        "growth_event_epoch_share": full_s / epoch_s,
        "growth_compute_epoch_share": natural / epoch_s,
        "stats_window_epoch_share": window_s / epoch_s,
        "epoch_assumed": f"{p.epoch_steps} optimizer steps of the default shape at the measured Lightning step "
                         f"time ({step_s:.3f} s/step)",
        "growth_shape": {**asdict(shape), "d_head_after": shape.d_head + p.grow_by,
                         "stats_instances": shape.batch * p.growth_micro_batches},
    }
