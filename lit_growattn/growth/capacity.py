"""How many columns a layer grows by under the automatic schedule (docs/design.md, "Automatic capacity").

Appending the bottleneck pair j of a form at step α changes M by α·σ_j u_j v_jᵀ, whose first-order loss
decrease is α·g_j with g_j = −σ_j u_jᵀN̄v_j (`FormGrowth.column_gains`). The forms of a layer share d_head, so
the layer's gain of column j sums g_j over its heads and forms. The first-order prediction at α = 1 overstates
what a step achieves by far (at real text growth events the best held-out decrease over all step sizes is a
small fraction of it: docs/design.md §11, docs/growth_step.md). A column is therefore trusted to
deliver ratio × g_j, and qualifies when that clears `threshold` × the current loss. The ratio starts at that
measured `realised_ratio` and can only fall: after each growth of the schedule it is the smaller of the prior and
what that growth realised on the kept batches ÷ the first-order prediction at α = 1 of the columns it added
(`observed_ratio`; a lucky early growth, measured on two batches, is not trusted beyond the prior). A growth that
realised nothing (the line search kept α = 0) therefore stops the next ones: that is how a solved task, whose
loss and predicted gains both shrink towards 0 at a constant ratio, stops growing.
Columns are taken in order (largest σ first) while they qualify, up to the room left below max_d_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from lit_growattn.growth.factorize import FormGrowth

# Median over the probed text events of (best realised decrease over α) / (first-order prediction at α = 1):
# docs/design.md §11, with the command that measures it.
REALISED_PER_PREDICTED = 0.004


@dataclass(frozen=True)
class CapacityRule:
    """threshold: a column must be expected to lower the loss by this share of it; realised_ratio: the share
    of the first-order prediction at α = 1 a growth realises (the calibration above)."""

    threshold: float = 1e-4
    realised_ratio: float = REALISED_PER_PREDICTED

    def __post_init__(self):
        if not self.threshold > 0:
            raise ValueError(f"AutoSchedule threshold must be positive (a share of the loss, e.g. 1e-4), got {self.threshold}")
        if not 0 < self.realised_ratio <= 1:
            raise ValueError(f"realised_ratio is a share of the predicted decrease in (0, 1], got {self.realised_ratio}")


@dataclass(frozen=True)
class Decision:
    """One layer at one check: `gains` are the expected (calibrated) decreases of its candidate columns, in the
    order they would be appended; `columns` of them clear `bar` = threshold × loss."""

    layer: int
    d_head: int
    candidates: int
    gains: list[float]
    bar: float
    columns: int
    ratio: float  # the realised/predicted ratio the gains were calibrated with

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def layer_gains(growths: Sequence[FormGrowth]) -> Tensor:
    """(e′,) first-order decrease at α = 1 of appending column j to every head of every form of one layer."""
    return torch.stack([g.column_gains().sum(0) for g in growths]).sum(0)


def latest_observed_ratio(history: list[dict]) -> float | None:
    """The observed ratio of the schedule's latest growth (None before its first)."""
    return next((e["observed_ratio"] for e in reversed(history) if "observed_ratio" in e), None)


def current_ratio(history: list[dict], rule: CapacityRule) -> float:
    """The calibration for the next check: the measured prior, lowered to the latest growth's observed ratio."""
    observed = latest_observed_ratio(history)
    return rule.realised_ratio if observed is None else min(rule.realised_ratio, observed)


def observed_ratio(realised: float, decisions: Sequence[dict]) -> float:
    """What a growth realised ÷ the first-order prediction at α = 1 of the columns it added, in [0, 1]."""
    predicted = sum(sum(d["gains"][: d["columns"]]) / d["ratio"] for d in decisions if d["columns"])
    return min(max(realised / predicted, 0.0), 1.0) if predicted > 0 else 0.0


def decide(layer: int, growths: Sequence[FormGrowth], loss: float, rule: CapacityRule, ratio: float,
           max_d_head: int, cap: int | None = None) -> Decision:
    """How many columns `layer` (its forms' growths) grows by, with gains calibrated by `ratio`; at most `cap`
    (None: no cap) and max_d_head."""
    d_head = growths[0].d_head
    room = max(0, min(max_d_head, growths[0].e_in) - d_head)
    if cap is not None:
        room = min(room, cap)
    expected = ratio * layer_gains(growths)[:room]
    bar = rule.threshold * loss
    clears = (expected >= bar).tolist()
    columns = clears.index(False) if False in clears else len(clears)
    return Decision(layer, d_head, room, [float(x) for x in expected], bar, columns, ratio)
