"""Attention measurements on a few evaluation batches, never in the training path (seed 001 plan 2, seed 004).

- Entropy: mean row entropy (nats) per layer and head of every map, computed from explicit maps. The combined
  DIFF/DINT map (`attn`) has negative entries: each of its rows is read as the distribution |A|/Σ|A| (for λ = 0
  that is A1 itself). Masked entries are 0 and add nothing, so a uniform causal row i has entropy log(i+1).
  The mean runs over every row and sequence, row 0 (entropy 0) included.
- W_M = W_V W_O per head (seed 004): its singular values, at most d_v of them non-zero. For DIFF the per-head
  RMSNorm sits between W_V and W_O; the spectrum is that of the linear part.

The attention input X of each layer is taken with forward pre-hooks, so the model knows nothing of this.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import islice

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from lit_growattn.model.gpt import GPT


def _wide(t: Tensor) -> Tensor:
    """At least float32 (half precision is too coarse for entropies and spectra)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def row_entropy(a: Tensor) -> Tensor:
    """Maps (…, s, s) → entropy (…, s) of each row of |A|/Σ|A|."""
    p = _wide(a).abs()
    p = p / p.sum(-1, keepdim=True)
    return -torch.special.xlogy(p, p).sum(-1)


def attention_maps(attn: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """Explicit maps (b, h, s, s) of one attention layer; `attn` is the one that multiplies V."""
    if hasattr(attn, "attention_maps"):
        return attn.attention_maps(x)
    forms = attn.qk_forms()
    if len(forms) != 1:
        raise TypeError(f"{type(attn).__name__} has {len(forms)} maps but no attention_maps(x) combining them")
    return {"attn": torch.softmax(forms[0].scores(x), -1)}


@contextmanager
def attention_inputs(model: GPT) -> Iterator[list[Tensor]]:
    """Collects the input X (b, s, e) of each layer's attention, in layer order, while inside."""
    xs: list[Tensor] = []
    handles = [block.attn.register_forward_pre_hook(lambda _, args: xs.append(args[0])) for block in model.blocks]
    try:
        yield xs
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def attention_entropy(model: GPT, batches: Iterable[Tensor]) -> list[dict[str, Tensor]]:
    """Per layer, map name → mean row entropy per head (h,), over token-id batches (b, s); in the model's current
    mode, so put it in eval mode first (the callback runs inside validation, where it is)."""
    sums, count = [], 0
    for idx in batches:
        with attention_inputs(model) as xs:
            model(idx)
        maps = [attention_maps(block.attn, x) for block, x in zip(model.blocks, xs)]
        sums.append([{name: row_entropy(a).mean(-1).sum(0) for name, a in layer.items()} for layer in maps])
        count += idx.shape[0]
    return [{name: sum(batch[i][name] for batch in sums) / count for name in layer} for i, layer in enumerate(sums[0])]


@torch.no_grad()
def wm_spectra(model: GPT) -> list[Tensor]:
    """Per layer, the singular values (h, d_v) of W_M = W_V W_O of each head, descending."""
    spectra = []
    for block in model.blocks:
        value = block.attn.value
        w_v = _wide(value.w_v)[:, : value.e_in - int(value.bias)]  # (h, e, d_v): W_M of the inputs, no bias row
        w_o = _wide(value.w_o)  # (h, d_v, e)
        # W_V = Q_V R_V and W_Oᵀ = Q_O R_O with orthonormal Q: W_M has the singular values of R_V R_Oᵀ (d_v × d_v).
        core = torch.linalg.qr(w_v).R @ torch.linalg.qr(w_o.transpose(-1, -2)).R.transpose(-1, -2)
        spectra.append(torch.linalg.svdvals(core))
    return spectra


def entropy_figure(entropy: Tensor) -> Figure:
    """Heat-map of a (layers, heads) entropy table."""
    fig = Figure(figsize=(2 + 0.5 * entropy.shape[1], 1.5 + 0.4 * entropy.shape[0]))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(entropy.cpu().numpy(), aspect="auto", cmap="viridis")
    ax.set(xlabel="head", ylabel="layer", title="mean row entropy (nats)")
    fig.colorbar(image, ax=ax)
    return fig


def spectrum_figure(spectra: list[Tensor], titles: list[str] | None = None, ylabel: str = "σ(W_V W_O)") -> Figure:
    """One panel per (heads, k) table of singular values (default: one per layer), one line per head."""
    titles = titles or [f"layer {i}" for i in range(len(spectra))]
    fig = Figure(figsize=(3.5 * len(spectra), 3), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (ax, s, title) in enumerate(zip(fig.subplots(1, len(spectra), squeeze=False)[0], spectra, titles)):
        ax.semilogy(s.T.float().cpu().numpy())
        ax.set(title=title, xlabel="index", ylabel=ylabel if i == 0 else None)
    return fig


class AttentionAnalysisCallback(L.Callback):
    """At the end of every `every_n_epochs`-th validation epoch: attention entropy on the first `num_batches`
    batches of the first validation loader, logged as `attention/entropy/layer_{i}` (mean over heads of the map
    that multiplies V; `…/layer_{i}/{a1,a2}` for the components of DIFF/DINT), and, with a TensorBoardLogger,
    an entropy heat-map and the W_M spectra as figures."""

    def __init__(self, num_batches: int = 2, every_n_epochs: int = 1):
        if num_batches < 1 or every_n_epochs < 1:
            raise ValueError(f"num_batches and every_n_epochs must be ≥ 1, got {num_batches}, {every_n_epochs}")
        self.num_batches, self.every_n_epochs = num_batches, every_n_epochs

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        loader = trainer.val_dataloaders
        if isinstance(loader, dict):
            loader = next(iter(loader.values()))
        elif isinstance(loader, (list, tuple)):
            loader = loader[0]
        batches = [batch[0].to(pl_module.device) for batch in islice(loader, self.num_batches)]
        if not batches:
            return
        entropy = attention_entropy(pl_module.model, batches)
        for i, maps in enumerate(entropy):
            for name, per_head in maps.items():
                tag = f"attention/entropy/layer_{i}" + ("" if name == "attn" else f"/{name}")
                pl_module.log(tag, per_head.mean().float(), sync_dist=True, add_dataloader_idx=False)
        # Figures on rank 0 only (elsewhere logger.experiment is a dummy); nothing below is a collective.
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                table = torch.stack([maps["attn"] for maps in entropy])
                logger.experiment.add_figure("attention/entropy", entropy_figure(table), trainer.global_step)
                logger.experiment.add_figure(
                    "attention/wm_spectrum", spectrum_figure(wm_spectra(pl_module.model)), trainer.global_step
                )
