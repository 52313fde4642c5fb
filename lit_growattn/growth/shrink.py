"""Shrinking a query/key form: the closest form of a smaller head size (the peer that growth must beat).

Per head the form is M = τ W_Q W_Kᵀ (e′ × e′). Its best rank-r approximation in Frobenius norm is the
truncated SVD U_r Σ_r V_rᵀ (Eckart–Young), so the shrunk form keeps τ and takes
W_Q′ = U_r (Σ_r/τ)^½, W_K′ = V_r (Σ_r/τ)^½. When r ≥ rank M nothing is lost. A pair whose singular value
vanishes would be two zero columns, which never receive gradient; it becomes zero fan-in instead (Q column
from U, K column zero), which leaves the function unchanged and lets the K column learn at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
