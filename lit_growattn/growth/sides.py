"""What the callback does with either side of attention that grows, a `unit.GrowableUnit`: a query/key form
(`form.FormShape`) or a value map (`value.ValueShape`): the cache cost of a column per layer and side, restoring
weights after a trial, sums from a checkpoint, and `growth_for`, a type table (the growths import the units, so it
cannot be a method)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable

from lit_growattn.growth.factorize import FormGrowth
from lit_growattn.growth.form import FormWeights
from lit_growattn.growth.grouped import GroupedGrowth, growth_for as form_growth_for
from lit_growattn.growth.sketch import SketchFormStats, SketchMoments, SketchValueMoments, SketchValueStats
from lit_growattn.growth.sketched import (
    SketchedFormGrowth, SketchedGroupedGrowth, SketchedValueGrowth, sketched_growth_for,
)
from lit_growattn.growth.stats import FormStats, Moments, Sums
from lit_growattn.growth.unit import GrowableUnit, HeadSize
from lit_growattn.growth.value import ValueGrowth, ValueShape, ValueStats, ValueWeights


def column_costs(units: Iterable[tuple[int, GrowableUnit]]) -> dict[tuple[int, HeadSize], int]:
    """Per (layer, side), the cache values per token one more column costs, from (layer, form or value map) pairs: a
    query/key column lengthens the K cache of every key head of the layer's forms (KV heads under GQA, both maps of
    DIFF), a value column the V cache of every value head (KV heads under GQA)."""
    costs: dict[tuple[int, HeadSize], int] = {}
    for layer, unit in units:
        key = layer, unit.side
        costs[key] = costs.get(key, 0) + unit.column_cost
    return costs


def restore(unit: GrowableUnit, weights: FormWeights | ValueWeights) -> None:
    """Puts `weights` back in `unit` as they are, the same objects (after rating a candidate)."""
    for f in dataclasses.fields(weights):
        setattr(unit, f.name, getattr(weights, f.name))


def stats_from_state_dict(state: dict) -> Sums:
    """Sums restored from `Sums.state_dict`: a sketch's have a "sketch" entry, and a value map's sketch its Nyström
    sum f_sum; of the full sums, a value map's C is per head (3-D), a query/key form's shared (2-D). Keyed on the
    saved data, not on a unit: checkpoints hold only the sums."""
    if "sketch" in state:
        return (SketchValueStats if "f_sum" in state else SketchFormStats).from_state_dict(state)
    return (ValueStats if state["c_sum"].ndim == 3 else FormStats).from_state_dict(state)


@functools.singledispatch
def growth_for(unit: GrowableUnit, moments: Moments | SketchMoments, method: str = "natural",
               **kwargs) -> FormGrowth | GroupedGrowth | SketchedFormGrowth | SketchedGroupedGrowth:
    """The growth of `unit` from its statistics' means (full or sketched): a value map's (registered below), else
    `grouped.growth_for` or `sketched.sketched_growth_for` (which read only w_q, w_k, log_tau and rotary, so anything
    holding those grows as a query/key form)."""
    if isinstance(moments, SketchMoments):
        return sketched_growth_for(unit, moments, method, **kwargs)
    return form_growth_for(unit, moments, method, **kwargs)


@growth_for.register
def _value_growth_for(unit: ValueShape, moments: Moments | SketchValueMoments, method: str = "natural",
                      **kwargs) -> ValueGrowth | SketchedValueGrowth:
    growth = SketchedValueGrowth if isinstance(moments, SketchValueMoments) else ValueGrowth
    return growth.from_values(unit, moments, method, **kwargs)
