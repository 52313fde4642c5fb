"""When growth events happen, read from the trainer's counters alone (never from which hook ran).

The schedule is one object, chosen in a config by its class: `AtEpochs`, `AtSteps` or `AutoSchedule`. Each checks
its own settings when built (the growth settings are checked against its `kind` by
`GrowthSettings.check_schedule`), learns the model's growing layers in `bind`, and checks the run's length in
`check_run`; the callback never asks which kind it has.

A growth point is an epoch start (`AtEpochs`) or an optimizer step (`AtSteps`, as `trainer.global_step`). The
event happens at the first training-batch start at or after its point where no accumulation window is open. Its
statistics window is the `statistics.batches` micro-batches just before it.
`Clock.advance` replays Lightning's loop (an optimizer step after every `accumulate` micro-batches and after
an epoch's last batch), so the window's position is known in advance from any resumed position.

`AutoSchedule` checks every `check_every` optimizer steps instead, until `spend_until` of the run or until its
KV-cache budget is spent, and decides at each check which side of which layer takes how many columns. Its next point and its
allowance are read from the history alone (one record per check), so a resumed run continues exactly where it
stopped.
"""

from __future__ import annotations

import abc
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Literal

from lit_growattn.growth import HeadSize
from lit_growattn.settings import GrowthSettings, ScheduleKind, StatisticsSettings, unset


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


class AutoSchedule(GrowthSchedule):
    """Spends a KV-cache budget where the statistics say it pays: a check every `check_every` optimizer steps until
    `spend_until` of the run, where every growing side (`growth.grow`: query/key, value or both) of every growing
    layer offers its next columns and the best, by held-out first-order gain per cache value, are bought across
    layers and sides while the check's allowance lasts (`lit_growattn.growth.allocation`). The allowance spreads the
    budget evenly over the checks, so the widths follow the run's length: all of it is available at the last check,
    and what earlier checks did not spend carries over. A column is bought only above a noise floor measured on the
    same statistics, so a budget can stay unspent (the summary at the end of fit says how much). After the last
    check, or once the budget is spent, no statistics are taken and steps cost what plain steps cost. Measured on the
    query/key side (docs/capacity.md): it spends 33–71 % of its budget (about half), mostly in the first layer; on a
    2-layer model a uniform static d_head of the budget beats it on 2 of 3 corpora (train that at a fixed K cache),
    on an 8-layer model it was at or below uniform on all three.

    Args:
        budget: the cache the grown model may use, as the mean head size of the growing sides over the growing
            layers, weighted by their cache heads, so that it is proportional to the cache's bytes per token:
            budget × (cache heads) × bytes per value. With growth.grow query_key the K cache (mean d_head over the key
            heads, KV heads under GQA), with value the V cache (mean d_v over the value heads), with both the KV cache
            (the mean of d_head and d_v over both). null: no budget; every column above the noise floor is bought, up
            to growth.max_d_head (and growth.max_d_v).
        check_every: optimizer steps between checks (the statistics window is the `statistics.batches`
            micro-batches before each).
        spend_until: the share of the run's optimizer steps over which the budget is spread (in (0, 1]); the last
            check comes at or before it.
    """

    unit, kind, splits_window = "step", "auto", True

    def __init__(self, budget: float | None = None, check_every: int = 50, spend_until: float = 0.5):
        if budget is not None and not budget > 0:
            raise ValueError(f"budget is a mean head size (> 0), or null for no budget; got {budget}")
        if check_every <= 0:
            raise ValueError(f"check_every must be a positive number of optimizer steps, got {check_every}")
        if not 0 < spend_until <= 1:
            raise ValueError(f"spend_until is a share of the run's optimizer steps in (0, 1], got {spend_until}")
        self.budget, self.check_every, self.spend_until = budget, check_every, spend_until
        # Learnt in `bind` and `check_run`: the growing sides' cache cost per column by (layer, head size), their
        # limits and sizes at the start, and the number of checks.
        self.costs: dict[tuple[int, HeadSize], int] = {}
        self.limits: dict[HeadSize, int] = {}
        self.start_sizes: dict[HeadSize, list[int]] = {}
        self.checks: int | None = None

    def bind(self, settings: GrowthSettings, statistics: StatisticsSettings, layers: list[int],
             start_sizes: dict[HeadSize, list[int]], costs: dict[tuple[int, HeadSize], int]) -> None:
        if statistics.layers_per_event is not None and statistics.layers_per_event < len(layers):
            raise ValueError(
                f"AutoSchedule offers every growing layer's columns at each check, but statistics.layers_per_event="
                f"{statistics.layers_per_event} covers {statistics.layers_per_event} of {len(layers)}: "
                f"{unset('statistics.layers_per_event')} with AutoSchedule (or bound memory with growth.layers), or "
                "use AtSteps")
        self.costs = {(layer, side): cost for (layer, side), cost in costs.items() if layer in layers}
        self.limits = {side: settings.max_width(side) for side in ("d_head", "d_v")
                       if any(s == side for _, s in self.costs)}
        self.start_sizes = start_sizes
        if self.budget is None:
            return
        weight = self.heads()
        start = self.cache(start_sizes) / weight
        most = sum(self.heads(side) * limit for side, limit in self.limits.items()) / weight
        if self.budget < start:
            raise ValueError(f"AutoSchedule(budget={self.budget}) is below the mean {self._what()} the growing layers "
                             f"are at ({start:.4g}): raise the budget to at least that, or start a new run from a "
                             "narrower model (a resumed run keeps its checkpoint's sizes)")
        if self.budget > most:
            limits = " and ".join(f"growth.max_{side}={limit}" for side, limit in self.limits.items())
            verb = "allow" if len(self.limits) > 1 else "allows"
            raise ValueError(f"AutoSchedule(budget={self.budget}) exceeds the mean {self._what()} that {limits} "
                             f"{verb} ({most:.4g}), so it could never be spent: lower the budget (or raise the limit)")

    def _what(self) -> str:
        """The budget's unit in words, by the sides that grow."""
        return {("d_head",): "query/key head size", ("d_v",): "value head size"}.get(
            tuple(self.limits), "head size of the query/key and value sides")

    def check_run(self, trainer, stats_batches: int) -> None:
        steps = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        # A check needs a batch after it: none comes at the run's last step.
        self.checks = min(int(self.spend_until * steps), int(steps) - 1) // self.check_every
        if self.checks == 0:
            warnings.warn(f"AutoSchedule checks every {self.check_every} optimizer steps until spend_until="
                          f"{self.spend_until} of the run's {int(steps)}: no check fits, so nothing will grow; lower "
                          "check_every or raise spend_until")
        if self.check_every * trainer.accumulate_grad_batches < stats_batches:
            raise ValueError(
                f"check_every={self.check_every} optimizer steps hold fewer than statistics.batches={stats_batches} "
                f"micro-batches (accumulate_grad_batches={trainer.accumulate_grad_batches}): raise check_every or "
                "lower statistics.batches")

    def cache(self, sizes: dict[HeadSize, list[int]], side: HeadSize | None = None) -> int:
        """Cache values per token of the growing sides (or of `side`) of the growing layers at `sizes` (per head
        size, one per layer of the model)."""
        return sum(cost * sizes[s][layer] for (layer, s), cost in self.costs.items() if side in (None, s))

    def heads(self, side: HeadSize | None = None) -> int:
        """The cache heads of the growing sides (or of `side`): the cache values per token of head size 1."""
        return sum(cost for (_, s), cost in self.costs.items() if side in (None, s))

    def _sizes(self, history: list[dict]) -> dict[HeadSize, list[int]]:
        return {side: history[-1][side] for side in self.limits} if history else self.start_sizes

    def _start(self, history: list[dict]) -> dict[HeadSize, list[int]]:
        # A resumed model is built at its grown sizes: where the run started is in its history.
        return {side: history[0][f"{side}_before"] for side in self.limits} if history else self.start_sizes

    def spent(self, history: list[dict]) -> int:
        return self.cache(self._sizes(history)) - self.cache(self._start(history))

    def total(self, history: list[dict]) -> float:
        """The cache values per token the budget adds to the run's start (inf: no budget)."""
        if self.budget is None:
            return float("inf")
        return self.budget * self.heads() - self.cache(self._start(history))

    def allowance(self, history: list[dict]) -> float:
        checks_done = len(history) + 1  # counting the one about to happen
        return self.total(history) * min(checks_done / self.checks, 1.0) - self.spent(history)

    def pending(self, history: list[dict]) -> GrowthPoint | None:
        sizes = self._sizes(history)
        left = self.total(history) - self.spent(history)
        affordable = any(cost <= left for (layer, side), cost in self.costs.items()
                         if sizes[side][layer] < self.limits[side])
        if len(history) >= self.checks or not affordable:
            return None
        return GrowthPoint("step", self.check_every * (len(history) + 1))

    def summary(self, history: list[dict]) -> str:
        sizes, weight = self._sizes(history), self.heads()
        cache = self.cache(sizes)
        cache_of = {("d_head",): "K", ("d_v",): "V"}.get(tuple(self.limits), "KV")
        mean = f"mean {self._what()} {cache / weight:.4g}"
        if len(self.limits) > 1:
            per_side = [f"{side} {self.cache(sizes, side) / self.heads(side):.4g}" for side in self.limits]
            mean += f" ({', '.join(per_side)})"
        if self.budget is None:
            return f"{cache_of} cache: {mean} (no budget), {cache} values per token"
        return (f"{cache_of}-cache budget: {mean} of {self.budget:.4g}, {cache} of {self.budget * weight:.6g} values per "
                f"token; {self.budget * weight - cache:.6g} unspent")


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
