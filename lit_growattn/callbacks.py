"""GrowAttentionCallback: grows the query/key head size of attention at scheduled epochs or optimizer steps, or
by itself (schedule='auto') while the statistics say that width pays.

Thin Lightning glue over `lit_growattn.growing` (docs/design.md, "Lightning mechanics"):
- schedule: at every training-batch start the trainer's counters say whether a growth happens now, or
  whether this micro-batch is one of the `stats_batches` before the next growth (a statistics step);
- window: on a statistics step the forms capture (X′, G X′) during the real training step, `on_after_backward`
  folds them into sums, and the window's last batch all-reduces them once;
- event: plan, step size, broadcast of rank 0's tensors, install;
- rebuild: DDP re-wrapped, optimizer and scheduler rebuilt with their state carried over.
The history and the pending window are in `state_dict`, so a run resumed from a checkpoint taken at any step
grows exactly once per event, from the statistics the uninterrupted run used.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lit_growattn import growth
from lit_growattn.growing import report
from lit_growattn.growing.event import GrowthEvent, GrowthSettings
from lit_growattn.growing.trainer_ops import install_growth, kept_batch_losses
from lit_growattn.growing.schedule import AutoSchedule, Clock, GrowthPoint, Schedule, check_same_schedule, warn_past_the_end
from lit_growattn.growth.capacity import CapacityRule
from lit_growattn.growing.window import CAPTURES, Capture, NamedForms, StatsWindow, capture_mode, fold_captured, layers_in_turn
from lit_growattn.lightning_private import should_update_logs


class GrowAttentionCallback(Callback):
    """Args:
        grow_at_epochs: epochs (0-based) at whose start d_head grows; 0 is refused (no statistics yet).
        grow_at_steps: or optimizer steps (`trainer.global_step`) at which it grows: at the first batch start
            at or after the step where no accumulation window is open. Give exactly one of the two, or neither
            with schedule='auto'.
        schedule: `fixed` (the growth points above) | `auto`: a check every `check_every` optimizer steps, where
            each layer grows by the columns whose held-out gain is at least `auto_threshold` of what the layer's
            existing columns can still gain and `auto_agreement` of their in-sample gain (`lit_growattn.growth.capacity`);
            it ends after `patience` checks in a row with no growth once the loss falls by less than
            `auto_min_fall` of itself per check, or when every layer is at max_d_head; no statistics after that.
        check_every, patience, auto_threshold, auto_agreement, auto_min_fall: the automatic schedule's settings.
        grow_by: new columns per head at each event: one int, or one per layer (default 1; with
            `dynamic_rank` or schedule='auto', a cap on the chosen growth, default none).
        dynamic_rank: if set, choose the growth per layer from the bottleneck spectrum instead: the number of
            singular values above `dynamic_rank` × the largest (at least 1).
        max_d_head: largest head size a layer may reach (default and maximum: the form's input size).
        method, mode, temperature, truncation, line_search, step_size, new_second_moment: see
            `lit_growattn.growth.choices`; `step_size: quadratic` also rates the minimiser of a quadratic fitted to
            the first-order prediction and the grid's losses (measured no better than the grid on text).
        stats_batches: micro-batches of statistics just before each growth.
        alphas: step-size candidates (0 keeps the function); default 0, 1, 1/2, …, 1/256.
        line_search_batches: the window's last batches, kept for the step-size evaluations (default min(2, stats_batches)).
        layers: layers to grow (default all).
        layers_per_step: statistics of only this many of those layers per statistics step, taken in turn
            (round-robin), to make statistics steps cheaper on deep models (default: all every step).
        capture: how statistics steps get G·X′: extend (SDPA zero-extension) | explicit (score map) | auto.
    """

    def __init__(
        self,
        grow_at_epochs: list[int] | None = None,
        grow_at_steps: list[int] | None = None,
        grow_by: int | list[int] | None = None,
        dynamic_rank: float | None = None,
        max_d_head: int | None = None,
        method: growth.Method = "natural",
        mode: growth.Mode = "append",
        temperature: growth.Temperature = "keep",
        truncation: growth.Truncation = "euclidean",
        stats_batches: int = 8,
        alphas: list[float] | None = None,
        line_search: growth.LineSearch = "low_rank",
        step_size: growth.StepRule = "grid",
        line_search_batches: int | None = None,
        layers: list[int] | None = None,
        layers_per_step: int | None = None,
        capture: Capture = "auto",
        new_second_moment: growth.SecondMoment = "mean",
        schedule: growth.ScheduleKind = "fixed",
        check_every: int = 50,
        patience: int = 2,
        auto_threshold: float = CapacityRule.ratio,
        auto_agreement: float = CapacityRule.agreement,
        auto_min_fall: float = CapacityRule.min_fall,
    ):
        super().__init__()
        growth.check_choice("schedule", schedule, growth.SCHEDULE_KINDS)
        capacity = None
        if schedule == "auto":
            if grow_at_epochs is not None or grow_at_steps is not None:
                raise ValueError("schedule='auto' decides by itself when to grow: leave grow_at_epochs and "
                                 "grow_at_steps out (null), or use schedule='fixed'")
            capacity = CapacityRule(auto_threshold, auto_agreement, auto_min_fall)
            self.schedule = AutoSchedule(check_every, patience, capacity.min_fall)
        else:
            self.schedule = Schedule(grow_at_epochs, grow_at_steps)
        growth.check_choice("capture", capture, CAPTURES)
        if stats_batches <= 0:
            raise ValueError(f"stats_batches must be positive, got {stats_batches}")
        if layers is not None and (not layers or len(set(layers)) != len(layers)):
            raise ValueError(f"layers must list each layer to grow once (0-based), got {layers}; leave it out to grow all")
        if layers_per_step is not None and layers_per_step <= 0:
            raise ValueError(f"layers_per_step must be positive (or None for all layers), got {layers_per_step}")
        if line_search_batches is None:
            line_search_batches = min(2, stats_batches)
        if not 0 < line_search_batches <= stats_batches:
            raise ValueError(
                f"need 0 < line_search_batches ≤ stats_batches (the kept batches come from the statistics window), "
                f"got {line_search_batches} and {stats_batches}"
            )
        self.settings = GrowthSettings(grow_by, dynamic_rank, max_d_head, method, mode, temperature, truncation,
                                       alphas, line_search, new_second_moment, step_size, capacity)
        self.stats_batches, self.line_search_batches = stats_batches, line_search_batches
        self.layers, self.layers_per_step = layers, layers_per_step
        self.capture = capture
        self.history: list[dict] = []  # one record per event, skipped ones included; survives checkpoints
        self.window = StatsWindow(method, halves=capacity is not None)
        self._capturing = self._closes_window = False
        self._strategy, self._rank, self._world = None, 0, 1

    @property
    def _schedule_kind(self) -> str:
        return "auto" if isinstance(self.schedule, AutoSchedule) else "fixed"

    # -- checks before any work is done --------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._strategy, self._rank, self._world = trainer.strategy, trainer.global_rank, trainer.world_size
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise RuntimeError(
                f"GrowAttentionCallback supports single-device and DDP training, not {type(trainer.strategy).__name__}: "
                "FSDP and DeepSpeed shard parameters, and resizing a sharded parameter needs a full re-shard. "
                "Use strategy='ddp' (any number of nodes) or 'ddp_spawn'."
            )
        forms = pl_module.model.qk_forms()
        n_layer = len(forms)
        layers = self.layers if self.layers is not None else list(range(n_layer))
        if bad := [i for i in layers if not 0 <= i < n_layer]:
            raise ValueError(f"layers {bad} do not exist: the model has {n_layer} layers (0-based)")
        if not_growable := [i for i in layers if not forms[i]]:
            raise ValueError(f"attention {pl_module.model.cfg.attention!r} has no growable query/key pair in layers {not_growable}")
        if isinstance(self.settings.grow_by, list) and len(self.settings.grow_by) != n_layer:
            raise ValueError(f"grow_by has {len(self.settings.grow_by)} entries but the model has {n_layer} layers")
        e_in = forms[layers[0]][0].w_q.shape[1]
        current = max(forms[i][0].d_head for i in layers)
        max_d = self.settings.max_d_head if self.settings.max_d_head is not None else e_in
        if not current <= max_d <= e_in:
            raise ValueError(
                f"max_d_head={max_d} must lie between the current head size ({current}) and the form's input size "
                f"({e_in}: the bilinear form has rank ≤ {e_in})"
            )
        self._per_step = min(self.layers_per_step or len(layers), len(layers))
        # The automatic schedule splits each layer's statistics in two halves: two turns per layer at least.
        turns = math.ceil(len(layers) / self._per_step) * (2 if self.window.halves else 1)
        if self.stats_batches < turns:
            raise ValueError(
                f"stats_batches={self.stats_batches} with layers_per_step={self.layers_per_step} leaves layers without "
                f"statistics: {len(layers)} growing layers need at least {turns} statistics batches (schedule='auto' "
                "needs two per layer, one for each half of the window); raise stats_batches or layers_per_step"
            )
        self._layers = layers
        self.settings = dataclasses.replace(self.settings, max_d_head=max_d)
        if isinstance(self.schedule, AutoSchedule):
            self.schedule.layers, self.schedule.max_d_head = layers, max_d
            self.schedule.start_sizes = pl_module.model.head_sizes()
        end = trainer.max_epochs if self.schedule.unit == "epoch" else trainer.max_steps
        for point in self.schedule.points:
            if end is not None and end >= 0 and point.at >= end:
                warnings.warn(f"grow_at_{point.unit}s has {point.name} but max_{point.unit}s={end}: it will never happen")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = trainer.num_training_batches
        if n == float("inf"):
            raise ValueError("GrowAttentionCallback needs epochs of known length (a sized train dataloader)")
        if self.schedule.unit == "epoch" and self.stats_batches > n:
            raise ValueError(f"stats_batches={self.stats_batches} is more than an epoch ({n} batches); lower it")
        if isinstance(self.schedule, AutoSchedule):
            self.schedule.end = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
            if self.schedule.check_every * trainer.accumulate_grad_batches < self.stats_batches:
                raise ValueError(
                    f"check_every={self.schedule.check_every} optimizer steps hold fewer than stats_batches="
                    f"{self.stats_batches} micro-batches (accumulate_grad_batches={trainer.accumulate_grad_batches}): "
                    "raise check_every or lower stats_batches"
                )
        if self.schedule.unit == "step":
            warn_past_the_end(self.schedule.points, trainer.max_steps, trainer.estimated_stepping_batches)
            steps = [0] + [p.at for p in self.schedule.points]
            if short := [b for a, b in zip(steps, steps[1:]) if (b - a) * trainer.accumulate_grad_batches < self.stats_batches]:
                raise ValueError(
                    f"grow_at_steps {short} leave less than stats_batches={self.stats_batches} micro-batches after the "
                    f"previous growth (or the start) with accumulate_grad_batches={trainer.accumulate_grad_batches}: "
                    "space the steps further apart or lower stats_batches"
                )
        report.add_layout(trainer, len(pl_module.model.qk_forms()))
        if trainer.logger is not None:
            trainer.logger.log_metrics(report.head_size_metrics(pl_module.model.head_sizes()), step=trainer.global_step)

    # -- statistics window and growth, decided from the trainer's counters ---------------------------
    def _forms(self, pl_module: L.LightningModule) -> NamedForms:
        """(layer, parameter-name prefix, form) of every form that grows; GrowAttentionLM keeps its GPT at `.model`."""
        return [(i, f"model.{name}", f) for i, name, f in pl_module.model.named_qk_forms() if i in self._layers]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        clock = Clock(trainer.current_epoch, batch_idx, trainer.global_step, trainer.num_training_batches,
                      trainer.accumulate_grad_batches)
        point = self.schedule.pending(self.history)
        if point is not None and point.reached(clock):
            self._grow(trainer, pl_module, point, batch_idx)
            point = self.schedule.pending(self.history)
        left = None if point is None else Schedule.batches_before(point, clock, self.stats_batches)
        if not left:
            return
        forms = self._forms(pl_module)
        active = layers_in_turn(self._layers, self._per_step, self.stats_batches - left)
        mode = capture_mode(self.capture, batch[0].device)
        self.window.begin_step(point.name, forms, active, mode, keep=batch if left <= self.line_search_batches else None)
        self._capturing, self._closes_window = True, left == 1

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._capturing:
            # Lightning already divided the loss by accumulate_grad_batches; a 16-mixed GradScaler has not been undone.
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            fold_captured(self._forms(pl_module), self.window.stats, 1.0 / trainer.accumulate_grad_batches,
                          None if scaler is None else scaler.get_scale(), self.window.half)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._capturing:
            self.window.end_step(self._forms(pl_module))
            if self._closes_window:
                self.window.close(trainer.strategy, trainer.world_size, pl_module.device)
            self._capturing = False
        if should_update_logs(trainer):
            for key, value in report.head_size_metrics(pl_module.model.head_sizes()).items():
                pl_module.log(key, value, on_step=True, on_epoch=False)

    def _grow(self, trainer: L.Trainer, pl_module: L.LightningModule, point: GrowthPoint, batch_idx: int) -> None:
        forms = self._forms(pl_module)
        where = {"event": point.name, "step": trainer.global_step, "epoch": trainer.current_epoch, "batch": batch_idx,
                 "d_head_before": pl_module.model.head_sizes()}
        window = self.window
        if window.event != point.name or window.stats is None:
            return self._skip(trainer, pl_module, where, "no statistics were gathered for it")
        if not window.reduced:
            window.close(trainer.strategy, trainer.world_size, pl_module.device)  # a window cut short
        window.to(pl_module.device)
        # Under a 16-mixed GradScaler overflowed steps are dropped: a short window (or a layer's few round-robin
        # turns) can end with nothing. Layers without statistics keep their size; the others still grow.
        halves = window.half or [None] * len(forms)
        kept = [(f, st, h) for f, st, h in zip(forms, window.stats, halves) if st.instances > 0]
        if not kept:
            return self._skip(trainer, pl_module, where, "no finite statistics were captured in its window")
        if empty := sorted({f[0] for f in forms} - {f[0] for f, _, _ in kept}):
            warnings.warn(f"growth at {point.name}: layers {empty} have no finite statistics (every step that "
                          "captured them overflowed); they keep their size, the other layers grow")
        forms = [f for f, _, _ in kept]
        batches = window.kept[self._rank :: self._world]
        event = GrowthEvent(
            self.settings,
            loss_of=lambda candidates: kept_batch_losses(trainer, pl_module, forms, batches, candidates),
            install=lambda grown: install_growth(trainer, pl_module, forms, grown, self.settings.new_second_moment),
            broadcast=lambda obj: trainer.strategy.broadcast(obj, src=0),
        )
        try:
            record, spectra = event.run(forms, [st for _, st, _ in kept], seed=point.at,
                                        half=None if window.half is None else [h for _, _, h in kept])
        except growth.NonFiniteStatistics as err:
            return self._skip(trainer, pl_module, where, str(err))
        pl_module.record_head_sizes()
        self._finish(trainer, {**where, "skipped": False, "d_head": pl_module.model.head_sizes(), **record}, spectra)

    def _skip(self, trainer, pl_module, where: dict, reason: str) -> None:
        warnings.warn(f"growth at {where['event']} skipped: {reason}; training continues with the current sizes")
        self._finish(trainer, {**where, "skipped": True, "reason": reason, "d_head": pl_module.model.head_sizes()})

    def _finish(self, trainer: L.Trainer, event: dict, spectra: dict | None = None) -> None:
        self.history.append(event)
        self.window.clear()
        report.log_event(trainer, event, {name: layer for layer, name, _ in self._forms(trainer.lightning_module)}, spectra)
        report.say(trainer, report.event_line(event))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.history:
            report.say(trainer, report.summary_table(self.history))

    # -- checkpoint state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"history": self.history, "window": self.window.state_dict(self._strategy, self._world),
                "schedule": self._schedule_kind}

    def load_state_dict(self, state_dict: dict) -> None:
        check_same_schedule(state_dict, self._schedule_kind)
        self.history = list(state_dict["history"])
        self.window.load_state_dict(state_dict["window"], self._rank, self._world)

