"""Where the width goes under a KV-cache budget: the automatic schedule's rule (docs/capacity.md).

At each check every growing side of every growing layer offers its next columns: on the query/key side the leading
pairs of the SVD of its bottleneck ΔM⊥ = (I − P_Q)ΔM(I − P_K), the part of the direction ΔM that its current columns
cannot express (under GQA per group of heads sharing keys, `grouped.GroupedGrowth.bottleneck`); on the value side
the leading pairs of its value bottleneck (I − P_V)ΔW_M(I − P_O) (docs/value.md); both in the order `append` takes
them. Each column is rated by its first-order loss decrease per cache value it costs,
and the best are bought across layers and sides while the check's allowance lasts (`allocate`, over `buy_columns`).

Held out. The statistics window is split in two halves A and B (alternate micro-batches). The pairs fitted on one half
are scored against the other half's score gradient N̄: with pair j of half X (σ_j, u_j, v_j),

    g_j^{XY} = −σ_j u_jᵀ N̄^Y v_j,   the first-order decrease at α = 1 of appending pair j of X, measured on Y.

Its held-out gain g_j = ½(g_j^{AB} + g_j^{BA}) carries no noise fitted on the half it is measured on, so in
expectation it is the column's signal alone; its in-sample gain ĝ_j = ½(g_j^{AA} + g_j^{BB}) is that signal plus the
noise the SVD fitted.

Noise floor. A column clears it when it gains, held out, more than the noise its own half fitted,
g_j > max(ĝ_j − g_j, 0): the halves agree on more than they disagree. Both sides come from the same statistics, so
nothing is calibrated to the loss's scale, the corpus or the learning rate. A layer's columns are bought in order, so
its first column below the floor ends its prefix above the floor.

Checks before the last buy only columns above the floor, and what they leave of their allowance carries over. The
last check (`fill_to`: the budget) withholds nothing, so the whole budget is spent: first the columns above the floor
by held-out gain per cache value, then every further column toward uniform, to the side whose width is smallest
relative to the budget. The floor orders the columns there; it no longer withholds them, since a floor alone closes a
layer at its first noisy column and left most of the budget unspent (studies/kcache_budget).

Cost. A query/key column of a layer adds one value per token to the K cache of every key head of the layer's forms
(with GQA one per KV head, not per query head; DIFF's two maps both); a value column adds one to the V cache of
every value head (one per KV head under GQA). Forms whose query heads share keys or carry rotary columns
(`grouped.GroupedGrowth`), and value maps whose query heads share a value head, give their gains per group of heads,
summed here over the layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

import torch
from torch import Tensor

from lit_growattn.growth.factorize import FormGrowth
from lit_growattn.growth.grouped import GroupedGrowth
from lit_growattn.growth.unit import HeadSize
from lit_growattn.growth.value import ValueGrowth

Growths = Sequence[FormGrowth | GroupedGrowth] | Sequence[ValueGrowth]
# (item, its columns so far) -> the sort key of its next column; the largest is bought first.
Priority = Callable[[int, int], tuple]


@dataclass(frozen=True)
class Offer:
    """One side of one layer at one check: its head size, the cache values per token one more column costs, and per
    candidate column (in the order they would be appended) the held-out and in-sample gains; `columns`: how many it
    bought; `filled`: at the last check, how many of those it bought toward the budget beyond the prefix above the
    floor (None at the checks before, which buy above the floor only)."""

    layer: int
    width: int
    cost: int
    held_out: list[float]
    in_sample: list[float]
    columns: int = 0
    side: HeadSize = "d_head"
    filled: int | None = None

    @property
    def key(self) -> tuple[int, HeadSize]:
        return self.layer, self.side

    @property
    def above_floor(self) -> int:
        """The leading columns that gain, held out, more than the noise their half fitted (g > max(ĝ − g, 0))."""
        count = 0
        for held, seen in zip(self.held_out, self.in_sample):
            if not held > max(seen - held, 0.0):
                break
            count += 1
        return count

    def as_dict(self) -> dict:
        record = asdict(self) | {"above_floor": self.above_floor}
        if self.filled is None:  # a check before the last records what it did before the fill existed: resumes match
            del record["filled"]
        return record


def layer_gains(growths: Growths, n: Sequence[Tensor] | None = None) -> Tensor:
    """(k,) first-order decrease at α = 1 of appending column j to every head (every group of heads sharing keys or
    values) of every form (or value map) of one side of a layer, against each one's own N̄ or the given ones (held
    out)."""
    held = n if n is not None else [None] * len(growths)
    return torch.stack([g.column_gains(h).sum(0) for g, h in zip(growths, held)]).sum(0)


def offer(layer: int, side: HeadSize, a: Growths, b: Growths, cost: int, room: int) -> Offer:
    """What one side of `layer` offers: its forms' (or value maps') growths fitted on the halves `a` and `b` of the
    window, at most `room` columns."""
    n_a, n_b = [g.moments.n for g in a], [g.moments.n for g in b]
    held_out = (layer_gains(a, n_b) + layer_gains(b, n_a)) / 2
    in_sample = (layer_gains(a) + layer_gains(b)) / 2
    return Offer(layer, a[0].width, cost, held_out[:room].tolist(), in_sample[:room].tolist(), side=side)


def buy_columns(gains: Sequence[Sequence[float]], costs: Sequence[int], budget: float, *,
                held: Sequence[int] | None = None, limits: Sequence[int] | None = None,
                tie: Sequence[tuple] | None = None, priority: Priority | None = None) -> list[int]:
    """Columns per item after buying, one at a time, the next column (gains[i][count_i]) with the largest
    `priority(i, count_i)` (default: gain per cost, then the `tie` key) among the items below limits[i] (default:
    len(gains[i])) whose cost still fits the budget, the `held` columns counted as spent; ties: the earlier item. The
    one allocator of a cache budget: the automatic schedule's (`allocate`) and the post-hoc shrink's
    (`shrink.allocate_ranks`)."""
    counts = list(held) if held is not None else [0] * len(gains)
    limits = limits if limits is not None else [len(g) for g in gains]
    tie = tie if tie is not None else [()] * len(gains)
    rank = priority or (lambda i, count: (gains[i][count] / costs[i], tie[i]))
    spent = sum(count * cost for count, cost in zip(counts, costs))
    while True:
        fits = [i for i in range(len(gains)) if counts[i] < limits[i] and spent + costs[i] <= budget]
        if not fits:
            return counts
        best = max(fits, key=lambda i: (*rank(i, counts[i]), -i))
        counts[best] += 1
        spent += costs[best]


def allocate(offers: Sequence[Offer], allowance: float, fill_to: float | None = None) -> list[Offer]:
    """The offers with the columns bought within `allowance`. Before the last check (`fill_to` None): repeatedly the
    next column above the floor with the largest held-out gain per cache value. At the last check (`fill_to`: the
    budget, a mean head size) every candidate may be bought: first the columns above the floor, in that order, then
    the others one at a time to the side whose width (with what it bought) is smallest relative to `fill_to`, ties to
    the larger held-out gain per value. Ties throughout: the lower layer, then the query/key side."""
    gains, costs = [o.held_out for o in offers], [o.cost for o in offers]
    tie = [(-o.layer, o.side == "d_head") for o in offers]
    if fill_to is None:
        columns = buy_columns(gains, costs, allowance, limits=[o.above_floor for o in offers], tie=tie)
        return [replace(o, columns=c) for o, c in zip(offers, columns)]
    floors = [o.above_floor for o in offers]

    def priority(i: int, count: int) -> tuple:
        per_value = offers[i].held_out[count] / offers[i].cost
        if count < floors[i]:
            return (1, per_value, tie[i])  # the statistics first: the floor orders the columns
        # Then toward uniform: one budget is every side's target, so the narrowest side is the furthest below it.
        return (0, -(offers[i].width + count), per_value, tie[i])

    columns = buy_columns(gains, costs, allowance, priority=priority)
    return [replace(o, columns=c, filled=max(0, c - f)) for o, c, f in zip(offers, columns, floors)]
