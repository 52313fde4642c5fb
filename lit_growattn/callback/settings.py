"""GrowAttentionCallback's settings besides the schedule, in three groups, with their defaults and allowed values:
the one place a setting is defined (the growth choices come from `growth.choices`, a leaf this module reads).

In a LightningCLI config they are nested under the callback's init_args:

    growth: {columns: 2, method: natural}
    statistics: {batches: 16}
    step_search: {alphas: [0, 1, 0.5, 0.25], batches: 2}

Every check that needs only the settings runs when they are built; those that need the model or the trainer run
in the callback's `setup` and at train start, before any training work.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal, get_args

from lit_growattn import growth
from lit_growattn.contract import CaptureMode

Capture = Literal["auto", CaptureMode]  # how statistics steps get G·X′ (auto: chosen by the device)
CAPTURES: tuple[str, ...] = get_args(Capture)
SketchMode = Literal["off", "on", "auto"]  # full statistics | a sketch | chosen at setup (checks.resolve_sketch)
SKETCH_MODES: tuple[str, ...] = get_args(SketchMode)
ScheduleKind = Literal["fixed", "auto"]  # growth at listed points (AtEpochs, AtSteps) | as AutoSchedule decides


def unset(setting: str) -> str:
    """How to unset the callback's `setting` (e.g. growth.columns): null, since a value a config gives stays when the
    command line leaves it out."""
    return f"set {setting} to null (--trainer.callbacks.init_args.{setting}=null)"


def _per_layer(value: int | list[int] | None) -> list[int | None]:
    return value if isinstance(value, list) else [value]


@dataclass(frozen=True)
class GrowthSettings:
    """How each growth event grows the query/key head size, the value head size, or both.

    Args:
        grow: what grows: query_key (d_head) | value (d_v, each head's W_V W_O; docs/value.md) | both, at the same
            events, each from its own statistics.
        columns: new query/key columns per head at each event: one int, or one per layer (null: 1, unless
            `rank_threshold` or the automatic schedule chooses the count).
        value_columns: new value columns per head at each event, as `columns` is for query/key (null: 1, unless
            `rank_threshold` chooses the count); only when `grow` includes value.
        rank_threshold: choose each layer's new columns from its bottleneck spectrum instead: the number of singular
            values above this fraction (in (0, 1)) of the largest, at least 1 (fixed schedules only).
        max_columns: a cap on the columns that `rank_threshold` chooses: one int, or one per layer (null: no cap).
        max_d_head: largest head size a layer may reach (null: the form's input size, its largest possible rank).
        max_d_v: largest value head size a layer may reach (null: min(input size, model width), W_M's largest rank).
        layers: the layers (0-based) that grow (null: every layer with a growable form).
        method: the growth direction: natural | gradient | pinv, or new columns not taken from the statistics:
            random (Q and K drawn at the old columns' scale) | zero (random Q, zero K). The value side takes
            natural, gradient, random or zero (zero: random V columns, zero O rows).
        size_by: for random and zero, the direction whose bottleneck sizes the growth (`rank_threshold`, the
            automatic schedule): natural | gradient | pinv (null: gradient). The others are sized by their own.
        mode: append new columns to W_Q/W_K (the function is kept at step 0) | replace them by a refactorisation.
        temperature: keep the learnable temperature τ | rescale it by √(d/d′) at each growth (query/key only).
        truncation: the metric of the truncated SVD of a query/key growth: euclidean | whitened (by the input
            covariance of the layer; the value side is always euclidean).
        new_second_moment: Adam second moments of new columns: mean (of the old ones; zero moments with a large
            step count would give new columns a larger effective learning rate, studies/growth_pays/README.md "Adam's second
            moments for new columns") | zero.
        ridge: natural's input covariance regularised by ridge × its mean eigenvalue (null: the pseudo-inverse with its
            cut-off; 1.0 under statistics.sketch, where the pseudo-inverse's amplified tail is not captured,
            docs/design.md, sketched statistics).
    """

    grow: growth.Side = "query_key"
    columns: int | list[int] | None = None
    value_columns: int | list[int] | None = None
    rank_threshold: float | None = None
    max_columns: int | list[int] | None = None
    max_d_head: int | None = None
    max_d_v: int | None = None
    layers: list[int] | None = None
    method: growth.Method = "natural"
    size_by: growth.Direction | None = None
    mode: growth.Mode = "append"
    temperature: growth.Temperature = "keep"
    truncation: growth.Truncation = "euclidean"
    new_second_moment: growth.SecondMoment = "mean"
    ridge: float | None = None

    def __post_init__(self):
        for name, allowed in [("grow", growth.SIDES), ("method", growth.METHODS), ("mode", growth.MODES),
                              ("temperature", growth.TEMPERATURES),
                              ("truncation", growth.TRUNCATIONS), ("new_second_moment", growth.SECOND_MOMENT_POLICIES)]:
            growth.check_choice(f"growth.{name}", getattr(self, name), allowed)
        for name in ("columns", "value_columns", "max_columns"):
            if any(p is not None and p <= 0 for p in _per_layer(getattr(self, name))):
                raise ValueError(f"growth.{name} must be positive, got {getattr(self, name)}")
        if self.rank_threshold is not None:
            if not 0.0 < self.rank_threshold < 1.0:
                raise ValueError(f"growth.rank_threshold is a fraction of the largest singular value in (0, 1), "
                                 f"got {self.rank_threshold}")
            for name in ("columns", "value_columns"):
                if getattr(self, name) is not None:
                    raise ValueError(f"growth.{name} is a fixed count, and growth.rank_threshold chooses the count from "
                                     "the spectrum: give one of them (growth.max_columns caps what rank_threshold chooses)")
        elif self.max_columns is not None and self.columns is not None:
            raise ValueError("growth.max_columns caps the count growth.rank_threshold chooses, "
                             f"but growth.columns={self.columns} fixes it: give one of them")
        for name in ("max_d_head", "max_d_v"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"growth.{name} must be positive, got {getattr(self, name)}")
        self._check_sides()
        if self.layers is not None and (not self.layers or len(set(self.layers)) != len(self.layers)):
            raise ValueError(f"growth.layers must list each layer to grow once (0-based), got {self.layers}; "
                             f"{unset('growth.layers')} to grow all")
        # A direction; size_by only with a baseline.
        sizing = growth.sizing_method(self.method, self.size_by, name="growth.size_by")
        if self.ridge is not None:
            if not self.ridge >= 0:
                raise ValueError(f"growth.ridge must be ≥ 0 (a multiple of the input covariance's mean eigenvalue), "
                                 f"got {self.ridge}")
            if "natural" not in (self.method, sizing):
                sized = f" (sized by {sizing!r}, growth.size_by)" if self.method in growth.BASELINES else ""
                raise ValueError(f"growth.ridge regularises the natural direction's C̄, which growth.method="
                                 f"{self.method!r}{sized} does not use: {unset('growth.ridge')}")
        if self.method in growth.BASELINES and self.mode != "append":
            raise ValueError(f"method {self.method!r} adds random columns and needs mode='append', got mode={self.mode!r}")

    def _check_sides(self) -> None:
        """Refuses what the chosen sides cannot apply, naming the fix."""
        if self.grow == "query_key":
            for name in ("value_columns", "max_d_v"):
                if getattr(self, name) is not None:
                    raise ValueError(f"growth.{name} sizes the value side, which does not grow with growth.grow="
                                     f"'query_key': set growth.grow to value or both, or {unset(f'growth.{name}')}")
            return
        if self.grow == "value":
            for name in ("columns", "max_d_head"):
                if getattr(self, name) is not None:
                    raise ValueError(f"growth.{name} sizes the query/key side, which does not grow with "
                                     f"growth.grow='value': {unset(f'growth.{name}')} (the value side's are "
                                     "growth.value_columns and growth.max_d_v), or grow both")
        if self.grow == "value" and self.temperature != "keep":
            raise ValueError("growth.temperature='rescale' rescales the query/key temperature, which does not grow with "
                             "growth.grow='value': set growth.temperature to keep, or grow both")
        if self.method not in growth.VALUE_METHODS:
            raise ValueError(f"the value side grows by {', '.join(growth.VALUE_METHODS)}, not method "
                             f"{self.method!r} (growth.grow={self.grow!r}): choose one of them")
        if self.mode != "append":
            raise ValueError(f"the value side only appends columns (a replace would rotate the value columns the "
                             f"heads of a group share), and growth.grow={self.grow!r}: use growth.mode='append'")
        if self.truncation != "euclidean":
            raise ValueError(f"truncation='whitened' applies to query/key forms only, and growth.grow={self.grow!r}: "
                             "use growth.truncation='euclidean'")

    def grows(self, side: str) -> bool:
        """Whether `side` (query_key | value) grows."""
        return self.grow in (side, "both")

    def check_schedule(self, kind: ScheduleKind, name: str) -> None:
        """Refuses the settings that a schedule of this kind (`name`: its class) cannot apply; with the checks in
        `__post_init__`, every rule on the number of new columns that does not need the model."""
        if kind == "auto":
            if self.mode != "append":
                raise ValueError(f"{name} sizes each layer from the gains of appended columns, and replace would also "
                                 "refactor the layers it leaves as they are: use growth.mode='append'")
            for setting in ("columns", "value_columns", "rank_threshold", "max_columns"):
                if getattr(self, setting) is not None:
                    raise ValueError(f"{name} chooses each layer's growth from its statistics, within its cache "
                                     f"budget and the budget's spending schedule: {unset(f'growth.{setting}')} (set "
                                     f"{name}.budget to bound the widths)")
        elif self.max_columns is not None and self.rank_threshold is None:
            fixed = "growth.value_columns" if self.grow == "value" else "growth.columns"
            raise ValueError(f"growth.max_columns caps a count chosen from the statistics, and {name} grows by "
                             f"{fixed}: set growth.rank_threshold to choose the count, or use {fixed} for a fixed one")

    def _of_side(self, side: growth.HeadSize, d_head, d_v):
        if side not in ("d_head", "d_v"):
            raise ValueError(f"side is 'd_head' (the query/key side) or 'd_v' (the value side), not {side!r}")
        return d_v if side == "d_v" else d_head

    def count(self, layer: int, side: growth.HeadSize = "d_head") -> int | None:
        """The fixed new query/key (or value) columns of `layer` at an event (None: chosen from the spectrum, up to
        `cap(layer)`)."""
        if self.rank_threshold is not None:
            return None
        setting = self._of_side(side, self.columns, self.value_columns)
        columns = setting[layer] if isinstance(setting, list) else setting
        return 1 if columns is None else columns

    def max_width(self, side: growth.HeadSize = "d_head") -> int | None:
        """The largest query/key (or value) head size a growth may reach (None: the form's own bound)."""
        return self._of_side(side, self.max_d_head, self.max_d_v)

    def cap(self, layer: int) -> int | None:
        return self.max_columns[layer] if isinstance(self.max_columns, list) else self.max_columns

    def per_layer_lengths(self) -> dict[str, int]:
        """The per-layer lists among the settings and their lengths, to check against the model."""
        return {name: len(v) for name in ("columns", "value_columns", "max_columns")
                if isinstance(v := getattr(self, name), list)}


@dataclass(frozen=True)
class StatisticsSettings:
    """The statistics window before each growth event.

    Args:
        batches: micro-batches of statistics just before each growth (each captures the gradient of the scores).
        layers_per_step: statistics of only this many of the growing layers per micro-batch, taken in turn
            (round-robin), to make statistics steps cheaper on deep models (null: every layer every step).
        capture: how statistics steps get G·X′: extend (SDPA on zero-extended queries) | explicit (an explicit score
            map) | auto (explicit on CPU, extend on GPU).
        layers_per_event: each event grows only this many of the growing layers, in turn, each from its own window,
            so that a window holds the statistics of that many layers (`callback.memory`; null: all at every event).
        max_memory_gb: refuse at setup when one window's statistics would need more than this per rank (the
            estimate is printed at setup either way; null: no limit).
        sketch: how each form's statistics are kept: off (all of N̄, H·e′² numbers per layer and side) | on (a sketch
            of rank sketch_size per head: per layer the query/key side keeps C̄ (e′²) and e′·(H·k + KV·l) numbers,
            captured with k + l extra attention columns instead of e′; exact when a head's statistics have rank
            ≤ k; docs/design.md, sketched statistics) | auto (off for pinv, registered directions, line_search
            full_rank and units without sketch capture (contract.SketchCapture); otherwise on when the full
            statistics exceed max_memory_gb and the sketch fits, or when e′ ≥ the measured crossover κ·(k + l),
            κ 2.0 on CPU and 4.3 on CUDA). Under the sketch, method natural uses growth.ridge, 1.0 unless set.
        sketch_size: k, the sketch's range columns per head (its co-range has ⌈3k/2⌉, the value side's Nyström sketch
            k); null: max(24, 2·p + 8), p the most columns one event appends to a head (growth.columns,
            value_columns, max_columns; 8 when AutoSchedule or rank_threshold chooses).
    """

    batches: int = 8
    layers_per_step: int | None = None
    capture: Capture = "auto"
    layers_per_event: int | None = None
    max_memory_gb: float | None = None
    sketch: SketchMode | bool = "auto"  # bool: YAML 1.1 reads an unquoted on/off as true/false
    sketch_size: int | None = None

    def __post_init__(self):
        if isinstance(self.sketch, bool):
            object.__setattr__(self, "sketch", "on" if self.sketch else "off")
        if self.batches <= 0:
            raise ValueError(f"statistics.batches must be positive, got {self.batches}")
        if self.layers_per_step is not None and self.layers_per_step <= 0:
            raise ValueError(f"statistics.layers_per_step must be positive (or null for all layers), got {self.layers_per_step}")
        if self.layers_per_event is not None and self.layers_per_event <= 0:
            raise ValueError(f"statistics.layers_per_event must be positive (or null for all layers), got {self.layers_per_event}")
        growth.check_choice("statistics.capture", self.capture, CAPTURES)
        growth.check_choice("statistics.sketch", self.sketch, SKETCH_MODES)
        if self.sketch_size is not None:
            if self.sketch_size <= 0:
                raise ValueError(f"statistics.sketch_size must be positive (or null for max(24, 2·p + 8)), got "
                                 f"{self.sketch_size}")
            if self.sketch == "off":
                raise ValueError("statistics.sketch_size sizes the sketch, and statistics.sketch is off: set "
                                 f"statistics.sketch to on or auto, or {unset('statistics.sketch_size')}")


@dataclass(frozen=True)
class StepSearch:
    """How each event chooses its step size α along the growth direction, from forward-only losses.

    Args:
        alphas: the step-size candidates; 0 keeps the function, so a growth never raises the loss it is rated on
            (null: 0, 1, 1/2, …, 1/256).
        batches: the statistics window's last micro-batches, kept to rate the candidates on (null: 2, or
            statistics.batches when that is smaller).
        line_search: what a candidate installs: low_rank (the truncated growth itself) | full_rank (M + αΔM before
            truncation, then the truncated growth at the chosen α is checked against α = 0).
        rule: grid (the best candidate) | quadratic (also the minimiser of a quadratic fitted to the first-order
            prediction and the candidates' losses; measured no better than the grid on text).
    """

    alphas: list[float] | None = None
    batches: int | None = None
    line_search: growth.LineSearch = "low_rank"
    rule: growth.StepRule = "grid"

    def __post_init__(self):
        growth.check_choice("step_search.line_search", self.line_search, growth.LINE_SEARCHES)
        growth.check_choice("step_search.rule", self.rule, growth.STEP_RULES)
        if self.batches is not None and self.batches <= 0:
            raise ValueError(f"step_search.batches must be positive, got {self.batches}")
        if self.alphas is not None and not all(math.isfinite(a) and a >= 0 for a in self.alphas) or self.alphas == []:
            raise ValueError(f"step-size candidates must be a non-empty list of finite values ≥ 0, got {self.alphas}")
        alphas = self.candidates
        if 0.0 not in alphas:
            warnings.warn(f"alphas {alphas} has no 0: a growth may then raise the loss (0 keeps the function)")
        if self.rule == "quadratic" and (self.line_search != "low_rank" or max(alphas) <= 0):
            raise ValueError(
                f"step_search.rule='quadratic' fits the losses of the grown forms at the positive alphas: it needs "
                f"line_search='low_rank' and a positive step size in alphas, got {self.line_search!r} and {alphas}"
            )

    @property
    def candidates(self) -> list[float]:
        """The candidates, sorted, each once."""
        return sorted(set(self.alphas if self.alphas is not None else growth.candidate_steps()))

    def check_method(self, growth_settings: GrowthSettings) -> None:
        if self.line_search == "full_rank" and growth_settings.method in growth.BASELINES:
            raise ValueError(f"step_search.line_search='full_rank' rates M + αΔM along a direction, and method "
                             f"{growth_settings.method!r} adds random columns without one: use line_search='low_rank'")
        if self.line_search == "full_rank" and growth_settings.grows("value"):
            raise ValueError("step_search.line_search='full_rank' refactors a query/key form at full rank, which the "
                             "value side (append only) cannot: use line_search='low_rank'")

    def kept_batches(self, statistics: StatisticsSettings) -> int:
        kept = self.batches if self.batches is not None else min(2, statistics.batches)
        if kept > statistics.batches:
            raise ValueError(f"need step_search.batches ≤ statistics.batches (the kept batches come from the "
                             f"statistics window), got {kept} and {statistics.batches}")
        return kept
