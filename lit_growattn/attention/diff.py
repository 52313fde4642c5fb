"""DIFF attention (Ye et al. 2024, microsoft/unilm Diff-Transformer) with growable query/key forms.

n_head // 2 heads; head j computes (A1 − λ·A2)·V with value head size 2·d_v, so the parameter count matches
`mha` with n_head heads. λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init (one λ per layer, as published), and
each head's output is RMSNorm(·) × (1 − λ_init). The learnable temperatures of the two forms replace 1/√d.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lit_growattn.attention.qk import QKForm
from lit_growattn.attention.registry import AttentionConfig, register_attention
from lit_growattn.attention.value import ValueMap, attach


def lambda_init_for(layer_idx: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·layer), layer 0-based (DIFF; DINT keeps it)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


@register_attention("diff")
class DiffAttention(nn.Module):
    # Its RMSNorm of each head's output before W_O makes the output not linear in W_V·W_O (docs/value.md).
    value_growable = False

    def __init__(self, cfg: AttentionConfig, layer_idx: int):
        super().__init__()
        if cfg.n_head % 2:
            raise ValueError(f"diff attention pairs heads: n_head must be even, got {cfg.n_head}")
        h, dv, d = cfg.n_head // 2, 2 * cfg.value_head_size(layer_idx), cfg.head_size(layer_idx)
        self.qk = QKForm(cfg.n_embd, h, d, cfg.bias, sdpa_pad=cfg.sdpa_pad)
        self.qk2 = QKForm(cfg.n_embd, h, d, cfg.bias, sdpa_pad=cfg.sdpa_pad)
        self.value: ValueMap = attach(self, cfg.n_embd, h, dv, cfg.bias)
        self.lambda_init = lambda_init_for(layer_idx)
        # Length d_v (the published head_dim), not d_head: d_v never grows, so checkpoints of grown models load
        # without touching λ.
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(cfg.value_head_size(layer_idx)) * 0.1) for _ in range(4)
        )
        self.norm = nn.RMSNorm(dv, eps=1e-5)

    def qk_forms(self) -> list[QKForm]:
        return [self.qk, self.qk2]

    @property
    def lam(self) -> Tensor:
        return (
            torch.exp(self.lambda_q1 @ self.lambda_k1) - torch.exp(self.lambda_q2 @ self.lambda_k2) + self.lambda_init
        )

    def forward(self, x: Tensor) -> Tensor:
        v = self.value.values(x)
        y = self.qk.attend(x, v) - self.lam * self.qk2.attend(x, v)
        return self.value.output(self.norm(y) * (1 - self.lambda_init))

    def attention_maps(self, x: Tensor) -> dict[str, Tensor]:
        """Explicit maps (b, h, s, s), for analysis: the combined map `attn` = A1 − λA2 and its two softmaxes."""
        a1, a2 = torch.softmax(self.qk.scores(x), -1), torch.softmax(self.qk2.scores(x), -1)
        return {"attn": a1 - self.lam * a2, "a1": a1, "a2": a2}
