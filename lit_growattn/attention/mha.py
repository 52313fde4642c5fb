"""Multi-head attention with a learnable temperature per head instead of 1/√d_head (seed 002)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from lit_growattn.attention.qk import QKForm
from lit_growattn.attention.registry import register_attention

if TYPE_CHECKING:  # the config names the variants; they only need its type
    from lit_growattn.model.config import GPTConfig


@register_attention("mha")
class MultiHeadAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int):
        super().__init__()
        h, dv = cfg.n_head, cfg.value_head_size
        self.n_head, self.d_v = h, dv
        self.qk = QKForm(cfg.n_embd, h, cfg.head_size(layer_idx), cfg.bias, sdpa_pad=cfg.sdpa_pad)
        self.v = nn.Linear(cfg.n_embd, h * dv, bias=cfg.bias)
        self.o = nn.Linear(h * dv, cfg.n_embd, bias=cfg.bias)

    def qk_forms(self) -> list[QKForm]:
        return [self.qk]

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        v = self.v(x).view(b, s, self.n_head, self.d_v).transpose(1, 2)  # (b, h, s, d_v)
        y = self.qk.attend(x, v)
        return self.o(y.transpose(1, 2).reshape(b, s, self.n_head * self.d_v))
