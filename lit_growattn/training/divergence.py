"""Stopping a diverged run before it trains on, or checkpoints, non-finite weights.

A single non-finite loss is tolerated: under 16-mixed an overflowing step is skipped by the gradient scaler and
training recovers. Several in a row mean the run has diverged, and going on would only write NaN checkpoints.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_growattn.training.lightning_private import accumulation_open_after_this_batch

ADVICE = "Lower the learning rate, or raise warmup_steps or gradient clipping"
MAX_NONFINITE_STEPS = 10  # the modules' default limit (`NonFiniteLosses`)


class TrainingDiverged(RuntimeError):
    """The training loss stayed non-finite, or a checkpoint would have stored non-finite weights."""


class NonFiniteLosses:
    """Counts consecutive optimizer steps with a non-finite training loss and raises TrainingDiverged at `limit`.

    A step counts as non-finite when any of its micro-batches, on any process, had a non-finite loss. The count is
    kept in checkpoints (`count`, under CHECKPOINT_KEY), so that a resumed run goes on counting instead of starting
    again at 0.
    """

    CHECKPOINT_KEY = "nonfinite_loss_steps"

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_nonfinite_steps must be ≥ 1, got {limit}")
        self.limit, self.count = limit, 0
        self._bad: tuple[float, str] | None = None  # (loss, where) of this process's last non-finite micro-batch

    def observe(self, loss: Tensor, where: Callable[[], str], step_ends: bool, any_process: Callable[[bool], bool]) -> None:
        """`where()`: the position, for the message. `step_ends`: this is the last micro-batch before an optimizer
        step. `any_process`: True when the flag is True on any process (every process gets the same answer, so
        all of them count, and raise, together)."""
        # One scalar read per micro-batch (the progress bar reads the loss every step anyway).
        if not torch.isfinite(loss):
            self._bad = (loss.item(), where())
        if not step_ends:  # decide once per optimizer step, not per micro-batch
            return
        bad, self._bad = self._bad, None
        # Every process makes this call at the same micro-batch: one small all-reduce per optimizer step under DDP.
        if not any_process(bad is not None):
            self.count = 0
            return
        self.count += 1
        if self.count >= self.limit:
            last = f"{bad[0]} at {bad[1]}" if bad else f"on another process (finite on this one) at {where()}"
            raise TrainingDiverged(
                f"training diverged: the training loss has been non-finite for {self.count} consecutive steps, the "
                f"last {last}. {ADVICE}; max_nonfinite_steps (now {self.limit}) sets how many such steps are "
                "tolerated"
            )


def non_finite(tensors: Iterable[tuple[str, Tensor]]) -> list[str]:
    """The names of the floating-point tensors holding NaN or inf (one device sync for all of them). Sharded tensors
    (FSDP2's DTensors) are checked shard by shard and the answers combined over the ranks (one small all-reduce), so
    that every rank names the same tensors and raises together."""
    named = [(name, t) for name, t in tensors if t.is_floating_point()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all() for _, t in named])
    if sharded := [t for _, t in named if isinstance(t, DTensor)]:
        finite = finite.int()  # gloo reduces no bool tensors
        # The ranks the tensors are sharded over (FSDP2's data-parallel mesh, one dimension), not every process.
        dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=sharded[0].device_mesh.get_group())
    return [name for (name, _), ok in zip(named, finite.tolist()) if not ok]


def first_names(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{', …' if len(names) > 3 else ''}"


def check_finite_weights(module: nn.Module, step: int) -> None:
    """Raises TrainingDiverged, naming the tensors, when any parameter of `module` holds NaN or inf."""
    if names := non_finite(module.named_parameters()):
        raise TrainingDiverged(
            f"training diverged: {len(names)} parameter tensors are non-finite at step {step} "
            f"({first_names(names)}), so no checkpoint is written (those already written keep their finite weights). "
            f"{ADVICE}"
        )


class DivergenceGuard:
    """Mixin placed before L.LightningModule, shared by the modules that GrowAttentionCallback grows: stops a run whose
    training loss stays non-finite, never writes a checkpoint of non-finite weights, and refuses 16-true at setup.

    A module using it calls `guard_divergence(max_nonfinite_steps)` in __init__ and `observe_loss` in training_step.
    """

    def guard_divergence(self, max_nonfinite_steps: int) -> None:
        self._nonfinite_losses = NonFiniteLosses(max_nonfinite_steps)

    def observe_loss(self, loss: Tensor, batch_idx: int) -> None:
        """Counts this micro-batch's loss; raises TrainingDiverged at the limit. Runs on every micro-batch."""
        trainer = self.trainer
        # `where` is only formatted when it is reported.
        where = lambda: f"step {trainer.global_step} (epoch {trainer.current_epoch}, batch {batch_idx})"  # noqa: E731
        self._nonfinite_losses.observe(
            loss, where, step_ends=not accumulation_open_after_this_batch(trainer),
            any_process=lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False),
        )

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.trainer.precision == "16-true":
            # Measured: fp16 weights and AdamW state without loss scaling turn the loss NaN within a few steps.
            raise ValueError("precision='16-true' is not supported for training (fp16 weights without loss scaling "
                             "diverge); use '16-mixed' or 'bf16-mixed', which keep fp32 weights")
        super().setup(stage)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Never replace a checkpoint (`last.ckpt` included) with non-finite weights: stop instead.
        check_finite_weights(self, self.trainer.global_step)
        # Checkpoints are written between optimizer steps: the count of non-finite steps is all there is to keep.
        checkpoint[NonFiniteLosses.CHECKPOINT_KEY] = self._nonfinite_losses.count
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A resumed run goes on counting non-finite steps (checkpoints from before this key: 0).
        self._nonfinite_losses.count = checkpoint.get(NonFiniteLosses.CHECKPOINT_KEY, 0)
        super().on_load_checkpoint(checkpoint)
