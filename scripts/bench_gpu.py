#!/usr/bin/env python
"""GPU benchmark of lit_growattn in bf16: fused attention kernels, grown vs static throughput, statistics steps.

Measurements (one function each):
1. sdpa_backends: for every d_head in 1…64 (a few in the dry run), a query/key form's forward and backward (a
   normal step's attention and the `extend` statistics capture) under `sdpa_kernel` restricted to the fused
   backends, so that a math fallback raises instead of being slow; the profiler names the kernel that ran.
   Beside it, the kernel that runs without padding (sdpa_pad: off), which is what the padding saves.
2. throughput: tokens/s of a model grown by GrowAttentionCallback (d_head d0 → d1 at epoch 1, timed in the
   epoch after the growth) ÷ a model built at d1 (same fit, same steps), and the static model under Lightning
   ÷ a plain PyTorch loop on the same model, optimizer and schedule.
3. statistics_step: a training step with `extend` capture on every form plus the folding of the captured
   pairs into FormStats (the callback's on_after_backward) ÷ a normal step, and the same with the value maps
   capturing too (both_sides_step_cost_ratio, growth.grow: both), interleaved repeats, medians;
   with the peak memory (torch.cuda.max_memory_allocated) of each, and the model's training FLOPs per token.

    python scripts/bench_gpu.py              # on a CUDA GPU (a few minutes): prints the JSON (--out FILE: saves it)
    python scripts/bench_gpu.py --compile    # the same with compile: true
    python scripts/bench_gpu.py --dry-run    # tiny shapes, on CPU without a GPU: checks the command, no figures
    python scripts/bench.py --accelerator gpu  # dispatches here (bf16 always)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import lightning as L
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader

from bench_common import StepTimer, json_only_stdout, make_lm, plain_step_times, sync, token_data

from lit_growattn import growth  # bench_common has put the repository on the path
from lit_growattn.attention import QKForm
from lit_growattn.attention.value import ValueMap
from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings
from lit_growattn.module import GrowAttentionLM

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


@dataclass(frozen=True)
class Setup:
    n_layer: int
    n_embd: int
    n_head: int
    d_v: int
    d_head: int  # before growth
    d_head_grown: int  # after growth, and the static model's
    seq_len: int
    batch: int
    epoch_steps: int  # the growth falls at the start of the second epoch
    warmup_steps: int  # steps of the second epoch left out of the timing
    repeats: int  # interleaved repeats of the statistics step
    d_heads: tuple[int, ...]  # the head sizes whose SDPA kernel is looked up
    vocab: int = 256


GPU = Setup(n_layer=6, n_embd=384, n_head=6, d_v=64, d_head=8, d_head_grown=32, seq_len=1024, batch=16,
            epoch_steps=40, warmup_steps=10, repeats=10, d_heads=tuple(range(1, 65)))
# A few head sizes only: the profiled lookup of all 64 is most of the dry run's time in the test suite.
DRY_RUN = Setup(n_layer=2, n_embd=32, n_head=2, d_v=16, d_head=2, d_head_grown=5, seq_len=32, batch=4,
                epoch_steps=6, warmup_steps=2, repeats=2, d_heads=(1, 2, 5, 9, 15, 17, 64))


def kernel_that_ran(fn) -> str:
    """Name of the SDPA kernel op that `fn` dispatched to (e.g. aten::_scaled_dot_product_flash_attention)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product_") and "backward" not in e.name}
    return ",".join(sorted(names))


# -- 1. which kernel runs at each head size -----------------------------------------------------------------
def sdpa_backends(s: Setup, device: torch.device) -> dict:
    x = torch.randn(2, 128, s.n_embd, device=device)
    v = torch.randn(2, s.n_head, 128, s.d_v, device=device)
    result, fallbacks = {}, []
    for d in s.d_heads:
        row = {}
        for pad in ("on", "off"):
            form = QKForm(s.n_embd, s.n_head, d, sdpa_pad=pad).to(device)
            for capture in (None, "extend"):
                form.capture = capture

                def step():
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        out = form.attend(x, v)
                    out.float().sum().backward()
                    form.take_captured()

                key = f"{'padded' if pad == 'on' else 'unpadded'}_{capture or 'train'}"
                if pad == "on":
                    try:
                        with sdpa_kernel(FUSED):  # a math fallback raises here
                            row[key] = kernel_that_ran(step)
                    except RuntimeError as err:
                        fallbacks.append(f"d_head {d} {key}: {err}")
                        row[key] = "none (math fallback refused)"
                else:
                    row[key] = kernel_that_ran(step)
        result[d] = row
    return {"per_d_head": result, "math_fallbacks": fallbacks, "d_v": s.d_v, "n_embd": s.n_embd}


# -- 2. throughput: grown vs static vs plain PyTorch ------------------------------------------------------
def model(s: Setup, d_head: int, compile: bool) -> GrowAttentionLM:
    return make_lm(vocab_size=s.vocab, block_size=s.seq_len, n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd,
                   d_head=d_head, d_v=s.d_v, compile=compile)


def token_loader(s: Setup, n_batches: int) -> DataLoader:
    return DataLoader(token_data(s.vocab, s.seq_len, s.batch, n_batches), batch_size=s.batch)


def lightning_steps(s: Setup, device: torch.device, compile: bool, grow: bool) -> tuple[list[float], list[int], int]:
    """Step times of the second epoch of a 2-epoch fit (the grown model grows at the start of that epoch), the
    head sizes at the end, and the peak memory of the fit (CUDA; 0 on CPU)."""
    lm = model(s, s.d_head if grow else s.d_head_grown, compile)
    timer = StepTimer(device, epoch=1)
    callbacks = [timer]
    if grow:
        callbacks.append(GrowAttentionCallback(AtEpochs([1]), GrowthSettings(columns=s.d_head_grown - s.d_head),
                                               StatisticsSettings(batches=2)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision="bf16-mixed",
                            max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            callbacks=callbacks, default_root_dir=tmp)
        trainer.fit(lm, token_loader(s, s.epoch_steps))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return timer.step_times(s.warmup_steps), lm.model.head_sizes(), peak


def throughput(s: Setup, device: torch.device, compile: bool) -> dict:
    grown, grown_sizes, grown_peak = lightning_steps(s, device, compile, grow=True)
    static, _, static_peak = lightning_steps(s, device, compile, grow=False)
    # The static model in a plain PyTorch loop: same optimizer, schedule and bf16 autocast, no Lightning.
    plain = plain_step_times(model(s, s.d_head_grown, compile), token_loader(s, s.epoch_steps), device, True,
                             s.warmup_steps)
    step_s = {name: statistics.median(t) for name, t in (("grown", grown), ("static", static), ("plain", plain))}
    tokens = s.batch * s.seq_len
    return {
        "grown_vs_static_throughput": step_s["static"] / step_s["grown"],
        "lightning_vs_plain_throughput": step_s["plain"] / step_s["static"],
        "tokens_per_s": {name: tokens / t for name, t in step_s.items()},
        "step_s": step_s,
        "grown_d_head": grown_sizes,
        "peak_memory_bytes": {"grown": grown_peak or None, "static": static_peak or None},
    }


# -- 3. statistics step vs normal step, and peak memory ---------------------------------------------------
def statistics_step(s: Setup, device: torch.device, compile: bool) -> dict:
    lm = model(s, s.d_head_grown, compile).to(device).train()
    forms = [m for m in lm.modules() if isinstance(m, QKForm)]
    values = [m for m in lm.modules() if isinstance(m, ValueMap)]
    optimizer = lm.configure_optimizers()["optimizer"]
    inputs, labels = (t.to(device) for t in next(iter(token_loader(s, 1))))
    sums = [growth.FormStats.empty_like(f, "natural") for f in forms] + [growth.ValueStats.empty_like(v) for v in values]

    def step(variant: str) -> tuple[float, int]:
        """variant: train (no capture) | extend (query/key) | both (query/key extend and the value maps)."""
        for f in forms:
            f.capture = None if variant == "train" else "extend"
        for v in values:
            v.capture = "extend" if variant == "both" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm.loss(lm(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for st, f in zip(sums, forms + values):  # what the callback's on_after_backward does
            for pair in f.take_captured():
                st.update(*pair)
        optimizer.step()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        return time.perf_counter() - start, peak

    variants = ("train", "extend", "both")
    for variant in (*variants, "train"):  # warm-up (and compilation)
        step(variant)
    timed = {v: [] for v in variants}
    for r in range(s.repeats):
        order = variants[r % 3:] + variants[: r % 3]  # rotate, so drift favours none
        for variant in order:
            timed[variant].append(step(variant))

    def ratio(variant: str) -> float:
        return statistics.median(t / n for (t, _), (n, _) in zip(timed[variant], timed["train"]))

    return {
        "stats_step_cost_ratio": ratio("extend"),
        "both_sides_step_cost_ratio": ratio("both"),
        "normal_step_s": statistics.median(t for t, _ in timed["train"]),
        "stats_step_s": statistics.median(t for t, _ in timed["extend"]),
        "both_sides_step_s": statistics.median(t for t, _ in timed["both"]),
        "normal_peak_memory_bytes": max(p for _, p in timed["train"]) or None,
        "stats_peak_memory_bytes": max(p for _, p in timed["extend"]) or None,
        "both_sides_peak_memory_bytes": max(p for _, p in timed["both"]) or None,
        "flops_per_token": lm.model.flops_per_token(s.seq_len),
    }


# -- driver -----------------------------------------------------------------------------------------------
def run(s: Setup, device: torch.device, compile: bool) -> dict:
    started = time.perf_counter()
    backends = sdpa_backends(s, device)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run: no figures)",
        "torch": torch.__version__,
        "lightning": L.__version__,
        "precision": "bf16-mixed",
        "compile": compile,
        "setup": asdict(s),
        "throughput": throughput(s, device, compile),
        "statistics_step": statistics_step(s, device, compile),
        "sdpa_backends": backends,
    }
    result["targets"] = {
        "grown_vs_static_throughput >= 0.95": result["throughput"]["grown_vs_static_throughput"] >= 0.95,
        "stats_step_cost_ratio <= 1.5": result["statistics_step"]["stats_step_cost_ratio"] <= 1.5,
        "both_sides_step_cost_ratio <= 1.5": result["statistics_step"]["both_sides_step_cost_ratio"] <= 1.5,
        "no math fallback at any d_head": not backends["math_fallbacks"],
    }
    result["bench_seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench_gpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (on CPU without a GPU): checks the command")
    parser.add_argument("--compile", action="store_true", help="models with compile: true")
    # scripts/results/bench_gpu.json is scripts/gpu/check.sh's result, of which this benchmark is one step (docs/gpu.md).
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not (cuda or args.dry_run):
        parser.error("no CUDA GPU: run on a GPU, or pass --dry-run to check the command on CPU")
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    setup = DRY_RUN if args.dry_run else GPU
    with json_only_stdout():
        result = run(setup, device, args.compile)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
