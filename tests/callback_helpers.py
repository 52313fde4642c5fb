"""Tiny recall runs shared by the callback tests (module level, so that ddp_spawn can pickle what uses them)."""

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lit_growattn import GrowAttentionCallback
from lit_growattn.data import FusedRecallDataModule
from lit_growattn.growth import SketchValueStats, loss_rounding
from lit_growattn.module import GrowAttentionLM


def recall_data(batch_size=16, examples=128, seed=0, val_examples=32) -> FusedRecallDataModule:
    """The validation split is drawn from a stream of its own: `val_examples` changes nothing of the training."""
    return FusedRecallDataModule(num_keys=8, num_values=4, num_kv_pairs=4, num_train_examples=examples,
                                 num_val_examples=val_examples, batch_size=batch_size, seed=seed)


def tiny_module(data, **kwargs) -> GrowAttentionLM:
    args = dict(n_layer=2, n_head=2, n_embd=16, d_head=2, d_v=8, warmup_steps=0, lr_schedule="cosine")
    return GrowAttentionLM(vocab_size=data.vocab_size, block_size=data.max_seq_len, **{**args, **kwargs})


def trainer(tmp_path, callbacks, max_epochs=3, **kwargs) -> L.Trainer:
    args = dict(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=TensorBoardLogger(tmp_path, name="run"),
                enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
                deterministic=True)
    return L.Trainer(callbacks=callbacks, **{**args, **kwargs})


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def function_products(module) -> list[torch.Tensor]:
    """Each growable unit's products per query head, which a sign flip of a grown pair leaves as they are: τ_j W_Q,j
    W_K,g(j)ᵀ of a query/key form, W_V,g(j) W_O,j of a value map (g(j): the head's key or value head under GQA)."""
    out = []
    for named in module.growable_forms() + module.growable_values():
        unit = named.form
        group = unit.n_head // unit.n_kv_head
        if unit.side == "d_head":
            tau = unit.log_tau.detach().exp()[:, None, None]
            out.append(tau * unit.w_q.detach() @ unit.w_k.detach().repeat_interleave(group, 0).mT)
        else:
            out.append(unit.w_v.detach().repeat_interleave(group, 0) @ unit.w_o.detach())
    return out


def sketch_tolerance(e_in: int, omega_c_cond: float | None) -> float:
    """How far, relative to its scale, a float64 growth from a sketch of k ≥ e′ (exact for any statistics) may lie from
    the full path's: round-off of sums over e′ terms; on the value side the Nyström core Ω_cᵀCΩ_c adds the
    conditioning of the square Ω_c, cond(Ω_c)², beyond C's (which natural's ridge tames)."""
    return e_in * torch.finfo(torch.float64).eps * max(e_in, (omega_c_cond or 0.0) ** 2)


class SketchEventProbe(GrowAttentionCallback):
    """After each event, every unit's `function_products` (which the sketch's canonical pair signs leave as they are),
    and the largest condition number of a value sketch's Ω_c in the event's window (None: no value sketch):
    `events`, one (products, cond) per event."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        omega_c = [st.tests["omega_c"] for st in self.window.stats or [] if isinstance(st, SketchValueStats)]
        cond = max((torch.linalg.cond(o).item() for o in omega_c), default=None)
        super()._grow(trainer, pl_module, point, batch_idx)
        self.events = getattr(self, "events", []) + [(function_products(pl_module), cond)]


class WindowRecorder(GrowAttentionCallback):
    """The statistics handed to the growth (means and how many instances and steps they hold)."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        self.seen = [(s.means() if s.instances > 0 else None, int(s.instances), float(s.weight)) for s in self.window.stats]
        super()._grow(trainer, pl_module, point, batch_idx)


class PreservationProbe(GrowAttentionCallback):
    """Model outputs on a kept batch just before and just after the growth event."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        inputs = self.window.kept[0][0]
        pl_module.eval()
        with torch.no_grad():
            self.out_before = pl_module(inputs)
        super()._grow(trainer, pl_module, point, batch_idx)
        with torch.no_grad():
            self.out_after = pl_module(inputs)
        pl_module.train()



class HeldOutProbe(GrowAttentionCallback):
    """The loss of every labelled token of the validation batches, which the line search never sees (it rates its
    step sizes on the kept training batches of the statistics window), just before and just after each growth
    event: `held_out` holds one (before, after) pair of float64 tensors per event."""

    def token_losses(self, trainer, pl_module) -> torch.Tensor:
        was_training = pl_module.training
        pl_module.eval()
        losses = []
        loaders = trainer.val_dataloaders
        with torch.no_grad():
            for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
                for inputs, labels in loader:
                    logits = pl_module(inputs.to(pl_module.device)).flatten(0, 1).float()
                    labels = labels.to(pl_module.device).flatten()
                    losses.append(torch.nn.functional.cross_entropy(logits, labels, reduction="none")[labels != -100])
        pl_module.train(was_training)
        assert losses, "no validation batch to measure the growth on"
        return torch.cat(losses).double()

    def _grow(self, trainer, pl_module, point, batch_idx):
        before = self.token_losses(trainer, pl_module)
        super()._grow(trainer, pl_module, point, batch_idx)
        self.held_out = getattr(self, "held_out", []) + [(before, self.token_losses(trainer, pl_module))]


def held_out_rise(before: torch.Tensor, after: torch.Tensor) -> tuple[float, float]:
    """The mean rise of the held-out loss over its tokens, and the standard error of that mean (the paired
    differences' spread over √tokens): a rise within a few standard errors is the noise of the sample."""
    rise = after - before
    return float(rise.mean()), float(rise.std() / rise.numel() ** 0.5)


def assert_never_raises_the_held_out_loss(grow: HeldOutProbe, steps_taken: bool = True) -> None:
    """The loss on validation batches, which the line search did not use, does not rise at any event by more
    than 3 standard errors of its mean over the held-out tokens (plus float32 round-off); and, unless
    `steps_taken` is False (a baseline, whose growth keeps the function), a step α > 0 was taken at some event
    and lowered it."""
    assert len(grow.held_out) == len(grow.history) > 0
    for event, (before, after) in zip(grow.history, grow.held_out):
        rise, error = held_out_rise(before, after)
        rounding = loss_rounding(float(before.mean()), torch.float32, before.numel())
        assert rise <= 3 * error + rounding, (event["epoch"], event["alpha"], rise, error)
        if not event["alpha"]:  # α = 0, or a baseline: the function is kept, up to the new columns' round-off
            assert abs(rise) <= rounding + 1e-6 * float(before.mean()), (event["epoch"], rise)
    if steps_taken:
        assert any(e["alpha"] and held_out_rise(*losses)[0] < 0 for e, losses in zip(grow.history, grow.held_out)), \
            f"no step α > 0 lowered the held-out loss: α {[e['alpha'] for e in grow.history]}"
