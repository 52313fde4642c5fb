"""A growable query/key bilinear form: the one piece of attention that growth touches.

Per head j the scores are S_j = τ_j · (X′ W_Qj)(X′ W_Kj)ᵀ + causal mask, with X′ = [X | 1] when the
form has a bias, and τ_j = exp(log_tau_j) a learnable temperature that replaces 1/√d_head.
The bilinear form of head j is M_j = τ_j W_Qj W_Kjᵀ ∈ ℝ^{e′×e′}.

W_Q and W_K are stored as (n_head, e′, d_head) so that growing d_head appends along the last dim; the
bias is the last row of e′, so it is grown with its columns.

Statistics capture (docs/design.md §4): on a statistics step the form records, per micro-batch, the pair
(X′, G·X′) with G = ∂L/∂S per head, from which N_i = X′ᵢᵀ Gᵢ X′ᵢ follows. Two paths behind one switch:
- "extend": SDPA on Q̃ = [τQ | E], K̃ = [K | X′] with E = 0; E.grad = G X′ (memory b·h·s·e′).
- "explicit": an explicit score map with a gradient hook (memory b·h·s²).
With `sketch` set as well (the statistics window's `growth.sketch.TestMatrices`), both paths record the sketch's
(X′, G X′Ω, GᵀX′Ψ) instead, with k + l extra columns in place of e′ (`attention.sketch`, docs/design.md §12).
With capture off the form runs plain SDPA and costs nothing extra. Both SDPA paths go through
`sdpa.causal_attention`, which pads the widths for the fused kernels (`sdpa_pad`).
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

import torch
from torch import Tensor, nn

from lit_growattn.attention.sdpa import SdpaPad, causal_attention
from lit_growattn.attention.capture import extended_queries_keys, score_gradient_products
from lit_growattn.contract import CaptureMode
from lit_growattn.growth.form import FormShape
from lit_growattn.growth.sketch import TestMatrices


def augment(x: Tensor, bias: bool) -> Tensor:
    """X (b, s, e) → X′ (b, s, e′): appends the constant column that carries the bias."""
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1) if bias else x


@functools.lru_cache(maxsize=16)
def _future(s: int, device: torch.device) -> Tensor:
    """(s, s) True above the diagonal: built once per length, not on every statistics step."""
    # Never an inference tensor (validation runs under inference_mode): a later training step saves it for backward.
    with torch.inference_mode(False):
        return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)


def causal_scores(q: Tensor, k: Tensor) -> Tensor:
    """Explicit scores q·kᵀ (b, h, s, s) with -inf above the diagonal."""
    s = q @ k.transpose(-1, -2)
    # In place: the product's backward needs q and k, not s, and a second (b, h, s, s) map is what costs here.
    return s.masked_fill_(_future(s.shape[-1], s.device), float("-inf"))


class QKForm(FormShape, nn.Module):
    """Satisfies `lit_growattn.contract.GrowableForm`, without grouping (n_kv_head = n_head)."""

    def __init__(
        self, n_embd: int, n_head: int, d_head: int, bias: bool = False, tau_init: float | None = None,
        sdpa_pad: SdpaPad = "auto",
    ):
        super().__init__()
        if n_head <= 0 or d_head <= 0:
            raise ValueError(f"n_head and d_head must be positive, got n_head={n_head}, d_head={d_head}")
        self.n_embd, self.bias, self.sdpa_pad = n_embd, bias, sdpa_pad
        e_in = n_embd + int(bias)
        # nn.Linear's default init, U(-1/√fan_in, 1/√fan_in); the low-rank DINT scale (docs/design.md §8) is derived from it.
        bound = 1.0 / math.sqrt(n_embd)
        self.w_q = nn.Parameter(torch.empty(n_head, e_in, d_head).uniform_(-bound, bound))
        self.w_k = nn.Parameter(torch.empty(n_head, e_in, d_head).uniform_(-bound, bound))
        tau = 1.0 / math.sqrt(d_head) if tau_init is None else tau_init
        self.log_tau = nn.Parameter(torch.full((n_head,), math.log(tau)))
        self.capture: CaptureMode | None = None
        self.sketch: TestMatrices | None = None
        self.captured: list[tuple[Tensor, ...]] = []

    def bias_row_parameters(self) -> list[nn.Parameter]:
        return [self.w_q, self.w_k] if self.bias else []

    def augment(self, x: Tensor) -> Tensor:
        return augment(x, self.bias)

    def bilinear(self) -> Tensor:
        """M (h, e′, e′) = τ W_Q W_Kᵀ per head."""
        return self.tau[:, None, None] * self.w_q @ self.w_k.transpose(-1, -2)

    def queries_keys(self, xa: Tensor) -> tuple[Tensor, Tensor]:
        """X′ (b, s, e′) → τQ, K, each (b, h, s, d_head)."""
        q = torch.einsum("bse,hed->bhsd", xa, self.w_q)
        k = torch.einsum("bse,hed->bhsd", xa, self.w_k)
        # τ in the queries' dtype: under autocast an fp32 τ would promote bf16 queries back to fp32.
        return q * self.tau.to(q.dtype)[:, None, None], k

    def scores(self, x: Tensor) -> Tensor:
        """Explicit causal scores S (b, h, s, s) with -inf above the diagonal (evaluation and references only)."""
        return causal_scores(*self.queries_keys(self.augment(x)))

    def attend(self, x: Tensor, v: Tensor) -> Tensor:
        """softmax(S) · V for x (b, s, e) and v (b, h, s, d_v) → (b, h, s, d_v)."""
        xa = self.augment(x)
        q, k = self.queries_keys(xa)
        if self.capture is None or not torch.is_grad_enabled():
            return causal_attention(q, k, v, self.sdpa_pad)
        if self.capture == "extend":
            return self._attend_extended(xa, q, k, v)
        if self.capture == "explicit":
            return self._attend_explicit(xa, q, k, v)
        raise ValueError(f"unknown capture mode {self.capture!r}; use 'extend' or 'explicit'")

    def _attend_extended(self, xa: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        xa_kept = xa.detach()
        q, k = extended_queries_keys(self.sketch, xa_kept, q, k, lambda *grads: self._record(xa_kept, *grads))
        return causal_attention(q, k, v, self.sdpa_pad)

    def _attend_explicit(self, xa: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        s = causal_scores(q, k)
        xa_kept, sketch, kv = xa.detach(), self.sketch, self.n_kv_head
        s.register_hook(lambda grad: self._record(xa_kept, *score_gradient_products(sketch, xa_kept, grad, kv)))
        return torch.softmax(s, dim=-1) @ v

    def _record(self, xa: Tensor, *grads: Tensor) -> None:
        self.captured.append((xa, *(g.detach().to(xa.dtype) for g in grads)))

    def take_captured(self) -> list[tuple[Tensor, ...]]:
        """What was recorded since the last call: the (X′, G X′) pairs, G X′ (b, h, s, e′); with `sketch` set, the
        (X′, G X′Ω (b, h, s, k), GᵀX′Ψ (b, h, s, l)) triples of `growth.SketchFormStats.update`."""
        out, self.captured = self.captured, []
        return out

    @torch.no_grad()
    def set_weights(self, w_q: Tensor, w_k: Tensor, log_tau: Tensor) -> None:
        """Replaces the parameters (possibly with a new d_head); new Parameter objects, so optimizers must be rebuilt."""
        if w_q.shape != w_k.shape or w_q.shape[:2] != self.w_q.shape[:2] or log_tau.shape != self.log_tau.shape:
            raise ValueError(
                f"new Q/K shapes {tuple(w_q.shape)}/{tuple(w_k.shape)} do not fit a form with "
                f"{self.n_head} heads and input size {self.w_q.shape[1]}"
            )
        like = self.w_q
        self.w_q = nn.Parameter(w_q.to(like.device, like.dtype).contiguous())
        self.w_k = nn.Parameter(w_k.to(like.device, like.dtype).contiguous())
        self.log_tau = nn.Parameter(log_tau.to(like.device, like.dtype).clone())

    def resize_to(self, state_dict: Mapping[str, Tensor], prefix: str) -> None:
        """Takes the head size of `state_dict[prefix + "w_q"]`, with placeholder values (before loading a grown checkpoint)."""
        key = f"{prefix}w_q"
        if key in state_dict and state_dict[key].shape[-1] != self.d_head:
            d_head = state_dict[key].shape[-1]
            self.set_weights(self.w_q.new_zeros(*self.w_q.shape[:2], d_head), self.w_k.new_zeros(*self.w_k.shape[:2], d_head),
                             self.log_tau)
