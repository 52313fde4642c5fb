"""Stopping a diverged run before it trains on, or checkpoints, non-finite weights.

A single non-finite loss is tolerated: under 16-mixed an overflowing step is skipped by the gradient scaler and
training recovers. Several in a row mean the run has diverged, and going on would only write NaN checkpoints.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

ADVICE = "Lower the learning rate, or raise warmup_steps or gradient clipping"


class TrainingDiverged(RuntimeError):
    """The training loss stayed non-finite, or a checkpoint would have stored non-finite weights."""


class NonFiniteLosses:
    """Counts consecutive non-finite training losses and raises TrainingDiverged at `limit` of them."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_nonfinite_steps must be ≥ 1, got {limit}")
        self.limit, self.count = limit, 0

    def observe(self, loss: Tensor, where: str) -> None:
        # One scalar read per step (the progress bar reads the loss every step anyway).
        if torch.isfinite(loss):
            self.count = 0
            return
        self.count += 1
        if self.count >= self.limit:
            raise TrainingDiverged(
                f"training diverged: the training loss has been non-finite for {self.count} consecutive steps, the "
                f"last {loss.item()} at {where}. {ADVICE}; max_nonfinite_steps (now {self.limit}) sets how many such "
                "steps are tolerated"
            )


def check_finite_weights(module: nn.Module, step: int) -> None:
    """Raises TrainingDiverged, naming the tensors, when any parameter of `module` holds NaN or inf."""
    named = list(module.named_parameters())
    finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
    if not all(finite):
        names = [name for (name, _), ok in zip(named, finite) if not ok]
        raise TrainingDiverged(
            f"training diverged: {len(names)} parameter tensors are non-finite at step {step} "
            f"({', '.join(names[:3])}{', …' if len(names) > 3 else ''}), so no checkpoint is written (those already "
            f"written keep their finite weights). {ADVICE}"
        )
