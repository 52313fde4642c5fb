"""Tiny recall runs shared by the callback tests (module level, so that ddp_spawn can pickle what uses them)."""

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lit_growattn import GrowAttentionCallback
from lit_growattn.data import FusedRecallDataModule
from lit_growattn.module import GrowAttentionLM


def recall_data(batch_size=16, examples=128, seed=0) -> FusedRecallDataModule:
    return FusedRecallDataModule(num_keys=8, num_values=4, num_kv_pairs=4, num_train_examples=examples,
                                 num_val_examples=32, batch_size=batch_size, seed=seed)


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
