"""Lightning's own callbacks that hold parameters or schedulers, through a growth event.

`WeightAveraging` (`EMAWeightAveraging`) and `StochasticWeightAveraging` keep a copy of the model and average its
parameters with the live model's, matched by position: after a growth the copy must have the grown shapes, or the
next average fails. Each grown tensor of the copy takes the live model's new entries, and its old entries keep
their average, moved as the growth moved the live ones; averaging goes on from there.

SWA also steps its own scheduler (SWALR) in place of configure_optimizers' one: the rebuild keeps it
(`trainer_ops.resize_parameters`), on the new optimizer.

The other callbacks of Lightning that hold parameters, parameter groups or schedulers are refused at setup
(`check_callbacks`), with the reason; ModelPruning only where it prunes a tensor that grows.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import (BaseFinetuning, BatchSizeFinder, Callback, LearningRateFinder, ModelPruning,
                                         WeightAveraging)
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler

from lit_growattn.training.checkpoint import resize_to_checkpoint
from lit_growattn.callback.window import NamedForms
from lit_growattn.growth import Carry
from lit_growattn.contract import growable_units
from lit_growattn.training.lightning_private import averaged_model, callback_scheduler, pruned_tensors


SEARCH = ("its search trains and then restores the model, optimizer and schedulers it saved before, which a growth "
          "inside the search replaces with others of other shapes; search without GrowAttentionCallback and put the "
          "value found in the config")
REFUSED: dict[type[Callback], str] = {
    BaseFinetuning: "it adds the parameters it unfreezes to the optimizer as new parameter groups, and a growth "
                    "rebuilds the optimizer from configure_optimizers, without them: the unfrozen modules would stop "
                    "training. Unfreeze them in configure_optimizers' groups instead (BackboneFinetuning included)",
    LearningRateFinder: SEARCH,
    BatchSizeFinder: SEARCH,
}


def check_callbacks(trainer: L.Trainer, grower: Callback, forms: NamedForms) -> None:
    """Refuses the trainer's callbacks that do not survive a growth of `forms`, and a weight-averaging callback
    placed before `grower`: on resume it loads its average in `on_load_checkpoint`, into a copy that `grower`
    must resize first."""
    callbacks = trainer.callbacks
    for callback in callbacks:
        name = type(callback).__name__
        if reason := next((r for kind, r in REFUSED.items() if isinstance(callback, kind)), None):
            raise ValueError(f"{name} cannot be combined with GrowAttentionCallback: {reason}")
        if isinstance(callback, WeightAveraging) and callbacks.index(callback) < callbacks.index(grower):
            raise ValueError(
                f"{name} comes before GrowAttentionCallback in trainer.callbacks: put it after, so that a resumed "
                f"run gives its averaged copy the checkpoint's head sizes before {name} loads the average into it"
            )
        if isinstance(callback, ModelPruning):
            growable = {form: form_name for _, form_name, form in forms}  # modules hash by identity
            pruned = pruned_tensors(callback, trainer.lightning_module)
            if hit := [f"{growable[module]}.{tensor}" for module, tensor in pruned
                       if module in growable and tensor in module.tensor_names()]:
                raise ValueError(
                    f"ModelPruning prunes {hit}, which grow: pruning re-parametrises a tensor (a mask beside "
                    "`<name>_orig`) and keeps a copy of its first values (lottery ticket), and neither follows a "
                    "growth. Leave the growing tensors (query/key: w_q, w_k, log_tau; values: w_v, w_o) out of "
                    "parameters_to_prune"
                )


def averaged_copies(trainer: L.Trainer) -> list[nn.Module]:
    """The averaged copies of the LightningModule that the trainer's callbacks keep (same parameter names)."""
    return [copy for copy in map(averaged_model, trainer.callbacks) if copy is not None]


def callback_schedulers(trainer: L.Trainer) -> list[LRScheduler]:
    """The schedulers in `trainer.lr_scheduler_configs` that a callback made, not configure_optimizers."""
    return [s for s in map(callback_scheduler, trainer.callbacks) if s is not None]


def grow_averaged(trainer: L.Trainer, forms: NamedForms, before: dict[str, dict[str, Tensor]],
                  carries: dict[str, Carry]) -> None:
    """Grows the averaged copies as the live `forms` (query/key forms and value maps) just grew. `before`: each
    form's tensors before the growth (by form name, then tensor name); `carries`: the growth's Carry per parameter
    name (`{form}.{tensor}`)."""
    for copy in averaged_copies(trainer):
        own = {named.name: named.form for named in growable_units(copy)}
        for _, name, form in forms:
            target = own[name]
            target.set_weights(**{
                tensor: follow(getattr(target, tensor), before[name][tensor], getattr(form, tensor),
                               carries[f"{name}.{tensor}"])
                for tensor in form.tensor_names()})
        copy.record_head_sizes()


def follow(average: Tensor, live_before: Tensor, live_after: Tensor, carry: Carry) -> Tensor:
    """The averaged tensor after a growth took its live tensor from `live_before` to `live_after`.

    New entries are the live ones. The old entries (`carry.old_index`) keep their average, mapped as the live
    values were: scaled by the growth's factor c on old columns (the carry scales their gradients' moments by
    1/c, `first_scale`) and shifted by whatever else the growth added to them (log τ under `temperature: rescale`).
    An unchanged tensor thus keeps its average bit for bit. A tensor whose values rotated (no `old_index`, mode
    `replace`) has no old entries to keep: its average restarts from the live values.
    """
    grown = live_after.detach().to(average, copy=True)
    if carry.old_index is not None:
        scale = 1.0 / carry.first_scale
        old = grown[carry.old_index]
        grown[carry.old_index] = scale * average.detach() + (old - scale * live_before.detach().to(average))
    return grown


def resize_averaged_to(trainer: L.Trainer, state_dict: dict[str, Tensor]) -> None:
    """Gives the averaged copies the head sizes of a checkpoint's `state_dict` (a resumed run's), before the
    callbacks load their averages into them."""
    for copy in averaged_copies(trainer):
        resize_to_checkpoint(copy, state_dict)
        copy.record_head_sizes()
