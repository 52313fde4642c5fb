"""The growth step on text: does a step along ΔM pay, and which part of growth does? (docs/growth_step.md)

    python scripts/growth_step.py probe --text ../shared/data/tinyshakespeare.txt        # L(α), noise → JSON
    python scripts/growth_step.py train --text … --runs 'grow natural/append + Q/K reset' --seeds 0 1 2
    python scripts/growth_step.py report                                                  # md table + plots

`probe` trains configs/text_grow.yaml (the experiments setting: 5 epochs of 150 steps) and, at the start of
each growth epoch, before the callback grows, copies the model and measures on it: the loss L(α) of every
method × mode on a log grid of α, on window batches (as the callback keeps them) and on held-out batches,
against the first-order prediction; and the agreement of the direction estimated from two halves of the
statistics. `train` runs the mechanism table's variants, with the loss on held-out batches just before and
just after each growth event. Everything here drives the public growth API (GrowthPlan, FormStats, QKForm
capture); nothing reads the callback's internals.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lit_growattn import growth  # noqa: E402
from lit_growattn.callbacks import GrowAttentionCallback  # noqa: E402
from lit_growattn.cli import main as cli_main  # noqa: E402

CONFIG = "configs/text_grow.yaml"
SETTING = ["--trainer.max_epochs=5", "--data.init_args.samples_per_epoch=9600"]  # as docs/experiments_text.md
GROW_EPOCHS = (1, 2)
HELD_OUT_BATCHES = 8
STATIC = ["--trainer.callbacks=null"]


def grow_args(method: str, mode: str, *extra: str) -> list[str]:
    return [f"--trainer.callbacks.init_args.method={method}", f"--trainer.callbacks.init_args.mode={mode}", *extra]


# name → (CLI overrides, reset the Q/K Adam moments at the growth epochs)
RUNS: dict[str, tuple[list[str], bool]] = {
    "static d_head 2": ([*STATIC, "--model.init_args.d_head=2"], False),
    "static d_head 16": ([*STATIC, "--model.init_args.d_head=16"], False),
    "static d_head 2 + Q/K reset": ([*STATIC, "--model.init_args.d_head=2"], True),
    "grow zero/append": (grow_args("zero", "append"), False),
    "grow random/append": (grow_args("random", "append"), False),
    "grow natural/append α=0": (grow_args("natural", "append", "--trainer.callbacks.init_args.alphas=[0]"), False),
    "grow natural/append α=0 + Q/K reset": (grow_args("natural", "append", "--trainer.callbacks.init_args.alphas=[0]"), True),
    "grow natural/replace α=0": (grow_args("natural", "replace", "--trainer.callbacks.init_args.alphas=[0]"), False),
}


def held_out(datamodule, n: int = HELD_OUT_BATCHES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = datamodule.val_dataloader()
    loader = loader[0] if isinstance(loader, list) else loader
    return [batch for _, batch in zip(range(n), loader)]


@torch.no_grad()
def mean_loss(module, batches) -> float:
    was_training = module.training
    module.eval()
    try:
        return sum(float(module.loss(module(x), y)) for x, y in batches) / len(batches)
    finally:
        module.train(was_training)


class EventLoss(L.Callback):
    """Held-out loss at the start of each growth epoch; placed before the growth callback (`before`) and after it."""

    def __init__(self, record: dict, key: str):
        self.record, self.key = record, key

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch in GROW_EPOCHS:
            self.record.setdefault(self.key, []).append(mean_loss(pl_module, held_out(trainer.datamodule)))


class ResetQKMoments(L.Callback):
    """Drops Adam's state (moments and step count) of every W_Q, W_K at the growth epochs, after the growth: the
    reset `replace` implies, without its rotation."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch in GROW_EPOCHS:
            (optimizer,) = trainer.optimizers
            for forms in pl_module.model.qk_forms():
                for form in forms:
                    optimizer.state.pop(form.w_q, None)
                    optimizer.state.pop(form.w_k, None)


def build(text: str, overrides: list[str], seed: int, log_dir: str):
    return cli_main(
        ["--config", str(REPO / CONFIG), "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         f"--trainer.logger.init_args.save_dir={log_dir}", f"--data.init_args.path={text}", *SETTING, *overrides,
         f"--seed_everything={seed}", f"--data.init_args.seed={seed}"],
        run=False,
    )


def train(text: str, name: str, seed: int, log_dir: str, extra: list[str]) -> dict:
    overrides, reset = RUNS[name]
    cli = build(text, [*overrides, *extra], seed, log_dir)
    record: dict = {}
    callbacks = cli.trainer.callbacks
    callbacks.insert(0, EventLoss(record, "before"))
    callbacks.append(EventLoss(record, "after"))  # after the growth callback, and after a reset
    if reset:
        callbacks.insert(len(callbacks) - 1, ResetQKMoments())
    val: list[dict] = []
    callbacks.append(L.pytorch.callbacks.LambdaCallback(on_validation_epoch_end=lambda trainer, module: None if
                     trainer.sanity_checking else val.append({"step": trainer.global_step,
                                                              "loss": float(trainer.callback_metrics["val/loss"])})))
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    grow = next((c for c in callbacks if isinstance(c, GrowAttentionCallback)), None)
    return {"run": name, "seed": seed, "seconds": time.perf_counter() - start, "final": val[-1]["loss"], "val": val,
            "event_loss": record, "events": grow.history if grow else []}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="mechanism-table runs")
    t.add_argument("--text", required=True)
    t.add_argument("--runs", nargs="+", required=True, choices=list(RUNS))
    t.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    t.add_argument("--out", required=True, help="JSON lines file, one run per line (appended)")
    t.add_argument("--override", nargs="+", action="extend", default=[], help="extra CLI overrides (smoke runs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "train":
        with tempfile.TemporaryDirectory() as logs:
            for name in args.runs:
                for seed in args.seeds:
                    result = train(args.text, name, seed, logs, args.override)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(result) + "\n")
                    print(json.dumps({k: result[k] for k in ("run", "seed", "seconds", "final", "event_loss")}), flush=True)


if __name__ == "__main__":
    main()
