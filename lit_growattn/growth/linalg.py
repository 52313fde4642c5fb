"""Small float64 linear-algebra helpers shared by the statistics and the factorisation.

A LayerNorm output has rows that sum to zero, so C = X′ᵀX′ is always singular (docs/design.md §1): every inverse
here is an eigendecomposition with an explicit cut-off relative to the largest eigenvalue, never
`torch.linalg.pinv`'s default tolerance.
"""

from __future__ import annotations

import torch
from torch import Tensor


def psd_pinv(a: Tensor, rcond: float) -> Tensor:
    """Pseudo-inverse of symmetric PSD matrices a (…, e, e), float64; eigenvalues ≤ rcond·λ_max count as zero."""
    w, v = torch.linalg.eigh(a.double())
    keep = w > rcond * w[..., -1:]  # eigh sorts ascending
    inv = torch.where(keep, 1.0 / torch.where(keep, w, 1.0), 0.0)
    return (v * inv.unsqueeze(-2)) @ v.mT


def psd_ridge_inverse(a: Tensor, ridge: float | None, rcond: float) -> Tensor:
    """(a + ρI)⁻¹ of symmetric PSD matrices a (…, e, e), float64, with ρ = ridge × a's mean eigenvalue (tr(a)/e, per
    matrix), so that the ridge is a share of the data's own scale. ridge None or 0: the pseudo-inverse `psd_pinv` with
    its cut-off, the limit ρ → 0 on the range of a, where statistics of inputs X′ (N̄ = ΣX′ᵀGX′) live."""
    if not ridge:
        return psd_pinv(a, rcond)
    if ridge < 0:
        raise ValueError(f"ridge must be ≥ 0 (a multiple of the mean eigenvalue), got {ridge}")
    w, v = torch.linalg.eigh(a.double())
    shifted = w + ridge * w.mean(-1, keepdim=True)
    return (v / shifted.unsqueeze(-2)) @ v.mT


def psd_sqrt(a: Tensor, rcond: float) -> tuple[Tensor, Tensor]:
    """(a^½, a^-½) of a symmetric PSD matrix a (…, e, e), float64.

    Eigenvalues are clamped *up* to rcond·λ_max rather than zeroed: both roots then exist and are exact
    inverses, so a change of coordinates through them loses nothing (the null space of C̄ just weighs little).
    """
    w, v = torch.linalg.eigh(a.double())
    if (w[..., -1] <= 0).any():
        raise ValueError("cannot whiten with a zero input covariance")
    w = w.clamp_min(rcond * w[..., -1:])
    return (v * w.sqrt().unsqueeze(-2)) @ v.mT, (v * w.rsqrt().unsqueeze(-2)) @ v.mT


def column_basis(w: Tensor) -> Tensor:
    """Orthonormal basis of the column span of w (…, e, d) as (…, e, d), columns beyond the rank set to zero.

    Zero columns are common (zero fan-in keys from an earlier growth), so QR's arbitrary completion would be wrong.
    """
    u, s, _ = torch.linalg.svd(w, full_matrices=False)
    tol = max(w.shape[-2:]) * torch.finfo(s.dtype).eps * s[..., :1]
    return u * (s > tol).unsqueeze(-2)


def project_out(a: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """(I − P_left) a (I − P_right) for a (…, e, e), orthonormal bases left, right (…, e, k); zero columns allowed."""
    a = a - left @ (left.mT @ a)
    return a - (a @ right) @ right.mT


def score_energy(a: Tensor, c: Tensor) -> Tensor:
    """Σ_heads tr(aᵀ c a c) for a (h, e, e), c (e, e): ‖X a Xᵀ‖²_F summed over heads when c = XᵀX."""
    return (a * (c @ a @ c)).sum()


def factored_score_energy(left: Tensor, right: Tensor, c: Tensor) -> Tensor:
    """score_energy(left @ rightᵀ, c) for left, right (h, e, d) without the (h, e, e) product:
    Σ_heads tr((Lᵀ c L)(Rᵀ c R)), d×d matrices only (d ≪ e before a growth)."""
    return ((left.mT @ c @ left) * (right.mT @ c @ right)).sum()


def thin_svd(left: Tensor, right: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The SVD u diag(s) vᵀ of left @ rightᵀ for thin factors left (…, m, r), right (…, n, r), without the m × n
    product: two QRs and the SVD of an r × r core. u (…, m, r′), s (…, r′) descending, v (…, n, r′), r′ = min(m, n, r);
    pairs beyond the product's rank have s at round-off and orthonormal, otherwise arbitrary, u and v."""
    q_left, t_left = torch.linalg.qr(left)
    q_right, t_right = torch.linalg.qr(right)
    u, s, vh = torch.linalg.svd(t_left @ t_right.mT, full_matrices=False)
    return q_left @ u, s, q_right @ vh.mT


def orthonormal_completion(u: Tensor, extra: int) -> Tensor:
    """`extra` orthonormal columns (…, m, extra) orthogonal to the orthonormal columns of u (…, m, k), k + extra ≤ m:
    the next columns of the Householder QR of u, so without the m × m complete basis."""
    reflectors, tau = torch.geqrf(u)
    padded = torch.cat([reflectors, reflectors.new_zeros(*u.shape[:-1], extra)], -1)
    return torch.linalg.householder_product(padded, tau)[..., u.shape[-1]:]


def canonical_signs(u: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Singular pairs (columns of u (…, m, k) and v (…, n, k)) with each pair's sign made canonical: the largest
    entry of u positive. A pair and its negation give the same matrix; fixing the sign makes two computations of one
    matrix (full and sketched statistics, or round-off apart) give the same columns."""
    sign = torch.where(u.gather(-2, u.abs().argmax(-2, keepdim=True)) < 0, -1.0, 1.0)
    return u * sign, v * sign
