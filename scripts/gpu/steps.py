"""The steps of scripts/gpu/check.py, most valuable first. Each takes (dry_run, work folder) and returns a dict of
figures with the same keys on a GPU and in a dry run, plus "checks": {name: True | False | None (not run here)}.
A step may keep what it has so far in `work/partial.json`, which check.py reports if the step does not finish.

A dry run (CPU, no CUDA) runs the same code at tiny sizes: it proves the kit works, not the figures."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; without it a bad path is looked up online

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))  # bench_gpu, bench_common; they put REPO on the path
sys.path.insert(0, str(REPO / "studies" / "seed001"))  # seed001_repro: its tiny Llama and tokenizer

import lightning as L  # noqa: E402
import torch  # noqa: E402

import bench_gpu  # noqa: E402
from bench_common import StepTimer, sync  # noqa: E402
from lit_growattn import GrowAttentionCallback  # noqa: E402
from lit_growattn.commands.cli import main as cli_main  # noqa: E402
from lit_growattn.callback import report  # noqa: E402

CONFIGS = REPO / "configs"


def device_of(dry_run: bool) -> torch.device:
    return torch.device("cpu" if dry_run else "cuda")


# -- 0. the environment: versions, the GPU, what the packages installed miss --------------------------------
PACKAGES = ["torch", "lightning", "torchmetrics", "transformers", "tokenizers", "huggingface_hub", "safetensors",
            "jsonargparse", "docstring_parser", "typeshed_client", "ruamel.yaml", "datasets", "numpy", "pytest"]


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unmet_requirements() -> list[str]:
    """The requirements of pyproject.toml (dependencies, hf, dev) and, in turn, of every distribution they name,
    that this environment does not meet: a package missing, or installed at a version outside the range."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    todo = [Requirement(r) for r in [*project["dependencies"], *extras["hf"], *extras["dev"]]]
    unmet, seen = set(), set()
    while todo:
        req = todo.pop()
        installed = version(req.name)
        if installed is None:
            unmet.add(f"{req}: not installed")
            continue
        if not req.specifier.contains(installed, prereleases=True):
            unmet.add(f"{req}: {installed} installed")
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        for text in metadata.requires(req.name) or []:
            needed = Requirement(text)
            if needed.marker is None or any(needed.marker.evaluate({"extra": e}) for e in {"", *req.extras}):
                todo.append(needed)
    return sorted(unmet)


def environment(dry_run: bool, work: Path) -> dict:
    import platform

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "packages": {name: version(name) for name in PACKAGES},
        "packages_from": {name: str(Path(module.__file__).parent) for name, module in
                          (("torch", torch), ("lightning", L), ("lit_growattn", sys.modules["lit_growattn"]))},
        "cuda_available": cuda,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "unmet_requirements": unmet_requirements(),
    }


# -- 1. the `gpu` pytest marker tests ---------------------------------------------------------------------
class Outcomes:
    """pytest plugin: each test's outcome, seconds, failure message and record_property values, saved to `partial`
    after each test: what check.py keeps if the time box ends the run."""

    def __init__(self, partial: Path):
        self.partial, self.tests = partial, {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":  # a setup skip or failure, or the call itself
            entry = self.tests.setdefault(report.nodeid, {"seconds": 0.0})
            entry["outcome"] = report.outcome
            entry["seconds"] += report.duration
            if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, reason)
                entry["message"] = report.longrepr[2]
            elif report.failed:
                entry["message"] = report.longreprtext.strip().splitlines()[-1][:500]
            entry.update(dict(report.user_properties))
            writing = self.partial.with_suffix(".writing")  # renamed whole: a kill never leaves half a file
            writing.write_text(json.dumps({"tests": self.tests}, default=str))
            os.replace(writing, self.partial)


def gpu_tests(dry_run: bool, work: Path) -> dict:
    import pytest

    outcomes = Outcomes(work / "partial.json")
    code = pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", f"--rootdir={REPO}", f"--basetemp={work / 'tmp'}",
                        str(REPO / "tests" / "test_gpu.py")], plugins=[outcomes])
    counts = {kind: sum(t["outcome"] == kind for t in outcomes.tests.values())
              for kind in ("passed", "failed", "skipped")}
    ran = counts["passed"] + counts["failed"]  # none without CUDA: all skipped
    return {**counts, "pytest_exit_code": int(code), "tests": outcomes.tests,
            "checks": {"gpu tests pass": not counts["failed"] if ran else None}}


# -- 2. scripts/bench_gpu.py ------------------------------------------------------------------------------
def bench(dry_run: bool, work: Path) -> dict:
    bench_gpu.main(["--out", str(work / "bench_gpu.json"), *(["--dry-run"] if dry_run else [])])
    result = json.loads((work / "bench_gpu.json").read_text())
    return {**result, "checks": result["targets"] if not dry_run else dict.fromkeys(result["targets"])}


# -- 3. sketched statistics at Llama-3.2-1B shapes (scripts/bench.py --llama1b on the GPU) -----------------
def sketch_1b(dry_run: bool, work: Path) -> dict:
    """Two Llama-3.2-1B-shaped layers, both sides: a plain step, the full statistics step and the sketched one, their
    times (medians of interleaved repeats) and the statistics' memory (sums + the step's extra allocation peak)."""
    from bench_setup import Env
    from bench_sketch import measure_llama1b

    device = device_of(dry_run)
    sizes = dict(layers=1, hidden=64, heads=4, kv_heads=2, seq_len=32) if dry_run else {}
    result = measure_llama1b(1 if dry_run else 5, Env(logger="none", log=print), device=device, **sizes)
    return {**result, "checks": dict.fromkeys(result["target"]) if dry_run else result["target"]}


def sketch_crossover(dry_run: bool, work: Path) -> dict:
    """The width e′ where the sketched statistics step gets cheaper than the full one on this GPU (κ of `auto`)."""
    from bench_setup import PRESETS, Env
    from bench_sketch import measure_crossover

    preset = PRESETS["quick" if dry_run else "full"]
    if not dry_run:  # a GPU's kernels need more work per call than the CPU preset's 1,024 tokens to be timed at all
        preset = replace(preset, crossover_widths=(128, 256, 512, 1024, 2048, 4096), crossover_tokens=(1024, 2))
    result = measure_crossover(preset, Env(logger="none", log=print), device_of(dry_run))
    return {**result, "checks": {}}


# -- 4. model FLOPs utilisation on a GPT-2-small shape -----------------------------------------------------
GPT2_SMALL = bench_gpu.Setup(n_layer=12, n_embd=768, n_head=12, d_v=64, d_head=64, d_head_grown=64, seq_len=1024,
                             batch=16, epoch_steps=0, warmup_steps=0, repeats=10, d_heads=(), vocab=50304)
GPT2_DRY_RUN = replace(GPT2_SMALL, n_layer=2, n_embd=32, n_head=2, d_v=16, d_head=16, d_head_grown=16, seq_len=32,
                       batch=4, repeats=2, vocab=256)


def matmul_peak_flops(device: torch.device, n: int, repeats: int) -> float:
    """FLOP/s of the fastest of `repeats` bf16 n×n matmuls: the peak the MFU is measured against (not the data
    sheet's, which the card may not reach at its clocks)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    best = float("inf")
    for _ in range(repeats + 2):  # two warm-ups
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def mfu(dry_run: bool, work: Path) -> dict:
    device, s = device_of(dry_run), GPT2_DRY_RUN if dry_run else GPT2_SMALL
    compile = not dry_run  # inductor's CPU compile would take the dry run's whole budget
    peak = matmul_peak_flops(device, 256 if dry_run else 8192, 3 if dry_run else 20)
    steps = bench_gpu.statistics_step(s, device, compile)
    tokens = s.batch * s.seq_len
    tokens_per_s = {"normal": tokens / steps["normal_step_s"], "statistics": tokens / steps["stats_step_s"]}
    return {
        "setup": {"n_layer": s.n_layer, "n_embd": s.n_embd, "n_head": s.n_head, "d_head": s.d_head, "d_v": s.d_v,
                  "block_size": s.seq_len, "batch": s.batch, "vocab": s.vocab, "precision": "bf16 autocast",
                  "compile": compile, "data": "random tokens"},
        "matmul_peak_tflops": peak / 1e12,
        "flops_per_token": steps["flops_per_token"],
        "tokens_per_s": tokens_per_s,
        "mfu": {kind: steps["flops_per_token"] * rate / peak for kind, rate in tokens_per_s.items()},
        "statistics_step": steps,
        "checks": {},
    }


# -- 5. a text growth run: configs/text_grow.yaml at GPU batch sizes, bf16-mixed ---------------------------
def repository_text() -> str:
    """The corpus: this repository's own documentation and code (about 0.7 MB of English and Python), so that
    the run needs no file from elsewhere."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "lit_growattn").rglob("*.py"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def text_growth(dry_run: bool, work: Path) -> dict:
    corpus = work / "corpus.txt"
    corpus.write_text(repository_text(), encoding="utf-8")
    batch, steps_per_epoch = (8, 6) if dry_run else (256, 100)
    args = ["--config", str(CONFIGS / "text_grow.yaml"), f"--data.init_args.path={corpus}",
            f"--data.init_args.cache_dir={work / 'cache'}", f"--data.init_args.batch_size={batch}",
            f"--data.init_args.samples_per_epoch={batch * steps_per_epoch}", "--trainer.max_epochs=3",
            f"--trainer.accelerator={'cpu' if dry_run else 'gpu'}", "--trainer.precision=bf16-mixed",
            "--trainer.limit_val_batches=4", "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={work / 'logs'}"]
    if dry_run:
        args.append("--trainer.callbacks.init_args.statistics.batches=2")
    cli = cli_main(args, run=False)
    timers = [StepTimer(device_of(dry_run), epoch) for epoch in range(cli.trainer.max_epochs)]
    cli.trainer.callbacks[:0] = timers
    cli.trainer.fit(cli.model, cli.datamodule)
    (grow,) = [c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback)]
    # The median step of each epoch, its first steps (warm-up after a growth) left out.
    per_epoch = [statistics.median(t.step_times(skip=2 if dry_run else 10)) for t in timers]
    grown = [e for e in grow.history if report.grew(e)]
    return {
        "corpus": {"what": "this repository's README, docs/*.md and lit_growattn/**/*.py",
                   "bytes": corpus.stat().st_size},
        "batch_size": batch, "block_size": cli.datamodule.block_size, "steps": cli.trainer.global_step,
        "growth_lines": [report.event_line(e) for e in grow.history],
        "d_head": cli.model.model.head_sizes(),
        "step_s_per_epoch": per_epoch,
        "step_s_before_after_growth": [
            {"epoch": e["epoch"], "d_head": e["d_head"], "before": per_epoch[e["epoch"] - 1],
             "after": per_epoch[e["epoch"]]} for e in grown],
        "val_loss": float(cli.trainer.callback_metrics["val/loss"]),
        "checks": {"text run grows at every event": len(grown) == len(grow.history) == 2},
    }


# -- 6. one growth under FSDP2 (ModelParallelStrategy) on one device ---------------------------------------------
def fsdp2_growth(dry_run: bool, work: Path) -> dict:
    """configs/mqar_grow.yaml under ModelParallelStrategy(data_parallel_size=1) with FSDP2's bf16 policy: the blocks
    sharded on a mesh of one device, two growths of both sides, the grown blocks re-sharded; then the run resumed from
    its last checkpoint (a folder of shards) for one more epoch, at the grown sizes. A growth assigned to a sharded
    block is silently undone (docs/design.md §13), so the widths are read from the parameters after each run, and the
    parameters must still be sharded (DTensors)."""
    from torch.distributed.tensor import DTensor

    strategy = ('{"class_path": "lightning.pytorch.strategies.ModelParallelStrategy", '
                '"init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1}}')

    def fit(epochs: int, ckpt_path: Path | None = None):
        cli = cli_main(["--config", str(CONFIGS / "mqar_grow.yaml"), f"--trainer.strategy={strategy}",
                        f"--trainer.accelerator={'cpu' if dry_run else 'gpu'}", "--trainer.devices=1",
                        f"--trainer.max_epochs={epochs}", "--trainer.limit_train_batches=8",
                        "--trainer.limit_val_batches=2", "--model.init_args.fsdp_param_dtype=bfloat16",
                        "--trainer.callbacks.init_args.schedule.init_args.epochs=[1, 2]",
                        "--trainer.callbacks.init_args.growth.grow=both",
                        "--trainer.callbacks.init_args.growth.value_columns=2",
                        "--trainer.callbacks.init_args.statistics.batches=4", "--trainer.enable_progress_bar=false",
                        f"--trainer.logger.init_args.save_dir={work / 'logs'}",
                        f"--trainer.default_root_dir={work}"], run=False)
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
        (grow,) = [c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback)]
        sizes = (cli.model.model.head_sizes(), cli.model.value_sizes())
        return cli, grow, sizes, all(isinstance(p, DTensor) for p in cli.model.parameters())

    cli, grow, sizes, sharded = fit(3)
    (last,) = (work / "logs").rglob("last.ckpt")
    resumed_cli, resumed, resumed_sizes, resumed_sharded = fit(4, ckpt_path=last)
    grown = [e for e in grow.history if report.grew(e)]
    return {
        "growth_lines": [report.event_line(e) for e in grow.history],
        "d_head": sizes[0], "d_v": sizes[1],
        "parameters_sharded": sharded,
        "val_loss": float(cli.trainer.callback_metrics["val/loss"]),
        "resumed_from": str(last.relative_to(work)), "resumed_d_head": resumed_sizes[0],
        "resumed_d_v": resumed_sizes[1], "resumed_val_loss": float(resumed_cli.trainer.callback_metrics["val/loss"]),
        "checks": {"FSDP2 run grows at every event, sharded": len(grown) == len(grow.history) == 2 and sharded,
                   "FSDP2 run resumes from its folder at the grown sizes": (
                       last.is_dir() and resumed.history == grow.history and resumed_sizes == sizes
                       and resumed_sharded and resumed_cli.trainer.current_epoch == 4)},
    }


# -- 7. seed 001's tiny config (low-rank DINT conversion, then SFT) in bf16 --------------------------------
def seed001(dry_run: bool, work: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_growattn.__main__ import main as command
    from lit_growattn.data.arithmetic import make_rows, write_jsonl
    from seed001_repro import MODEL, make_tokenizer

    rows = make_rows(40 if dry_run else 4000, seed=0)  # more batches per epoch than steps between validations
    rows_file = write_jsonl(work / "rows.jsonl", rows)
    (work / "other.txt").write_text(repository_text()[:20000], encoding="utf-8")
    native, dint = work / "llama", work / "dint"
    tokenizer = make_tokenizer(native, "\n".join(r["problem"] + "\n" + r["generated_solution"] for r in rows), 300)
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**MODEL, "vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(config).save_pretrained(native)
    if command(["convert", "--pretrained", str(native), "--to", "lowrank_dint", "--rank", "4", "--out", str(dint)]):
        raise RuntimeError("python -m lit_growattn convert failed (its message is in the log above)")
    steps = 6 if dry_run else 200
    started = time.perf_counter()
    code = command(["fit", "--config", str(CONFIGS / "hf_llama_dint_sft_tiny.yaml"),
                    f"--model.init_args.pretrained={dint}", f"--data.init_args.tokenizer={dint}",
                    f"--data.init_args.path={rows_file}", f"--data.init_args.cache_dir={work / 'cache'}",
                    "--data.init_args.val_texts={other: " + str(work / "other.txt") + "}",
                    f"--data.init_args.batch_size={4 if dry_run else 32}", f"--trainer.max_steps={steps}",
                    f"--trainer.val_check_interval={steps // 2}",
                    f"--trainer.accelerator={'cpu' if dry_run else 'gpu'}", "--trainer.precision=bf16-mixed",
                    f"--trainer.logger.init_args.save_dir={work / 'logs'}"])
    seconds = time.perf_counter() - started
    if code:
        raise RuntimeError("python -m lit_growattn fit on configs/hf_llama_dint_sft_tiny.yaml failed (see the log)")
    (ckpt,) = (work / "logs").rglob("last.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    lam = {name: value.float().abs().mean().item() for name, value in state.items() if name.endswith("self_attn.lam")}
    scalars = {}
    for events in (work / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        scalars |= {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}
    entropy = {tag: value for tag, value in scalars.items() if tag.startswith("attention/entropy")}
    layers = MODEL["num_hidden_layers"]
    return {
        "model": {**MODEL, "vocab_size": len(tokenizer), "dint": "lowrank, rank 4"},
        "steps": steps, "fit_seconds": seconds,
        "mean_abs_lambda_per_layer": list(lam.values()),
        "attention_entropy": entropy,
        "losses": {tag: value for tag, value in scalars.items() if tag.endswith("loss")},
        "checks": {
            "lambda moves": len(lam) == layers and all(v > 0 for v in lam.values()),
            "entropy callback logs": all(f"attention/{kind}/layer_{i}" in entropy
                                         for kind in ("entropy", "entropy_original") for i in range(layers)),
        },
    }


STEPS = {"environment": environment, "gpu_tests": gpu_tests, "bench_gpu": bench, "sketch_1b": sketch_1b,
         "sketch_crossover": sketch_crossover, "mfu": mfu,
         "text_growth": text_growth, "fsdp2_growth": fsdp2_growth, "seed001": seed001}


def run_step(name: str, dry_run: bool, work: str, result_file: str, error_file: str, log_file: str) -> None:
    """A step in a process of its own (check.py's time box ends it and its process group): what it prints goes to
    the log, its result to `result_file` as JSON, a traceback to `error_file`."""
    os.setpgrp()
    with open(log_file, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    torch.manual_seed(0)
    if dry_run:
        torch.set_num_threads(1)  # tiny shapes: more threads only spin (and `make test` runs beside this)
    try:
        result = STEPS[name](dry_run, Path(work))
    except BaseException:
        Path(error_file).write_text(traceback.format_exc())
        raise
    Path(result_file).write_text(json.dumps(result, default=str))
