"""The two sides of attention that grow, as functions over a `unit.GrowableUnit`: a query/key form
(`form.FormShape`) or a value map (`value.ValueShape`). Each is one line over the unit's members, kept as the names
`lit_growattn.growth` exports; `growth_for` is a type table, since the growths import the units."""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable

import torch

from lit_growattn.growth.factorize import FormGrowth
from lit_growattn.growth.form import FormWeights
from lit_growattn.growth.grouped import GroupedGrowth, growth_for as form_growth_for
from lit_growattn.growth.stats import FormStats, Moments, Sums
from lit_growattn.growth.unit import GrowableUnit, HeadSize
from lit_growattn.growth.value import ValueGrowth, ValueShape, ValueStats, ValueWeights


def is_value(unit: object) -> bool:
    """True for a value map, False for a query/key form."""
    return isinstance(unit, ValueShape)


def head_size_of(unit: GrowableUnit) -> HeadSize:
    return unit.side


def column_costs(units: Iterable[tuple[int, GrowableUnit]]) -> dict[tuple[int, HeadSize], int]:
    """Per (layer, side), the cache values per token one more column costs, from (layer, form or value map) pairs: a
    query/key column lengthens the K cache of every key head of the layer's forms (KV heads under GQA, both maps of
    DIFF), a value column the V cache of every value head (KV heads under GQA)."""
    costs: dict[tuple[int, HeadSize], int] = {}
    for layer, unit in units:
        key = layer, unit.side
        costs[key] = costs.get(key, 0) + unit.column_cost
    return costs


def weights_of(unit: GrowableUnit) -> FormWeights | ValueWeights:
    """The weights `unit` holds now (the same tensors, not copies)."""
    return unit.held_weights()


def tensor_names(unit: GrowableUnit) -> tuple[str, ...]:
    """The parameter names a growth of `unit` replaces (what its `set_weights` takes)."""
    return unit.tensor_names()


def leading_tensor(unit: GrowableUnit) -> torch.Tensor:
    """W_Q or W_V: where the unit's dtype and device are read."""
    return unit.leading_tensor


def restore(unit: GrowableUnit, weights: FormWeights | ValueWeights) -> None:
    """Puts `weights` back in `unit` as they are, the same objects (after rating a candidate)."""
    for f in dataclasses.fields(weights):
        setattr(unit, f.name, getattr(weights, f.name))


def stats_like(unit: GrowableUnit, method: str, dtype: torch.dtype = torch.float32) -> Sums:
    """Empty sums for `unit`'s statistics."""
    return unit.empty_sums(method, dtype)


def stats_from_state_dict(state: dict) -> Sums:
    """Sums restored from `Sums.state_dict`: a value map's C is per head (3-D), a query/key form's shared (2-D). Keyed
    on the saved data, not on a unit: checkpoints hold only the sums."""
    return (ValueStats if state["c_sum"].ndim == 3 else FormStats).from_state_dict(state)


@functools.singledispatch
def growth_for(unit: GrowableUnit, moments: Moments, method: str = "natural",
               **kwargs) -> FormGrowth | GroupedGrowth | ValueGrowth:
    """The growth of `unit` from its statistics' means: ValueGrowth for a value map, else `grouped.growth_for` (which
    reads only w_q, w_k, log_tau and rotary, so anything holding those grows as a query/key form)."""
    return form_growth_for(unit, moments, method, **kwargs)


growth_for.register(ValueShape, ValueGrowth.from_values)
