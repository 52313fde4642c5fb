"""Optimisation shared by the LightningModules that grow (GrowAttentionLM, hf.HFCausalLM): the default optimizer,
parameter groups, decoupled weight decay on every row but a query/key bias row, and the built-in schedule.

The optimizer and scheduler are callables (not a top-level `optimizer:` block of LightningCLI), because a growth
event resizes parameters and has to build them again (docs/design.md, "Lightning mechanics"). A module using
`GrowthOptimization` sets `optimizer_factory`, `scheduler_factory` and `_total_steps`, and has hparams
`warmup_steps`, `lr_schedule` and `min_lr_ratio`.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

import torch
from torch import nn

from lit_growattn.contract import Resizable

LrSchedule = Literal["cosine", "constant"]
# The built-in schedule's defaults (`lr_factor`), as the modules' arguments.
LR_SCHEDULE: LrSchedule = "cosine"
WARMUP_STEPS = 100
MIN_LR_RATIO = 0.1


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def lr_factor(step: int, warmup: int, total: int, floor: float, shape: LrSchedule) -> float:
    """The learning rate at optimizer `step` as a share of the peak: linear warmup over `warmup` steps, then constant
    or a cosine decay to `floor` at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if shape == "constant":
        return 1.0
    total = max(total, warmup + 1)
    progress = min((step - warmup) / (total - warmup), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class GrowthOptimization:
    """Mixin placed before L.LightningModule."""

    def __deepcopy__(self, memo: dict) -> "GrowthOptimization":
        """A copy (Lightning's weight averaging makes one) shares the optimizer and scheduler callables: those the
        CLI builds reach its parser and, under DDP, the trainer's process group, which cannot be copied."""
        for factory in (self.optimizer_factory, self.scheduler_factory):
            memo[id(factory)] = factory
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))  # LightningModule leaves its trainer out
        return copied

    def parameter_groups(self) -> list[dict[str, Any]]:
        """Weight decay only on ≥2-D weights; never on temperatures, biases, norms or gates.

        The query/key bias is the last row of W_Q/W_K (and of the low-rank map's down factors): those tensors are
        in the no-decay group, and `on_before_optimizer_step` decays their other rows.
        """
        with_bias_row = {id(p) for p in self._bias_row_parameters()}
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 and id(p) not in with_bias_row else no_decay).append(p)
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    def _bias_row_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules() if isinstance(m, Resizable) for p in m.bias_row_parameters()]

    @torch.no_grad()
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Decoupled weight decay, as AdamW applies it, on every row but the bias row of the Q/K tensors that carry one.

        Reads the decay group's weight_decay and the no-decay group's learning rate (`parameter_groups`' order).
        """
        params = [p for p in self._bias_row_parameters() if p.grad is not None]  # AdamW skips the others too
        if not params:
            return
        decay_group, no_decay_group = optimizer.param_groups
        shrink = 1.0 - no_decay_group["lr"] * decay_group.get("weight_decay", 0.0)
        for p in params:
            p[:, :-1].mul_(shrink)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameter_groups())
        if self.scheduler_factory is not None:
            scheduler = self.scheduler_factory(optimizer)
        else:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        # Read here, not when the scheduler is built: `estimated_stepping_batches` loads the train dataloader,
        # and loading it before a checkpoint is restored would lose the dataloader's mid-epoch position.
        self._total_steps = self.trainer.estimated_stepping_batches

    # Left out of mutation testing: LambdaLR saves this bound method's __dict__ in every checkpoint, where mutmut's
    # wrapper of a mutated function would put the unpicklable original (docs/testing.md).
    def _lr_factor(self, step: int) -> float:  # pragma: no mutate block
        h = self.hparams
        return lr_factor(step, h.warmup_steps, self._total_steps, h.min_lr_ratio, h.lr_schedule)
