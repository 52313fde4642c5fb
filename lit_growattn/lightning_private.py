"""Every private attribute of Lightning that lit_growattn reads, in one place.

Lightning has no public API for these three facts, and each is read where a public alternative would cost a
millisecond per step or would be wrong after a resume. A Lightning upgrade that moves one of them breaks here,
and `tests/test_lightning_private.py` says which.

`cli.py` also overrides two private methods of `LightningCLI`: `_instantiate_trainer` (the default checkpoint
callback only when none is configured) and `_run_subcommand` (no empty log folder after a failed start). They
are listed in `CLI_OVERRIDES`, and the same test checks that LightningCLI still has them.
"""

from __future__ import annotations

import lightning as L

CLI_OVERRIDES = ("_instantiate_trainer", "_run_subcommand")


def should_update_logs(trainer: L.Trainer) -> bool:
    """True on the steps at which the logger writes (`log_every_n_steps`), as Lightning's own monitors read it."""
    return trainer._logger_connector.should_update_logs


def accumulation_open_after_this_batch(trainer: L.Trainer) -> bool:
    """True inside an accumulation window: this micro-batch is not followed by an optimizer step."""
    return trainer.fit_loop._should_accumulate()


def batches_done_in_epoch(trainer: L.Trainer) -> int:
    """Training batches of the current epoch already processed (restored from a checkpoint on resume)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed
