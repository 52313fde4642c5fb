"""Shrinking a query/key form: the closest form of a smaller head size (the peer that growth must beat).

Per head the form is M = τ W_Q W_Kᵀ (e′ × e′). Its best rank-r approximation in Frobenius norm is the
truncated SVD U_r Σ_r V_rᵀ (Eckart–Young), so the shrunk form keeps τ and takes
W_Q′ = U_r (Σ_r/τ)^½, W_K′ = V_r (Σ_r/τ)^½. When r ≥ rank M nothing is lost. A pair whose singular value
vanishes would be two zero columns, which never receive gradient; it becomes zero fan-in instead (Q column
from U, K column zero), which leaves the function unchanged and lets the K column learn at once.

The value side is the same for a linear map: each head's W_M = W_V W_O (e′ × e) truncated to rank r gives
W_V′ = U_r Σ_r^½ and W_O′ = Σ_r^½ V_rᵀ (`shrink_values`); a vanishing pair keeps a V column and a zero O row.

`allocate_ranks` chooses the per-layer sizes to shrink to under a K-cache budget (the post-hoc allocation growth
is compared with).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lit_growattn.growth.allocation import buy_columns
from lit_growattn.growth.factorize import FAN_IN_FLOOR, VANISH


def shrink_form(w_q: Tensor, w_k: Tensor, log_tau: Tensor, d_new: int) -> tuple[Tensor, Tensor, Tensor]:
    """The closest head-size-d_new form to τ W_Q W_Kᵀ per head.

    w_q, w_k (h, e′, d), log_tau (h,) → w_q′, w_k′ (h, e′, d_new) in the input dtype, and the discarded
    energy ‖M − M′‖²_F per head (h,), float64. τ is kept as it is.
    """
    h, e_in, d = w_q.shape
    if not 1 <= d_new <= d:
        raise ValueError(f"can shrink a head size of {d} to a size between 1 and {d}, not {d_new}")
    tau = log_tau.detach().double().exp()[:, None, None]
    m = tau * w_q.detach().double() @ w_k.detach().double().mT
    u, s, vh = torch.linalg.svd(m)
    kept = s[:, :d_new]
    live = kept > VANISH * s[:, :1]
    root = (kept * live / tau[:, :, 0]).sqrt().unsqueeze(1)
    new_q, new_k = u[:, :, :d_new] * root, vh[:, :d_new].mT * root
    largest = torch.where(s[:, :1] > 0, s[:, :1], 1.0)  # a zero form still gets Q columns that are not zero
    floor = (FAN_IN_FLOOR * largest / tau[:, :, 0]).sqrt().unsqueeze(1)
    new_q = torch.where(live.unsqueeze(1), new_q, u[:, :, :d_new] * floor)
    discarded = s[:, d_new:].square().sum(-1)
    return new_q.to(w_q.dtype), new_k.to(w_k.dtype), discarded


def shrink_values(w_v: Tensor, w_o: Tensor, d_new: int) -> tuple[Tensor, Tensor, Tensor]:
    """The closest value-head-size-d_new map to each head's W_M = W_V W_O.

    w_v (h, e′, d), w_o (h, d, e) with one value head per query head → w_v′ (h, e′, d_new), w_o′ (h, d_new, e) in
    the input dtype, and the discarded energy ‖W_M − W_M′‖²_F per head (h,), float64.
    """
    h, _, d = w_v.shape
    if w_o.shape[0] != h:
        raise ValueError(f"{w_o.shape[0]} query heads share {h} value heads: shrinking one shared value head for "
                         "several heads' maps is not a truncated SVD; it is refused")
    if not 1 <= d_new <= d:
        raise ValueError(f"can shrink a value head size of {d} to a size between 1 and {d}, not {d_new}")
    u, s, vh = torch.linalg.svd(w_v.detach().double() @ w_o.detach().double(), full_matrices=False)
    kept = s[:, :d_new]
    live = kept > VANISH * s[:, :1]
    root = kept.sqrt().unsqueeze(1)
    largest = torch.where(s[:, :1] > 0, s[:, :1], 1.0)
    floor = (FAN_IN_FLOOR * largest).sqrt().unsqueeze(1)
    new_v = torch.where(live.unsqueeze(1), u[:, :, :d_new] * root, u[:, :, :d_new] * floor)
    new_o = (vh[:, :d_new] * (root * live.unsqueeze(1)).mT)
    return new_v.to(w_v.dtype), new_o.to(w_o.dtype), s[:, d_new:].square().sum(-1)


def allocate_ranks(layers: Sequence[Sequence[tuple[Tensor, Tensor, Tensor]]], budget: float) -> list[int]:
    """Per-layer head sizes to shrink to within a K-cache budget, by SVD energy (Palu's and Eigen Attention's
    post-hoc allocation).

    layers: each layer's forms as (w_q, w_k, log_tau) (one for mha; the forms of a layer share its d_head).
    budget: K-cache values per token, Σ_layers kv_l × d_l, where kv_l is the layer's key heads summed over its forms.
    Every layer keeps at least one column; each further column goes, greedily, to the layer whose next singular
    value adds the most energy per cache value: Σ over the layer's forms and query heads of σ_r² of
    M = τ W_Q W_Kᵀ, which is what `shrink_form` keeps. A layer never exceeds its current d_head, and the budget is
    never exceeded. With equal key heads per layer this is the optimum (each layer's gains fall with r); with
    unequal ones it is the greedy knapsack. Under GQA the query heads sharing a key are rated one by one, an
    upper bound on what a shared key keeps.
    """
    gains = [sum(_energy_per_column(*form) for form in forms).tolist() for forms in layers]
    costs = [sum(w_k.shape[0] for _, w_k, _ in forms) for forms in layers]
    spent = sum(costs)
    if spent > budget:
        raise ValueError(f"a budget of {budget} K-cache values per token is below one column per layer ({spent}): "
                         f"give at least {spent}")
    return buy_columns(gains, costs, budget, held=[1] * len(layers))


def _energy_per_column(w_q: Tensor, w_k: Tensor, log_tau: Tensor) -> Tensor:
    """(d_head,) float64: σ_r² of τ W_Q W_Kᵀ summed over the query heads, r = 0 … d_head − 1."""
    n_head, n_kv = w_q.shape[0], w_k.shape[0]
    keys = w_k.detach().double().repeat_interleave(n_head // n_kv, dim=0)  # query head j reads key head j // group
    m = log_tau.detach().double().exp()[:, None, None] * w_q.detach().double() @ keys.mT
    return torch.linalg.svdvals(m)[:, : w_q.shape[-1]].square().sum(0)
