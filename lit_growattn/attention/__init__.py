"""Attention variants by name: one file per variant, one line in ATTENTIONS.

A variant is an nn.Module built as `cls(cfg: GPTConfig, layer_idx: int, **cfg.attention_args)`, mapping
(b, s, e) → (b, s, e) with a causal mask, and exposing `qk_forms()`: the growable query/key bilinear forms it
owns (every softmax map that growth may widen goes through a `QKForm`). A variant with a softmax map that does
not grow also exposes `score_maps()`, every map (each with `n_head` and `d_head`), so that FLOPs count it.
`attention_maps(x)`, optional, gives the explicit maps for analysis (entropy); training never calls it.
"""

from __future__ import annotations

from torch import nn

from lit_growattn.attention.diff import DiffAttention
from lit_growattn.attention.dint import DintAttention
from lit_growattn.attention.lowrank_dint import LowRankDintAttention
from lit_growattn.attention.mha import MultiHeadAttention
from lit_growattn.attention.qk import QKForm

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


__all__ = ["ATTENTIONS", "QKForm", "attention_class"]
