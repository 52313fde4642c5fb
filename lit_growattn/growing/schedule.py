"""When growth events happen, read from the trainer's counters alone (never from which hook ran).

A growth point is an epoch start (`grow_at_epochs`) or an optimizer step (`grow_at_steps`, as
`trainer.global_step`). The event happens at the first training-batch start at or after its point where no
accumulation window is open. Its statistics window is the `stats_batches` micro-batches just before it.
`Clock.advance` replays Lightning's loop (an optimizer step after every `accumulate` micro-batches and after
an epoch's last batch), so the window's position is known in advance from any resumed position.

`AutoSchedule` (schedule='auto') checks every `check_every` optimizer steps instead, and ends by itself: after
`patience` checks in a row where no layer grew, provided the loss no longer falls fast (by less than `min_fall` of
itself per check over those checks), or once every growing layer is at max_d_head. Its next point is read from the
history alone (one record per check), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Literal

from lit_growattn.growth.capacity import loss_fall


@dataclass(frozen=True)
class Clock:
    """Where training stands at the start of a training batch."""

    epoch: int  # trainer.current_epoch
    batch: int  # batch_idx within the epoch
    step: int  # optimizer steps taken so far (trainer.global_step)
    epoch_batches: int  # trainer.num_training_batches
    accumulate: int  # trainer.accumulate_grad_batches

    @property
    def between_windows(self) -> bool:
        """No accumulation window is open: the previous micro-batch ended with an optimizer step."""
        return self.batch % self.accumulate == 0

    def advance(self) -> Clock:
        """The clock one micro-batch later."""
        last = self.batch + 1 == self.epoch_batches
        stepped = (self.batch + 1) % self.accumulate == 0 or last
        epoch, batch = (self.epoch + 1, 0) if last else (self.epoch, self.batch + 1)
        return dataclasses.replace(self, epoch=epoch, batch=batch, step=self.step + stepped)


@dataclass(frozen=True)
class GrowthPoint:
    unit: Literal["epoch", "step"]
    at: int

    @property
    def name(self) -> str:
        """How the event is tagged in the history and in the statistics that belong to it."""
        return f"{self.unit} {self.at}"

    def reached(self, clock: Clock) -> bool:
        if self.unit == "epoch":
            return clock.epoch >= self.at
        return clock.step >= self.at and clock.between_windows


class Schedule:
    """The growth points, in order; exactly one of `epochs`, `steps` is given."""

    def __init__(self, epochs: list[int] | None, steps: list[int] | None):
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of grow_at_epochs and grow_at_steps")
        unit, points = ("epoch", epochs) if epochs is not None else ("step", steps)
        option = f"grow_at_{unit}s"
        if not points or len(set(points)) != len(points):
            raise ValueError(f"{option} {points} must list each growth {unit} once (and at least one)")
        if min(points) <= 0:
            raise ValueError(
                f"{option} {points}: growth at {unit} 0 (or earlier) has no statistics; {unit}s are 0-based, "
                f"so the first possible growth is at {unit} 1"
            )
        self.unit = unit
        self.points = [GrowthPoint(unit, at) for at in sorted(points)]

    def pending(self, history: list[dict]) -> GrowthPoint | None:
        """The next point without an event in the history."""
        done = {event["event"] for event in history}
        return next((p for p in self.points if p.name not in done), None)

    @staticmethod
    def batches_before(point: GrowthPoint, clock: Clock, horizon: int) -> int | None:
        """Micro-batches still to run before the event, counting the one starting now: 0 when it happens now,
        None when more than `horizon` are left."""
        for left in range(horizon + 1):
            if point.reached(clock):
                return left
            clock = clock.advance()
        return None


class AutoSchedule:
    """A check every `check_every` optimizer steps, until `patience` checks in a row grow nothing while the loss
    falls by less than `min_fall` of itself per check (a near miss while training still moves fast is never final),
    every layer of `layers` is at `max_d_head`, or the next check would come at or after `end` (the run's last step)."""

    unit = "step"

    def __init__(self, check_every: int, patience: int, min_fall: float = 0.01):
        if check_every <= 0:
            raise ValueError(f"check_every must be a positive number of optimizer steps, got {check_every}")
        if patience <= 0:
            raise ValueError(f"patience must be a positive number of checks, got {patience}")
        self.check_every, self.patience, self.min_fall = check_every, patience, min_fall
        # Set by the callback once the model is known: the growing layers, their limit, their sizes at the start.
        self.layers: list[int] = []
        self.max_d_head: int | None = None
        self.start_sizes: list[int] = []
        self.end: int | None = None

    @property
    def points(self) -> list[GrowthPoint]:
        return []  # none fixed in advance

    def finished(self, history: list[dict]) -> bool:
        recent = history[-self.patience:]
        if len(recent) == self.patience and all(e["d_head"] == e["d_head_before"] for e in recent):
            fall = loss_fall(history, self.patience)
            if fall is not None and fall < self.min_fall:
                return True
        sizes = history[-1]["d_head"] if history else self.start_sizes
        return all(sizes[i] >= self.max_d_head for i in self.layers)

    def pending(self, history: list[dict]) -> GrowthPoint | None:
        if self.finished(history):
            return None
        point = GrowthPoint("step", self.check_every * (len(history) + 1))
        return None if self.end is not None and point.at >= self.end else point


def check_same_schedule(state_dict: dict, kind: str) -> None:
    """A resumed run keeps its schedule kind: the other kind's history would be read as its own (an automatic
    schedule would count a fixed run's growths, or skip catch-up checks without statistics, against `patience`)."""
    history = state_dict["history"]
    saved = state_dict.get("schedule") or (
        ("auto" if any("decisions" in e for e in history) else "fixed") if history else None)  # older checkpoints
    if saved is not None and saved != kind:
        raise ValueError(f"the checkpoint was written by a run with schedule={saved!r}, this one has schedule={kind!r}: "
                         f"resume with schedule={saved!r}, or start a new run from its weights with "
                         "--model.init_args.init_from=CHECKPOINT")


def warn_past_the_end(points: list[GrowthPoint], max_steps: int, estimated_steps: float) -> None:
    """grow_at_steps points the run never reaches when it is bounded by max_epochs (max_steps is checked at setup):
    the steps are estimated from the epochs and the train loader's length."""
    if max_steps < 0 and estimated_steps != float("inf"):
        for point in points:
            if point.at >= estimated_steps:
                warnings.warn(f"grow_at_steps has {point.name} but the run ends after about {int(estimated_steps)} "
                              "optimizer steps (max_epochs × batches per epoch): it will never happen")
