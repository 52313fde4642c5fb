"""The Lightning private attributes lit_growattn reads (lit_growattn/training/lightning_private.py) still mean what the
project relies on: a Lightning upgrade that moves one fails here, by name."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_growattn.training import lightning_private


class Probe(L.LightningModule):
    """A linear model that records the three facts at every training batch."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        t = self.trainer
        self.seen.append((t.current_epoch, batch_idx, lightning_private.batches_done_in_epoch(t),
                          lightning_private.should_update_logs(t),
                          lightning_private.accumulation_open_after_this_batch(t)))
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ValidatedProbe(Probe):
    def validation_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()


def test_private_counters_mean_what_the_project_reads(tmp_path):
    probe = Probe()
    data = DataLoader(TensorDataset(torch.randn(5, 2)), batch_size=1)
    L.Trainer(max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=2, default_root_dir=tmp_path,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(probe, data)
    epoch_0 = [row[1:] for row in probe.seen if row[0] == 0]
    # (batch, done before it, the logger writes at this batch, an accumulation window stays open after it)
    assert [(b, done, acc) for b, done, _, acc in epoch_0] == [
        (0, 0, True), (1, 1, False), (2, 2, True), (3, 3, False), (4, 4, False)]  # the last batch steps anyway
    # log_every_n_steps=2 counts optimizer steps: the logger writes on every micro-batch of steps 2, 4 and 6
    # (1-based; epoch 0 has steps of batches 0-1, 2-3 and 4, epoch 1 likewise).
    assert [row[:2] for row in probe.seen if row[3]] == [(0, 2), (0, 3), (1, 0), (1, 1), (1, 4)]


def test_lightning_cli_still_has_the_methods_the_project_overrides():
    from lightning.pytorch.cli import LightningCLI

    missing = [name for name in lightning_private.CLI_OVERRIDES if not callable(getattr(LightningCLI, name, None))]
    assert not missing, f"LightningCLI no longer has {missing}: update lit_growattn/commands/cli.py"


def test_the_checkpoint_a_run_loads_is_known_at_setup(tmp_path):
    """Read at setup, before Lightning loads the checkpoint (the path need not exist: nothing is loaded before the
    callback stops the run): the ckpt_path given to fit or validate, or the one set on the trainer by hand; None
    outside a run."""

    class Stop(Exception):
        pass

    class AtSetup(L.Callback):
        def __init__(self):
            self.seen = []

        def setup(self, trainer, pl_module, stage):
            self.seen.append(lightning_private.resume_checkpoint(trainer))
            raise Stop

    data = DataLoader(TensorDataset(torch.randn(2, 2)), batch_size=1)
    at_setup = AtSetup()
    trainer = L.Trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[at_setup], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    for given in [dict(ckpt_path=tmp_path / "given.ckpt"), {}]:
        with pytest.raises(Stop):
            trainer.fit(Probe(), data, **given)
    with pytest.raises(Stop):
        trainer.validate(ValidatedProbe(), data, ckpt_path=tmp_path / "validated.ckpt")
    trainer.ckpt_path = tmp_path / "set.ckpt"
    with pytest.raises(Stop):
        trainer.fit(Probe(), data)
    assert at_setup.seen == [str(tmp_path / "given.ckpt"), None, str(tmp_path / "validated.ckpt"),
                             str(tmp_path / "set.ckpt")]
    assert lightning_private.resume_checkpoint(trainer) is None
