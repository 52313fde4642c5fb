"""The checks GrowAttentionCallback runs at setup, before any training work: the strategy, the growing layers and
what each side has to grow there, the head-size limits, and what the statistics settings ask of those layers. Each
refusal says what to change."""

from __future__ import annotations

import math

import lightning as L
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

from lit_growattn.callback.settings import GrowthSettings, StatisticsSettings, unset
from lit_growattn.contract import NamedForm

Firsts = dict[str, dict[int, object]]  # per side that grows ("query/key form", "value map"), each layer's first unit


def check_strategy(strategy: Strategy) -> None:
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise RuntimeError(
            f"GrowAttentionCallback supports single-device and DDP training, not {type(strategy).__name__}: "
            "FSDP and DeepSpeed shard parameters, and resizing a sharded parameter needs a full re-shard. "
            "Use strategy='ddp' (any number of nodes) or 'ddp_spawn'."
        )


def growing_layers(settings: GrowthSettings, pl_module: L.LightningModule, named: list[NamedForm],
                   values: list[NamedForm]) -> tuple[list[int], Firsts]:
    """The layers that grow, and the first unit of each layer for each side that grows; refuses layers the model
    lacks, layers without a unit of a growing side, and per-layer settings of another length than the model's."""
    n_layer = len(pl_module.head_sizes())
    firsts = {}
    if settings.grows("query_key"):
        firsts["query/key form"] = {layer: form for layer, _, form in reversed(named)}
    if settings.grows("value"):
        firsts["value map"] = {layer: values_map for layer, _, values_map in reversed(values)}
    # Unset: every layer with a query/key form (a layer without a value map to grow is then named below).
    layers = settings.layers if settings.layers is not None else sorted({f.layer for f in named})
    if bad := [i for i in layers if not 0 <= i < n_layer]:
        raise ValueError(f"growth.layers {bad} do not exist: the model has {n_layer} layers (0-based)")
    for side, first in firsts.items():
        if not_growable := [i for i in layers if i not in first]:
            hint = (" (an attention whose output is not linear in W_V·W_O, such as diff with its per-head "
                    "normalisation, has none): leave those layers out of growth.layers, or grow query_key only"
                    if side == "value map" else "")
            raise ValueError(f"{type(pl_module).__name__} has no growable {side} in layers {not_growable}{hint}")
    for name, length in settings.per_layer_lengths().items():
        if length != n_layer:
            raise ValueError(f"growth.{name} has {length} entries but the model has {n_layer} layers")
    return layers, firsts


def width_limits(settings: GrowthSettings, firsts: Firsts, layers: list[int]) -> dict[str, int]:
    """max_d_head and max_d_v of the sides that grow: as set, else the units' own bound; refuses a limit outside
    the current size and that bound, and a side already past its bound."""
    limits = {}
    for side, key, first_of_layer, what in [
        ("query/key", "max_d_head", firsts.get("query/key form"), "the form's input size ({}: the bilinear form "
                                                                  "has rank ≤ {})"),
        ("value", "max_d_v", firsts.get("value map"), "the smaller of input size and width ({}: W_V·W_O has "
                                                      "rank ≤ {})"),
    ]:
        if first_of_layer is None:
            continue
        current, bound = max(first_of_layer[i].width for i in layers), first_of_layer[layers[0]].max_width
        other = "value" if side == "query/key" else "query_key"
        limits[key] = getattr(settings, key) if getattr(settings, key) is not None else bound
        if current > bound:
            raise ValueError(f"the {side} head size ({current}) already exceeds {what.format(bound, bound)}: it "
                             f"cannot grow; build the model at most {bound} wide, or grow the other side only "
                             f"(growth.grow={other})")
        if not current <= limits[key] <= bound:
            raise ValueError(f"{key}={limits[key]} must lie between the current {side} head size ({current}) and "
                             f"{what.format(bound, bound)}")
    return limits


def check_layers_per_event(statistics: StatisticsSettings, layers: list[int]) -> None:
    per_event = statistics.layers_per_event
    if per_event is not None and per_event > len(layers):
        raise ValueError(
            f"statistics.layers_per_event={per_event} exceeds the {len(layers)} growing layers {layers}: set it to "
            f"at most {len(layers)}, or {unset('statistics.layers_per_event')} to grow every growing layer at "
            "each event"
        )


def layers_per_step(statistics: StatisticsSettings, layers: list[int], halves: bool) -> int:
    """The layers each statistics step captures; refuses a window too short to reach every layer (`halves`: the
    automatic schedule's two halves)."""
    per_step = min(statistics.layers_per_step or len(layers), len(layers))
    # The automatic schedule splits each layer's statistics in two halves: two turns per layer at least.
    turns = math.ceil(len(layers) / per_step) * (2 if halves else 1)
    if statistics.batches < turns:
        raise ValueError(
            f"statistics.batches={statistics.batches} with layers_per_step={statistics.layers_per_step} "
            f"leaves layers without statistics: {len(layers)} growing layers need at least {turns} statistics "
            "batches (AutoSchedule needs two per layer, one for each half of the window); raise statistics.batches "
            "or statistics.layers_per_step"
        )
    return per_step
