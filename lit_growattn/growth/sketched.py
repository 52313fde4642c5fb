"""Sketched growths: the growths of both sides from the thin factors of sketched statistics (`sketch`).

Growth from thin factors. Directions are products ΔM_j = A_jB_gᵀ: gradient A = −L, B = R; natural A = −(C̄ + ρI)⁻¹L,
B = (C̄ + ρI)⁻¹R (ridge ρ; none: C̄⁺). The bottleneck (I − P_stacked)[A_j]_j·((I − P_K)B)ᵀ is two thin QRs and a k × k
SVD (`linalg.thin_svd`); gains, the normalisation tr(ΔMᵀC̄ΔMC̄) = tr((AᵀC̄A)(BᵀC̄B)) and the predicted decrease
⟨N̂, M′ − M⟩ are traces of small matrices. Nothing of size e′ × e′ (e′ × e) per head is formed. On the value side the
natural direction inverts Ĉ_j + ρ_jI by Woodbury on its thin root. The sketched growths (`SketchedFormGrowth`,
`SketchedGroupedGrowth`, `SketchedValueGrowth`) are the full ones (`FormGrowth`, `GroupedGrowth`, `ValueGrowth`) with
their direction, bottleneck, gains and first-order prediction taken from the factors; everything that turns pairs
into columns is theirs. Pair signs are canonical (`linalg.canonical_signs`).

Exactness. When each group's stacked statistics have rank ≤ k (and C_V,j rank ≤ k_c), the sketched growth equals the
full one: the same columns up to each pair's sign, gains and predicted decrease. With k ≥ e′ it is exact for any
statistics. Pairs beyond the sketch's k cannot be priced: a sketched growth appends at most k columns per head per
event, except on the value side under natural, where each head's own (Ĉ_j + ρ_jI)⁻¹ turns the group's shared range
into up to g·k directions (the full path's when the group's statistics have rank ≤ k); under gradient the heads of a
group share their left factor, and its pairs beyond k are round-off, not offered.

`pinv` cannot be sketched: it sums each sequence's C_i⁺N_iC_i⁺, which is not a function of the summed N̄ a sketch keeps.
Nor can a direction registered by a user, which reads N̄ itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_growattn.growth.choices import BASELINES, check_choice
from lit_growattn.growth.factorize import FormGrowth, sizing_method, zero_fan_in_columns
from lit_growattn.growth.grouped import GroupedGrowth, is_grouped
from lit_growattn.growth.linalg import (
    canonical_signs, column_basis, factored_score_energy, orthonormal_completion, psd_pinv, psd_ridge_inverse, thin_svd,
)
from lit_growattn.growth.sketch import Factored, SketchMoments, SketchValueMoments, nystrom_solve
from lit_growattn.growth.solvers import energy_scale
from lit_growattn.growth.value import ValueGrowth

# The directions a sketch can give: pinv needs each sequence's own C_i⁺ (module docstring), a user's direction N̄.
SKETCH_DIRECTIONS = ("natural", "gradient")


def _check_sketchable(method: str, size_by: str | None) -> None:
    check_choice("method under a sketch", method, (*SKETCH_DIRECTIONS, *BASELINES))
    if method in BASELINES:
        check_choice("size_by under a sketch", sizing_method(method, size_by), SKETCH_DIRECTIONS)


class SketchedGrowth:
    """What the sketched growths of both sides share: a sketch prices at most its bottleneck's pairs per group and
    event (pairs beyond its rank it cannot see), so a growth by more columns is refused, not filled blindly. Mixed in
    before the full growth class, whose `grow` it guards."""

    @property
    def pairs(self) -> int:
        """The bottleneck pairs per group this sketch holds: its thin bottleneck's columns (query/key min(e′, k),
        value min(e′, g·e, g·k) under natural, min(e′, e, k) under gradient: `SketchedValueGrowth.bottleneck`)."""
        return self.bottleneck(self.sizing_method)[1].shape[-1]

    def grow(self, alpha: float, d_new: int, **kwargs):
        if self.method not in BASELINES and d_new - self.width > self.pairs:
            raise ValueError(f"d_new={d_new} needs {d_new - self.width} bottleneck pairs per head, and this sketch "
                             f"prices at most {self.pairs}: grow fewer columns, or sketch with a larger k")
        return super().grow(alpha, d_new, **kwargs)


class SketchedForm(SketchedGrowth):
    """What the sketched query/key growths share: the direction, bottleneck, gains and first-order terms from the
    factors of SketchMoments (module docstring), in the conventions of `GroupedGrowth` (per group of query heads
    sharing a key head; one head per group for a plain form). Mixed in before FormGrowth or GroupedGrowth, which
    turn the pairs into columns."""

    moments: SketchMoments

    def __init__(self, w_q: Tensor, w_k: Tensor, log_tau: Tensor, moments: SketchMoments, method: str = "natural",
                 **kwargs):
        _check_sketchable(method, kwargs.get("size_by"))
        super().__init__(w_q, w_k, log_tau, moments, method, **kwargs)

    def _per_query_head(self, w: Tensor) -> Tensor:
        return w.repeat_interleave(self.n_head // self.n_kv_head, 0)

    def direction(self, method: str) -> Factored:
        """Normalised ΔM_j = left_j right_gᵀ as thin factors left (H, e′, r), right (KV, e′, r), scaled as
        `solvers.direction` scales ΔM: its score energy Σ_j tr((left_jᵀC̄left_j)(right_gᵀC̄right_g)) made M's."""
        if method not in self._directions:
            left, right = self.moments.n
            if method == "natural":
                inverse = psd_ridge_inverse(self.moments.c, self.ridge, self.rcond)
                # (inverse @ f) as (fᵀ inverse)ᵀ: the inverse is symmetric, and a 2-D right operand is not expanded
                # to one copy per head.
                left, right = (left.mT @ inverse).mT, (right.mT @ inverse).mT
            c, tau_q = self.moments.c, self.log_tau.exp()[:, None, None] * self.w_q
            target = factored_score_energy(tau_q, self._per_query_head(self.w_k), c)
            current = factored_score_energy(left, self._per_query_head(right), c)
            self._directions[method] = Factored(-left * energy_scale(current, target), right)
        return self._directions[method]

    def bottleneck(self, method: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per group, in the truncation's coordinates: u (KV, g·e′, r), σ (KV, r) descending, v (KV, e′, r) with
        canonical signs, and ‖ΔM‖² (KV,): `GroupedGrowth.bottleneck`'s (I − P_stacked)[ΔM_j(I − P_K)]_j with
        ΔM_j = A_jBᵀ, i.e. the thin SVD of (I − P_stacked)[A_j]_j and (I − P_K)B."""
        if method not in self._bottlenecks:
            left, right = (self._cols(f, 0) for f in self.direction(method))
            kv, e, r = self.n_kv_head, self.e_in, left.shape[-1]
            group = self.n_head // kv
            basis_k = column_basis(self._cols(self.w_k, 0))
            right_out = right - basis_k @ (basis_k.mT @ right)
            tau_q = self.log_tau.exp()[:, None, None] * self._cols(self.w_q, 0)
            basis_q = column_basis(tau_q.reshape(kv, group * e, -1))
            stacked = left.reshape(kv, group * e, r)
            u, s, v = thin_svd(stacked - basis_q @ (basis_q.mT @ stacked), right_out)
            u, v = canonical_signs(u, v)
            energy = ((left.mT @ left) * self._per_query_head(right.mT @ right)).sum((-2, -1))
            self._bottlenecks[method] = u, s, v, energy.reshape(kv, group).sum(-1)
        return self._bottlenecks[method]

    def column_gains(self, n: Factored | None = None) -> Tensor:
        """−σ_j Σ_{h∈g} u_{j,h}ᵀN̂_h v_j per group (KV, r), in the order the pairs are appended, against this form's N̂
        or another's factors (held out)."""
        u, s, v, _ = self.bottleneck(self.sizing_method)
        left, right = self.moments.n if n is None else n
        u_heads = self._cols(u.reshape(self.n_head, self.e_in, -1), 1)
        along_right = self._per_query_head(right.mT @ self._cols(v, 1))  # (H, r, pairs)
        per_head = ((u_heads.mT @ left) * along_right.mT).sum(-1)
        return -s * per_head.reshape(self.n_kv_head, -1, per_head.shape[-1]).sum(1)

    def _score_inner(self, tau: Tensor, w_q: Tensor, w_k: Tensor) -> float:
        """⟨N̂, τ W_Q W_Kᵀ⟩ summed over heads = Σ_j τ_j tr((L_jᵀW_Q,j)(W_K,gᵀR_g)), for w_q (H, e′, c) and
        w_k (KV, e′, c)."""
        left, right = self.moments.n
        return float((tau[:, None, None] * (left.mT @ w_q) * self._per_query_head(right.mT @ w_k)).sum())


class SketchedFormGrowth(SketchedForm, FormGrowth):
    """`FormGrowth` of a plain form (one key head per query head, no rotary columns) from SketchMoments: append and
    replace. A replace refactors M + αΔM = [τW_Q | αA][W_K | B]ᵀ, of rank ≤ d + r, by the same thin SVD."""

    def _replaced_pairs(self, method: str, alpha: float) -> tuple[Tensor, Tensor, Tensor]:
        left, right = self.direction(method)
        tau_q = self.log_tau.exp()[:, None, None] * self.w_q
        u, s, v = thin_svd(self._cols(torch.cat([tau_q, alpha * left], -1), 0),
                           self._cols(torch.cat([self.w_k, right], -1), 0))
        u, v = canonical_signs(u, v)
        return u, s, v

    def _zero_fan_in(self, method: str, order: Tensor, tau: Tensor) -> Tensor:
        u, s, _, _ = self.bottleneck(method)
        # (order is empty when the event appends no column to this form, as AutoSchedule may decide.)
        extra = (int(order.max()) + 1 if order.numel() else 0) - s.shape[-1]
        if extra > 0:
            # A replace of a rank-deficient M can need more zero fan-in columns than the sketch has pairs. The full
            # path takes its pairs of σ ≈ 0 there, orthonormal directions outside the others: so does the completion
            # (σ = 0, at the floor), where repeating a pair would install the same column twice.
            u = torch.cat([u, orthonormal_completion(u, extra)], -1)
            s = torch.cat([s, s.new_zeros(s.shape[0], extra)], -1)
        return zero_fan_in_columns(u, s, order, tau)

    def _first_order(self, tau: Tensor, w_q: Tensor, w_k: Tensor) -> float:
        return -(self._score_inner(tau, w_q, w_k) - self._score_inner(self.log_tau.exp(), self.w_q, self.w_k))


class SketchedGroupedGrowth(SketchedForm, GroupedGrowth):
    """`GroupedGrowth` (keys shared by GQA groups, or rotary leading columns; append only) from SketchMoments."""

    def _first_order(self, tau: Tensor, w_q: Tensor, w_k: Tensor) -> float:
        # Append only: the appended columns alone, as GroupedGrowth._first_order.
        return -self._score_inner(tau, w_q[..., self.d_head:], w_k[..., self.d_head:])


def sketched_growth_for(form, moments: SketchMoments, method: str = "natural",
                        **kwargs) -> SketchedFormGrowth | SketchedGroupedGrowth:
    """The sketched growth of a query/key form, chosen as `grouped.growth_for` chooses the full one."""
    if not is_grouped(form):
        return SketchedFormGrowth(form.w_q, form.w_k, form.log_tau, moments, method, **kwargs)
    return SketchedGroupedGrowth(form.w_q, form.w_k, form.log_tau, moments, method, rotary=form.rotary, **kwargs)


class SketchedValueGrowth(SketchedGrowth, ValueGrowth):
    """`ValueGrowth` from SketchValueMoments: ΔW_j = A_jX_jᵀ as thin factors, the bottleneck's least-squares residual
    stacked over a group as one thin product (`bottleneck`), Ĉ_j from its Nyström root."""

    moments: SketchValueMoments

    def __init__(self, w_v: Tensor, w_o: Tensor, moments: SketchValueMoments, method: str = "natural", **kwargs):
        _check_sketchable(method, kwargs.get("size_by"))
        super().__init__(w_v, w_o, moments, method, **kwargs)

    def direction(self, method: str) -> Factored:
        """Normalised ΔW_j = left_j right_jᵀ, left (H, e′, r), right (H, e, r): gradient −N̂_V,j, natural
        −(Ĉ_j + ρ_jI)⁻¹N̂_V,j (Woodbury; no ridge: Ĉ_j⁺), scaled as `value_direction` scales: Σ_j tr(ΔW_jᵀĈ_jΔW_j)
        made Σ_j tr(W_M,jᵀĈ_jW_M,j), both as traces of r × r (d × d) matrices through Ĉ_j's root."""
        if method not in self._directions:
            q, right = self.moments.n
            left = self.per_head(q)
            if method == "natural":
                left = nystrom_solve(self.moments.c_root, left, self.ridge, self.rcond)
            root = self.moments.c_root
            root_v, root_left = root.mT @ self.per_head(self.w_v), root.mT @ left
            target = ((root_v.mT @ root_v) * (self.w_o @ self.w_o.mT)).sum()
            current = ((root_left.mT @ root_left) * (right.mT @ right)).sum()
            self._directions[method] = Factored(-left * energy_scale(current, target), right)
        return self._directions[method]

    def bottleneck(self, method: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per group: u (KV, e′, m), σ (KV, m), w (KV, g·e, m) with canonical signs, m = min(e′, g·e, g·r) (gradient:
        at most r), and ‖ΔW‖² (KV,).

        `ValueGrowth.bottleneck`'s residual R_j = (I − P_V)ΔW_j − C_gW_O,j with the common change
        C_g = Σ_i (I − P_V)A_i K_i, K_i = X_iᵀW_O,iᵀ(Σ_j W_O,jW_O,jᵀ)⁺ (r × d), is
        Σ_i (I − P_V)A_i(δ_ij X_jᵀ − K_iW_O,j): side by side over the group, left = [(I − P_V)A_i]_i (e′ × g·r)
        times the transpose of right = blockdiag(X_j) − [W_O,jᵀ]_j [K_iᵀ]_i (g·e × g·r).

        Under gradient every head of a group has the group's left factor, A_i = −L_g: the left side has rank ≤ r, and
        the pairs beyond r are round-off of a sketch that sees nothing there (the full statistics may well hold pairs
        there), so they are cut, as the query/key side's bottleneck has r pairs. Under natural A_i = (Ĉ_i + ρ_iI)⁻¹L_g
        differs per head: up to g·r pairs, each priced by the sketch's N̂_V (docs/value.md §5)."""
        if method not in self._bottlenecks:
            a, x = self.direction(method)
            kv, g, e_in, e_out, r = self.n_kv_head, self.group, self.e_in, self.e_out, a.shape[-1]
            basis_v = self.per_head(column_basis(self.w_v))
            outside = a - basis_v @ (basis_v.mT @ a)
            gram = (self.w_o @ self.w_o.mT).reshape(kv, g, self.d_v, self.d_v).sum(1)
            k_heads = x.mT @ self.w_o.mT @ self.per_head(psd_pinv(gram, self.rcond))  # K_j (H, r, d)
            left = outside.reshape(kv, g, e_in, r).permute(0, 2, 1, 3).reshape(kv, e_in, g * r)
            blocks = x.reshape(kv, g, e_out, 1, r) * torch.eye(g, dtype=x.dtype, device=x.device)[:, None, :, None]
            w_o_rows = self.w_o.mT.reshape(kv, g * e_out, self.d_v)
            k_cols = k_heads.mT.reshape(kv, g, self.d_v, r).permute(0, 2, 1, 3).reshape(kv, self.d_v, g * r)
            u, s, w = thin_svd(left, blocks.reshape(kv, g * e_out, g * r) - w_o_rows @ k_cols)
            if method == "gradient":
                u, s, w = u[..., :r], s[..., :r], w[..., :r]
            u, w = canonical_signs(u, w)
            energy = ((a.mT @ a) * (x.mT @ x)).sum((-2, -1)).reshape(kv, g).sum(-1)
            self._bottlenecks[method] = u, s, w, energy
        return self._bottlenecks[method]

    def column_gains(self, n: Factored | None = None) -> Tensor:
        """−σ_k Σ_{j∈g} u_kᵀN̂_V,j w_k,j per group (KV, m), against this map's N̂_V or another's factors (held out)."""
        u, s, w, _ = self.bottleneck(self.sizing_method)
        q, x = self.moments.n if n is None else n
        per_head = ((self.per_head(u.mT @ q)) * (self._rows_per_head(w).mT @ x)).sum(-1)
        return -s * per_head.reshape(self.n_kv_head, self.group, -1).sum(1)

    def _first_order(self, new_v: Tensor, new_o: Tensor) -> float:
        q, x = self.moments.n
        return -float((self.per_head(q.mT @ new_v) * (new_o @ x).mT).sum())
