"""The two sides of attention that grow, and what each needs, picked by the type of the grown object: a query/key
form (`form.FormShape`: w_q, w_k, log_tau) or a value map (`value.ValueShape`: w_v, w_o). Everything above this
module handles a list of both without asking which is which."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Literal

import torch

from lit_growattn.growth.form import FormShape, FormWeights
from lit_growattn.growth.grouped import GroupedGrowth, growth_for as form_growth_for
from lit_growattn.growth.factorize import FormGrowth
from lit_growattn.growth.stats import FormStats, Moments, Sums
from lit_growattn.growth.value import ValueGrowth, ValueShape, ValueStats, ValueWeights


HeadSize = Literal["d_head", "d_v"]  # which head size a column widens (query/key or value): its key in an event record


def is_value(unit: object) -> bool:
    """True for a value map, False for a query/key form."""
    return isinstance(unit, ValueShape)


def head_size_of(unit: FormShape | ValueShape) -> HeadSize:
    return "d_v" if is_value(unit) else "d_head"


def column_costs(units: Iterable[tuple[int, FormShape | ValueShape]]) -> dict[tuple[int, HeadSize], int]:
    """Per (layer, side), the cache values per token one more column costs, from (layer, form or value map) pairs: a
    query/key column lengthens the K cache of every key head of the layer's forms (w_k's first dimension: KV heads
    under GQA, both maps of DIFF), a value column the V cache of every value head (KV heads under GQA)."""
    costs: dict[tuple[int, HeadSize], int] = {}
    for layer, unit in units:
        key = layer, head_size_of(unit)
        costs[key] = costs.get(key, 0) + (unit.n_kv_head if is_value(unit) else unit.w_k.shape[0])
    return costs


def weights_of(unit: FormShape | ValueShape) -> FormWeights | ValueWeights:
    """The weights `unit` holds now (the same tensors, not copies)."""
    return ValueWeights.of(unit) if is_value(unit) else FormWeights.of(unit)


def tensor_names(unit: FormShape | ValueShape) -> tuple[str, ...]:
    """The parameter names a growth of `unit` replaces (what its `set_weights` takes)."""
    return tuple(f.name for f in dataclasses.fields(ValueWeights if is_value(unit) else FormWeights))


def leading_tensor(unit: FormShape | ValueShape) -> torch.Tensor:
    """W_Q or W_V: where the unit's dtype and device are read."""
    return unit.w_v if is_value(unit) else unit.w_q


def restore(unit: FormShape | ValueShape, weights: FormWeights | ValueWeights) -> None:
    """Puts `weights` back in `unit` as they are, the same objects (after rating a candidate)."""
    for f in dataclasses.fields(weights):
        setattr(unit, f.name, getattr(weights, f.name))


def stats_like(unit: FormShape | ValueShape, method: str, dtype: torch.dtype = torch.float32) -> Sums:
    """Empty sums for `unit`'s statistics."""
    return ValueStats.empty_like(unit, dtype=dtype) if is_value(unit) else FormStats.empty_like(unit, method, dtype=dtype)


def stats_from_state_dict(state: dict) -> Sums:
    """Sums restored from `Sums.state_dict`: a value map's C is per head (3-D), a query/key form's shared (2-D)."""
    return (ValueStats if state["c_sum"].ndim == 3 else FormStats).from_state_dict(state)


def growth_for(unit: FormShape | ValueShape, moments: Moments, method: str = "natural",
               **kwargs) -> FormGrowth | GroupedGrowth | ValueGrowth:
    """The growth of `unit` from its statistics' means: ValueGrowth for a value map, else `grouped.growth_for`."""
    if is_value(unit):
        return ValueGrowth.from_values(unit, moments, method, **kwargs)
    return form_growth_for(unit, moments, method, **kwargs)
