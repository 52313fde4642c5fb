"""Shrinking a query/key form or a value map: the closest one of a smaller head size (the peer that growth must beat),
and the per-layer sizes under a KV-cache budget.

Query/key. Per head the form is M_j = τ_j W_Qj W_Kjᵀ (e′ × e′). Its error on the scores of inputs X′ with
C̄ = X′ᵀX′/n is ‖X′(M − M′)X′ᵀ‖²_F = n‖R(M − M′)R‖²_F, R = C̄^½ (over all position pairs; attention uses only the
causal pairs of a sequence, which is the approximation). So the best rank-r form truncates the SVD of A = RMR
(Eckart–Young in whitened coordinates) and maps back with R⁻¹; without C̄ (R = I) it is the plain SVD of M, the
weights' energy. Query heads that share a key head (GQA, group g) are stacked, [R M_j R]_{j in g} (g·e′ × e′) =
U Σ Vᵀ, the exact optimum of their summed error under one shared key:
    K′ = R⁻¹ V_r (Σ_r/τ̄)^½,   Q′_j = R⁻¹ U_{j,r} (Σ_r/τ̄)^½ τ̄/τ_j,   so τ_j Q′_j K′ᵀ = R⁻¹ (U_r Σ_r V_rᵀ)_j R⁻¹,
with τ̄ the group's mean temperature (as `grouped` appends) and τ kept; one head per group is the plain MHA case.
Leading rotary columns (RoPE rotates them by position, so they are not one bilinear form of X′) are copied as they
are; only the NoPE columns are truncated. A pair whose singular value vanishes would be two zero columns, which
never receive gradient; it becomes zero fan-in instead (Q column R⁻¹u with a floor, K column zero), which leaves
the function unchanged and lets the K column learn at once.

Values. Each head's W_M,j = W_V W_O,j (e′ × e) acts on P_j = A_j X′, linearly: the output error is
‖P_j(W_M − W_M′)‖² = n·tr(Eᵀ C̄_j E) with C̄_j = P_jᵀP_j/n, one-sided. With R = C̄_g^½ (C̄_g the mean of the group's
C̄_j; exact for one head per group, the group-mean weighting otherwise), R[W_M,j]_{j in g} (e′ × g·e) = U Σ Wᵀ gives
    W_V′ = R⁻¹ U_r Σ_r^½,   W_O′,j = Σ_r^½ W_{j,r}ᵀ;
a vanishing pair keeps a V column and a zero O row.

Budget. `allocate_sizes` buys columns per (layer, side) with `allocation.buy_columns`, by the energy each keeps
(σ² of the side's whitened matrices summed over its groups) per cache value; `shrink_to_budget` does it for a
model's units, from a mean head size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
from torch import Tensor

from lit_growattn.growth.allocation import buy_columns
from lit_growattn.growth.factorize import FAN_IN_FLOOR, VANISH
from lit_growattn.growth.linalg import psd_sqrt
from lit_growattn.growth.sides import column_costs
from lit_growattn.growth.unit import HeadSize

Units = Sequence[tuple[int, str, object]]  # (layer, name, query/key form or value map), as contract.NamedForm


def _whitened_forms(w_q: Tensor, w_k: Tensor, log_tau: Tensor, c: Tensor | None, rotary: int,
                    rcond: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """Each group's stacked whitened NoPE forms [R M_j R]_j (KV, g·e′, e′), R = C̄^½ (I without c), with the
    temperatures τ (H,) and R⁻¹ (None without c)."""
    h, kv = w_q.shape[0], w_k.shape[0]
    if h % kv:
        raise ValueError(f"{h} query heads cannot share {kv} key heads evenly")
    tau = log_tau.detach().double().exp()
    keys = w_k[..., rotary:].detach().double().repeat_interleave(h // kv, dim=0)  # query head j reads key j // g
    m = tau[:, None, None] * w_q[..., rotary:].detach().double() @ keys.mT
    roots = None if c is None else psd_sqrt(c.to(m.device), rcond)
    if roots is not None:
        m = roots[0] @ m @ roots[0]
    return m.reshape(kv, -1, m.shape[-1]), tau, None if roots is None else roots[1]


@dataclass(frozen=True)
class _SVD:
    """U Σ Vᵀ of a unit's whitened matrices per group, leading pairs only, with R⁻¹ (None without C̄) and, for a
    form, its temperatures τ: what shrinking to any size takes (`shrink_to_budget` rates and shrinks from one)."""

    u: Tensor
    s: Tensor
    vh: Tensor
    back: Tensor | None
    tau: Tensor | None = None


def _form_svd(w_q: Tensor, w_k: Tensor, log_tau: Tensor, c: Tensor | None, rotary: int, rcond: float) -> _SVD:
    """The SVD of each group's stacked whitened NoPE forms, its leading d − rotary pairs (the most a form of d − rotary
    NoPE columns has: the others are round-off), with τ and R⁻¹."""
    stacked, tau, back = _whitened_forms(w_q, w_k, log_tau, c, rotary, rcond)
    u, s, vh = torch.linalg.svd(stacked, full_matrices=False)
    k = w_q.shape[-1] - rotary
    return _SVD(u[..., :k], s[:, :k], vh[:, :k], back, tau)


def shrink_form(w_q: Tensor, w_k: Tensor, log_tau: Tensor, d_new: int, c: Tensor | None = None, rotary: int = 0,
                rcond: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """The closest head-size-d_new form to τ W_Q W_Kᵀ per head (module docstring).

    w_q (H, e′, d), w_k (KV, e′, d) with KV dividing H, log_tau (H,); c: C̄ (e′, e′) of the form's inputs, None for
    the weights alone; rotary: the leading rotary columns, kept as they are. → w_q′ (H, e′, d_new), w_k′ (KV, e′,
    d_new) in the input dtype, and the discarded energy ‖R(M_j − M′_j)R‖²_F per query head (H,), float64. τ is kept.
    """
    _check_form_size(w_q.shape[-1], d_new, rotary)
    return _truncated_form(w_q, w_k, _form_svd(w_q, w_k, log_tau, c, rotary, rcond), d_new, rotary)


def _check_form_size(d: int, d_new: int, rotary: int) -> None:
    if not max(rotary, 1) <= d_new <= d:
        what = f" ({rotary} of them rotary)" if rotary else ""
        raise ValueError(f"can shrink a head size of {d}{what} to a size between {max(rotary, 1)} and {d}, not {d_new}")


def _truncated_form(w_q: Tensor, w_k: Tensor, svd: _SVD, d_new: int, rotary: int) -> tuple[Tensor, Tensor, Tensor]:
    """shrink_form's result from the form's `_form_svd`."""
    h, e_in, _ = w_q.shape
    kv, r = w_k.shape[0], d_new - rotary
    u, s, vh, back, tau = svd.u, svd.s, svd.vh, svd.back, svd.tau
    tau_group = tau.reshape(kv, -1).mean(-1)  # (KV,)
    q_scale = (tau_group.repeat_interleave(h // kv) / tau)[:, None, None]  # τ̄/τ_j: 1 with one head per group
    kept = s[:, :r]
    live = kept > VANISH * s[:, :1]
    root = (kept * live / tau_group[:, None]).sqrt().unsqueeze(1)  # (KV, 1, r)
    per_head = lambda t: t.repeat_interleave(h // kv, dim=0)  # noqa: E731  (KV, …) → (H, …)
    u_heads = u[:, :, :r].reshape(h, e_in, r)
    largest = torch.where(s[:, :1] > 0, s[:, :1], 1.0)  # a zero form still gets Q columns that are not zero
    floor = (FAN_IN_FLOOR * largest / tau_group[:, None]).sqrt().unsqueeze(1)
    new_q = torch.where(per_head(live).unsqueeze(1), u_heads * per_head(root), u_heads * per_head(floor)) * q_scale
    new_k = vh[:, :r].mT * root
    if back is not None:
        new_q, new_k = back @ new_q, back @ new_k
    # Per head, the rows of the discarded U Σ Vᵀ that are its block: Σ_{k ≥ r} σ_k² ‖u_{j,k}‖².
    rest = u[:, :, r:].reshape(h, e_in, -1).square().sum(1)
    discarded = (rest * per_head(s[:, r:]).square()).sum(-1)
    keep = lambda w, new: torch.cat([w[..., :rotary], new.to(w.dtype)], -1)  # noqa: E731  rotary columns bit for bit
    return keep(w_q.detach(), new_q), keep(w_k.detach(), new_k), discarded


def form_energy(w_q: Tensor, w_k: Tensor, log_tau: Tensor, c: Tensor | None = None, rotary: int = 0,
                rcond: float = 1e-6) -> Tensor:
    """(d − rotary,) float64: what each NoPE column keeps, σ_k² of the whitened stacked forms summed over the groups,
    k = 0 … d − rotary − 1 (shrink_form to rotary + r keeps the first r)."""
    return _form_svd(w_q, w_k, log_tau, c, rotary, rcond).s.square().sum(0)


def _whitened_maps(w_v: Tensor, w_o: Tensor, c: Tensor | None, rcond: float) -> tuple[Tensor, Tensor | None]:
    """Each group's whitened maps R[W_M,j]_j (KV, e′, g·e), R = C̄_g^½ (I without c), with R⁻¹ (None without c)."""
    kv, _, d = w_v.shape
    h, e_out = w_o.shape[0], w_o.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads cannot share {kv} value heads evenly")
    outputs = w_o.detach().double().reshape(kv, h // kv, d, e_out).transpose(1, 2).reshape(kv, d, -1)
    b = w_v.detach().double() @ outputs
    if c is None:
        return b, None
    root, back = psd_sqrt(c.to(b.device).double().reshape(kv, h // kv, *c.shape[1:]).mean(1), rcond)
    return root @ b, back


def _value_svd(w_v: Tensor, w_o: Tensor, c: Tensor | None, rcond: float) -> _SVD:
    """The SVD of each group's whitened maps, its leading d_v pairs (the most a map of d_v columns has), with R⁻¹."""
    maps, back = _whitened_maps(w_v, w_o, c, rcond)
    u, s, wh = torch.linalg.svd(maps, full_matrices=False)
    d = w_v.shape[-1]
    return _SVD(u[..., :d], s[:, :d], wh[:, :d], back)


def shrink_values(w_v: Tensor, w_o: Tensor, d_new: int, c: Tensor | None = None,
                  rcond: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """The closest value-head-size-d_new map to each head's W_M = W_V W_O (module docstring).

    w_v (KV, e′, d), w_o (H, d, e) with KV dividing H; c: C̄_j (H, e′, e′) of each head's P_j = A_j X′, None for the
    weights alone → w_v′ (KV, e′, d_new), w_o′ (H, d_new, e) in the input dtype, and the discarded energy
    ‖R(W_M,j − W_M,j′)‖²_F per query head (H,), float64.
    """
    _check_value_size(w_v.shape[-1], d_new)
    return _truncated_values(w_v, w_o, _value_svd(w_v, w_o, c, rcond), d_new)


def _check_value_size(d: int, d_new: int) -> None:
    if not 1 <= d_new <= d:
        raise ValueError(f"can shrink a value head size of {d} to a size between 1 and {d}, not {d_new}")


def _truncated_values(w_v: Tensor, w_o: Tensor, svd: _SVD, d_new: int) -> tuple[Tensor, Tensor, Tensor]:
    """shrink_values' result from the map's `_value_svd`."""
    kv = w_v.shape[0]
    h, e_out = w_o.shape[0], w_o.shape[2]
    u, s, wh, back = svd.u, svd.s, svd.vh, svd.back
    kept = s[:, :d_new]
    live = kept > VANISH * s[:, :1]
    root = kept.sqrt().unsqueeze(1)
    largest = torch.where(s[:, :1] > 0, s[:, :1], 1.0)
    floor = (FAN_IN_FLOOR * largest).sqrt().unsqueeze(1)
    new_v = torch.where(live.unsqueeze(1), u[:, :, :d_new] * root, u[:, :, :d_new] * floor)
    if back is not None:
        new_v = back @ new_v
    per_group = wh[:, :d_new] * (root * live.unsqueeze(1)).mT  # (KV, d_new, g·e): each head's O rows side by side
    new_o = per_group.reshape(kv, d_new, h // kv, e_out).transpose(1, 2).reshape(h, d_new, e_out)
    rest = wh[:, d_new:].reshape(kv, -1, h // kv, e_out).square().sum(-1)  # (KV, k, g): ‖w_{j,k}‖² per head
    discarded = (rest * s[:, d_new:, None].square()).sum(1).reshape(h)
    return new_v.to(w_v.dtype), new_o.to(w_o.dtype), discarded


def value_energy(w_v: Tensor, w_o: Tensor, c: Tensor | None = None, rcond: float = 1e-6) -> Tensor:
    """(d_v,) float64: what each value column keeps, σ_k² of the whitened maps summed over the groups."""
    return _value_svd(w_v, w_o, c, rcond).s.square().sum(0)


@dataclass(frozen=True)
class ShrinkItem:
    """One side of one layer under a cache budget: the cache values per token a column costs (its KV heads summed
    over its forms), the columns it keeps whatever (its rotary ones, else one), its current width, and per column
    the energy it keeps (`form_energy`/`value_energy`, 0 for a rotary one; empty until rated)."""

    layer: int
    side: HeadSize
    cost: int
    held: int
    width: int
    gains: tuple[float, ...] = ()


def allocate_sizes(items: Sequence[ShrinkItem], budget: float) -> list[int]:
    """Head sizes of the items within `budget` cache values per token: from each item's held columns, the next
    column with the most energy per cache value while it fits (`buy_columns`); never wider than the item is.

    With both sides among the items, each column's energy is taken as a share of its side's total: score energy and
    output energy have no common unit. Within one side that division would change nothing but round-off (greedy
    choice does not depend on scale), so a one-sided allocation uses the energies as they are."""
    spent = sum(item.cost * item.held for item in items)
    if spent > budget:
        raise ValueError(f"a budget of {budget:g} cache values per token is below what the layers keep whatever "
                         f"({spent}): give at least {spent}")
    totals = {item.side: 0.0 for item in items}
    for item in items:
        totals[item.side] += sum(item.gains)
    share = len(totals) > 1
    gains = [[g / totals[i.side] if share and totals[i.side] > 0 else g for g in i.gains] for i in items]
    return buy_columns(gains, [i.cost for i in items], budget, held=[i.held for i in items])


def allocate_ranks(layers: Sequence[Sequence[tuple[Tensor, Tensor, Tensor]]], budget: float,
                   covariances: Sequence[Tensor] | None = None) -> list[int]:
    """Per-layer head sizes to shrink to within a K-cache budget, by SVD energy (Palu's and Eigen Attention's
    post-hoc allocation), or by activation-whitened energy with each layer's input covariance C̄ (`covariances`).

    layers: each layer's forms as (w_q, w_k, log_tau) (one for mha; the forms of a layer share its d_head).
    budget: K-cache values per token, Σ_layers kv_l × d_l, where kv_l is the layer's key heads summed over its forms.
    Every layer keeps at least one column; each further column goes, greedily, to the layer whose next singular
    value adds the most energy per cache value (`form_energy`, summed over the layer's forms), which is what
    `shrink_form` keeps. A layer never exceeds its current d_head, and the budget is never exceeded. With equal key
    heads per layer this is the optimum (each layer's gains fall with r); with unequal ones it is the greedy
    knapsack. Under GQA the heads sharing a key are rated stacked, as `shrink_form` shrinks them.
    """
    costs = [sum(w_k.shape[0] for _, w_k, _ in forms) for forms in layers]
    if sum(costs) > budget:
        raise ValueError(f"a budget of {budget} K-cache values per token is below one column per layer "
                         f"({sum(costs)}): give at least {sum(costs)}")
    covariances = covariances if covariances is not None else [None] * len(layers)
    items = [ShrinkItem(layer, "d_head", cost, 1, forms[0][0].shape[-1],
                        tuple(sum(form_energy(*form, c=c) for form in forms).tolist()))
             for layer, (forms, cost, c) in enumerate(zip(layers, costs, covariances))]
    return allocate_sizes(items, budget)


def _rotary(unit) -> int:
    return getattr(unit, "rotary", 0) if unit.side == "d_head" else 0


def shrink_items(units: Units) -> list[ShrinkItem]:
    """One unrated item per (layer, side) of the units, in their order: its cost is `column_costs`' (growth's)."""
    units = list(units)
    first: dict[tuple[int, HeadSize], object] = {}
    for layer, _, unit in units:
        first.setdefault((layer, unit.side), unit)
    return [ShrinkItem(layer, side, cost, _rotary(first[layer, side]) or 1, first[layer, side].width)
            for (layer, side), cost in column_costs((layer, unit) for layer, _, unit in units).items()]


def mean_size(items: Sequence[ShrinkItem], sizes: Sequence[int]) -> float:
    """The mean head size over the items' cache heads (the unit of a budget)."""
    return sum(i.cost * s for i, s in zip(items, sizes)) / sum(i.cost for i in items)


def check_budget(items: Sequence[ShrinkItem], budget: float) -> None:
    """Refuses a mean head size `budget` the items cannot be shrunk to: below what they keep whatever, or not
    below where they are, or one that is not a finite positive number."""
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"a budget of {budget:g} is not a mean head size: give a finite number of columns above 0")
    least = mean_size(items, [i.held for i in items])
    if budget < least:
        rotary = sorted({i.held for i in items if i.side == "d_head" and i.held > 1})
        also = f" and its {', '.join(map(str, rotary))} rotary query/key columns" if rotary else ""
        raise ValueError(f"a budget of {budget:g} is below what the model must keep: one column per layer and side"
                         f"{also} (mean {least:.4g}): give at least {least:.4g}")
    if (now := mean_size(items, [i.width for i in items])) <= budget:
        raise ValueError(f"the model's caches are already at mean {now:.4g} ≤ {budget:g}: nothing to shrink (a budget "
                         "never widens)")


@dataclass(frozen=True)
class BudgetShrink:
    """What `shrink_to_budget` did: the rated items and the head size each got."""

    items: list[ShrinkItem]
    sizes: list[int]

    def sides(self) -> list[HeadSize]:
        return list(dict.fromkeys(i.side for i in self.items))

    def per_layer(self, side: HeadSize) -> list[int]:
        return [s for i, s in zip(self.items, self.sizes) if i.side == side]

    def mean(self, side: HeadSize | None = None) -> float:
        chosen = [(i, s) for i, s in zip(self.items, self.sizes) if side in (None, i.side)]
        return mean_size([i for i, _ in chosen], [s for _, s in chosen])

    def values_per_token(self) -> int:
        return sum(i.cost * s for i, s in zip(self.items, self.sizes))

    def kept_share(self, side: HeadSize) -> float:
        """The share of the side's (whitened) energy the shrunk sizes keep."""
        pairs = [(i, s) for i, s in zip(self.items, self.sizes) if i.side == side]
        total = sum(sum(i.gains) for i, _ in pairs)
        return sum(sum(i.gains[:s]) for i, s in pairs) / total if total > 0 else 1.0


def budget_values(budget: float, items: Sequence[ShrinkItem]) -> int:
    """The cache values per token a mean head size `budget` allows the items: ⌊budget × Σ cost⌋, taken on the
    decimal the budget is written as (4.1 × 30 is 123, where the float product is 122.99999999999999)."""
    return math.floor(Fraction(repr(float(budget))) * sum(i.cost for i in items))


def shrink_to_budget(units: Units, budget: float, covariances: Mapping[str, Tensor] | None = None,
                     rcond: float = 1e-6) -> BudgetShrink:
    """Shrinks the units (query/key forms and value maps, in place through their `set_weights`) to a mean head size
    `budget` over their cache heads: sizes by `allocate_sizes`, each unit by `shrink_form`/`shrink_values`, both
    weighted by the unit's C̄ in `covariances` (by name; None: the weights' own energy). Each unit's whitening and
    SVD are computed once, for both its energies and its shrink."""
    items = shrink_items(units)
    check_budget(items, budget)
    c_of = lambda name: None if covariances is None else covariances[name]  # noqa: E731
    svds: list[_SVD] = []
    gains: dict[tuple[int, HeadSize], Tensor] = {}
    for layer, name, unit in units:
        key = layer, unit.side
        if unit.side == "d_head":
            svds.append(_form_svd(unit.w_q, unit.w_k, unit.log_tau, c_of(name), _rotary(unit), rcond))
            energy = svds[-1].s.square().sum(0)
            energy = torch.cat([energy.new_zeros(_rotary(unit)), energy])
        else:
            svds.append(_value_svd(unit.w_v, unit.w_o, c_of(name), rcond))
            energy = svds[-1].s.square().sum(0)
        gains[key] = gains[key] + energy if key in gains else energy
    items = [replace(i, gains=tuple(gains[i.layer, i.side].tolist())) for i in items]
    sizes = allocate_sizes(items, budget_values(budget, items))
    size_of = {(i.layer, i.side): s for i, s in zip(items, sizes)}
    for (layer, _, unit), svd in zip(units, svds):
        size = size_of[layer, unit.side]
        if unit.side == "d_head":
            w_q, w_k, _ = _truncated_form(unit.w_q, unit.w_k, svd, size, _rotary(unit))
            unit.set_weights(w_q, w_k, unit.log_tau)
        else:
            w_v, w_o, _ = _truncated_values(unit.w_v, unit.w_o, svd, size)
            unit.set_weights(w_v, w_o)
    return BudgetShrink(items, sizes)
