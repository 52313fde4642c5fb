"""One training run of the studies (growth_pays/experiments.py, capacity/capacity_study.py, hf_growth/hf_experiment.py),
and their results merged."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import lightning as L

REPO = Path(__file__).resolve().parents[1]  # studies/ sits in the repository's root
sys.path.insert(0, str(REPO))

from lit_growattn.callbacks import GrowAttentionCallback  # noqa: E402
from lit_growattn.commands.cli import main as cli_main  # noqa: E402


class Curve(L.Callback):
    """Validation loss/accuracy against training FLOPs and d_head against steps, for the plots; every extra
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
        })


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
    curve = Curve()
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
