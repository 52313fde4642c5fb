"""Every private attribute of Lightning that lit_growattn reads, in one place.

Lightning has no public API for these four facts, and each is read where a public alternative would cost a
millisecond per step, would be wrong after a resume, or would come too late (the checkpoint a run loads, needed at
configure_model). A Lightning upgrade that moves one of them breaks here,
and `tests/test_lightning_private.py` says which.

Nor does Lightning expose what a growth must follow in its own callbacks (`callback/averaging.py`): the averaged
copy of the model that its weight-averaging callbacks keep, SWA's scheduler, and which tensors ModelPruning
prunes. `tests/test_weight_averaging.py` reads them through these functions.

`cli.py` also overrides three private methods of `LightningCLI`: `_instantiate_trainer` (the default checkpoint
callback only when none is configured), `_run_subcommand` (no empty log folder after a failed start) and
`_parse_ckpt_path` (the checkpoint's hyperparameters read safely, differing settings named, and those of a
distributed checkpoint folder applied as LightningCLI applies a file's). They
are listed in `CLI_OVERRIDES`, and the same test checks that LightningCLI still has them. It wraps one private
function of jsonargparse too, `_typehints.adapt_class_type` (a nested `null` on the command line reaches the
class's parser as JSON instead of the text "None"); `tests/test_cli_overrides.py` checks that jsonargparse still
needs it.
"""

from __future__ import annotations

import inspect

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelPruning, StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

CLI_OVERRIDES = ("_instantiate_trainer", "_run_subcommand", "_parse_ckpt_path")


def should_update_logs(trainer: L.Trainer) -> bool:
    """True on the steps at which the logger writes (`log_every_n_steps`), as Lightning's own monitors read it."""
    return trainer._logger_connector.should_update_logs


def accumulation_open_after_this_batch(trainer: L.Trainer) -> bool:
    """True inside an accumulation window: this micro-batch is not followed by an optimizer step."""
    return trainer.fit_loop._should_accumulate()


def batches_done_in_epoch(trainer: L.Trainer) -> int:
    """Training batches of the current epoch already processed (restored from a checkpoint on resume)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


def resume_checkpoint(trainer: L.Trainer) -> str | None:
    """The checkpoint the running fit, validate or test of `trainer` loads (None: none), known already at setup and
    configure_model. Lightning sets `trainer.ckpt_path` only when it starts loading (after both) and keeps it after
    that run; the path the run resolved (one set on the trainer by hand included) is an argument of the running
    `Trainer._run`, read from its frame."""
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_code is L.Trainer._run.__code__ and frame.f_locals["self"] is trainer):
        frame = frame.f_back
    path = None if frame is None else frame.f_locals["ckpt_path"]
    return None if path is None else str(path)


def averaged_model(callback: Callback) -> nn.Module | None:
    """The copy of the LightningModule whose parameters a weight-averaging callback averages (None: another
    callback, or before the copy exists). Lightning keeps it in `_average_model`: an `AveragedModel` around the
    copy for `WeightAveraging` (and `EMAWeightAveraging`), the copy itself for `StochasticWeightAveraging`."""
    if isinstance(callback, WeightAveraging):
        return None if callback._average_model is None else callback._average_model.module
    if isinstance(callback, StochasticWeightAveraging):
        return callback._average_model
    return None


def callback_scheduler(callback: Callback) -> LRScheduler | None:
    """The scheduler a callback put in `trainer.lr_scheduler_configs` in place of configure_optimizers' own:
    `StochasticWeightAveraging`'s SWALR (`_swa_scheduler`, None before its first SWA epoch)."""
    return callback._swa_scheduler if isinstance(callback, StochasticWeightAveraging) else None


def pruned_tensors(callback: ModelPruning, pl_module: L.LightningModule) -> list[tuple[nn.Module, str]]:
    """The (module, tensor name) pairs that a `ModelPruning` prunes, resolved from its constructor's arguments
    (`_parameters_to_prune`, `_parameter_names`) as its own setup resolves them."""
    pairs = callback.sanitize_parameters_to_prune(pl_module, callback._parameters_to_prune,
                                                  parameter_names=callback._parameter_names)
    return callback.filter_parameters_to_prune(pairs)
