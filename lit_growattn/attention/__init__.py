"""Attention variants by name: one file per variant, one line in ATTENTIONS; each satisfies `Attention`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from lit_growattn.attention.diff import DiffAttention
from lit_growattn.attention.dint import DintAttention
from lit_growattn.attention.lowrank_dint import LowRankDintAttention
from lit_growattn.attention.mha import MultiHeadAttention
from lit_growattn.attention.qk import QKForm



@runtime_checkable
class Attention(Protocol):
    """What a variant must provide. It is an nn.Module built as `cls(cfg: GPTConfig, layer_idx: int,
    **cfg.attention_args)`, mapping (b, s, e) → (b, s, e) with a causal mask.

    Optional beyond these: `score_maps()`, every softmax map (each with `n_head` and `d_head`) when some map
    does not grow (FLOPs count it, see `GPT.flops_per_token`; default `qk_forms()`), and `attention_maps(x)`,
    the explicit maps for analysis (entropy; default: built from the forms). Training never calls either.
    """

    n_head: int  # value heads
    d_v: int  # value head size
    v: nn.Linear  # (e → n_head·d_v): with `o`, the per-head W_M = W_V W_O of `analysis.wm_spectra`
    o: nn.Linear  # (n_head·d_v → e)

    def qk_forms(self) -> list[QKForm]:
        """The growable query/key bilinear forms: every softmax map that growth may widen goes through one."""
        ...

    def forward(self, x: Tensor) -> Tensor: ...


ATTENTIONS: dict[str, type[nn.Module]] = {
    "mha": MultiHeadAttention,
    "diff": DiffAttention,
    "dint": DintAttention,
    "lowrank_dint": LowRankDintAttention,
}


def attention_class(name: str) -> type[nn.Module]:
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; registered attentions: {', '.join(sorted(ATTENTIONS))}")
    return ATTENTIONS[name]


__all__ = ["ATTENTIONS", "Attention", "QKForm", "attention_class"]
