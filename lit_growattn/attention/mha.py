"""Multi-head attention with a learnable temperature per head instead of 1/√d_head (seed 002)."""

from __future__ import annotations

from torch import Tensor, nn

from lit_growattn.attention.qk import QKForm
from lit_growattn.attention.registry import AttentionConfig, register_attention
from lit_growattn.attention.value import ValueMap, attach


@register_attention("mha")
class MultiHeadAttention(nn.Module):
    value_growable = True

    def __init__(self, cfg: AttentionConfig, layer_idx: int):
        super().__init__()
        self.qk = QKForm(cfg.n_embd, cfg.n_head, cfg.head_size(layer_idx), cfg.bias, sdpa_pad=cfg.sdpa_pad)
        self.value: ValueMap = attach(self, cfg.n_embd, cfg.n_head, cfg.value_head_size(layer_idx), cfg.bias)

    def qk_forms(self) -> list[QKForm]:
        return [self.qk]

    def forward(self, x: Tensor) -> Tensor:
        return self.value.output(self.qk.attend(x, self.value.values(x)))
