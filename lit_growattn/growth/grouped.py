"""Growth of forms whose keys are shared (GQA) or whose leading columns are rotary (RoPE); docs/hf.md, "Growth".

Shapes: H query heads, KV key heads, group size g = H/KV (query head j uses key head j // g), input size e′,
head size d = r + nope (the first r columns rotary). M_j = τ_j W_Qj W_K(j//g)ᵀ counts every column as it acts at
relative position 0 (RoPE's rotation is the identity there); only the direction's normalisation and the
bottleneck's projections use M, and new columns are NoPE, for which N̄_j = Σ X′ᵀG_jX′ is the exact gradient.
- append (the only mode): per group the part of its heads' directions stacked, [ΔM_j]_j (g·e′ × e′), that no
  first-order change of the factors reaches (`GroupedGrowth.bottleneck`: the shared key head moves the heads' Q
  factors together, so the projection is onto the group's stacked Q span, not each head's), and its truncated SVD
  ≈ U Σ Vᵀ: the rows of U split into per-head Q columns, V gives the group's new K columns. With τ̄ the group's mean temperature,
      K_new = V (ασ/τ̄)^½,   Q_new,j = U_j (ασ τ̄)^½ / τ′_j,   so τ′_j Q_new,j K_newᵀ = α U_j Σ Vᵀ;
  zero fan-in (α = 0, vanishing σ) keeps the Q column and sets the K column to 0, as `factorize` does.
- replace is refused: it would refactor the rotary columns (not one bilinear form of X), and one K factor cannot
  hold the SVDs of several heads' forms.
The same `Growth` records as `factorize.FormGrowth`; `growth_for` picks the class for a form.
The automatic schedule's gains (`allocation`) per group: column j of group g is its shared K column v_j with
per-head Q parts u_{j,h}, so its first-order decrease at α = 1 is −σ_j Σ_{h in g} u_{j,h}ᵀ N̄_h v_j (`column_gains`),
exact for the appended (NoPE) columns.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from lit_growattn.growth.choices import BASELINES, METHODS, MODES, TEMPERATURES, TRUNCATIONS, check_choice
from lit_growattn.growth.factorize import FAN_IN_FLOOR, VANISH, Carry, FormGrowth, Growth, sizing_method
from lit_growattn.growth.form import FormShape
from lit_growattn.growth.linalg import column_basis, factored_score_energy, psd_sqrt
from lit_growattn.growth.solvers import DIRECTIONS, direction
from lit_growattn.growth.stats import Moments


def refused_mode(form, mode: str, line_search: str = "low_rank") -> str | None:
    """Why `mode` (or the line search) cannot grow `form` (None: it can)."""
    rotary, grouped = getattr(form, "rotary", 0), form.w_k.shape[0] != form.w_q.shape[0]
    if mode == "replace" and rotary:
        return (f"mode='replace' refactors every query/key column, but the first {rotary} columns are rotary (RoPE "
                "rotates them by position, so they are not one bilinear form of X): use mode='append', which keeps "
                "them and appends position-independent columns")
    if mode == "replace" and grouped:
        return "mode='replace' cannot share one K factor among a GQA group's query heads: use mode='append'"
    if line_search == "full_rank" and (rotary or grouped):
        return ("line_search='full_rank' rates M + αΔM refactored at full rank (a replace), which rotary or GQA "
                "columns cannot take: use line_search='low_rank'")
    return None


def check_modes(named_forms, mode: str, line_search: str) -> None:
    """Refuses, naming the form and the reason, a mode or line search that some (name, form) cannot take."""
    for _, name, form in named_forms:
        if reason := refused_mode(form, mode, line_search):
            raise ValueError(f"{name}: {reason}")


def is_grouped(form) -> bool:
    """True when query heads share keys (GQA) or leading columns are rotary: the form grows by GroupedGrowth."""
    return form.w_k.shape[0] != form.w_q.shape[0] or bool(getattr(form, "rotary", 0))


def growth_for(form, moments: Moments, method: str = "natural", **kwargs) -> FormGrowth | GroupedGrowth:
    """FormGrowth for a plain form; GroupedGrowth when keys are shared or leading columns rotary."""
    if not is_grouped(form):
        return FormGrowth.from_form(form, moments, method, **kwargs)
    return GroupedGrowth(form.w_q, form.w_k, form.log_tau, moments, method, rotary=form.rotary, **kwargs)


class GroupedGrowth(FormShape):
    """The α-independent part of growing one grouped form (API of `factorize.FormGrowth`).

    w_q (H, e′, d), w_k (KV, e′, d), log_tau (H,); moments with n (H, e′, e′); rotary: leading rotary columns;
    ridge: natural's (`solvers.natural`).
    """

    def __init__(self, w_q: Tensor, w_k: Tensor, log_tau: Tensor, moments: Moments, method: str = "natural", *,
                 rotary: int = 0, truncation: str = "euclidean", rcond: float = 1e-6, size_by: str | None = None,
                 ridge: float | None = None):
        check_choice("method", method, METHODS)
        check_choice("truncation", truncation, TRUNCATIONS)
        if w_q.shape[0] % w_k.shape[0]:
            raise ValueError(f"{w_q.shape[0]} query heads cannot share {w_k.shape[0]} key heads evenly")
        self.method, self.rotary, self.rcond, self.ridge = method, rotary, rcond, ridge
        self.moments, self.dtype = moments, w_q.dtype
        self.sizing_method = sizing_method(method, size_by)
        self.w_q, self.w_k, self.log_tau = (t.detach().double() for t in (w_q, w_k, log_tau))
        self.group = w_q.shape[0] // w_k.shape[0]
        self._roots = psd_sqrt(moments.c, rcond) if truncation == "whitened" else None
        self._directions: dict[str, Tensor] = {}
        self._bottlenecks: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    def keys_per_head(self, w: Tensor) -> Tensor:
        return w.repeat_interleave(self.group, 0)

    def direction(self, method: str) -> Tensor:
        """Normalised ΔM (H, e′, e′) per query head, M counting rotary columns at relative position 0."""
        if method not in self._directions:
            tau_q = self.log_tau.exp()[:, None, None] * self.w_q
            energy = factored_score_energy(tau_q, self.keys_per_head(self.w_k), self.moments.c)
            self._directions[method] = direction(method, self.moments, energy, self.rcond, self.ridge)
        return self._directions[method]

    def bottleneck(self, method: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per group, in the truncation's coordinates: u (KV, g·e′, e′), σ (KV, e′), v (KV, e′, e′), ‖ΔM‖² (KV,).

        The residual of the group's ΔM_j that no first-order change of the factors reaches: δM_j = τ_j (δW_Q,j W_Kᵀ
        + W_Q,j δW_Kᵀ) with δW_K shared by the group. Each head's own δW_Q,j takes the part in the span of W_K's
        columns on the right, (I − P_K); the shared δW_K can only move the heads' left factors together, so what it
        takes is the projection onto the span of the group's stacked [τ_j W_Q,j]_j (g·e′ × d), not onto each
        head's own W_Q,j: R = (I − P_stacked) [ΔM_j (I − P_K)]_j. For one head per group R = (I − P_Q)ΔM(I − P_K)."""
        if method not in self._bottlenecks:
            delta = self._to_work(self.direction(method))
            basis_k = self.keys_per_head(column_basis(self._cols(self.w_k, 0)))
            kv, e = self.w_k.shape[0], self.e_in
            outside = (delta - (delta @ basis_k) @ basis_k.mT).reshape(kv, self.group * e, e)
            left = (self.log_tau.exp()[:, None, None] * self._cols(self.w_q, 0)).reshape(kv, self.group * e, -1)
            basis_q = column_basis(left)
            stacked = outside - basis_q @ (basis_q.mT @ outside)
            u, s, vh = torch.linalg.svd(stacked, full_matrices=False)
            energy = delta.square().sum((-2, -1)).reshape(kv, self.group).sum(-1)
            self._bottlenecks[method] = u, s, vh.mT, energy
        return self._bottlenecks[method]

    def rank(self, threshold: float, max_d_head: int) -> int:
        s = self.bottleneck(self.sizing_method)[1]
        count = int((s > threshold * s.max()).sum(-1).max())
        return max(0, min(max(count, 1), min(max_d_head, self.e_in) - self.d_head))

    def column_gains(self, n: Tensor | None = None) -> Tensor:
        """First-order loss decrease −σ_j Σ_{h in group} u_{j,h}ᵀ N̄_h v_j of appending the group's bottleneck pair j
        at α = 1, per group (KV, e′), in the order `append` takes the pairs; against this form's N̄ or a given one
        (H, e′, e′). Summed over groups it is the layer's gain of column j (`allocation.layer_gains`)."""
        u, s, v, _ = self.bottleneck(self.sizing_method)
        kv, e = self.w_k.shape[0], self.e_in
        n = self.moments.n if n is None else n
        u_heads = self._cols(u.reshape(self.n_head, e, -1), 1)  # rows of a group's U: its heads in order
        v_heads = self.keys_per_head(self._cols(v, 1))
        per_head = torch.einsum("hej,hef,hfj->hj", u_heads, n.to(u.dtype), v_heads)
        return -s * per_head.reshape(kv, self.group, -1).sum(1)

    def grow(self, alpha: float, d_new: int, *, mode: str = "append", temperature: str = "keep",
             generator: torch.Generator | None = None) -> Growth:
        check_choice("mode", mode, MODES)
        check_choice("temperature", temperature, TEMPERATURES)
        if mode != "append":
            raise ValueError(refused_mode(self, mode))
        if not alpha >= 0:
            raise ValueError(f"step size α must be ≥ 0, got {alpha}")
        if not self.d_head <= d_new <= self.e_in:
            raise ValueError(f"d_new={d_new} must lie between the current d_head {self.d_head} and e′ = {self.e_in}")
        grown = self._build(self.method, alpha, d_new, temperature, generator)
        if alpha > 0 and self.method in DIRECTIONS and self.method != "gradient" and grown.predicted_decrease <= 0:
            grown = dataclasses.replace(self._build("gradient", alpha, d_new, temperature, generator), fell_back=True)
        return grown

    def _build(self, method: str, alpha: float, d_new: int, temperature: str, generator) -> Growth:
        d, p, kv, e = self.d_head, d_new - self.d_head, self.w_k.shape[0], self.e_in
        log_tau = self.log_tau + 0.5 * math.log(d / d_new) if temperature == "rescale" else self.log_tau
        tau = log_tau.exp()
        tau_group = tau.reshape(kv, self.group).mean(-1)  # (KV,)
        c = (d_new / d) ** 0.25 if temperature == "rescale" else 1.0  # (τ/τ′)^½ on the old columns
        if method in BASELINES:
            new_q, new_k, discarded, spectrum = self._random_pairs(method, p, c, generator)
        else:
            u, s, v, energy = self.bottleneck(method)
            sigma = s[:, :p]
            live = (sigma > VANISH * s[:, :1]) & (alpha > 0)
            fan_in = torch.where(live, alpha * sigma, sigma.clamp_min(FAN_IN_FLOOR * s[:, :1]))  # (KV, p)
            u_heads = u[:, :, :p].reshape(kv, self.group, e, p)
            q_scale = (fan_in * tau_group[:, None]).sqrt()[:, None, None, :] / tau.reshape(kv, self.group)[..., None, None]
            new_q = self._cols((u_heads * q_scale).reshape(self.n_head, e, p), 1)
            new_k = self._cols(v[:, :, :p] * (alpha * sigma * live / tau_group[:, None]).sqrt()[:, None, :], 1)
            discarded = (alpha**2 * (energy - (sigma.square() * live).sum(-1))).clamp_min(0)
            spectrum = sigma
        w_q, w_k = torch.cat([c * self.w_q, new_q], -1), torch.cat([c * self.w_k, new_k], -1)
        old = Carry((slice(None), slice(None), slice(0, d)), 1 / c, 1 / c**2)
        return Growth(w_q=w_q.to(self.dtype), w_k=w_k.to(self.dtype), log_tau=log_tau.to(self.dtype),
                      carries={"w_q": old, "w_k": old, "log_tau": Carry((slice(None),))},
                      predicted_decrease=self._first_order(tau, w_q, w_k), discarded_energy=discarded,
                      spectrum=spectrum, alpha=alpha, method=method)

    def _first_order(self, tau: Tensor, w_q: Tensor, w_k: Tensor) -> float:  # see FormGrowth._first_order
        # An append leaves the old columns' part of M as it was (also under rescale, τ′c² = τ): M_j′ − M_j is
        # τ′_j Q_new,j K_new,gᵀ, the appended columns alone, which spares the cancellation of two large inner products.
        new_q, new_k = w_q[..., self.d_head:], w_k[..., self.d_head:]
        change = tau[:, None, None] * new_q @ self.keys_per_head(new_k).mT
        return -float((self.moments.n * change).sum())

    def _random_pairs(self, method: str, p: int, c: float, generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Baselines: N(0, σ²) columns, σ the RMS of the head's (rescaled) old columns; `zero`: zero K columns."""
        where = self.w_q.device if generator is None else generator.device

        def normal_like(w: Tensor) -> Tensor:
            noise = torch.randn(*w.shape[:2], p, generator=generator, dtype=torch.float64, device=where).to(w.device)
            return noise * (c * w).square().mean((1, 2), keepdim=True).sqrt()

        new_q, new_k = normal_like(self.w_q), normal_like(self.w_k)
        new_k = new_k if method == "random" else torch.zeros_like(new_k)
        return new_q, new_k, self.w_q.new_zeros(self.w_k.shape[0]), self.w_q.new_zeros(self.w_k.shape[0], 0)

    def _to_work(self, a: Tensor) -> Tensor:
        return a if self._roots is None else self._roots[0] @ a @ self._roots[0]

    def _cols(self, w: Tensor, which: int) -> Tensor:
        """Columns into (which = 0) or out of (which = 1) the truncation's coordinates."""
        return w if self._roots is None else self._roots[which] @ w
