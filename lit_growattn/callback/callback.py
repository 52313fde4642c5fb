"""GrowAttentionCallback: grows the query/key head size of attention, its value head size, or both (`growth.grow`), at
scheduled epochs or optimizer steps, or by itself (AutoSchedule) while the statistics say that width pays.

Thin Lightning glue over the rest of `lit_growattn.callback` (docs/design.md, "Lightning mechanics"):
- schedule: at every training-batch start the trainer's counters say whether a growth happens now, or
  whether this micro-batch is one of the `statistics.batches` before the next growth (a statistics step);
- window: on a statistics step the forms capture (X′, G X′) and the value maps (A·X′, ∂L/∂Y) during the real
  training step, `on_after_backward` folds them into sums, and the window's last batch all-reduces them once;
- event: plan, step size, broadcast of rank 0's tensors, install;
- rebuild: DDP re-wrapped, averaged copies of Lightning's weight-averaging callbacks grown alike, optimizer and
  scheduler rebuilt with their state carried over (other callbacks that hold parameters or schedulers are
  refused at setup: `averaging.check_callbacks`; the other setup checks: `checks`).
The history and the pending window are in `state_dict`, so a run resumed from a checkpoint taken at any step
grows exactly once per event, from the statistics the uninterrupted run used (inside a window, only with the
settings the window began with: `check_resumed`).
"""

from __future__ import annotations

import dataclasses
import warnings

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_growattn import growth
from lit_growattn.callback import report
from lit_growattn.callback.averaging import check_callbacks, resize_averaged_to
from lit_growattn.callback.checks import (available_sketch, check_layers_per_event, check_model_parallel,
                                          check_sketch, check_strategy, growing_layers, layers_per_step,
                                          resolve_sketch, sketch_ridge, width_limits)
from lit_growattn.callback.event import GrowthEvent
from lit_growattn.callback.memory import check_statistics_memory, layers_of_event
from lit_growattn.callback.schedule import Clock, GrowthPoint, GrowthSchedule, check_same_schedule
from lit_growattn.callback.trainer_ops import WindowCollectives, install_growth, kept_batch_losses, loss_terms
from lit_growattn.callback.settings import GrowthSettings, StatisticsSettings, StepSearch
from lit_growattn.callback.window import NamedForms, StatsWindow, capture_mode, fold_captured, layers_in_turn
from lit_growattn.growth.grouped import check_modes
from lit_growattn.contract import NamedForm, check_module, check_value_module, growable_units
from lit_growattn.training.fsdp2 import GatheredBlocks, check_sharded_by_blocks
from lit_growattn.training.lightning_private import should_update_logs


class GrowAttentionCallback(Callback):
    """Grows the query/key and/or value head size of a `lit_growattn.contract.GrowableModule` (GrowAttentionLM
    and HFCausalLM are).

    Args:
        schedule: when to grow: `AtEpochs(epochs)`, `AtSteps(steps)` or `AutoSchedule(...)` (in a config:
            `class_path: lit_growattn.AtEpochs` with `init_args: {epochs: [2, 4]}`).
        growth: how each event grows (`GrowthSettings`: columns, method, mode, …).
        statistics: the statistics window before each event (`StatisticsSettings`: batches, layers_per_step, capture,
            layers_per_event, max_memory_gb, sketch, sketch_size).
        step_search: how each event chooses its step size (`StepSearch`: alphas, batches, line_search, rule).
    """

    def __init__(
        self,
        schedule: GrowthSchedule,
        growth: GrowthSettings = GrowthSettings(),
        statistics: StatisticsSettings = StatisticsSettings(),
        step_search: StepSearch = StepSearch(),
    ):
        super().__init__()
        if not isinstance(schedule, GrowthSchedule):
            raise TypeError(f"schedule must be AtEpochs([...]), AtSteps([...]) or AutoSchedule(...) from lit_growattn, "
                            f"got {schedule!r}")
        growth.check_schedule(schedule.kind, type(schedule).__name__)
        step_search.check_method(growth)
        check_sketch(statistics, growth, step_search, schedule.kind)
        self.schedule, self.settings, self.statistics, self.search = schedule, growth, statistics, step_search
        self._ridge_given = growth.ridge  # setup resolves the ridge per run: a later setup starts from the user's
        self.line_search_batches = step_search.kept_batches(statistics)
        self.history: list[dict] = []  # one record per event, skipped ones included; survives checkpoints
        # The automatic schedule decides from two halves of each window (growth/allocation.py).
        self.window = StatsWindow(growth.method, halves=schedule.splits_window)
        self._capturing = self._closes_window = False
        self._collectives, self._rank, self._world = None, 0, 1
        self._fitting = True  # set by `setup`; validate and test ignore the checkpoint's growth state
        self._caps_given: set[str] = set()

    # -- checks before any work is done --------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._collectives = WindowCollectives(trainer.strategy)
        self._rank, self._world = trainer.global_rank, trainer.world_size
        self._fitting = stage == "fit"
        if stage != "fit":
            return
        check_strategy(trainer.strategy)
        named = check_module(pl_module)
        check_model_parallel(trainer, pl_module)
        values = check_value_module(pl_module) if self.settings.grows("value") else []
        layers, firsts = growing_layers(self.settings, pl_module, named, values)
        limits = width_limits(self.settings, firsts, layers)
        check_layers_per_event(self.statistics, layers)
        check_callbacks(trainer, self, named + values)
        self._per_step = layers_per_step(self.statistics, layers, self.window.halves)
        self._layers = layers
        growing = (named if self.settings.grows("query_key") else []) + values
        if self.settings.grows("query_key"):
            check_modes(named, self.settings.mode, self.search.line_search)
        self._resolve_sketch(trainer, growing, layers)
        offer = None if self.window.sketch is not None else available_sketch(
            self.statistics, self.settings, self.search, self.schedule.kind, [u for u in growing if u.layer in layers])
        report.say(trainer, check_statistics_memory(growing, layers, self.statistics.layers_per_event,
                                                    self.settings.method, self.statistics.max_memory_gb,
                                                    self.window.halves, self.window.sketch, offer))
        self._caps_given = {key for key in limits if getattr(self.settings, key) is not None}  # for the console
        self.settings = dataclasses.replace(self.settings, **limits)
        self.schedule.bind(self.settings, self.statistics, layers, self._sizes(pl_module),
                           growth.column_costs((f.layer, f.form) for f in growing))

    def _resolve_sketch(self, trainer: L.Trainer, growing: NamedForms, layers: list[int]) -> None:
        """Whether the window sketches the statistics (`checks.resolve_sketch`), and natural's ridge under it."""
        sketch, reason = resolve_sketch(self.statistics, self.settings, self.search, self.schedule.kind, growing,
                                        layers, self.window.halves, trainer.strategy.root_device)
        self.window.sketch = sketch
        ridge = sketch_ridge(dataclasses.replace(self.settings, ridge=self._ridge_given), sketch)
        if self.statistics.sketch != "off":
            report.say(trainer, report.sketch_line(sketch, reason, ridge if ridge != self._ridge_given else None))
        self.settings = dataclasses.replace(self.settings, ridge=ridge)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, ModelParallelStrategy):  # configure_model has run: its sharding is known
            check_sharded_by_blocks(pl_module)
        # The optimizers exist from here on: a growth rebuilds exactly one, so refuse others before any step.
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"GrowAttentionCallback rebuilds the one optimizer of configure_optimizers after each growth, but "
                f"{type(pl_module).__name__} configures {len(trainer.optimizers)}: return a single optimizer (with "
                "parameter groups if the parameters need different settings)"
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.num_training_batches == float("inf"):
            raise ValueError("GrowAttentionCallback needs epochs of known length (a sized train dataloader)")
        self.schedule.check_run(trainer, self.statistics.batches)
        self.window.check_resumed(self._window_settings(trainer))
        report.add_layout(trainer, len(pl_module.head_sizes()))
        if trainer.logger is not None:
            trainer.logger.log_metrics(self._size_metrics(pl_module), step=trainer.global_step)

    # -- statistics window and growth, decided from the trainer's counters ---------------------------
    def _window_settings(self, trainer: L.Trainer) -> dict:
        """What decides the contents of a statistics window: which micro-batches it spans, which units (the caps
        leave capped ones out) and layers each captures, their weights in the sums, and which batches are kept to
        rate the step sizes."""
        return {"accumulate_grad_batches": trainer.accumulate_grad_batches, "statistics.batches": self.statistics.batches,
                "statistics.layers_per_step": self.statistics.layers_per_step,
                "step_search.batches": self.line_search_batches, "growth.max_d_head": self.settings.max_d_head,
                "growth.max_d_v": self.settings.max_d_v,
                # As resolved: an auto run resumed as on (or off) with the same size gathers the same sums.
                "statistics.sketch": "off" if self.window.sketch is None else "on",
                "statistics.sketch_size": None if self.window.sketch is None else self.window.sketch.k}

    def _units(self, pl_module: L.LightningModule) -> NamedForms:
        """The query/key forms and value maps of the next event's layers (layer, qualified parameter-name prefix,
        form or map), as `growth.grow` chooses."""
        layers = layers_of_event(self._layers, self.statistics.layers_per_event, len(self.history))
        units = ((pl_module.growable_forms() if self.settings.grows("query_key") else [])
                 + (pl_module.growable_values() if self.settings.grows("value") else []))
        return [named for named in units if named.layer in layers]

    def _capped(self, named) -> bool:
        """Whether a unit has no room left under growth.max_d_head / max_d_v (or its rank bound)."""
        form = named.form
        return form.width >= min(self.settings.max_width(form.side), form.max_width)

    def _forms(self, pl_module: L.LightningModule) -> NamedForms:
        """The units that grow at the next event: those with room left. A capped one gathers no statistics."""
        return [named for named in self._units(pl_module) if not self._capped(named)]

    def _capped_text(self, pl_module: L.LightningModule) -> str:
        """e.g. `d_v at growth.max_d_v=11 in layers [0, 1]`: the next event's capped sides ("": none)."""
        capped: dict[str, set[int]] = {}
        for named in filter(self._capped, self._units(pl_module)):
            capped.setdefault(named.form.side, set()).add(named.layer)

        def cap(side: str) -> str:
            size = self.settings.max_width(side)
            return f"growth.max_{side}={size}" if f"max_{side}" in self._caps_given else f"its largest possible size {size}"

        return ", ".join(f"{side} at {cap(side)} in layers {sorted(layers)}" for side, layers in capped.items())

    def _sizes(self, pl_module: L.LightningModule) -> dict[str, list[int]]:
        """The head sizes an event record keeps: d_head, and d_v when the value side grows."""
        return {"d_head": pl_module.head_sizes(),
                **({"d_v": pl_module.value_sizes()} if self.settings.grows("value") else {})}

    def _size_metrics(self, pl_module: L.LightningModule) -> dict[str, float]:
        sizes = self._sizes(pl_module)
        return report.head_size_metrics(sizes["d_head"], sizes.get("d_v"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        clock = Clock(trainer.current_epoch, batch_idx, trainer.global_step, trainer.num_training_batches,
                      trainer.accumulate_grad_batches)
        point = self.schedule.pending(self.history)
        if point is not None and point.reached(clock):
            self._grow(trainer, pl_module, point, batch_idx)
            point = self.schedule.pending(self.history)
        batches = self.statistics.batches
        left = None if point is None else GrowthSchedule.batches_before(point, clock, batches)
        if not left:
            return
        forms = self._forms(pl_module)
        if not forms:  # every unit of the event is capped: the event is skipped, with nothing to gather
            return
        active = layers_in_turn(sorted({f.layer for f in forms}), self._per_step, batches - left)
        mode = capture_mode(self.statistics.capture, pl_module.device)
        self.window.begin_step(point.name, forms, active, mode, self._window_settings(trainer),
                               keep=batch if left <= self.line_search_batches else None)
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
                self.window.close(self._collectives, trainer.world_size, pl_module.device)
            self._capturing = False
        if should_update_logs(trainer):
            for key, value in self._size_metrics(pl_module).items():
                pl_module.log(key, value, on_step=True, on_epoch=False)

    def _grow(self, trainer: L.Trainer, pl_module: L.LightningModule, point: GrowthPoint, batch_idx: int) -> None:
        forms = self._forms(pl_module)
        capped = self._capped_text(pl_module)
        where = {"event": point.name, "step": trainer.global_step, "epoch": trainer.current_epoch, "batch": batch_idx,
                 **{f"{key}_before": sizes for key, sizes in self._sizes(pl_module).items()},
                 **({"capped": capped} if capped else {}), **report.sketch_record(self.window.sketch)}
        if not forms:
            return self._skip(trainer, pl_module, where, f"nothing has room left to grow ({capped})")
        window = self.window
        if window.event != point.name or window.stats is None:
            return self._skip(trainer, pl_module, where, "no statistics were gathered for it (as when a run resumes "
                              "from a checkpoint written before its statistics window and Lightning goes on with the "
                              "next epoch)")
        if not window.reduced:
            window.close(self._collectives, trainer.world_size, pl_module.device)
            unrated = "" if window.kept else (
                "; none of its batches kept for the step-size search were seen, so the new columns go in at α = 0 "
                "(the function unchanged)")
            warnings.warn(f"growth at {point.name}: its statistics window was cut short (as when a run resumes from a "
                          "checkpoint written inside it and Lightning goes on with the next epoch); it grows from "
                          f"the statistics gathered before the cut{unrated}")
        window.to(pl_module.device)
        # Under a 16-mixed GradScaler overflowed steps are dropped: a short window (or a layer's few round-robin
        # turns) can end with nothing. Layers without statistics keep their size; the others still grow.
        halves = window.half or [None] * len(forms)
        kept = [(f, st, h) for f, st, h in zip(forms, window.stats, halves, strict=True) if st.instances > 0]
        if not kept:
            return self._skip(trainer, pl_module, where, "no finite statistics were captured in its window")
        if empty := sorted({f[0] for f in forms} - {f[0] for f, _, _ in kept}):
            warnings.warn(f"growth at {point.name}: layers {empty} have no finite statistics (every step that "
                          "captured them overflowed); they keep their size, the other layers grow")
        forms = [f for f, _, _ in kept]
        # Under FSDP2 the event plans, rates and grows plain copies of its blocks (elsewhere the forms themselves).
        with GatheredBlocks(pl_module, sorted({f.layer for f in forms})) as gathered:
            forms = [NamedForm(f.layer, f.name, pl_module.get_submodule(f.name)) for f in forms]
            event = GrowthEvent(
                self.settings,
                self.search,
                loss_of=lambda candidates: kept_batch_losses(trainer, pl_module, forms, window.kept, candidates),
                install=lambda grown: install_growth(trainer, pl_module, forms, grown, self.settings.new_second_moment,
                                                     gathered),
                broadcast=lambda obj: trainer.strategy.broadcast(obj, src=0),
                allowance=self.schedule.allowance(self.history),
                fill_to=self.schedule.fill_to(self.history),
                terms=loss_terms(window.kept),  # every rank's kept batches
            )
            try:
                record, spectra = event.run(forms, [st for _, st, _ in kept], seed=point.at,
                                            half=None if window.half is None else [h for _, _, h in kept])
            except growth.NonFiniteStatistics as err:
                return self._skip(trainer, pl_module, where, str(err))
        pl_module.record_head_sizes()
        self._finish(trainer, {**where, "skipped": False, **self._sizes(pl_module), **record}, spectra)

    def _skip(self, trainer, pl_module, where: dict, reason: str) -> None:
        warnings.warn(f"growth at {where['event']} skipped: {reason}; training continues with the current sizes")
        self._finish(trainer, {**where, "skipped": True, "reason": reason, **self._sizes(pl_module)})

    def _finish(self, trainer: L.Trainer, event: dict, spectra: dict | None = None) -> None:
        self.history.append(event)
        self.window.clear()
        layer_of = {f.name: (f.layer, f.form.side) for f in growable_units(trainer.lightning_module)}
        report.log_event(trainer, event, layer_of, spectra)
        report.say(trainer, report.event_line(event))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.history:
            report.say(trainer, report.summary_table(self.history))
        if (line := self.schedule.summary(self.history)) is not None:
            report.say(trainer, line)

    # -- checkpoint state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"history": self.history, "window": self.window.state_dict(self._collectives, self._world),
                "schedule": self.schedule.kind, "grow": self.settings.grow}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # The averaged copies of weight-averaging callbacks were made from the model as built, before it took the
        # checkpoint's head sizes; they load their averages after this (check_callbacks keeps that order). Under
        # ModelParallelStrategy the checkpoint has no "state_dict" here (its strategy loaded the weights already,
        # from a folder or a file), nor do averaged copies exist there.
        if "state_dict" in checkpoint:
            resize_averaged_to(trainer, checkpoint["state_dict"])

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._fitting:  # validate/test evaluate the checkpoint's weights: its growth state plays no part
            return
        check_same_schedule(state_dict, self.schedule.kind)
        # Another side would not match the window's sums, and AutoSchedule's budget counts the sides it grew.
        if state_dict.get("grow", self.settings.grow) != self.settings.grow:  # absent: written before value growth
            raise ValueError(f"the checkpoint was written by a run with growth.grow={state_dict['grow']!r}, this one "
                             f"has {self.settings.grow!r}: resume with growth.grow={state_dict['grow']}, or start a new "
                             "run from its weights with --model.init_args.init_from=CHECKPOINT")
        self.history = list(state_dict["history"])
        self.window.load_state_dict(state_dict["window"], self._rank, self._world)

