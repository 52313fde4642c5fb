"""Low-rank DINT (seed 001): DINT whose second map has rank-r factors, Q2 = X′ W_down W_up, K2 likewise.

The scale d₂ (docs/design.md §8). Every factor gets nn.Linear's init U(−1/√fan_in, 1/√fan_in), as QKForm does:
Var(W_Q1) = 1/(3e) and Var(W_down W_up) = r · 1/(3e) · 1/(3r) = 1/(9e), a third of it. Queries and keys each
lose that third, so at a fixed input the score variance over the initialisation is 1/9 of the first map's
(the two factors of one product are independent, so E[q_j q_l] = δ_jl Var(q_j) still holds). Softmax over
Q2K2ᵀ/√d₂ with d₂ = d/9 (not the seed's d/81) restores it: the second temperature starts at 1/√(d · d2_ratio).

The second map is not a QKForm, so growth never touches it: its bilinear form has rank ≤ r whatever d_head is,
and growing r would need the growth machinery to factor M′ through W_down, which it does not.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor, nn

from lit_growattn.attention.dint import DenoisedAttention
from lit_growattn.attention.qk import augment, causal_scores
from lit_growattn.attention.registry import AttentionConfig, register_attention
from lit_growattn.attention.sdpa import SdpaPad, causal_attention


def uniform_parameter(*shape: int, fan_in: int, device=None, dtype=None) -> nn.Parameter:
    """nn.Linear's init U(−1/√fan_in, 1/√fan_in), from which the d₂ scale is derived."""
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype).uniform_(-bound, bound))


class LowRankQK(nn.Module):
    """Causal scores τ·(X′ D_q U_q)(X′ D_k U_k)ᵀ per head, D: (e′, r), U: (r, d); the interface of a QKForm's
    `scores` and `attend`, without statistics capture: a `lit_growattn.contract.ScoreMap`, not a growable form."""

    def __init__(
        self, n_embd: int, n_head: int, d_head: int, rank: int, bias: bool, d2_ratio: float, sdpa_pad: SdpaPad = "auto"
    ):
        super().__init__()
        e_in = n_embd + int(bias)
        self.bias, self.sdpa_pad = bias, sdpa_pad
        self.down_q = uniform_parameter(n_head, e_in, rank, fan_in=n_embd)
        self.down_k = uniform_parameter(n_head, e_in, rank, fan_in=n_embd)
        self.up_q = uniform_parameter(n_head, rank, d_head, fan_in=rank)
        self.up_k = uniform_parameter(n_head, rank, d_head, fan_in=rank)
        self.log_tau = nn.Parameter(torch.full((n_head,), -0.5 * math.log(d_head * d2_ratio)))

    @property
    def n_head(self) -> int:
        return self.up_q.shape[0]

    @property
    def d_head(self) -> int:
        return self.up_q.shape[-1]

    def queries_keys(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """X (b, s, e) → τQ2, K2, each (b, h, s, d)."""
        xa = augment(x, self.bias)
        q = torch.einsum("bse,her->bhsr", xa, self.down_q) @ self.up_q
        k = torch.einsum("bse,her->bhsr", xa, self.down_k) @ self.up_k
        return q * self.log_tau.exp()[:, None, None], k

    def scores(self, x: Tensor) -> Tensor:
        return causal_scores(*self.queries_keys(x))

    def attend(self, x: Tensor, v: Tensor) -> Tensor:
        q, k = self.queries_keys(x)
        return causal_attention(q, k, v, self.sdpa_pad)

    def bias_row_parameters(self) -> list[nn.Parameter]:
        return [self.down_q, self.down_k] if self.bias else []

    def resize_to(self, state_dict: Mapping[str, Tensor], prefix: str) -> None:
        """Takes the width of `state_dict[prefix + "up_q"]` with placeholder values, before loading a checkpoint whose
        map has that width (after growth the hparams record the layer's new d_head, but this map keeps the width
        it was built with)."""
        key = f"{prefix}up_q"
        if key in state_dict and state_dict[key].shape[-1] != self.d_head:
            h, rank, _ = self.up_q.shape
            self.up_q = nn.Parameter(self.up_q.new_zeros(h, rank, state_dict[key].shape[-1]))
            self.up_k = nn.Parameter(self.up_k.new_zeros(h, rank, state_dict[key].shape[-1]))


@register_attention("lowrank_dint")
class LowRankDintAttention(DenoisedAttention):
    """Args:
        rank: rank r of the second map's factors.
        d2_ratio: d₂ / d_head; the second temperature starts at 1/√d₂. 1/9 equalises both maps' score variance
            at init for this initialisation.
        lambda_init: initial λ of every head (None → DIFF's schedule in the layer index).
    """

    def __init__(
        self, cfg: AttentionConfig, layer_idx: int, rank: int, d2_ratio: float = 1 / 9, lambda_init: float | None = None
    ):
        if rank < 1 or d2_ratio <= 0:
            raise ValueError(f"lowrank_dint needs rank ≥ 1 and d2_ratio > 0, got rank={rank}, d2_ratio={d2_ratio}")
        e_in = cfg.n_embd + int(cfg.bias)
        if rank > e_in:
            raise ValueError(
                f"lowrank_dint rank={rank} exceeds n_embd{' + 1 (bias)' if cfg.bias else ''} = {e_in}: the second map's "
                f"form has rank ≤ min(rank, n_embd, d_head) and d_head never exceeds n_embd, so a larger rank adds "
                f"parameters, never rank; use rank ≤ {e_in}")
        qk2 = LowRankQK(cfg.n_embd, cfg.n_head, cfg.head_size(layer_idx), rank, cfg.bias, d2_ratio, cfg.sdpa_pad)
        super().__init__(cfg, layer_idx, qk2, lambda_init)
