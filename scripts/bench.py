#!/usr/bin/env python
"""Benchmarks of lit_growattn, side by side in one process (docs/design.md §4, §9). Prints ONE JSON object on stdout.

Measurements (one function each):
1. lightning_vs_plain_throughput: tokens/s of GrowAttentionLM under a lightning.Trainer (GrowAttentionCallback
   attached, its growth scheduled beyond the measured steps, so no statistics step is timed) ÷ tokens/s of a
   plain PyTorch loop on the same GPT with the same AdamW, param groups and schedule.
2. stats_step_cost_ratio & co.: a full training step with statistics capture (forward, backward, folding the
   captured (X′, G X′) pairs into FormStats as the callback's on_after_backward does, optimizer step) ÷ a
   normal step; for capture "extend" (SDPA zero-extension) and "explicit" (score map with retained gradient),
   and for the `pinv` method (per-instance pseudo-inverses in FormStats.update) beside the others;
   round_robin_step_cost_ratio: capture="auto" on a third of the layers (the callback's statistics.layers_per_step).
3. growth_event_seconds: GrowthPlan build + factorisation at one α for all forms (6 layers, e 256, 8 heads,
   d_head 8 → 16, statistics from b 32, s 256), per method; plus one full event driven through
   GrowAttentionCallback in a real fit, timed by the event itself (all-reduce, plan, line search, optimizer rebuild).
4. stats_peak_memory_ratio: bytes of tensors saved for backward in a statistics step ÷ a normal step
   (saved_tensors_hooks, deterministic); beside it the allocation peak of the whole step (profiler memory
   events, *_alloc_peak_ratio) and the captured G X′ pairs held until on_after_backward. On CUDA:
   torch.cuda.max_memory_allocated over one step.
5. capture_sweep: one attention layer (QKForm.attend fwd+bwd+fold) at a fixed token count over sequence
   lengths, to check the callback's capture="auto" rule.

Timing rules (docs/design.md §9): warm-up excluded, variants interleaved in rotating order inside one process,
per-repeat ratios against the normal step of the same repeat, medians over repeats. The machine may be
shared, so absolute times are only context; the ratios are the result. CPU runs use one intra-op thread by
default (--threads): see its help for why.

    python scripts/bench.py            # full CPU run (several minutes on 2 cores)
    python scripts/bench.py --quick    # small shapes, < 1 minute, same keys
    python scripts/bench.py --accelerator gpu [--bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
from torch.utils.data import DataLoader, TensorDataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lit_growattn import growth  # noqa: E402
from lit_growattn.attention import QKForm  # noqa: E402
from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings, StepSearch  # noqa: E402
from lit_growattn.growing.event import plan_growth  # noqa: E402
from lit_growattn.growing.window import NamedForms, capture_mode, fold_captured  # noqa: E402
from lit_growattn.module import GrowAttentionLM  # noqa: E402

VARIANTS = ("normal", "extend", "explicit", "extend_pinv", "explicit_pinv", "round_robin")
# The round_robin variant: capture="auto" on a third of the layers, as GrowAttentionCallback(statistics=StatisticsSettings(layers_per_step=n/3)).
ROUND_ROBIN_SHARE = 3


# -- configuration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    d_head: int
    seq_len: int
    batch: int
    vocab: int = 256

    @property
    def name(self) -> str:
        return f"s{self.seq_len}_b{self.batch}"

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch


@dataclass(frozen=True)
class Preset:
    shapes: tuple[Shape, ...]  # the first is the default shape of the top-level keys
    repeats: int  # interleaved repeats of the step-cost measurements
    fit_repeats: int  # Lightning fits (and plain runs) for the throughput ratio
    fit_warmup: int  # steps excluded at the start of each fit / plain run
    fit_steps: int  # timed steps per fit / plain run
    growth_shape: Shape  # model and micro-batch of the growth event
    growth_micro_batches: int  # statistics from growth_micro_batches × growth_shape.batch instances
    grow_by: int
    growth_repeats: int
    sweep_seqs: tuple[int, ...]
    sweep_tokens: int
    epoch_steps: int = 1000  # epoch assumed for the growth event's share


DEFAULT = Shape(n_layer=6, n_embd=256, n_head=8, d_head=8, seq_len=256, batch=8)  # the shape of docs/design.md §4
TINY = Shape(n_layer=2, n_embd=64, n_head=4, d_head=4, seq_len=64, batch=8)
PRESETS = {
    "full": Preset(
        shapes=(DEFAULT, replace(DEFAULT, seq_len=1024, batch=2)), repeats=5, fit_repeats=3, fit_warmup=2,
        fit_steps=3, growth_shape=DEFAULT, growth_micro_batches=4, grow_by=8, growth_repeats=3,
        sweep_seqs=(128, 256, 512, 1024, 2048), sweep_tokens=2048,
    ),
    "quick": Preset(
        shapes=(TINY, replace(TINY, seq_len=256, batch=2)), repeats=5, fit_repeats=3, fit_warmup=3, fit_steps=8,
        growth_shape=TINY, growth_micro_batches=2, grow_by=4, growth_repeats=3, sweep_seqs=(32, 64, 128, 256, 512),
        sweep_tokens=512,
    ),
}


@dataclass
class Env:
    device: torch.device
    bf16: bool
    logger: str
    log: Callable[[str], None] = field(default=lambda msg: None)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        # CUDA kernels are asynchronous: a timer read without a sync measures the launch, not the work.
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 and self.cuda else contextlib.nullcontext()


# -- shared pieces ---------------------------------------------------------------------------------
def make_lm(shape: Shape, seed: int = 0, cls: type[GrowAttentionLM] = GrowAttentionLM) -> GrowAttentionLM:
    # Constant schedule without warm-up: the plain loop can then run the module's own LambdaLR without a trainer.
    torch.manual_seed(seed)
    return cls(
        vocab_size=shape.vocab, block_size=shape.seq_len, n_layer=shape.n_layer, n_head=shape.n_head,
        n_embd=shape.n_embd, d_head=shape.d_head, lr_schedule="constant", warmup_steps=0,
    )


def token_data(shape: Shape, n_batches: int, seed: int = 0) -> TensorDataset:
    """Random next-token data: labels are the inputs shifted by one (the cost does not depend on the values)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, shape.vocab, (n_batches * shape.batch, shape.seq_len + 1), generator=g)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def named_forms(lm: GrowAttentionLM) -> NamedForms:
    """(layer, parameter-name prefix, form), as the callback names them."""
    return [(layer, f"model.{name}", form) for layer, name, form in lm.model.named_qk_forms()]


def fold(forms: NamedForms, stats: list[growth.FormStats], weight: float = 1.0) -> None:
    """What the callback does with the captured pairs after a backward (no GradScaler here)."""
    fold_captured(forms, stats, weight, grad_scale=None)


def set_capture(forms: NamedForms, mode: str | None) -> None:
    for _, _, form in forms:
        form.capture = mode


def auto_capture(inputs: torch.Tensor) -> str:
    """The callback's own capture='auto' choice for these inputs (not a copy of the rule)."""
    return capture_mode("auto", inputs.device)


def median(xs) -> float:
    return float(statistics.median(xs))


class StepTimer(Callback):
    """Wall time between consecutive on_train_batch_start calls: the whole Lightning loop per step (hooks,
    training_step with its logging and metrics, backward, optimizer, scheduler, fetch of the next batch)."""

    def __init__(self, env: Env):
        self.env, self.starts = env, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.env.sync()
        self.starts.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


def make_trainer(env: Env, callbacks, tmp: str, **kwargs) -> L.Trainer:
    logger = False
    if env.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(tmp, name="bench")
    args = dict(
        accelerator="gpu" if env.cuda else "cpu", devices=1, precision="bf16-mixed" if env.bf16 else "32-true",
        logger=logger, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )
    return L.Trainer(**{**args, **kwargs})


# -- 1. Lightning vs plain PyTorch -----------------------------------------------------------------
class BareLM(GrowAttentionLM):
    """GrowAttentionLM with a training_step that only computes the loss: separates what Lightning's loop costs
    from what the module's own per-step bookkeeping (4 + n_layer self.log calls, accuracy metric, FLOP count)
    costs."""

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        return self.loss(self(inputs), labels)


def measure_lightning_vs_plain(shape: Shape, p: Preset, env: Env) -> dict:
    n = p.fit_warmup + p.fit_steps + 1  # +1: a step's time ends at the next step's start
    data = token_data(shape, n)
    lit = make_lm(shape)
    bare = make_lm(shape, cls=BareLM)
    plain = copy.deepcopy(lit)  # same GPT, same initial weights
    plain.to(env.device)
    optim_cfg = plain.configure_optimizers()  # same AdamW, param groups and LambdaLR as under Lightning
    optimizer, scheduler = optim_cfg["optimizer"], optim_cfg["lr_scheduler"]["scheduler"]

    def plain_run() -> list[float]:
        stamps = []
        for inputs, labels in DataLoader(data, batch_size=shape.batch):
            env.sync()
            stamps.append(time.perf_counter())
            inputs, labels = inputs.to(env.device), labels.to(env.device)
            with env.autocast():
                loss = plain.loss(plain(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        return [b - a for a, b in zip(stamps, stamps[1:])][p.fit_warmup:]

    def lightning_run(module: GrowAttentionLM, tmp: str) -> list[float]:
        timer = StepTimer(env)
        # Growth scheduled at epoch 2 of a 1-epoch fit: its statistics window (end of epoch 1) is never reached,
        # but every hook of the callback still runs on every step.
        grow = GrowAttentionCallback(AtEpochs([2]), statistics=StatisticsSettings(batches=1))
        trainer = make_trainer(env, [grow, timer], tmp, max_epochs=1)
        trainer.fit(module, DataLoader(data, batch_size=shape.batch))
        return timer.step_times()[p.fit_warmup:]

    sides = {"lightning": lambda tmp: lightning_run(lit, tmp), "bare": lambda tmp: lightning_run(bare, tmp),
             "plain": lambda tmp: plain_run()}
    steps = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(p.fit_repeats):
            # Rotate which side runs first, so a drift in the machine's load does not favour one side.
            order = list(sides)[r % 3:] + list(sides)[: r % 3]
            for name in order:
                steps[name].append(median(sides[name](tmp)))
            env.log(f"  throughput repeat {r}: " + " ".join(f"{k} {v[-1]:.4f}s" for k, v in steps.items()))
    ratio = lambda a: median(x / y for x, y in zip(steps["plain"], steps[a]))  # noqa: E731
    step_s = {name: median(v) for name, v in steps.items()}
    return {
        "lightning_vs_plain_throughput": ratio("lightning"),
        "lightning_bare_vs_plain_throughput": ratio("bare"),
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
def measure_stats_steps(shape: Shape, p: Preset, env: Env) -> dict:
    lm = make_lm(shape).to(env.device)
    forms = named_forms(lm)
    opt = lm.configure_optimizers()["optimizer"]
    inputs, labels = (t.to(env.device) for t in token_data(shape, 1).tensors)
    stats = {
        "natural": [growth.FormStats.empty_like(f, "natural") for _, _, f in forms],  # gradient: same sums
        "pinv": [growth.FormStats.empty_like(f, "pinv") for _, _, f in forms],
    }

    auto = auto_capture(inputs)
    n_layer = len(lm.model.blocks)
    per_step = max(1, n_layer // ROUND_ROBIN_SHARE)
    in_turn = [(layer, name, f) for layer, name, f in forms if layer < per_step]

    def step(variant: str) -> tuple[float, float]:
        """One training step; returns (step seconds, of which folding seconds)."""
        mode, _, method = (auto, "", "") if variant == "round_robin" else variant.partition("_")
        mode = None if mode == "normal" else mode
        set_capture(in_turn if variant == "round_robin" else forms, mode)
        env.sync()
        t0 = time.perf_counter()
        with env.autocast():
            loss = lm.loss(lm(inputs), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        env.sync()
        t1 = time.perf_counter()
        if mode is not None:
            fold(forms, stats[method or "natural"])
        env.sync()
        t2 = time.perf_counter()
        opt.step()
        env.sync()
        t3 = time.perf_counter()
        set_capture(forms, None)
        return t3 - t0, t2 - t1

    for v in VARIANTS:  # warm-up: first use of each path (allocator, AdamW state, kernels)
        step(v)
    times = {v: [] for v in VARIANTS}
    folds = {v: [] for v in VARIANTS}
    for r in range(p.repeats):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]  # rotate: no fixed position
        for v in order:
            t, f = step(v)
            times[v].append(t)
            folds[v].append(f)
        env.log(f"  {shape.name} repeat {r}: " + " ".join(f"{v} {times[v][-1]:.3f}" for v in VARIANTS))

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
        "round_robin_layers_per_step": f"{per_step} of {n_layer}",
    }


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
    set_capture(forms, auto_capture(data.tensors[0].to(env.device)))
    for inputs, labels in DataLoader(data, batch_size=shape.batch):
        inputs, labels = inputs.to(env.device), labels.to(env.device)
        with env.autocast():
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
    env.sync()
    t = time.perf_counter()
    reduced = growth.unflatten_stats(growth.flatten_stats(stats), stats)
    plan = plan_growth(forms, reduced, settings, StepSearch().line_search, sized_later=False, seed=1)
    for alpha in alphas:
        grown = {name: plan.grow(name, alpha) for _, name, _ in forms}
    env.sync()
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
    lm = make_lm(shape).to(env.device)
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
    # nothing from a second thread, and MKL's OpenMP team spin-waits when another job holds a core (measured on
    # the shared 2-core machine: 4 to 90 s instead of 2 s).
    threads = torch.get_num_threads()
    if not env.cuda and (os.cpu_count() or 1) > threads:
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


# -- 4. memory -------------------------------------------------------------------------------------
def cpu_allocation_peak(fn: Callable[[], None]) -> int:
    """Peak of the bytes allocated on the CPU while fn runs, above the level at its start, from the profiler's
    memory events (deterministic on one thread). The CPU counterpart of torch.cuda.max_memory_allocated: unlike
    the saved-tensor count it sees transients and the captured pairs, and that those come while the backward
    frees activations."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def measure_memory(shape: Shape, env: Env) -> dict:
    lm = make_lm(shape).to(env.device)
    forms = named_forms(lm)
    inputs, labels = (t.to(env.device) for t in token_data(shape, 1).tensors)
    params = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    stats = [growth.FormStats.empty_like(f, "natural") for _, _, f in forms]

    def step(mode: str | None, out: dict) -> None:
        """Forward, backward and fold of one statistics (or normal) step; fills out's byte counts."""
        saved: dict[int, int] = {}

        def pack(t):
            # Unique storages (views and repeated saves count once); parameters exist anyway and are left out.
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                saved[st.data_ptr()] = st.nbytes()
            return t

        set_capture(forms, mode)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), env.autocast():
            loss = lm.loss(lm(inputs), labels)
        loss.backward()
        # The pairs wait in the forms until on_after_backward folds them: G X′ is new memory, X′ is an
        # activation that the forward saved anyway.
        out["captured_bytes"] = sum(gx.untyped_storage().nbytes() for _, _, f in forms for _, gx in f.captured)
        fold(forms, stats)
        set_capture(forms, None)
        out["saved_bytes"] = sum(saved.values())

    def one(mode: str | None) -> dict:
        out: dict = {}
        if env.cuda:
            env.sync()
            torch.cuda.reset_peak_memory_stats(env.device)
            base = torch.cuda.memory_allocated(env.device)
            step(mode, out)
            env.sync()
            out["peak_bytes"] = torch.cuda.max_memory_allocated(env.device) - base
        else:
            out["peak_bytes"] = cpu_allocation_peak(lambda: step(mode, out))
        lm.zero_grad(set_to_none=True)  # gradients are allocated inside every measured step, as in training
        return out

    one(None)  # first step: lazily created state is not part of the comparison
    got = {name: one(mode) for name, mode in (("normal", None), ("extend", "extend"), ("explicit", "explicit"))}
    base = got["normal"]
    # The headline follows docs/design.md §9: saved-for-backward bytes on CPU, max_memory_allocated on CUDA.
    key = "peak_bytes" if env.cuda else "saved_bytes"
    return {
        "bytes": got,
        "measure": "torch.cuda.max_memory_allocated" if env.cuda else "bytes saved for backward",
        "stats_peak_memory_ratio": got["extend"][key] / base[key],
        "explicit_peak_memory_ratio": got["explicit"][key] / base[key],
        # Allocation peak of the whole step (CPU: profiler memory events; CUDA: the same as the headline).
        "stats_alloc_peak_ratio": got["extend"]["peak_bytes"] / base["peak_bytes"],
        "explicit_alloc_peak_ratio": got["explicit"]["peak_bytes"] / base["peak_bytes"],
        # Saved tensors plus the captured pairs still held at the end of backward: an upper bound of the extra.
        "stats_memory_ratio_with_captured": (got["extend"]["saved_bytes"] + got["extend"]["captured_bytes"])
        / base["saved_bytes"],
        "explicit_memory_ratio_with_captured": (got["explicit"]["saved_bytes"] + got["explicit"]["captured_bytes"])
        / base["saved_bytes"],
    }


# -- 5. capture sweep (one attention layer) --------------------------------------------------------
def measure_capture_sweep(shape: Shape, p: Preset, env: Env) -> dict:
    """QKForm.attend forward+backward (+ fold) of one layer, tokens fixed, sequence length swept: the only part
    of a step that differs between the capture paths. Gives the rule for capture='auto'."""
    out = {}
    for s in p.sweep_seqs:
        b = max(1, p.sweep_tokens // s)
        torch.manual_seed(0)
        form = QKForm(shape.n_embd, shape.n_head, shape.d_head).to(env.device)
        x = torch.randn(b, s, shape.n_embd, device=env.device, requires_grad=True)
        v = torch.randn(b, shape.n_head, s, shape.n_embd // shape.n_head, device=env.device, requires_grad=True)
        w = torch.randn_like(v)
        st = growth.FormStats.empty_like(form, "natural")
        params = {q.untyped_storage().data_ptr() for q in form.parameters()}

        def run(mode):
            form.capture = mode
            saved = {}

            def pack(t):
                if t.untyped_storage().data_ptr() not in params:
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            env.sync()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), env.autocast():
                loss = (form.attend(x, v) * w).sum()
            loss.backward()
            for xa, gx in form.take_captured():
                st.update(xa, gx)
            env.sync()
            form.capture = None
            return time.perf_counter() - t0, sum(saved.values())

        modes = (None, "extend", "explicit")
        for m in modes:
            run(m)
        times = {str(m): [] for m in modes}
        mem = {}
        for r in range(p.repeats):
            for m in modes[r % 3:] + modes[: r % 3]:
                t, mem[str(m)] = run(m)
                times[str(m)].append(t)
        ratio = lambda a, c: median(x / y for x, y in zip(times[a], times[c]))  # noqa: E731
        out[f"s{s}_b{b}"] = {
            "normal_s": median(times["None"]),
            "extend_s": median(times["extend"]),
            "explicit_s": median(times["explicit"]),
            "extend_over_explicit": ratio("extend", "explicit"),
            "extend_saved_over_explicit_saved": mem["extend"] / mem["explicit"],
            "faster": "extend" if ratio("extend", "explicit") < 1 else "explicit",
            "smaller": "extend" if mem["extend"] < mem["explicit"] else "explicit",
            "auto_rule_picks": auto_capture(torch.zeros(b, s, dtype=torch.long, device=env.device)),
        }
        env.log(f"  sweep s{s}: {out[f's{s}_b{b}']}")
    return out


# -- driver ----------------------------------------------------------------------------------------
def run(preset_name: str, env: Env) -> dict:
    p = PRESETS[preset_name]
    default = p.shapes[0]
    started = time.perf_counter()
    result: dict = {
        "preset": preset_name,
        "device": torch.cuda.get_device_name(env.device) if env.cuda else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "lightning": L.__version__,
        "bf16": env.bf16,
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
    env.log("5. capture sweep")
    sweep = measure_capture_sweep(default, p, env)

    top_keys = ("stats_step_cost_ratio", "explicit_step_cost_ratio", "stats_vs_naive_cost_ratio",
                "stats_step_cost_ratio_pinv", "explicit_step_cost_ratio_pinv", "stats_vs_naive_cost_ratio_pinv",
                "auto_capture", "auto_step_cost_ratio", "round_robin_step_cost_ratio", "stats_peak_memory_ratio", "explicit_peak_memory_ratio",
                "stats_alloc_peak_ratio", "explicit_alloc_peak_ratio")
    result.update({"lightning_vs_plain_throughput": throughput.pop("lightning_vs_plain_throughput")})
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
        "round_robin_step_cost_ratio <= 1.5": result["round_robin_step_cost_ratio"] <= 1.5,
        "stats_step_cost_ratio (extend) <= 1.5": result["stats_step_cost_ratio"] <= 1.5,
        "growth_event_seconds <= 2": result["growth_event_seconds"] <= 2.0,
        "growth_event_full_seconds <= 2": result["growth_event_full_seconds"] <= 2.0,
        "stats_peak_memory_ratio <= 1.3": result["stats_peak_memory_ratio"] <= 1.3,
        "auto_peak_memory_ratio <= 1.3": result["auto_peak_memory_ratio"] <= 1.3,
    }
    result["bench_seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and fewer repeats (< 1 minute on 2 cores)")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU only; bf16-mixed under Lightning)")
    parser.add_argument("--logger", choices=("none", "tensorboard"), default="none",
                        help="Lightning logger of the throughput fits (TensorBoard writes to a temp dir)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (0: torch's default). Default 1: on a shared machine a 2-thread "
                             "OpenMP team stalls at every barrier while another job holds a core (measured: 4x slower "
                             "steps with 4x the spread), which swamps the differences measured here")
    parser.add_argument("--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu":  # fused kernels, bf16, grown vs static: scripts/bench_gpu.py
        import bench_gpu

        return bench_gpu.main([])
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu but CUDA is not available")
    if args.bf16 and args.accelerator != "gpu":
        parser.error("--bf16 needs --accelerator gpu")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    env = Env(torch.device("cuda" if args.accelerator == "gpu" else "cpu"), args.bf16, args.logger,
              log=(lambda msg: print(msg, file=sys.stderr, flush=True)) if args.verbose else (lambda msg: None))
    # Only the JSON goes to stdout: Lightning's banners and warnings are silenced or sent to stderr.
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.redirect_stdout(sys.stderr):
        result = run("quick" if args.quick else "full", env)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
