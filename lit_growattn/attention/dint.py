"""DINT attention (Cang et al. 2025) as seed 001 writes it: (λ·A3 + A1 − λ·A2)·V, no normalisation.

A3 is the integral map. Causally, row i is the mean of the rows ≤ i of A1 (the mean over all rows would leak
the future), so A3·V is the running mean of A1·V over query positions and needs no explicit map. Every row of
λ·A3 + A1 − λ·A2 still sums to 1. λ is a learnable scalar per head, initialised at DIFF's
λ_init = 0.8 − 0.6·exp(−0.3·layer): DINT reuses DIFF's λ and its initialisation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lit_growattn.attention.diff import lambda_init_for
from lit_growattn.attention.qk import QKForm
from lit_growattn.attention.registry import AttentionConfig, register_attention
from lit_growattn.attention.value import ValueMap, attach


def causal_mean(t: Tensor) -> Tensor:
    """Row i ↦ mean of rows 0…i along dim −2."""
    n = torch.arange(1, t.shape[-2] + 1, device=t.device, dtype=t.dtype)
    return t.cumsum(-2) / n[:, None]


class DenoisedAttention(nn.Module):
    """The DINT layer around a second map `qk2`: any module with `attend(x, v)` and `scores(x)` like QKForm."""

    value_growable = True  # the combined map is linear in the values

    def __init__(self, cfg: AttentionConfig, layer_idx: int, qk2: nn.Module, lambda_init: float | None):
        super().__init__()
        h = cfg.n_head
        self.qk = QKForm(cfg.n_embd, h, cfg.head_size(layer_idx), cfg.bias, sdpa_pad=cfg.sdpa_pad)
        self.qk2 = qk2
        self.value: ValueMap = attach(self, cfg.n_embd, h, cfg.value_head_size(layer_idx), cfg.bias)
        lam = lambda_init_for(layer_idx) if lambda_init is None else lambda_init
        self.lam = nn.Parameter(torch.full((h,), float(lam)))

    def score_maps(self) -> list[nn.Module]:
        return [self.qk, self.qk2]

    def qk_forms(self) -> list[QKForm]:
        return [form for form in self.score_maps() if isinstance(form, QKForm)]

    def forward(self, x: Tensor) -> Tensor:
        v = self.value.values(x)
        y1 = self.qk.attend(x, v)
        # Grouped so that λ = 0 gives exactly A1·V: a converted mha model starts with identical outputs.
        y = y1 + self.lam[:, None, None] * (causal_mean(y1) - self.qk2.attend(x, v))
        return self.value.output(y)

    def attention_maps(self, x: Tensor) -> dict[str, Tensor]:
        """Explicit maps (b, h, s, s), for analysis: the combined map `attn` and the two softmaxes."""
        a1, a2 = torch.softmax(self.qk.scores(x), -1), torch.softmax(self.qk2.scores(x), -1)
        return {"attn": a1 + self.lam[:, None, None] * (causal_mean(a1) - a2), "a1": a1, "a2": a2}


@register_attention("dint")
class DintAttention(DenoisedAttention):
    """Args: lambda_init: initial λ of every head (None → DIFF's schedule in the layer index)."""

    def __init__(self, cfg: AttentionConfig, layer_idx: int, lambda_init: float | None = None):
        qk2 = QKForm(cfg.n_embd, cfg.n_head, cfg.head_size(layer_idx), cfg.bias, sdpa_pad=cfg.sdpa_pad)
        super().__init__(cfg, layer_idx, qk2, lambda_init)
