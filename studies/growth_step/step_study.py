"""The setting of the growth-step study (growth_step.py): the config, the growth epochs, the statistics
window, and building a run of it through the project's CLI."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from lit_growattn.commands.cli import main as cli_main  # noqa: E402

CONFIG = "configs/text_grow.yaml"
SETTING = ["--trainer.max_epochs=5", "--data.init_args.samples_per_epoch=9600"]  # as studies/growth_pays' text runs
GROW_EPOCHS = (1, 2)
HELD_OUT_BATCHES = 8
FINE_GRID = [0.0] + [2.0**-k for k in range(9)]  # 1 … 1/256: on text the best step lies at 1/256 … 1/32
OLD_GRID = "--trainer.callbacks.init_args.step_search.alphas=[0,0.0625,0.125,0.25,0.5,1]"
STATIC = ["--trainer.callbacks=null"]
WINDOW, KEPT = 16, 2  # configs/text_grow.yaml's statistics.batches; step_search.batches' default
GRIDS = {"1 … 1/16": [2.0**-k for k in range(5)], "1 … 1/256": [2.0**-k for k in range(9)]}  # candidates of a rule


def grow_args(method: str, mode: str, *extra: str) -> list[str]:
    return [f"--trainer.callbacks.init_args.growth.method={method}", f"--trainer.callbacks.init_args.growth.mode={mode}", *extra]


# name → (CLI overrides, reset the Q/K Adam moments at the growth epochs)


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


def build(text: str, overrides: list[str], seed: int, log_dir: str):
    return cli_main(
        ["--config", str(REPO / CONFIG), "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         f"--trainer.logger.init_args.save_dir={log_dir}", f"--data.init_args.path={text}", *SETTING, *overrides,
         f"--seed_everything={seed}", f"--data.init_args.seed={seed}"],
        run=False,
    )
