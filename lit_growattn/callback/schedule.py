"""When growth events happen, read from the trainer's counters alone (never from which hook ran).

The schedule is one object, chosen in a config by its class: `AtEpochs`, `AtSteps` or `AutoSchedule` (`budget.py`).
Each checks its own settings when built (the growth settings are checked against its `kind` by
`GrowthSettings.check_schedule`), learns the model's growing layers in `bind`, and checks the run's length in
`check_run`; the callback never asks which kind it has.

A growth point is an epoch start (`AtEpochs`) or an optimizer step (`AtSteps`, as `trainer.global_step`). The
event happens at the first training-batch start at or after its point where no accumulation window is open. Its
statistics window is the `statistics.batches` micro-batches just before it.
`Clock.advance` replays Lightning's loop (an optimizer step after every `accumulate` micro-batches and after
an epoch's last batch), so the window's position is known in advance from any resumed position.

`AutoSchedule` (`budget.py`) checks every `check_every` optimizer steps instead, until `spend_until` of the run or
until its K- (or KV-) cache budget is spent.
"""

from __future__ import annotations

import abc
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Literal

from lit_growattn.growth import HeadSize
from lit_growattn.callback.settings import GrowthSettings, ScheduleKind, StatisticsSettings


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


class GrowthSchedule(abc.ABC):
    """When the callback grows: a list of growth points in advance, or a rule that decides as training goes."""

    unit: Literal["epoch", "step"]
    kind: ScheduleKind  # kept in checkpoints: a run resumes with the kind it was written by
    splits_window: bool = False  # whether each event needs its statistics window in two halves

    @abc.abstractmethod
    def pending(self, history: list[dict]) -> GrowthPoint | None:
        """The next point without an event in the history (None: no more growth)."""

    def bind(self, settings: GrowthSettings, statistics: StatisticsSettings, layers: list[int],
             start_sizes: dict[HeadSize, list[int]], costs: dict[tuple[int, HeadSize], int]) -> None:
        """At setup: learns the growing layers, their head sizes (d_head, and d_v when the value side grows: one per
        layer of the model) and the cache values per token one more column of each growing side costs (`costs`, by
        (layer, head size)), and refuses what it cannot apply (the settings were checked against the schedule's kind
        when the callback was built: `GrowthSettings.check_schedule`)."""

    def allowance(self, history: list[dict]) -> float | None:
        """The cache values per token the next event may add (None: the growth settings size each event)."""
        return None

    def fill_to(self, history: list[dict]) -> float | None:
        """The budget (a mean head size) when the next event is the last check, which spends all that is left
        toward it; None: the event buys by the statistics alone."""
        return None

    def summary(self, history: list[dict]) -> str | None:
        """A line for the end of fit, if the schedule has something to say."""
        return None

    def check_run(self, trainer, stats_batches: int) -> None:
        """At train start, before any work: refuses a run too short for the schedule (`trainer`: its counters)."""

    @staticmethod
    def batches_before(point: GrowthPoint, clock: Clock, horizon: int) -> int | None:
        """Micro-batches still to run before the event, counting the one starting now: 0 when it happens now,
        None when more than `horizon` are left."""
        for left in range(horizon + 1):
            if point.reached(clock):
                return left
            clock = clock.advance()
        return None


class _FixedSchedule(GrowthSchedule):
    """Growth at listed points of one unit."""

    kind = "fixed"

    def __init__(self, unit: Literal["epoch", "step"], points: list[int]):
        if not points or len(set(points)) != len(points):
            raise ValueError(f"{type(self).__name__}({unit}s={points}) must list each growth {unit} once (and at least one)")
        if min(points) <= 0:
            raise ValueError(
                f"{type(self).__name__}({unit}s={points}): growth at {unit} 0 (or earlier) has no statistics; {unit}s "
                f"are 0-based, so the first possible growth is at {unit} 1"
            )
        self.unit = unit
        self.points = [GrowthPoint(unit, at) for at in sorted(points)]

    def pending(self, history: list[dict]) -> GrowthPoint | None:
        done = {event["event"] for event in history}
        return next((p for p in self.points if p.name not in done), None)

    def check_run(self, trainer, stats_batches: int) -> None:
        end = trainer.max_epochs if self.unit == "epoch" else trainer.max_steps
        for point in self.points:
            if end is not None and end >= 0 and point.at >= end:
                warnings.warn(f"{type(self).__name__} has {point.name} but max_{self.unit}s={end}: it will never happen")


class AtEpochs(_FixedSchedule):
    """Growth at the start of listed epochs.

    Args:
        epochs: epochs (0-based, as `trainer.current_epoch`) at whose start d_head grows; 0 is refused (no
            statistics yet).
    """

    def __init__(self, epochs: list[int]):
        super().__init__("epoch", epochs)

    def check_run(self, trainer, stats_batches: int) -> None:
        super().check_run(trainer, stats_batches)
        if stats_batches > trainer.num_training_batches:
            raise ValueError(f"statistics.batches={stats_batches} is more than an epoch "
                             f"({trainer.num_training_batches} batches); lower it")


class AtSteps(_FixedSchedule):
    """Growth at listed optimizer steps.

    Args:
        steps: optimizer steps (`trainer.global_step`) at which d_head grows: at the first batch start at or after
            the step where no accumulation window is open.
    """

    def __init__(self, steps: list[int]):
        super().__init__("step", steps)

    def check_run(self, trainer, stats_batches: int) -> None:
        super().check_run(trainer, stats_batches)
        warn_past_the_end(self.points, trainer.max_steps, trainer.estimated_stepping_batches)
        accumulate = trainer.accumulate_grad_batches
        steps = [0] + [p.at for p in self.points]
        if short := [b for a, b in zip(steps, steps[1:]) if (b - a) * accumulate < stats_batches]:
            raise ValueError(
                f"AtSteps {short} leave less than statistics.batches={stats_batches} micro-batches after the previous "
                f"growth (or the start) with accumulate_grad_batches={accumulate}: space the steps further apart or "
                "lower statistics.batches"
            )


def check_same_schedule(state_dict: dict, kind: str) -> None:
    """A resumed run keeps its schedule kind: the other kind's history would be read as its own (an automatic
    schedule would count a fixed run's growths as its checks, and spend its budget by them). A run of the automatic
    rule before the K-cache budget (its decisions have `ratios`) cannot continue under the budget's checks."""
    history = state_dict["history"]
    saved = state_dict.get("schedule") or (
        ("auto" if any("decisions" in e for e in history) else "fixed") if history else None)  # older checkpoints
    if any("ratios" in d for e in history for d in e.get("decisions", ())):
        raise ValueError("the checkpoint was written by the automatic schedule before its K-cache budget, whose checks "
                         "this one cannot continue: start a new run from its weights with "
                         "--model.init_args.init_from=CHECKPOINT")
    if saved is not None and saved != kind:
        named = {"fixed": "a fixed schedule (AtEpochs or AtSteps)", "auto": "the automatic schedule (AutoSchedule)"}
        raise ValueError(f"the checkpoint was written by a run with {named[saved]}, this one has {named[kind]}: resume "
                         f"with {named[saved].split(' (')[0]}, or start a new run from its weights with "
                         "--model.init_args.init_from=CHECKPOINT")


def warn_past_the_end(points: list[GrowthPoint], max_steps: int, estimated_steps: float) -> None:
    """AtSteps points the run never reaches when it is bounded by max_epochs (max_steps is checked at setup):
    the steps are estimated from the epochs and the train loader's length."""
    if max_steps < 0 and estimated_steps != float("inf"):
        for point in points:
            if point.at >= estimated_steps:
                warnings.warn(f"AtSteps has {point.name} but the run ends after about {int(estimated_steps)} "
                              "optimizer steps (max_epochs × batches per epoch): it will never happen")
