"""GrowAttentionCallback: grows the query/key head size of attention at scheduled epochs.

Timeline of a growth at epoch E (0-based, as `trainer.current_epoch`):
- the last `stats_batches` micro-batches of epoch E-1 are statistics steps: the attention forms capture
  (X′, G X′) during the real training step and `on_after_backward` folds them into per-form sums;
- at the start of epoch E (a clean point: no accumulation window is open) the sums are all-reduced once,
  every rank solves the same growth, a step size is chosen by forward-only evaluations on batches kept
  from the window, rank 0's tensors are broadcast, DDP is re-wrapped and the optimizer and scheduler are
  rebuilt with their state carried over.
The pending sums and the growth history live in `state_dict`, so a run resumed from a checkpoint taken
between the window and the growth point grows from the same statistics, and never grows twice.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import Tensor

from lit_growattn import growth
from lit_growattn.analysis import spectrum_figure
from lit_growattn.attention import QKForm
from lit_growattn.optim_state import carry_state, snapshot_state

Method = Literal["pinv", "gradient", "natural", "random", "zero"]


class GrowAttentionCallback(Callback):
    """Args:
        grow_at_epochs: epochs (0-based) at whose start d_head grows; 0 is refused (no statistics yet).
        grow_by: new columns per head at each event: one int, or one per layer (default 1; with
            `dynamic_rank`, a cap on the chosen growth, default none).
        dynamic_rank: if set, choose the growth per layer from the bottleneck spectrum instead: the number of
            singular values above `dynamic_rank` × the largest (at least 1).
        max_d_head: largest head size a layer may reach (default and maximum: the form's input size).
        method: growth direction: pinv | gradient | natural | random | zero.
        mode: replace (refactor all columns) | append (keep old columns, add new ones).
        temperature: keep (τ′ = τ) | rescale (τ′ = τ·√(d_old/d_new)).
        truncation: euclidean | whitened (rank measured on the scores).
        stats_batches: micro-batches of statistics at the end of the epoch before each growth.
        alphas: step-size candidates (0 keeps the function); default 0, 1, 1/2, …, 1/256.
        line_search: low_rank (loss after truncation) | full_rank (seed 002's λ_FR, gradient method).
        step_size: grid (the best of `alphas`) | quadratic (also tries the minimiser of a quadratic fitted to
            the first-order prediction and the losses at `alphas`; low_rank line search only).
        line_search_batches: batches kept from the window for the step-size evaluations (default min(2, stats_batches)).
        layers: layers to grow (default all).
        layers_per_step: statistics of only this many of those layers per statistics step, taken in turn
            (round-robin; DESIGN §4), to make statistics steps cheaper on deep models (default: all every step).
        capture: how statistics steps get G·X′: extend (SDPA zero-extension) | explicit (score map) | auto.
        new_second_moment: Adam second moments of new columns: mean (of the old ones) | zero.
    """

    def __init__(
        self,
        grow_at_epochs: list[int],
        grow_by: int | list[int] | None = None,
        dynamic_rank: float | None = None,
        max_d_head: int | None = None,
        method: Method = "natural",
        mode: Literal["replace", "append"] = "append",
        temperature: Literal["keep", "rescale"] = "keep",
        truncation: Literal["euclidean", "whitened"] = "euclidean",
        stats_batches: int = 8,
        alphas: list[float] | None = None,
        line_search: Literal["low_rank", "full_rank"] = "low_rank",
        step_size: Literal["grid", "quadratic"] = "grid",
        line_search_batches: int | None = None,
        layers: list[int] | None = None,
        layers_per_step: int | None = None,
        capture: Literal["auto", "extend", "explicit"] = "auto",
        new_second_moment: Literal["mean", "zero"] = "mean",
    ):
        super().__init__()
        if len(set(grow_at_epochs)) != len(grow_at_epochs):
            raise ValueError(f"grow_at_epochs {grow_at_epochs} repeats an epoch; list each growth epoch once")
        if any(e <= 0 for e in grow_at_epochs):
            raise ValueError(
                f"grow_at_epochs {grow_at_epochs}: growth at epoch 0 (or earlier) has no statistics; epochs are 0-based, "
                "so the first possible growth is at epoch 1"
            )
        if grow_by is None and dynamic_rank is None:
            grow_by = 1
        per_layer = grow_by if isinstance(grow_by, list) else [grow_by]
        if any(p is not None and p <= 0 for p in per_layer):
            raise ValueError(f"grow_by must be positive, got {grow_by}")
        if dynamic_rank is not None and not 0.0 < dynamic_rank < 1.0:
            raise ValueError(f"dynamic_rank is a fraction of the largest singular value in (0, 1), got {dynamic_rank}")
        for name, value, allowed in [
            ("method", method, tuple(growth.METHODS)),
            ("mode", mode, growth.MODES),
            ("temperature", temperature, growth.TEMPERATURES),
            ("truncation", truncation, growth.TRUNCATIONS),
            ("line_search", line_search, growth.LINE_SEARCHES),
            ("step_size", step_size, growth.STEP_RULES),
            ("capture", capture, ("auto", "extend", "explicit")),
            ("new_second_moment", new_second_moment, ("mean", "zero")),
        ]:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if method in ("random", "zero") and mode != "append":
            raise ValueError(f"method {method!r} adds random columns and needs mode='append', got mode={mode!r}")
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
        self.alphas = sorted(set(alphas if alphas is not None else growth.candidate_steps()))
        if not self.alphas or any(a < 0 for a in self.alphas):
            raise ValueError(f"step-size candidates must be a non-empty list of values ≥ 0, got {alphas}")
        if step_size == "quadratic" and (line_search != "low_rank" or max(self.alphas) <= 0):
            raise ValueError(
                f"step_size='quadratic' fits the losses of the grown forms at the positive alphas: it needs "
                f"line_search='low_rank' and a positive step size in alphas, got {line_search!r} and {self.alphas}"
            )
        if 0.0 not in self.alphas:
            warnings.warn(f"alphas {self.alphas} has no 0: a growth may then raise the loss (0 keeps the function)")
        self.grow_at_epochs = sorted(grow_at_epochs)
        self.grow_by, self.dynamic_rank, self.max_d_head = grow_by, dynamic_rank, max_d_head
        self.method, self.mode, self.temperature, self.truncation = method, mode, temperature, truncation
        self.stats_batches, self.line_search, self.line_search_batches = stats_batches, line_search, line_search_batches
        self.step_size = step_size
        self.layers, self.layers_per_step = layers, layers_per_step
        self.capture, self.new_second_moment = capture, new_second_moment
        # State that survives checkpoints.
        self.history: list[dict] = []
        self._stats: list[growth.FormStats] | None = None
        self._eval_batches: list[tuple[Tensor, Tensor]] = []
        self._reduced = False  # pending sums already summed over ranks (the window has closed)
        self._capturing = False
        self._strategy, self._rank, self._world = None, 0, 1

    # -- validation at setup ---------------------------------------------------------------------
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
            name = pl_module.model.cfg.attention
            raise ValueError(f"attention {name!r} has no growable query/key pair in layers {not_growable}")
        if isinstance(self.grow_by, list) and len(self.grow_by) != n_layer:
            raise ValueError(f"grow_by has {len(self.grow_by)} entries but the model has {n_layer} layers")
        e_in = forms[layers[0]][0].w_q.shape[1]
        current = max(forms[i][0].d_head for i in layers)
        max_d = self.max_d_head if self.max_d_head is not None else e_in
        if not current <= max_d <= e_in:
            raise ValueError(
                f"max_d_head={max_d} must lie between the current head size ({current}) and the form's input size "
                f"({e_in}: the bilinear form has rank ≤ {e_in})"
            )
        per_step = min(self.layers_per_step or len(layers), len(layers))
        turns = math.ceil(len(layers) / per_step)
        if self.stats_batches < turns:
            raise ValueError(
                f"stats_batches={self.stats_batches} with layers_per_step={self.layers_per_step} leaves layers without "
                f"statistics: {len(layers)} growing layers need at least {turns} statistics batches; raise "
                "stats_batches or layers_per_step"
            )
        self._layers, self._per_step, self._max_d = layers, per_step, max_d
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            for epoch in self.grow_at_epochs:
                if epoch >= trainer.max_epochs:
                    warnings.warn(f"grow_at_epochs has epoch {epoch} but max_epochs={trainer.max_epochs}: it will never happen")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = trainer.num_training_batches
        if n == float("inf"):
            raise ValueError("GrowAttentionCallback needs epochs of known length (a sized train dataloader)")
        if self.stats_batches > n:
            raise ValueError(f"stats_batches={self.stats_batches} is more than an epoch ({n} batches); lower it")
        if trainer.is_global_zero and isinstance(trainer.logger, TensorBoardLogger):
            trainer.logger.experiment.add_custom_scalars(self._layout(len(pl_module.model.qk_forms())))
        self._log_head_sizes(trainer, pl_module)

    # -- statistics steps ------------------------------------------------------------------------
    def _forms(self, pl_module: L.LightningModule) -> list[tuple[str, QKForm]]:
        """(name, form) of every form that grows, in a fixed order shared by all ranks."""
        chosen = {id(f) for i in self._layers for f in pl_module.model.qk_forms()[i]}
        return [(name, m) for name, m in pl_module.named_modules() if id(m) in chosen]

    def _window_step(self, trainer: L.Trainer, batch_idx: int) -> int:
        """Position of this batch in the statistics window at the end of the epoch (negative: before it)."""
        return batch_idx - (trainer.num_training_batches - self.stats_batches)

    def _in_window(self, trainer: L.Trainer, batch_idx: int) -> bool:
        next_epoch = trainer.current_epoch + 1
        pending = next_epoch in self.grow_at_epochs and next_epoch not in self._done_epochs()
        return pending and self._window_step(trainer, batch_idx) >= 0

    def _done_epochs(self) -> set[int]:
        return {event["epoch"] for event in self.history}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if not self._in_window(trainer, batch_idx):
            return
        forms = self._forms(pl_module)
        if self._stats is None:
            # float64 sums when the model itself runs in float64 (precision="64-true").
            dtype = torch.float64 if forms[0][1].w_q.dtype == torch.float64 else torch.float32
            self._stats = [growth.FormStats.empty_like(form, self.method, dtype=dtype) for _, form in forms]
        mode = self._capture_mode(batch[0], forms[0][1])
        active = self._layers_in_turn(self._window_step(trainer, batch_idx))
        for name, form in forms:
            form.capture = mode if _layer_of(name) in active else None
        self._capturing = True
        if batch_idx >= trainer.num_training_batches - self.line_search_batches:
            self._eval_batches.append(tuple(t.detach().clone() for t in batch))

    def _layers_in_turn(self, window_step: int) -> set[int]:
        """The layers captured at this step of the window: all of them, or the next `layers_per_step` in turn."""
        n = len(self._layers)
        return {self._layers[(window_step * self._per_step + j) % n] for j in range(self._per_step)}

    def _capture_mode(self, inputs: Tensor, form: QKForm) -> str:
        if self.capture != "auto":
            return self.capture
        # Measured (scripts/bench.py, README): on CPU the explicit map is faster and smaller at every length tried
        # (s 32 to 2048), because CPU SDPA builds the full map for the widened queries anyway. On GPU the explicit
        # map would lose flash attention, and the extension's memory grows with s·e′ instead of s².
        return "explicit" if inputs.device.type == "cpu" else "extend"

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._capturing:
            return
        # Lightning already divided the loss by accumulate_grad_batches; a 16-mixed GradScaler has not been undone.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        weight = 1.0 / trainer.accumulate_grad_batches
        for stats, (_, form) in zip(self._stats, self._forms(pl_module)):
            for xa, gx in form.take_captured():
                try:
                    stats.update(xa, gx / scaler.get_scale() if scaler is not None else gx, weight)
                except growth.NonFiniteStatistics:
                    if scaler is None:
                        # Poison the sums rather than raise: after the all-reduce every rank sees the NaN and
                        # skips this growth together, and training goes on.
                        stats.weight.fill_(float("nan"))
                    # With a GradScaler an overflow is routine (the scaler skips that optimizer step): drop the pair.

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self._capturing:
            return
        for _, form in self._forms(pl_module):
            form.capture = None
            form.take_captured()  # drops anything a skipped backward left behind
        self._capturing = False
        if batch_idx == trainer.num_training_batches - 1:
            self._close_window(trainer)

    def _close_window(self, trainer: L.Trainer) -> None:
        """Sums the statistics over ranks (the one collective of the window) and gathers the kept batches, as
        soon as the window ends: every rank then holds the same state, which a checkpoint taken before the
        growth saves whole. Each rank still evaluates its own batches, `_eval_batches[rank::world]`."""
        strategy = trainer.strategy
        self._stats = growth.unflatten_stats(strategy.reduce(growth.flatten_stats(self._stats), reduce_op="sum"), self._stats)
        self._eval_batches = _gather_batches(strategy, self._eval_batches, trainer.world_size)
        self._reduced = True

    # -- growth event ----------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch in self.grow_at_epochs and epoch not in self._done_epochs():
            self._grow(trainer, pl_module, epoch)

    def _skip(self, trainer: L.Trainer, epoch: int, reason: str) -> None:
        warnings.warn(f"growth at epoch {epoch} skipped: {reason}; training continues with the current sizes")
        self._finish(trainer, {"epoch": epoch, "skipped": True})

    def _grow(self, trainer: L.Trainer, pl_module: L.LightningModule, epoch: int) -> None:
        start = time.perf_counter()
        forms = self._forms(pl_module)
        if self._stats is None:
            # Only possible when resuming from a checkpoint that predates the callback's state.
            return self._skip(trainer, epoch, "no statistics were gathered before this epoch")
        if not self._reduced:
            self._close_window(trainer)  # a window cut short (e.g. a shorter resumed epoch)
        device = forms[0][1].w_q.device  # statistics restored from a checkpoint arrive on the CPU
        stats = growth.unflatten_stats(growth.flatten_stats(self._stats).to(device), self._stats)
        # Under a 16-mixed GradScaler overflowed steps are dropped: a short window (or a layer's few round-robin
        # turns) can end with nothing. Layers without statistics keep their size; the others still grow.
        empty = sorted({_layer_of(name) for (name, _), st in zip(forms, stats) if not st.instances > 0})
        if len(empty) == len(self._layers):
            return self._skip(trainer, epoch, "no finite statistics were captured in its window")
        if empty:
            warnings.warn(f"growth at epoch {epoch}: layers {empty} have no finite statistics (every step that "
                          "captured them overflowed); they keep their size, the other layers grow")
            kept = [i for i, (name, _) in enumerate(forms) if _layer_of(name) not in empty]
            forms, stats = [forms[i] for i in kept], [stats[i] for i in kept]
        try:
            plan = self._plan(forms, stats, epoch)
        except growth.NonFiniteStatistics as err:
            return self._skip(trainer, epoch, str(err))
        # α = 0 keeps the function (new pairs with zero fan-in), so its loss is the current one: no forward for it.
        moving = [a for a in self.alphas if a > 0 or self.method == "random"]
        losses = self._losses(trainer, pl_module, forms, [None] + [{n: plan.trial(n, a) for n, _ in forms} for a in moving])
        before, by_alpha = losses[0], dict(zip(moving, losses[1:]))
        alphas, rated = self.alphas, torch.stack([by_alpha.get(a, before) for a in self.alphas])
        if self.step_size == "quadratic" and self.method not in growth.BASELINES:
            alphas, rated = self._with_quadratic_step(trainer, pl_module, forms, plan, before, rated)
        best = growth.choose_step(rated, alphas)
        alpha, after = alphas[best], rated[best]
        if self.line_search == "full_rank":
            # λ_FR rated α before truncation: measure the truncated growth itself, and keep α = 0 if that is better.
            finalists = [0.0, alpha]
            final = self._losses(trainer, pl_module, forms, [{n: plan.grow(n, a) for n, _ in forms} for a in finalists])
            pick = growth.choose_step(final, finalists)
            alpha, after = finalists[pick], final[pick]
        # Rank 0's tensors for every rank, so replicas are bit-identical whatever the SVD did; through the CPU,
        # since a pickled CUDA tensor would land on rank 0's device.
        grown = trainer.strategy.broadcast({name: _to_cpu(plan.grow(name, alpha)) for name, _ in forms}, src=0)
        self._apply(trainer, pl_module, forms, grown)
        event = {
            "epoch": epoch,
            "skipped": False,
            "alpha": alpha,
            "d_head": pl_module.model.head_sizes(),
            "sign_fallbacks": sum(g.fell_back for g in grown.values()),
            "predicted_decrease": float(sum(g.predicted_decrease for g in grown.values())),
            "realised_decrease": float(before - after),
            "discarded_energy": {name: g.discarded_energy.sum().item() for name, g in grown.items()},
            "seconds": time.perf_counter() - start,
        }
        self._finish(trainer, event, spectra={name: g.spectrum for name, g in grown.items()})

    def _plan(self, forms: list[tuple[str, QKForm]], stats: list[growth.FormStats], epoch: int) -> growth.GrowthPlan:
        grow_by = (
            {name: self.grow_by[_layer_of(name)] for name, _ in forms} if isinstance(self.grow_by, list) else self.grow_by
        )
        return growth.GrowthPlan.build(
            dict(forms), stats, method=self.method, grow_by=grow_by, dynamic_rank=self.dynamic_rank,
            max_d_head=self._max_d, group_of=_layer_of, mode=self.mode, temperature=self.temperature,
            truncation=self.truncation, line_search=self.line_search,
            # Random columns of the baselines: the same draw on every rank, and on a resumed run.
            generator=torch.Generator().manual_seed(epoch),
        )

    def _with_quadratic_step(self, trainer, pl_module, forms, plan, before: Tensor, rated: Tensor):
        """The grid's candidates and losses, plus α* = s/2c of the quadratic L(0) − sα + cα² (growth.quadratic_step)
        with its loss: the slope s from the first-order prediction at the smallest positive candidate."""
        probe = min(a for a in self.alphas if a > 0)
        slope = sum(plan.grow(name, probe).predicted_decrease for name, _ in forms) / probe
        star = growth.quadratic_step(slope, self.alphas, (before - rated).tolist(), max_alpha=max(self.alphas))
        if star in self.alphas:
            return self.alphas, rated
        loss = self._losses(trainer, pl_module, forms, [{name: plan.grow(name, star) for name, _ in forms}])
        return [*self.alphas, star], torch.cat([rated, loss])

    def _losses(self, trainer, pl_module, forms, candidates: list[dict | None]) -> Tensor:
        """Loss of each candidate (name → Growth to install; None: the forms as they are), averaged over ranks
        so that every rank makes the same choice."""
        losses = torch.stack([self._loss_with(trainer, pl_module, forms, c) for c in candidates])
        return trainer.strategy.reduce(losses, reduce_op="mean")

    @torch.no_grad()
    def _loss_with(self, trainer, pl_module, forms, grown: dict | None) -> Tensor:
        """Mean loss on the kept batches with `grown` installed, forward only; the forms are restored after."""
        originals = {name: (f.w_q, f.w_k, f.log_tau) for name, f in forms}
        was_training = pl_module.training
        pl_module.eval()
        try:
            for name, form in forms:
                if grown is not None:
                    g = grown[name]
                    form.set_weights(g.w_q, g.w_k, g.log_tau)
            total = torch.zeros((), device=pl_module.device)
            with trainer.precision_plugin.forward_context():
                for inputs, labels in self._eval_batches[self._rank :: self._world]:
                    inputs, labels = inputs.to(pl_module.device), labels.to(pl_module.device)
                    total += pl_module.loss(pl_module(inputs), labels).float()
            return total / len(self._eval_batches[self._rank :: self._world])
        finally:
            for name, form in forms:
                form.w_q, form.w_k, form.log_tau = originals[name]
            pl_module.train(was_training)

    def _apply(self, trainer: L.Trainer, pl_module: L.LightningModule, forms, grown) -> None:
        """Installs the grown tensors, re-wraps DDP and rebuilds optimizer and scheduler with their state."""
        strategy = trainer.strategy
        (old_optimizer,) = trainer.optimizers
        old_schedulers = [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs]
        old_state = snapshot_state(old_optimizer, pl_module)
        if isinstance(strategy, DDPStrategy):
            strategy.model = strategy.lightning_module  # unwrap: DDP cannot follow resized parameters
        carries: dict[str, growth.Carry] = {}
        for name, form in forms:
            g = grown[name]
            form.set_weights(g.w_q, g.w_k, g.log_tau)
            carries.update({f"{name}.{param}": carry for param, carry in g.carries.items()})
        if isinstance(strategy, DDPStrategy):
            strategy.configure_ddp()
        strategy.setup_optimizers(trainer)
        (new_optimizer,) = trainer.optimizers
        for new_group, old_group in zip(new_optimizer.param_groups, old_optimizer.param_groups):
            # lr, and whatever else a scheduler moves (betas, momentum), as they were.
            new_group.update({k: v for k, v in old_group.items() if k != "params"})
        carry_state(old_state, new_optimizer, pl_module, carries, self.new_second_moment)
        for cfg, state in zip(trainer.lr_scheduler_configs, old_schedulers):
            cfg.scheduler.load_state_dict(state)
        pl_module.record_head_sizes()

    # -- logging and state -----------------------------------------------------------------------
    def _finish(self, trainer: L.Trainer, event: dict, spectra: dict | None = None) -> None:
        self.history.append(event)
        self._stats, self._eval_batches, self._reduced = None, [], False
        step = trainer.global_step
        metrics = {"growth/skipped": float(event["skipped"])}
        if not event["skipped"]:
            metrics |= {f"growth/{k}": float(event[k]) for k in
                        ("alpha", "sign_fallbacks", "predicted_decrease", "realised_decrease", "seconds")}
            for i, d in enumerate(event["d_head"]):
                metrics[f"growth/d_head/layer_{i}"] = float(d)
            for name, energy in event["discarded_energy"].items():  # the forms of a layer add up
                key = f"growth/discarded_energy/layer_{_layer_of(name)}"
                metrics[key] = metrics.get(key, 0.0) + energy
        if trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=step)
        if spectra and trainer.is_global_zero and isinstance(trainer.logger, TensorBoardLogger):
            trainer.logger.experiment.add_figure(f"growth/spectrum/epoch_{event['epoch']}", _growth_spectra(spectra), step)

    def _log_head_sizes(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.logger is not None:
            sizes = {f"growth/d_head/layer_{i}": float(d) for i, d in enumerate(pl_module.model.head_sizes())}
            trainer.logger.log_metrics(sizes, step=trainer.global_step)

    @staticmethod
    def _layout(n_layer: int) -> dict:
        per_layer = lambda tag: [f"growth/{tag}/layer_{i}" for i in range(n_layer)]  # noqa: E731
        return {
            "growth": {
                "head size": ["Multiline", per_layer("d_head")],
                "decrease (predicted vs realised)": ["Multiline", ["growth/predicted_decrease", "growth/realised_decrease"]],
                "step size": ["Multiline", ["growth/alpha"]],
                "discarded energy": ["Multiline", per_layer("discarded_energy")],
                "sign fallbacks and skips": ["Multiline", ["growth/sign_fallbacks", "growth/skipped"]],
                "seconds": ["Multiline", ["growth/seconds"]],
            },
            "training": {
                "loss": ["Multiline", ["train/loss", "val/loss"]],
                "temperature": ["Multiline", [f"attention/temperature/layer_{i}" for i in range(n_layer)]],
            },
        }

    def state_dict(self) -> dict:
        stats, batches = self._stats, self._eval_batches
        per_rank = stats is not None and not self._reduced and self._world > 1
        if per_rank:
            # Inside the window every rank holds its own partial sums: keep all of them (this is called on
            # every rank, and only rank 0's copy is written), so each rank resumes with its own.
            stats = self._strategy.all_gather(growth.flatten_stats(stats))
            batches = _gather_batches(self._strategy, batches, self._world)
        return {
            "history": self.history,
            "reduced": self._reduced,
            "per_rank": per_rank,
            "stats": None if stats is None else {
                "flat": (stats if per_rank else growth.flatten_stats(stats)).cpu(),
                "like": [s.state_dict() for s in self._stats],
            },
            "eval_batches": [tuple(t.cpu() for t in b) for b in batches],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict["history"])
        self._reduced = state_dict["reduced"]
        stats, batches = state_dict["stats"], [tuple(b) for b in state_dict["eval_batches"]]
        if state_dict["per_rank"]:
            stats = stats and {**stats, "flat": stats["flat"][self._rank]}
            batches = batches[self._rank :: self._world]
        like = None if stats is None else [growth.FormStats.from_state_dict(s) for s in stats["like"]]
        self._stats = None if stats is None else growth.unflatten_stats(stats["flat"], like)
        self._eval_batches = batches


def _gather_batches(strategy, batches: list[tuple[Tensor, ...]], world: int) -> list[tuple[Tensor, ...]]:
    """The kept batches of all ranks, batch-major (batch k of rank r at index k·world + r)."""
    if world == 1:
        return batches
    gathered = [tuple(strategy.all_gather(t) for t in batch) for batch in batches]
    return [tuple(t[r] for t in batch) for batch in gathered for r in range(world)]


def _growth_spectra(spectra: dict[str, Tensor]):
    titles = [name.removeprefix("model.") for name in spectra]
    return spectrum_figure(list(spectra.values()), titles, ylabel="σ kept by the growth")


def _to_cpu(g: growth.Growth) -> growth.Growth:
    return dataclasses.replace(g, w_q=g.w_q.cpu(), w_k=g.w_k.cpu(), log_tau=g.log_tau.cpu())


def _layer_of(form_name: str) -> int:
    """'model.blocks.3.attn.qk' → 3."""
    parts = form_name.split(".")
    return int(parts[parts.index("blocks") + 1])
