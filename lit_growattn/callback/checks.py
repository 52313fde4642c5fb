"""The checks GrowAttentionCallback runs at setup, before any training work: the strategy, the growing layers and
what each side has to grow there, the head-size limits, and what the statistics settings ask of those layers; and
whether the statistics are sketched (`check_sketch` when the callback is built, `resolve_sketch` at setup). Each
refusal says what to change."""

from __future__ import annotations

import math

import lightning as L
import torch
from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy,
                                          Strategy)
from lightning.pytorch.utilities import rank_zero_warn

from lit_growattn import growth
from lit_growattn.analysis import AttentionAnalysisCallback
from lit_growattn.callback.memory import size_text, window_bytes
from lit_growattn.callback.settings import GrowthSettings, ScheduleKind, StatisticsSettings, StepSearch, unset
from lit_growattn.contract import NamedForm, SketchCapture, check_shardable, missing
from lit_growattn.growth.sketched import SKETCH_DIRECTIONS
from lit_growattn.module import GrowAttentionLM
from lit_growattn.training import fsdp2
from lit_growattn.training.lm import GrowableLM

# `auto` sketches when e′ ≥ κ·(k + l): a statistics step then widens attention by k + l columns instead of e′, and
# both paths keep C̄ (e′²). Measured where the sketched step costs the same as the full one (scripts/bench.py's
# `sketch_crossover` on CPU, 1.97; the GPU check's on an H200, 4.29: its fused kernels make the full path's wide
# call cheaper; docs/performance.md).
SKETCH_CROSSOVER = {"cpu": 2.0, "cuda": 4.3}
# p, the columns an event appends to a head, when the statistics choose it (AutoSchedule, rank_threshold).
CHOSEN_COLUMNS = 8
# natural's ridge under the sketch when growth.ridge is null: the pseudo-inverse direction lies in N̄'s tail, which no
# sketch of N̄'s leading directions holds, and the ridge caps that amplification; at 1.0 a sketch held most of it and
# kept its held-out gain (docs/design.md §12, studies/sketch).
SKETCH_RIDGE = 1.0

Firsts = dict[str, dict[int, object]]  # per side that grows ("query/key form", "value map"), each layer's first unit


# A sharded run that a growth can re-shard, named in every refusal of another sharding strategy.
MODEL_PARALLEL = ("strategy=ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) (FSDP2, which the "
                  "module's configure_model applies), or strategy='ddp'")


def check_strategy(strategy: Strategy) -> None:
    """Accepts a single device, DDP, and ModelParallelStrategy without tensor parallelism."""
    if isinstance(strategy, ModelParallelStrategy):
        fsdp2.check_data_parallel_only(strategy.device_mesh)
        return
    # DeepSpeedStrategy is a DDPStrategy: refused by name before DDP is accepted.
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise RuntimeError(
            f"GrowAttentionCallback cannot grow under {type(strategy).__name__}: it shards parameters in a way a "
            f"growth cannot re-shard (FSDP1, DeepSpeed). Use {MODEL_PARALLEL}."
        )


# The configure_model methods that shard as a growth re-shards (`training.fsdp2.shard_model`).
PROJECT_CONFIGURE_MODELS = (GrowableLM.configure_model, GrowAttentionLM.configure_model)


def check_model_parallel(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Under ModelParallelStrategy: refuses a module whose blocks a growth cannot rebuild or that shards
    itself in its own way, and the callbacks that do not follow a sharded module (weight averaging, attention
    analysis)."""
    if not isinstance(trainer.strategy, ModelParallelStrategy):
        return
    check_shardable(pl_module)
    if type(pl_module).configure_model not in PROJECT_CONFIGURE_MODELS:
        raise ValueError(
            f"{type(pl_module).__name__} overrides configure_model: under ModelParallelStrategy a growth re-shards "
            "the blocks it grows the project's way (fully_shard on each block, lit_growattn.training.fsdp2), which "
            "would silently replace a sharding of one's own, so a custom configure_model is not supported yet. Use "
            "the project's configure_model, or strategy='ddp'"
        )
    fsdp2.check_no_weight_averaging(trainer.callbacks)
    for callback in trainer.callbacks:
        if isinstance(callback, AttentionAnalysisCallback):
            raise ValueError(
                "AttentionAnalysisCallback does not run under ModelParallelStrategy yet: it reads the attention of "
                "unsharded weights, and draws its figures on rank 0 alone, where a sharded model's every forward is "
                "a collective. Remove it from the callbacks, or use strategy='ddp'"
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


def most_columns(settings: GrowthSettings, kind: ScheduleKind) -> tuple[str | None, int]:
    """p, the most columns one event appends to a head, and the setting that fixes it (None: chosen by the statistics,
    or 1 by default)."""
    fixed = {name: max(v) if isinstance(v, list) else v for name in ("columns", "value_columns", "max_columns")
             if (v := getattr(settings, name)) is not None}
    if fixed:
        name = max(fixed, key=fixed.__getitem__)
        return f"growth.{name}", fixed[name]
    return None, CHOSEN_COLUMNS if kind == "auto" or settings.rank_threshold is not None else 1


def sketch_size(statistics: StatisticsSettings, settings: GrowthSettings, kind: ScheduleKind) -> growth.SketchSize:
    """The sketch's sizes: statistics.sketch_size, or max(24, 2·p + 8), with room for p pairs and as many again for
    the reconstruction's accuracy beyond them."""
    _, p = most_columns(settings, kind)
    return growth.SketchSize.of(statistics.sketch_size or max(24, 2 * p + 8))


def _settings_refusal(settings: GrowthSettings, search: StepSearch) -> tuple[str, str] | None:
    """Why these settings cannot use a sketch, as (the console's short reason, the refusal of statistics.sketch: on);
    None when they can."""
    direction = growth.sizing_method(settings.method, settings.size_by)
    setting = "growth.size_by" if settings.method in growth.BASELINES else "growth.method"
    option = setting.removeprefix("growth.")
    if direction == "pinv":
        return (f"{setting}='pinv' sums each sequence's own C_i⁺N_iC_i⁺, which no sketch keeps",
                f"{setting}='pinv' cannot use statistics.sketch: on: pinv sums each sequence's C_i⁺N_iC_i⁺ with that "
                "sequence's own pseudo-inverse, which is not a function of the summed N a sketch keeps; sketching it "
                "directly would need an e′×e′ eigendecomposition per sequence inside every statistics step. Use "
                f"{option} natural or gradient with the sketch, or statistics.sketch: off (auto resolves to off for "
                "pinv)")
    if direction not in SKETCH_DIRECTIONS:
        return (f"{setting}={direction!r} reads N̄ itself",
                f"{setting}={direction!r} cannot use statistics.sketch: on: a registered direction reads N̄ itself, of "
                f"which the sketch keeps only thin factors. Use {option} natural or gradient with the sketch, or "
                "statistics.sketch: off (auto resolves to off for it)")
    if search.line_search == "full_rank":
        return ("step_search.line_search='full_rank' installs M + αΔM at full rank",
                "step_search.line_search='full_rank' installs M + αΔM at full rank (e′ columns per head), which the "
                "sketch does not keep: use line_search='low_rank', or statistics.sketch: off")
    return None


def _model_refusal(units: list[NamedForm]) -> tuple[str, str] | None:
    """As `_settings_refusal`, for units that do not capture a sketch (lack a member of `contract.SketchCapture`)."""
    for layer, _, unit in units:
        if lacks := missing(unit, SketchCapture):
            what = "value maps" if unit.side == "d_v" else "forms"
            who = f"{type(unit).__name__} of layer {layer}"
            return (f"{who} captures no sketch",
                    f"statistics.sketch: on needs {what} that capture a sketch (lit_growattn.contract.SketchCapture); "
                    f"{who} lacks {', '.join(lacks)}: set statistics.sketch to off, or to auto (which then keeps the "
                    "full statistics)")
    return None


def check_sketch(statistics: StatisticsSettings, settings: GrowthSettings, search: StepSearch,
                 kind: ScheduleKind) -> None:
    """Refuses, when the callback is built, statistics.sketch: on with settings no sketch can serve, and a
    statistics.sketch_size that prices fewer pairs than an event appends."""
    if statistics.sketch == "on" and (refused := _settings_refusal(settings, search)):
        raise ValueError(refused[1])
    setting, p = most_columns(settings, kind)
    k = statistics.sketch_size
    if setting is not None and k is not None and k < p:
        raise ValueError(f"{setting}={getattr(settings, setting.removeprefix('growth.'))} needs {p} bottleneck pairs "
                         f"per head, and a sketch of statistics.sketch_size={k} yields at most {k}: raise "
                         f"statistics.sketch_size to at least {p} ({2 * p + 8} = 2·{p} + 8 recommended), or grow fewer "
                         "columns")


def available_sketch(statistics: StatisticsSettings, settings: GrowthSettings, search: StepSearch, kind: ScheduleKind,
                     units: list[NamedForm]) -> growth.SketchSize | None:
    """The sketch statistics.sketch: on would keep, or None when these settings or these units cannot use one."""
    if _settings_refusal(settings, search) or _model_refusal(units):
        return None
    return sketch_size(statistics, settings, kind)


def resolve_sketch(statistics: StatisticsSettings, settings: GrowthSettings, search: StepSearch, kind: ScheduleKind,
                   units: list[NamedForm], layers: list[int], halves: bool,
                   device: torch.device) -> tuple[growth.SketchSize | None, str]:
    """The sketch of the growing `units` (None: the full statistics) and the reason, for the console. auto: off when
    the settings or the units cannot use one; on when the full statistics exceed max_memory_gb and the sketch fits;
    otherwise on iff e′ ≥ κ·(k + l) (`SKETCH_CROSSOVER`). on: refuses units without a sketch capture, and warns when
    the sketch keeps no fewer columns than e′."""
    units = [u for u in units if u.layer in layers]
    if statistics.sketch == "off":
        return None, "statistics.sketch: off"
    size = sketch_size(statistics, settings, kind)
    e_in = max(u.form.e_in for u in units)
    if statistics.sketch == "on":
        if refused := _model_refusal(units):
            raise ValueError(refused[1])
        if size.k + size.l >= e_in:
            named = (f"statistics.sketch_size={size.k}" if statistics.sketch_size is not None
                     else f"the default sketch size {size.k}")
            rank_zero_warn(f"{named} keeps k + l = {size.k + size.l} columns per head, not fewer than the input size "
                           f"e′ = {e_in}: the sketch saves nothing here")
        return size, "statistics.sketch: on"
    if refused := _settings_refusal(settings, search) or _model_refusal(units):
        return None, f"auto: {refused[0]}"
    if (limit := statistics.max_memory_gb) is not None:
        per_event = statistics.layers_per_event
        full = window_bytes(units, layers, per_event, settings.method, halves)[0]
        sketched = window_bytes(units, layers, per_event, settings.method, halves, size)[0]
        if sketched <= limit * 1e9 < full:
            return size, (f"auto: the full statistics' {size_text(full)} per rank exceed statistics.max_memory_gb="
                          f"{limit}, the sketch's {size_text(sketched)} fit")
    kappa = SKETCH_CROSSOVER.get(device.type, SKETCH_CROSSOVER["cpu"])
    threshold = kappa * (size.k + size.l)
    wide = e_in >= threshold
    return (size if wide else None), (f"auto: e′ = {e_in} {'≥' if wide else '<'} {kappa:g}·(k + l) = {threshold:g} "
                                      f"on {device.type}")


def sketch_ridge(settings: GrowthSettings, sketch: growth.SketchSize | None) -> float | None:
    """growth.ridge as the growth maths take it: SKETCH_RIDGE under the sketch when null and natural is used."""
    uses_natural = "natural" in (settings.method, growth.sizing_method(settings.method, settings.size_by))
    if sketch is not None and settings.ridge is None and uses_natural:
        return SKETCH_RIDGE
    return settings.ridge
