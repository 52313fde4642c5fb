"""One training run of the studies (growth_pays/experiments.py, hf_growth/hf_experiment.py,
kcache_budget/kcache_study.py), their results merged, and the static-then-shrunk peer of growth (kcache_budget)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L

REPO = Path(__file__).resolve().parents[1]  # studies/ sits in the repository's root
sys.path.insert(0, str(REPO))

from lit_growattn.callback import GrowAttentionCallback  # noqa: E402
from lit_growattn.commands.cli import main as cli_main  # noqa: E402
from lit_growattn.commands.convert import convert_checkpoint  # noqa: E402

TEXT_SETTING = ["--trainer.max_epochs=5", "--data.init_args.samples_per_epoch=9600"]  # 750 steps, as experiments_text
SHRINK_SHARE = 2 / 3  # the shrunk peer: static 16 for this share of the steps, then shrunk and fine-tuned for the rest
FINE_TUNE_WARMUP = 25  # the fine-tune is a new run: a short warmup of its own instead of the config's 100 steps
BYTES_PER_VALUE = 4  # float32 K cache


class Curve(L.Callback):
    """Validation loss/accuracy against training FLOPs and d_head and d_v against steps, for the plots; every extra
    validation set (`sets`, by name) and the attention entropy per layer, when logged."""

    def __init__(self):
        self.points: list[dict] = []

    def on_validation_end(self, trainer, pl_module):
        # After every callback's on_validation_epoch_end, so that the attention analysis has logged its entropy.
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        sets: dict[str, dict[str, float]] = {}
        for key, value in metrics.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "val":  # val/<name>/<metric>
                sets.setdefault(parts[1], {})[parts[2]] = value
        self.points.append({
            "step": trainer.global_step,
            "flops": _flops(pl_module),
            "loss": metrics["val/loss"],
            "bpb": metrics.get("val/bpb"),
            "acc": metrics.get("val/acc"),  # None for a model that logs no accuracy (lit_growattn.hf.HFCausalLM)
            "sets": sets,
            "entropy": {k.removeprefix("attention/entropy/"): v for k, v in metrics.items()
                        if k.startswith("attention/entropy/")},
            "d_head": pl_module.head_sizes(),
            "d_v": _value_sizes(pl_module),
        })


class StepTimer(L.Callback):
    """Wall seconds of every training step, and whether statistics were gathered in it (some form or value map
    capturing) or a growth check ran at its start. It must come first among the callbacks: its clock then spans the
    growth callback's check (in on_train_batch_start) and the capture (on backward); its on_train_batch_end runs
    before the growth callback's, so the forms still say whether they captured."""

    def __init__(self):
        self.steps: list[tuple[float, bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._checks = _checks(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._start
        captured = any(named.form.capture is not None for named in [*pl_module.growable_forms(), *_values(pl_module)])
        self.steps.append((seconds, captured or _checks(trainer) != self._checks))

    def summary(self) -> dict:
        """The statistics' share of training time: what the steps that gathered statistics or checked took beyond
        as many plain steps (at the plain steps' median), over all steps' time (validation left out)."""
        window = [s for s, stats in self.steps if stats]
        plain = [s for s, stats in self.steps if not stats]
        total = sum(s for s, _ in self.steps)
        extra = sum(window) - len(window) * statistics.median(plain) if window and plain else 0.0
        return {"steps": len(self.steps), "step_seconds": total, "statistics_steps": len(window),
                "statistics_step_seconds": sum(window),
                "plain_step_median": statistics.median(plain) if plain else None,
                "statistics_share": extra / total if total else 0.0}


def _checks(trainer) -> int:
    return sum(len(c.history) for c in trainer.callbacks if isinstance(c, GrowAttentionCallback))


def _values(pl_module) -> list:
    """The module's value maps, where its value side can grow (GrowAttentionLM; not HFCausalLM)."""
    return pl_module.growable_values() if hasattr(pl_module, "growable_values") else []


def _value_sizes(pl_module) -> list[int] | None:
    """d_v per layer, where the module reports it (GrowAttentionLM, HFCausalLM)."""
    return pl_module.value_sizes() if hasattr(pl_module, "value_sizes") else None


def _flops(pl_module) -> float | None:
    """Training FLOPs seen so far, where the module counts them (GrowAttentionLM; not HFCausalLM)."""
    return float(pl_module.flops_seen) if hasattr(pl_module, "flops_seen") else None


def run(config: str, overrides: list[str], log_dir: str, grow: bool, save: Path | None = None,
        callbacks: list[L.Callback] = ()) -> dict:
    """One training run; without `grow` the config's growth callback is left out and every other callback kept;
    with `save`, the trained model's checkpoint is written there; `callbacks` are added (the caller reads them)."""
    cli = cli_main(
        ["--config", str(REPO / config), "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         f"--trainer.logger.init_args.save_dir={log_dir}", *overrides],
        run=False,
    )
    if not grow:
        cli.trainer.callbacks = [c for c in cli.trainer.callbacks if not isinstance(c, GrowAttentionCallback)]
    curve, timer = Curve(), StepTimer()
    cli.trainer.callbacks.insert(0, timer)
    cli.trainer.callbacks.extend([curve, *callbacks])
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    if curve.points[-1]["step"] != cli.trainer.global_step:  # max_steps stopped it mid-epoch: validate the end
        cli.trainer.validate(cli.model, cli.datamodule, verbose=False)
    if save is not None:
        cli.trainer.save_checkpoint(save)
    grow = next((c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback)), None)
    return {
        "params": sum(p.numel() for p in cli.model.parameters()),
        "n_head": cli.model.hparams.get("n_head"),
        "seconds": time.perf_counter() - start,
        "flops": _flops(cli.model),
        "final": curve.points[-1],
        "curve": curve.points,
        "events": grow.history if grow else [],
        "time": timer.summary(),
    }


def k_cache_bytes(n_kv_head: int, d_head: list[int]) -> int:
    """Bytes of K cache per token: every layer keeps n_kv_head keys of its d_head."""
    return n_kv_head * sum(d_head) * BYTES_PER_VALUE


def v_cache_bytes(n_kv_head: int, d_v: list[int]) -> int:
    """Bytes of V cache per token: every layer keeps n_kv_head values of its d_v."""
    return k_cache_bytes(n_kv_head, d_v)


def sizes(d_head: list[int]) -> str:
    """The override of a static model with one head size per layer."""
    return f"--model.init_args.d_head=[{', '.join(map(str, d_head))}]"


def shrink_query_keys(budget: float, calibration: Path | None = None,
                      sequences: int = 256) -> Callable[[Path, Path], list[int]]:
    """A `fine_tune_shrunk` shrink: the query/key sides to a mean head size `budget` (convert --kv_budget), sizes
    and factors by the weights' SVD energy, or with `calibration` by the activations on `sequences` windows of that
    text file (--calibration)."""
    def shrink(trained: Path, to: Path) -> list[int]:
        module = convert_checkpoint(trained, to, to="mha", kv_budget=budget, sides="query_key", overwrite=True,
                                    **({"calibration": calibration, "calibration_sequences": sequences}
                                       if calibration is not None else {}))
        return module.head_sizes()
    return shrink


def train_to_shrink(config: str, common: list[str], steps: int, trained: Path, logs: str) -> dict:
    """The shrunk peer's first phase: static d_head 16 for SHRINK_SHARE of `steps`, its checkpoint written to
    `trained` (several sizes can be shrunk from it)."""
    at = round(SHRINK_SHARE * steps)
    return run(config, [*common, "--model.init_args.d_head=16", f"--trainer.max_steps={at}"], logs, grow=False,
               save=trained)


def fine_tune_shrunk(config: str, common: list[str], first: dict, trained: Path,
                     shrink: Callable[[Path, Path], list[int]], steps: int, work: Path, logs: str) -> dict:
    """The shrunk peer's second phase: `trained` (first phase `first`) shrunk by `shrink(trained, to)`, which writes
    the shrunk checkpoint and returns its d_head per layer, and fine-tuned for the rest of `steps`; FLOPs, curve and
    seconds of both phases together (the shrink's seconds in time["shrink_s"])."""
    at = first["final"]["step"]
    shrunk = work / "shrunk.ckpt"  # one scratch file per cell
    start = time.perf_counter()
    d_head = shrink(trained, shrunk)
    shrink_s = time.perf_counter() - start
    second = run(config, [*common, sizes(d_head), f"--model.init_args.init_from={shrunk}",
                          f"--trainer.max_steps={steps - at}",
                          f"--model.init_args.warmup_steps={FINE_TUNE_WARMUP}"], logs, grow=False)
    # The shrunk checkpoint carries the model's FLOPs counter (a buffer): the fine-tune's counts continue it.
    shifted = [{**p, "step": p["step"] + at} for p in second["curve"]]
    return {
        "params": second["params"],
        "n_head": second["n_head"],
        "seconds": first["seconds"] + second["seconds"],
        "flops": second["flops"],
        "final": shifted[-1],
        "curve": first["curve"] + shifted,
        "events": [{"event": f"shrink at step {at}", "step": at, "d_head_before": first["final"]["d_head"],
                    "d_head": d_head}],
        "time": {"static 16": first["time"], "fine-tune": second["time"], "shrink_s": shrink_s},  # per phase
    }


def merge(parts: list[dict[str, list[dict]]], order: list[str], task: str | None = None) -> dict[str, list[dict]]:
    """One results dict from several: the seeds of a run name are concatenated; names keep the grid's order.
    With `task`, results of another task are refused (they would be rendered with the wrong metric)."""
    merged: dict[str, list[dict]] = {}
    for part in parts:
        for name, runs in part.items():
            merged.setdefault(name, []).extend(runs)
    for name, runs in merged.items():
        found = {r.get("task") for r in runs}
        if task is not None and None in found:
            raise ValueError(f"{name!r} has results that do not record their task (written before it was recorded); "
                             f"if they are {task} results, add \"task\": \"{task}\" to each of its runs")
        if task is not None and found != {task}:
            other = "with --text FILE" if "text" in found else "without --text"
            raise ValueError(f"{name!r} holds {' and '.join(sorted(found))} results, not {task}: render them {other}")
    for name, runs in merged.items():
        seeds = [r["seed"] for r in runs if "seed" in r]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"{name!r} has seeds {sorted(seeds)}: the same run is in two of the files (or a file "
                             "written by an earlier merge is merged again)")
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(merged.items(), key=lambda item: rank.get(item[0], len(rank))))


def read_results(parser: argparse.ArgumentParser, out: Path, what: str) -> dict:
    """A grid's results file as earlier invocations left it (a new one, described by `what`, when absent); a file
    that is not one fails through `parser` before any run."""
    try:
        return json.loads(out.read_text()) if out.exists() else {"what": what, "runs": {}}
    except json.JSONDecodeError as error:
        parser.error(f"{out} is not a results JSON ({error}); give another --out")


def save(results: dict, out: Path) -> None:
    """Writes the results whole or not at all (the grid's earlier runs are in the same file)."""
    partial = out.with_suffix(".json.partial")
    partial.write_text(json.dumps(results, indent=1))
    os.replace(partial, out)
