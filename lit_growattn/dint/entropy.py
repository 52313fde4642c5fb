"""Attention entropy of a Hugging Face model during fine-tuning, next to the original model's (seed 001, plan 2).

`AttentionEntropyCallback` measures, per layer, the mean row entropy (nats) of the attention map that multiplies V
on a fixed set of validation batches: once when fit starts — the reference, kept in the callback's state so a
resumed run keeps it — and again at the end of every validation epoch. Both are logged each time,
`attention/entropy/layer_{i}` and `attention/entropy_original/layer_{i}`, so TensorBoard shows the current curve
beside the flat reference. The reference is the model as fit receives it: for a model converted to DINT
(λ = 0, outputs identical) that is exactly the original model's attention.

Maps come from the model's own `output_attentions` under the eager interface (switched on for the measurement
only). A DINT layer returns its combined map A1 + λ(A3 − A2), whose rows are read as |A|/Σ|A|
(`analysis.row_entropy`). Rows of padding do not count: a row counts up to the last position that has a label.

What it needs of the module: `model`, a transformers PreTrainedModel, and (inputs, labels) validation batches.
"""

from __future__ import annotations

from itertools import islice

import lightning as L
import torch
from torch import Tensor

from lit_growattn.analysis import row_entropy


@torch.no_grad()
def layer_entropies(model, batches: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Mean row entropy (layers,) of each layer's attention map over the real rows of (inputs, labels) batches."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        sums, rows = None, 0
        for inputs, labels in batches:
            t = torch.arange(inputs.shape[1], device=inputs.device)
            labelled = torch.where(labels != -100, t, -1)
            real = t[None, :] <= labelled.max(-1, keepdim=True).values  # (b, s)
            maps = model(input_ids=inputs, output_attentions=True, use_cache=False).attentions
            per_layer = torch.stack([(row_entropy(a).mean(1) * real).sum() for a in maps])
            sums = per_layer if sums is None else sums + per_layer
            rows += int(real.sum())
        return sums / max(rows, 1)
    finally:
        model.set_attn_implementation(previous)


class AttentionEntropyCallback(L.Callback):
    """Args:
        num_batches: validation batches (of the first validation set) the entropy is measured on.
    """

    def __init__(self, num_batches: int = 2):
        if num_batches < 1:
            raise ValueError(f"num_batches must be ≥ 1, got {num_batches}")
        self.num_batches = num_batches
        self.reference: Tensor | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        model = getattr(pl_module, "model", None)
        if model is None or not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"AttentionEntropyCallback needs a module whose `model` is a transformers model "
                            f"(e.g. lit_growattn.hf.HFCausalLM), not {type(pl_module).__name__}")

    def _batches(self, trainer: L.Trainer, device) -> list[tuple[Tensor, Tensor]]:
        loaders = trainer.datamodule.val_dataloader()
        loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        return [(x.to(device), y.to(device)) for x, y in islice(loader, self.num_batches)]

    def _measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Tensor:
        was_training = pl_module.training
        pl_module.eval()
        try:
            return layer_entropies(pl_module.model, self._batches(trainer, pl_module.device)).cpu()
        finally:
            pl_module.train(was_training)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.reference is None:
            self.reference = self._measure(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.reference is None:
            return
        current = self._measure(trainer, pl_module)
        for i, (now, before) in enumerate(zip(current, self.reference)):
            pl_module.log(f"attention/entropy/layer_{i}", now.item())
            pl_module.log(f"attention/entropy_original/layer_{i}", before.item())

    def state_dict(self) -> dict:
        return {"reference": self.reference}

    def load_state_dict(self, state_dict: dict) -> None:
        self.reference = state_dict["reference"]
