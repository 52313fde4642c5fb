"""Sketched growth statistics and growths (growth/sketch.py, growth/sketched.py), float64 against the full path: when
each group's statistics have rank ≤ k the sketched growth is the full one (columns up to each pair's sign, gains,
predicted decrease, allocation); the sums merge as the full ones do, and a loss scale divides out of the parts it
multiplies; nothing of size e′ × e′ per head is formed; the ridge of the natural direction."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_growattn.growth import (
    FormGrowth, FormStats, FormWeights, GroupedGrowth, GrowthPlan, SketchedFormGrowth, SketchedGroupedGrowth,
    SketchedValueGrowth, SketchFormStats, SketchSize, SketchValueStats, TestMatrices, ValueGrowth, ValueStats,
    ValueWeights, flatten_stats, stats_from_state_dict, unflatten_stats,
)
from lit_growattn.growth.allocation import allocate, offer
from lit_growattn.growth.factorize import FAN_IN_FLOOR
from lit_growattn.growth.linalg import canonical_signs, psd_pinv, thin_svd
from lit_growattn.growth.sketch import Factored, SketchMoments, nystrom, nystrom_psd, nystrom_solve
from lit_growattn.growth.solvers import direction, register_direction, DIRECTIONS
from lit_growattn.growth.stats import Moments

F64 = torch.float64
RCOND = 1e-6
# Float64 round-off (eps ≈ 2e-16) grown by the problems' sizes (e′ ≤ 24) and the conditioning of C̄⁺ on the inputs'
# range (below 1e4 here): agreement to 1e-10 leaves four digits of margin, and any wrong term is off by O(1).
RTOL = 1e-10
METHODS = [("gradient", None), ("natural", None), ("natural", 1.0)]  # (method, ridge): natural-ridge is the third
METHOD_IDS = ["gradient", "natural", "natural-ridge"]


def close(actual, expected, rtol=RTOL):
    """Relative agreement in norm: exact maths up to round-off."""
    actual, expected = torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64)
    assert float((actual - expected).norm()) <= rtol * max(float(expected.norm()), 1e-300), (actual, expected)


def layer_norm_inputs(b, s, e, gen, decay=0.15):
    """LayerNorm-like inputs (rows sum to zero, so C is singular) with a decaying covariance spectrum."""
    x = torch.randn(b, s, e, generator=gen, dtype=F64) * torch.exp(-decay * torch.arange(e, dtype=F64))
    x = x - x.mean(-1, keepdim=True)
    return x / x.std(-1, keepdim=True)


def covariance(e, gen):
    x = layer_norm_inputs(8, 16, e, gen).reshape(-1, e)
    return x.mT @ x / 8


def low_rank_n(h, e, group, rank, c, gen):
    """N_j = A_jB_gᵀ inside range(C), B shared by a group: each group's stacked [N_j]_j has rank `rank`."""
    basis = torch.linalg.eigh(c)[1][:, 1:]  # without the null direction of LayerNorm inputs
    a = basis @ torch.randn(h, basis.shape[1], rank, generator=gen, dtype=F64)
    b = basis @ torch.randn(h // group, basis.shape[1], rank, generator=gen, dtype=F64)
    return a @ b.repeat_interleave(group, 0).mT


def form_sketch(n, c, kv, size, seed=0, dtype=F64) -> SketchFormStats:
    """The sums (in dtype) of a sketch whose window had C̄ = c and N̄ = n (one instance of weight 1)."""
    h, e, _ = n.shape
    stats = SketchFormStats(h, kv, e, size, seed, dtype=dtype)
    omega, psi = stats.tests["omega"].double(), stats.tests["psi"].double()
    stats.c_sum += c.to(dtype)
    stats.y_sum += (n @ omega).to(dtype)
    stats.w_sum += (n.mT @ psi).reshape(kv, h // kv, e, size.l).sum(1).to(dtype)
    stats.instances += 1
    stats.weight += 1
    return stats


def value_sketch(n_v, c_v, kv, size, seed=0, dtype=F64) -> SketchValueStats:
    """The sums (in dtype) of a value sketch whose window had C̄_j = c_v and N̄_V,j = n_v."""
    h, e_in, e_out = n_v.shape
    stats = SketchValueStats(h, kv, e_in, e_out, size, seed, dtype=dtype)
    tests = {name: t.double() for name, t in stats.tests.matrices.items()}
    stats.y_sum += (n_v @ tests["omega"]).reshape(kv, h // kv, e_in, size.k).sum(1).to(dtype)
    stats.w_sum += (n_v.mT @ tests["psi"]).to(dtype)
    stats.f_sum += (c_v @ tests["omega_c"]).to(dtype)
    stats.instances += 1
    stats.weight += 1
    return stats


def form_weights(h, kv, e, d, gen):
    return (torch.randn(h, e, d, generator=gen, dtype=F64), torch.randn(kv, e, d, generator=gen, dtype=F64),
            0.1 * torch.randn(h, generator=gen, dtype=F64))


def canonical_columns(w_q, w_k):
    """Each (Q column, K column) pair with the sign that makes the largest |entry| of its stacked Q column positive."""
    h, e, d = w_q.shape
    kv = w_k.shape[0]
    q, k = canonical_signs(w_q.reshape(kv, (h // kv) * e, d), w_k)
    return q.reshape(h, e, d), k


def qk_pair(group, method, ridge, truncation="euclidean", rotary=0, seed=0, rank=5, k=6):
    """The full growth and the sketched one of the same form and low-rank statistics (e′ 24, 4 heads, d 3)."""
    gen = torch.Generator().manual_seed(seed)
    h, e, d = 4, 24, 3
    c = covariance(e, gen)
    n = low_rank_n(h, e, group, rank, c, gen)
    w_q, w_k, log_tau = form_weights(h, h // group, e, d, gen)
    kwargs = dict(truncation=truncation, rcond=RCOND, ridge=ridge)
    sketched = form_sketch(n, c, h // group, SketchSize.of(k), seed).means()
    if group == 1 and not rotary:
        return (FormGrowth(w_q, w_k, log_tau, Moments(c, n, None), method, **kwargs),
                SketchedFormGrowth(w_q, w_k, log_tau, sketched, method, **kwargs))
    return (GroupedGrowth(w_q, w_k, log_tau, Moments(c, n, None), method, rotary=rotary, **kwargs),
            SketchedGroupedGrowth(w_q, w_k, log_tau, sketched, method, rotary=rotary, **kwargs))


def assert_same_qk_growth(full, sketched, method, p, **grow):
    """Same σ, canonical pairs, gains and grown form (canonical columns, log τ′, predicted decrease)."""
    u_f, s_f, v_f, _ = full.bottleneck(method)
    u_s, s_s, v_s, _ = sketched.bottleneck(method)
    close(s_s[:, :p], s_f[:, :p])
    assert all(torch.equal(a, b) for a, b in zip(canonical_signs(u_s, v_s), (u_s, v_s)))  # the sketch's own signs
    pairs_f, pairs_s = canonical_signs(u_f[..., :p], v_f[..., :p]), canonical_signs(u_s[..., :p], v_s[..., :p])
    for a, b in zip(pairs_s, pairs_f):
        close(a, b)
    close(sketched.column_gains()[:, :p], full.column_gains()[:, :p])
    g_f, g_s = full.grow(0.5, full.d_head + p, **grow), sketched.grow(0.5, full.d_head + p, **grow)
    for a, b in zip(canonical_columns(g_s.w_q, g_s.w_k), canonical_columns(g_f.w_q, g_f.w_k)):
        close(a, b)
    close(g_s.log_tau, g_f.log_tau)
    close(g_s.spectrum, g_f.spectrum)
    close(g_s.discarded_energy, g_f.discarded_energy)
    close(g_s.predicted_decrease, g_f.predicted_decrease)
    assert not g_f.fell_back and not g_s.fell_back


@pytest.mark.parametrize("temperature", ["keep", "rescale"])
@pytest.mark.parametrize("mode", ["append", "replace"])
@pytest.mark.parametrize("truncation", ["euclidean", "whitened"])
@pytest.mark.parametrize("method, ridge", METHODS, ids=METHOD_IDS)
def test_sketch_growth_equals_full_when_low_rank(method, ridge, truncation, mode, temperature):
    full, sketched = qk_pair(1, method, ridge, truncation)
    assert isinstance(sketched, SketchedFormGrowth)
    assert_same_qk_growth(full, sketched, method, 4, mode=mode, temperature=temperature)


@pytest.mark.parametrize("rotary", [0, 2])
@pytest.mark.parametrize("method, ridge", METHODS, ids=METHOD_IDS)
def test_grouped_sketch_equals_grouped_full(method, ridge, rotary):
    # Each group's stacked statistics have rank 5 ≤ k = 6, but its two heads' N_j together span up to 10 columns:
    # a sketch per head, or per-head projections instead of the group's stacked one, would not agree.
    full, sketched = qk_pair(2, method, ridge, rotary=rotary)
    assert isinstance(sketched, SketchedGroupedGrowth)
    assert_same_qk_growth(full, sketched, method, 4, temperature="rescale")


def value_pair(group, method, ridge, seed=0, rank_c=7, rank_n=4, k=6, k_c=8):
    """Full and sketched growth of one value map (e′ 20, e 16, 4 heads, d_v 3) whose C_V,j have rank 7 ≤ k_c and whose
    group's stacked N_V have rank 4 ≤ k. The heads of a group see the same input range but weigh it differently."""
    gen = torch.Generator().manual_seed(seed)
    h, e_in, e_out, d = 4, 20, 16, 3
    kv = h // group
    base = torch.randn(kv, e_in, rank_c, generator=gen, dtype=F64).repeat_interleave(group, 0)
    base = base @ torch.randn(h, rank_c, rank_c, generator=gen, dtype=F64)
    c_v = base @ base.mT
    common = torch.randn(kv, e_in, rank_n, generator=gen, dtype=F64).repeat_interleave(group, 0)
    right = torch.randn(h, e_out, rank_n, generator=gen, dtype=F64)
    n_v = c_v @ psd_pinv(c_v, 1e-10) @ common @ right.mT  # in each head's input range
    w_v, w_o = torch.randn(kv, e_in, d, generator=gen, dtype=F64), torch.randn(h, d, e_out, generator=gen, dtype=F64)
    sketched = value_sketch(n_v, c_v, kv, SketchSize(k, math.ceil(1.5 * k), k_c), seed).means()
    return (ValueGrowth(w_v, w_o, Moments(c_v, n_v, None), method, rcond=RCOND, ridge=ridge),
            SketchedValueGrowth(w_v, w_o, sketched, method, rcond=RCOND, ridge=ridge))


@pytest.mark.parametrize("method, ridge", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("group", [1, 2])
def test_value_sketch_equals_full_when_low_rank(group, method, ridge):
    full, sketched = value_pair(group, method, ridge)
    p = 3
    u_f, s_f, w_f, _ = full.bottleneck(method)
    u_s, s_s, w_s, _ = sketched.bottleneck(method)
    # The natural direction goes through C̄⁺ (cond ≈ 1e4 on the range here) on top of the Nyström reconstruction.
    rtol = 1e-8 if method == "natural" else RTOL
    for a, b in ((s_s, s_f), (u_s, u_f), (w_s, w_f)):
        close(a[..., :p], b[..., :p], rtol)
    close(sketched.column_gains()[:, :p], full.column_gains()[:, :p], rtol)
    g_f, g_s = full.grow(0.5, 3 + p), sketched.grow(0.5, 3 + p)
    close(g_s.w_v, g_f.w_v, rtol)
    close(g_s.w_o, g_f.w_o, rtol)
    close(g_s.discarded_energy, g_f.discarded_energy, rtol)
    close(g_s.predicted_decrease, g_f.predicted_decrease, rtol)


@pytest.mark.parametrize("method, ridge", METHODS, ids=METHOD_IDS)
def test_value_pairs_under_gqa_are_those_the_sketch_prices(method, ridge):
    # g = 2 heads per value head, k = 6, each group's statistics of rank 4. The heads of a group share the left factor
    # L_g of N̂_V: under gradient the stacked bottleneck has rank ≤ k and pairs beyond k would be round-off (where the
    # full statistics of a higher rank hold real pairs), so k are offered. Under natural each head's (Ĉ_j + ρ_jI)⁻¹
    # gives directions of its own: up to g·k pairs, here 7 > k of them real, the full path's.
    full, sketched = value_pair(2, method, ridge)
    k = 6
    assert sketched.pairs == (k if method == "gradient" else 2 * k)
    gains_f, gains_s = full.column_gains(), sketched.column_gains()
    assert gains_s.shape == (2, sketched.pairs)
    if method == "natural":
        assert ((gains_f.abs() > 1e-9 * gains_f[:, :1].abs()).sum(-1) > k).all()
    close(gains_s, gains_f[:, :sketched.pairs], 1e-8 if method == "natural" else RTOL)
    grown = sketched.grow(0.5, 3 + sketched.pairs)
    assert grown.w_v.shape[-1] == 3 + sketched.pairs
    with pytest.raises(ValueError, match=f"prices at most {sketched.pairs}"):
        sketched.grow(0.5, 3 + sketched.pairs + 1)


def test_sketch_of_full_size_is_exact_for_any_statistics():
    # k ≥ e′: Ω has full row rank, so range(Y) = range(N) whatever N's rank; the value side's C_V is ill-conditioned
    # (cond up to about 1e6), which the Nyström core's round-off cut must survive.
    gen = torch.Generator().manual_seed(1)
    h, kv, e, d = 4, 2, 12, 3
    c = covariance(e, gen)
    n = torch.randn(h, e, e, generator=gen, dtype=F64)
    w_q, w_k, log_tau = form_weights(h, kv, e, d, gen)
    sketched = form_sketch(n, c, kv, SketchSize(e, e + 2, e)).means()
    close(sketched.n.left @ sketched.n.right.repeat_interleave(2, 0).mT, n, 1e-13)
    full = GroupedGrowth(w_q, w_k, log_tau, Moments(c, n, None), "natural", rcond=RCOND)
    sk = SketchedGroupedGrowth(w_q, w_k, log_tau, sketched, "natural", rcond=RCOND)
    close(sk.bottleneck("natural")[1][:, :e - d], full.bottleneck("natural")[1][:, :e - d], 1e-9)
    base = torch.randn(h, e, e, generator=gen, dtype=F64) @ torch.diag(torch.logspace(0, -3, e, dtype=F64))
    c_v, n_v = base @ base.mT, torch.randn(h, e, 10, generator=gen, dtype=F64)
    values = value_sketch(n_v, c_v, kv, SketchSize(e, e + 2, e)).means()
    close(values.n.left.repeat_interleave(2, 0) @ values.n.right.mT, n_v, 1e-13)
    close(values.c_root @ values.c_root.mT, c_v, 1e-9)


@pytest.mark.parametrize("method, ridge", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("side", ["qk", "value"])
def test_float32_sums_grow_as_float64_sums_to_their_precision(side, method, ridge):
    # The default sums are float32; the growth runs in float64 on them. Their round-off (eps 1.2e-7) reaches the pairs
    # amplified at most by the pseudo-inverse on the inputs' range (conditioning below 1e4 here), and the Nyström
    # core's cut follows the sums' dtype.
    full, sketched = qk_pair(2, method, ridge) if side == "qk" else value_pair(2, method, ridge)
    single = (form_sketch(full.moments.n, full.moments.c, 2, SketchSize.of(6), dtype=torch.float32) if side == "qk"
              else value_sketch(full.moments.n, full.moments.c, 2, SketchSize(6, 9, 8), dtype=torch.float32))
    assert single.y_sum.dtype == torch.float32
    weights = (sketched.w_q, sketched.w_k, sketched.log_tau) if side == "qk" else (sketched.w_v, sketched.w_o)
    again = type(sketched)(*weights, single.means(), method, rcond=RCOND, ridge=ridge,
                           **({"rotary": 0} if side == "qk" else {}))
    rtol = 1e4 * torch.finfo(torch.float32).eps
    close(again.bottleneck(method)[1][:, :3], sketched.bottleneck(method)[1][:, :3], rtol)
    close(again.column_gains()[:, :3], sketched.column_gains()[:, :3], rtol)


def test_nystrom_core_cut_at_round_off_keeps_an_ill_conditioned_covariance():
    # The core ΩᵀCΩ has cond ≈ cond(C)·cond(Ω)²: cut at the growth's rcond (1e-6) it would lose the small eigenvalues.
    gen = torch.Generator().manual_seed(2)
    q = torch.linalg.qr(torch.randn(10, 10, generator=gen, dtype=F64)).Q
    c = q @ torch.diag(torch.logspace(0, -6, 10, dtype=F64)) @ q.mT
    omega = torch.randn(10, 10, generator=gen, dtype=F64)
    root = nystrom_psd(c @ omega, omega, 10 * torch.finfo(F64).eps)
    close(root @ root.mT, c, 1e-6)
    assert float((nystrom_psd(c @ omega, omega, RCOND) @ nystrom_psd(c @ omega, omega, RCOND).mT - c).norm()) > 1e-7


def test_nystrom_core_of_float32_sums_is_cut_at_their_round_off():
    # A covariance of rank 3 sketched with k_c = 12 leaves nine core eigenvalues at the sums' round-off; kept (a cut
    # at float64's round-off), the small positive ones among them scale float32 noise up into Ĉ.
    eps = torch.finfo(torch.float32).eps
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(1, 20, 3, generator=gen, dtype=F64)
        c_v = base @ base.mT
        stats = value_sketch(torch.zeros(1, 20, 4, dtype=F64), c_v, 1, SketchSize(2, 3, 12), seed, torch.float32)
        root = stats.means().c_root
        close(root @ root.mT, c_v, eps)


def test_nystrom_does_not_depend_on_where_its_inputs_lie():
    # A resumed run holds the same sums at other addresses; its growth must be bit-identical to the uninterrupted
    # run's (tests/test_value_growth.py resumes a sketched window). CPU lstsq's last bits followed the alignment.
    gen = torch.Generator().manual_seed(3)
    y, w, psi = (torch.randn(4, 16, n, generator=gen, dtype=F64) for n in (8, 12, 12))

    def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
        storage = torch.empty(t.numel() + offset, dtype=t.dtype)
        return storage[offset:].view(t.shape).copy_(t)

    first = nystrom(y, w, psi)
    for offset in range(1, 8):
        again = nystrom(*(at_offset(t, offset) for t in (y, w, psi)))
        assert all(torch.equal(a, b) for a, b in zip(again, first)), offset


def allocation_layers(sketched: bool, seed=0):
    """Three one-form layers, each with two halves of rank ≤ 4 < k = 6 (a shared signal and half-specific noise)."""
    gen = torch.Generator().manual_seed(seed)
    h, e, d = 4, 24, 3
    layers = []
    for layer in range(3):
        c = covariance(e, gen)
        w_q, w_k, log_tau = form_weights(h, h, e, d, gen)
        signal = low_rank_n(h, e, 1, 3, c, gen) * (1 + layer)
        halves = []
        for _ in range(2):
            n = signal + 0.3 * low_rank_n(h, e, 1, 1, c, gen)
            if sketched:  # one layer's halves share their test matrices, as a window's do
                moments = form_sketch(n, c, h, SketchSize.of(6), 100 + layer).means()
                growth = SketchedFormGrowth(w_q, w_k, log_tau, moments, "natural", rcond=RCOND)
            else:
                growth = FormGrowth(w_q, w_k, log_tau, Moments(c, n, None), "natural", rcond=RCOND)
            halves.append([growth])
        layers.append(halves)
    return layers


def test_allocation_same_when_low_rank():
    offers = {}
    for sketched in (False, True):
        offers[sketched] = [offer(layer, "d_head", a, b, cost=4, room=4)
                            for layer, (a, b) in enumerate(allocation_layers(sketched))]
    for full, sketched in zip(offers[False], offers[True]):
        close(sketched.held_out, full.held_out)
        close(sketched.in_sample, full.in_sample)
    for allowance, fill_to in ((6 * 4, None), (9 * 4, 6.0)):
        bought = [[o.columns for o in allocate(offers[s], allowance, fill_to)] for s in (False, True)]
        assert bought[0] == bought[1] and sum(bought[0]) > 0


def test_offers_cut_at_sketch_rank():
    (a, b), *_ = allocation_layers(True)
    assert len(offer(0, "d_head", a, b, cost=4, room=24).held_out) == 6  # the sketch's k, not e′ = 24
    gen = torch.Generator().manual_seed(5)
    c = covariance(24, gen)
    form = FormWeights(*form_weights(4, 4, 24, 3, gen))
    stats = form_sketch(torch.randn(4, 24, 24, generator=gen, dtype=F64), c, 4, SketchSize.of(6))
    plan = GrowthPlan.build({"form": form}, [stats], method="gradient", grow_by=None, dynamic_rank=0.0)
    assert isinstance(plan.forms["form"], SketchedFormGrowth) and plan.d_new["form"] == 3 + 6


@pytest.mark.parametrize("group", [1, 2])
def test_zero_fan_in_beyond_rank(group):
    full, sketched = qk_pair(group, "gradient", None, rank=2)
    p = 5  # three pairs beyond the statistics' rank 2, within the sketch's 6
    grown = sketched.grow(0.5, 3 + p)
    sigma = sketched.bottleneck("gradient")[1]
    new_q, new_k = grown.w_q[..., 3 + 2:], grown.w_k[..., 3 + 2:]
    assert torch.equal(new_k, torch.zeros_like(new_k))
    # A group's zero fan-in Q columns U_j(σ_floor τ̄)^½/τ′_j, with Σ_j ‖U_j‖² = 1: Σ_j τ′_j²‖Q_j‖² = σ_floor τ̄.
    tau = grown.log_tau.exp()
    scores = (new_q.norm(dim=1) * tau[:, None]).square().reshape(sketched.n_kv_head, group, p - 2).sum(1)
    floor = FAN_IN_FLOOR * sigma[:, :1] * tau.reshape(sketched.n_kv_head, group).mean(-1, keepdim=True)
    close(scores, floor.expand(-1, p - 2), 1e-12)
    at_zero = sketched.grow(0.0, 3 + p)
    m = lambda g: g.log_tau.exp()[:, None, None] * g.w_q @ g.w_k.repeat_interleave(group, 0).mT  # noqa: E731
    torch.testing.assert_close(m(at_zero), m(FormWeights(sketched.w_q, sketched.w_k, sketched.log_tau)), rtol=0,
                               atol=0)
    with pytest.raises(ValueError, match="prices at most 6"):
        sketched.grow(0.5, 3 + 7)
    # No column at all, as AutoSchedule decides for a unit that buys none: the weights as they are.
    unchanged = sketched.grow(0.5, 3)
    assert torch.equal(unchanged.w_q, sketched.w_q) and torch.equal(unchanged.w_k, sketched.w_k)


def test_a_sketched_replace_of_a_rank_deficient_form_fills_with_zero_fan_in_pairs():
    # M of rank 2 < d = 3 at α = 0: a replace to d + 6 needs 7 zero fan-in columns and the sketch holds 6 pairs; the
    # seventh comes from an orthonormal completion, as the full path's pairs of σ ≈ 0 would, not a repeated pair.
    _, sketched = qk_pair(1, "gradient", None)
    sketched.w_k[:, :, 0] = 0
    grown = sketched.grow(0.0, 3 + 6, mode="replace")
    m = lambda g: g.log_tau.exp()[:, None, None] * g.w_q @ g.w_k.mT  # noqa: E731
    close(m(grown), m(sketched), 1e-12)
    zero_k = grown.w_k.norm(dim=1) == 0  # (H, d_new)
    assert int(zero_k.sum()) == 4 * 7
    fan_in = grown.w_q.mT[zero_k].reshape(4, 7, -1)
    directions = fan_in / fan_in.norm(dim=-1, keepdim=True)
    eye = torch.eye(7, dtype=F64).expand(4, 7, 7)
    # Orthonormal to the round-off of QRs of e′ = 24 rows.
    close(directions @ directions.mT, eye, 24 * torch.finfo(F64).eps * 10)


@pytest.mark.parametrize("truncation", ["euclidean", "whitened"])
def test_a_sketched_replace_does_not_depend_on_the_factors_basis(truncation):
    # The same M and N̂ from other factors: the form's columns in another order and sign (W_QP, W_KP, P a signed
    # permutation) and N̂'s factors in another basis (LO, RO, O orthogonal). The replace's thin QRs then see other
    # bases and the SVD of their core returns each pair with either sign, which the canonical signs undo. (A sign flip
    # of whole factors alone would pass Householder QRs unchanged: it cannot show a missing canonicalisation.)
    _, sketched = qk_pair(1, "natural", None, truncation)
    gen = torch.Generator().manual_seed(12)
    signed = torch.eye(3, dtype=F64)[[2, 0, 1]] * torch.tensor([1.0, -1.0, -1.0], dtype=F64)
    rotation = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=F64)).Q
    (left, right), c = sketched.moments.n, sketched.moments.c
    other = SketchedFormGrowth(sketched.w_q @ signed, sketched.w_k @ signed, sketched.log_tau,
                               SketchMoments(c, Factored(left @ rotation, right @ rotation)), "natural",
                               truncation=truncation, rcond=RCOND)
    grown, again = sketched.grow(0.5, 3 + 4, mode="replace"), other.grow(0.5, 3 + 4, mode="replace")
    close(again.w_q, grown.w_q)
    close(again.w_k, grown.w_k)


def test_both_sides_refuse_more_columns_than_the_sketch_prices():
    for sketched in (qk_pair(1, "gradient", None)[1], value_pair(2, "gradient", None)[1]):
        pairs, width = sketched.pairs, sketched.width
        message = (f"d_new={width + pairs + 1} needs {pairs + 1} bottleneck pairs per head, and this sketch prices at "
                   f"most {pairs}: grow fewer columns, or sketch with a larger k")
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            sketched.grow(0.5, width + pairs + 1)
        assert sketched.grow(0.5, width + pairs).width == width + pairs


@pytest.mark.parametrize("group, rotary", [(1, 0), (2, 0), (2, 2)])
def test_the_first_order_hook_takes_the_grown_form_in_every_query_key_growth(group, rotary):
    # One meaning (FormGrowth._first_order): the grown form's whole weights, whichever growth, full or sketched.
    full, sketched = qk_pair(group, "natural", None, rotary=rotary)
    per_head = lambda w: w.repeat_interleave(group, 0)  # noqa: E731
    for growth in (full, sketched):
        grown = growth.grow(0.5, 3 + 4, temperature="rescale")
        tau = grown.log_tau.exp()
        change = (tau[:, None, None] * grown.w_q @ per_head(grown.w_k).mT
                  - growth.log_tau.exp()[:, None, None] * growth.w_q @ per_head(growth.w_k).mT)
        expected = -float((full.moments.n * change).sum())
        close(growth._first_order(tau, grown.w_q, grown.w_k), expected)
        close(grown.predicted_decrease, expected)


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage any operation's output holds (views count their base's)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


def test_no_dense_per_head_matrix():
    # A Llama-3.2-1B-shaped layer: e′ 2049, 32 query heads over 8 key/value heads, head size 64, k 24. The full path
    # would hold heads × e′² numbers; the sketched growth holds e′² (C̄) and thin factors.
    gen = torch.Generator().manual_seed(0)
    h, kv, e, d, size = 32, 8, 2049, 64, SketchSize.of(24)
    x = torch.randn(256, e, generator=gen, dtype=F64)
    stats = SketchFormStats(h, kv, e, size, 0, dtype=F64)
    stats.c_sum += x.mT @ x
    stats.y_sum += torch.randn(stats.y_sum.shape, generator=gen, dtype=F64)
    stats.w_sum += torch.randn(stats.w_sum.shape, generator=gen, dtype=F64)
    stats.instances += 1
    stats.weight += 1
    w_q, w_k, log_tau = form_weights(h, kv, e, d, gen)
    form = SimpleNamespace(w_q=w_q, w_k=w_k, log_tau=log_tau, rotary=0)
    values = ValueWeights(torch.randn(kv, e, d, generator=gen, dtype=F64), torch.randn(h, d, e - 1, generator=gen,
                                                                                      dtype=F64))
    value_stats = SketchValueStats(h, kv, e, e - 1, size, 0, dtype=F64)
    for t in value_stats.tensors():
        t += torch.randn(t.shape, generator=gen, dtype=F64).abs()
    value_stats.f_sum.copy_(x.mT @ (x @ value_stats.tests["omega_c"]))
    with LargestAllocation() as recorded:
        for grown in (GrowthPlan.build({"qk": form, "v": values}, [stats, value_stats], method="natural", grow_by=8,
                                       ridge=1.0).grow(name, 0.5) for name in ("qk", "v")):
            assert grown.predicted_decrease != 0
    assert recorded.largest < kv * e * e  # less than a dense matrix per key head, let alone per query head


def random_capture(b, h, s, e, gen):
    """A captured step of a form: inputs, score gradients G (b, H, s, s) of a causal map."""
    x = torch.randn(b, s, e, generator=gen, dtype=F64)
    g = torch.randn(b, h, s, s, generator=gen, dtype=F64).tril()
    return x, g


def test_sketch_sums_are_the_sketch_of_the_explicit_statistics():
    gen = torch.Generator().manual_seed(3)
    b, h, kv, s, e, e_out = 2, 4, 2, 7, 6, 5
    group = h // kv
    stats = SketchFormStats(h, kv, e, SketchSize.of(3), 11, dtype=F64)
    x, g = random_capture(b, h, s, e, gen)
    omega, psi = stats.tests["omega"], stats.tests["psi"]
    gt_psi = torch.einsum("bhts,bhtl->bhsl", g, torch.einsum("bse,hel->bhsl", x, psi))
    stats.update(x, g @ (x @ omega).unsqueeze(1), gt_psi.reshape(b, kv, group, s, -1).sum(2), weight=0.5)
    n = torch.einsum("bse,bhst,btf->hef", x, g, x)
    close(stats.y_sum, n @ omega, 1e-13)
    close(stats.w_sum, (n.mT @ psi).reshape(kv, group, e, -1).sum(1), 1e-13)
    close(stats.c_sum, torch.einsum("bse,bsf->ef", x, x), 1e-13)
    # Value side: A (b, H, s, s) per head, G_Y (b, s, e).
    values = SketchValueStats(h, kv, e, e_out, SketchSize.of(3), 12, dtype=F64)
    a = torch.randn(b, h, s, s, generator=gen, dtype=F64).tril().softmax(-1)
    g_y = torch.randn(b, s, e_out, generator=gen, dtype=F64)
    om, ps, om_c = values.tests["omega"], values.tests["psi"], values.tests["omega_c"]
    p = a @ x.unsqueeze(1)  # P_j = A_jX′ (b, H, s, e′)
    e_v_grad = a.mT @ torch.einsum("bsf,hfk->bhsk", g_y, om)
    values.update(x, e_v_grad.reshape(b, kv, group, s, -1).sum(2), p @ ps, g_y, a.mT @ (p @ om_c), weight=0.5)
    n_v, c_v = torch.einsum("bhse,bsf->hef", p, g_y), torch.einsum("bhse,bhsf->hef", p, p)
    close(values.y_sum, (n_v @ om).reshape(kv, group, e, -1).sum(1), 1e-13)
    close(values.w_sum, n_v.mT @ ps, 1e-13)
    close(values.f_sum, c_v @ om_c, 1e-13)
    with pytest.raises(ValueError, match="expected"):
        stats.update(x, g @ (x @ omega).unsqueeze(1), gt_psi, weight=1.0)  # per query head, not summed per group


def filled(stats, gen, batches):
    """The sums after `batches` random captured micro-batches (weights 1/batches), each also returned alone."""
    alone = []
    for _ in range(batches):
        one = unflatten_stats(torch.zeros_like(flatten_stats([stats])), [stats])[0]
        captured = [torch.randn((3, *shape), generator=gen, dtype=F64) for shape in capture_shapes(stats)]
        stats.update(*captured, weight=1 / batches)
        one.update(*captured, weight=1 / batches)
        alone.append(one)
    return alone


def capture_shapes(stats):
    s = 5
    if isinstance(stats, SketchFormStats):
        (h, e, k), (kv, _, l) = stats.y_sum.shape, stats.w_sum.shape
        return [(s, e), (h, s, k), (kv, s, l)]
    (kv, e, k), (h, e_out, l) = stats.y_sum.shape, stats.w_sum.shape
    return [(s, e), (kv, s, k), (h, s, l), (s, e_out), (h, s, stats.size.k_c)]


@pytest.mark.parametrize("side", ["qk", "value"])
def test_sketch_sums_merge(side):
    gen = torch.Generator().manual_seed(4)
    make = ((lambda seed: SketchFormStats(4, 2, 6, SketchSize.of(3), seed, dtype=F64)) if side == "qk" else
            (lambda seed: SketchValueStats(4, 2, 6, 5, SketchSize.of(3), seed, dtype=F64)))
    whole = make(7)
    parts = filled(whole, gen, 3)
    merged = parts[0] + parts[1] + parts[2]
    for a, b in zip(merged.tensors(), whole.tensors()):
        close(a, b, 1e-14)
    for a, b in zip((whole - parts[0]).tensors(), (parts[1] + parts[2]).tensors()):
        close(a, b, 1e-14)
    # One all-reduce buffer: the sums only, the test matrices stay out and travel with the copies.
    flat = flatten_stats([whole])
    assert flat.numel() == sum(t.numel() for t in whole.tensors())
    again = unflatten_stats(flat, [whole])[0]
    assert all(torch.equal(a, b) for a, b in zip(again.tensors(), whole.tensors())) and again.tests is whole.tests
    # A checkpoint keeps the seed, sizes and checksum, not the matrices; a restore draws them again.
    state = whole.state_dict()
    assert state["sketch"] == {"seed": 7, "k": 3, "l": 5, "k_c": 3, "checksum": whole.tests.checksum}
    restored = stats_from_state_dict(state)
    assert type(restored) is type(whole)
    assert all(torch.equal(a, b) for a, b in zip(restored.tensors(), whole.tensors()))
    assert all(torch.equal(restored.tests[name], t) for name, t in whole.tests.matrices.items())
    with pytest.raises(ValueError, match="different test matrices"):
        whole + make(8)
    with pytest.raises(ValueError, match="torch changed its generator"):
        stats_from_state_dict({**state, "sketch": {**state["sketch"], "checksum": "0" * 64}})


SIZE = SketchSize(3, 5, 3)


def sketch_sums(side, seed=7, size=SIZE):
    """Empty sums of a query/key form (4 heads over 2 key heads, e′ 6) or a value map (e 5) of that sketch."""
    if side == "qk":
        return SketchFormStats(4, 2, 6, size, seed, dtype=F64)
    return SketchValueStats(4, 2, 6, 5, size, seed, dtype=F64)


@pytest.mark.parametrize("setting, saved, seed, size", [
    ("seed", 8, 8, SIZE), ("k", 4, 7, SketchSize(4, 5, 3)), ("l", 6, 7, SketchSize(3, 6, 3)),
    ("k_c", 4, 7, SketchSize(3, 5, 4)),
])
@pytest.mark.parametrize("side", ["qk", "value"])
def test_a_state_of_another_sketch_is_refused_naming_the_setting(side, setting, saved, seed, size):
    # Sums of other test matrices are sums of other linear maps of N̄: adding them up would be meaningless.
    here = sketch_sums(side)  # seed 7, SIZE (3, 5, 3)
    current = {"seed": 7, "k": 3, "l": 5, "k_c": 3}[setting]
    message = (f"the saved sums are of another sketch ({setting} {saved}, here {current}): sums of other test "
               "matrices do not combine")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        here.load_state_dict(sketch_sums(side, seed, size).state_dict())
    here.load_state_dict(sketch_sums(side).state_dict())  # the same settings restore


def test_the_checksum_is_the_same_under_any_thread_count():
    # A resume under torchrun runs other OMP threads. Over a million numbers a BLAS reduction (as a float checksum
    # would be) splits its sum by thread and its last bits change; a hash of the bytes does not.
    shapes = {"omega": (1000, 24), "psi": (28, 1000, 36)}
    threads = torch.get_num_threads()
    try:
        checksums = []
        for count in (1, 2):
            torch.set_num_threads(count)
            checksums.append(TestMatrices.draw(0, shapes).checksum)
    finally:
        torch.set_num_threads(threads)
    assert checksums[0] == checksums[1]
    assert isinstance(checksums[0], str) and len(checksums[0]) == 64  # a sha256 in hex


@pytest.mark.parametrize("side", ["qk", "value"])
def test_means_divide_by_instances_and_weight_apart(side):
    # C̄ is per instance (sequence), N̄ per weight (share of an optimizer step's loss); with k ≥ e′ the reconstruction
    # is exact for any statistics, so each mean meets its own normaliser and a swap is off by instances / weight = 6.
    gen = torch.Generator().manual_seed(9)
    e, e_out, h, kv, instances, weight = 6, 5, 4, 2, 3, 0.5
    size = SketchSize(e, e + 2, e)
    base = torch.randn(h if side == "value" else 1, e, e, generator=gen, dtype=F64)
    c_sum = base @ base.mT
    n_sum = torch.randn(h, e, e_out if side == "value" else e, generator=gen, dtype=F64)
    if side == "qk":
        stats = form_sketch(n_sum, c_sum[0], kv, size)
    else:
        stats = value_sketch(n_sum, c_sum, kv, size)
    stats.instances.fill_(instances)
    stats.weight.fill_(weight)
    means = stats.means()
    tol = 1e3 * e * torch.finfo(F64).eps  # a Nyström reconstruction of a covariance with cond ≤ 1e3
    if side == "qk":
        close(means.c, c_sum[0] / instances, tol)
        close(means.n.left @ means.n.right.repeat_interleave(h // kv, 0).mT, n_sum / weight, tol)
    else:
        close(means.c_root @ means.c_root.mT, c_sum / instances, tol)
        close(means.n.left.repeat_interleave(h // kv, 0) @ means.n.right.mT, n_sum / weight, tol)


def explicit_capture(stats, x, a, g, g_y):
    """The tuple `stats.update` takes, from explicit maps: inputs x (b, s, e′), attention a (b, H, s, s), score
    gradients g (b, H, s, s) and output gradients g_y (b, s, e), as a capture would hand it."""
    if isinstance(stats, FormStats):
        return x, g @ x.unsqueeze(1)
    if isinstance(stats, ValueStats):
        return a @ x.unsqueeze(1), g_y
    b, h, s, _ = a.shape
    kv = stats.y_sum.shape[0] if isinstance(stats, SketchValueStats) else stats.w_sum.shape[0]
    per_group = lambda t: t.reshape(b, kv, h // kv, s, -1).sum(2)  # noqa: E731
    if isinstance(stats, SketchFormStats):
        omega, psi = stats.tests["omega"], stats.tests["psi"]
        return x, g @ (x @ omega).unsqueeze(1), per_group(g.mT @ torch.einsum("bse,hel->bhsl", x, psi))
    omega, psi, omega_c = stats.tests["omega"], stats.tests["psi"], stats.tests["omega_c"]
    p = a @ x.unsqueeze(1)
    return (x, per_group(a.mT @ torch.einsum("bsf,hfk->bhsk", g_y, omega)), p @ psi, g_y, a.mT @ (p @ omega_c))


@pytest.mark.parametrize("make", [lambda: FormStats(4, 6, pinv=True, dtype=F64), lambda: ValueStats(4, 6, 5, dtype=F64),
                                  lambda: sketch_sums("qk"), lambda: sketch_sums("value")],
                         ids=["full-qk", "full-value", "sketch-qk", "sketch-value"])
def test_gradient_parts_are_the_parts_a_loss_scale_multiplies(make):
    # A GradScaler multiplies the loss, hence G and G_Y, by its scale; the parts built from them must be divided by it
    # and the others (inputs, attention, the value sketch's injected cotangent) must not. A power of two scales
    # exactly, so the sums of the divided capture are bit-equal to the unscaled ones.
    gen = torch.Generator().manual_seed(10)
    b, h, s, e, e_out, scale = 2, 4, 7, 6, 5, 2.0**10
    x = torch.randn(b, s, e, generator=gen, dtype=F64)
    a = torch.randn(b, h, s, s, generator=gen, dtype=F64).tril().softmax(-1)
    g = torch.randn(b, h, s, s, generator=gen, dtype=F64).tril()
    g_y = torch.randn(b, s, e_out, generator=gen, dtype=F64)
    plain, scaled = make(), make()
    plain.update(*explicit_capture(plain, x, a, g, g_y))
    captured = explicit_capture(scaled, x, a, scale * g, scale * g_y)
    scaled.update(*(t / scale if i in scaled.gradient_parts else t for i, t in enumerate(captured)))
    assert all(torch.equal(u, v) for u, v in zip(scaled.tensors(), plain.tensors()))


@pytest.mark.parametrize("sketch", [None, SketchSize(3, 5, 2)], ids=["full", "sketch"])
@pytest.mark.parametrize("method", ["natural", "pinv"])
@pytest.mark.parametrize("side", ["qk", "value"])
def test_sums_numel_is_what_empty_sums_allocate(side, method, sketch):
    gen = torch.Generator().manual_seed(11)
    if side == "qk":
        unit = FormWeights(*form_weights(4, 2, 10, 3, gen))
    else:
        unit = ValueWeights(torch.randn(2, 10, 3, generator=gen, dtype=F64), torch.randn(4, 3, 7, generator=gen,
                                                                                         dtype=F64))
    sums = unit.empty_sums(method, F64, sketch, seed=5)
    assert isinstance(sums, (SketchFormStats, SketchValueStats) if sketch else (FormStats, ValueStats))
    assert all(t.dtype == F64 for t in sums.tensors())
    if sketch:
        assert sums.size == sketch and sums.tests.seed == 5
    # Without the two scalars, instances and weight.
    assert unit.sums_numel(method, sketch) == sum(t.numel() for t in sums.tensors() if t.ndim)
    # The test matrices drawn beside a sketch's sums (the memory estimate counts them too).
    assert unit.tests_numel(sketch) == (sum(t.numel() for t in sums.tests.matrices.values()) if sketch else 0)
    if sketch:  # Given another sums' test matrices of that seed, the sums hold them rather than drawing their own.
        shared = unit.empty_sums(method, F64, sketch, seed=5, tests=sums.tests)
        assert shared.tests is sums.tests
        with pytest.raises(ValueError, match=r"^the given test matrices \(seed 5, shapes .*\) are not those of seed 6"):
            unit.empty_sums(method, F64, sketch, seed=6, tests=sums.tests)


@pytest.mark.parametrize("size, message", [
    (lambda: SketchSize(0, 1, 1), "a sketch's k must be a positive int, got 0"),
    (lambda: SketchSize(2, 3, 1.5), "a sketch's k_c must be a positive int, got 1.5"),
    (lambda: SketchSize(2, True, 2), "a sketch's l must be a positive int, got True"),
    (lambda: SketchSize.of(-1), "a sketch's k must be a positive int, got -1"),
    (lambda: SketchSize(4, 3, 4), "a sketch's co-range needs l ≥ k columns for an exact reconstruction at rank ≤ k, "
                                  "got l=3 < k=4"),
], ids=["zero", "float", "bool", "of", "l-below-k"])
def test_sketch_size_refuses_what_is_not_a_size(size, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        size()


def test_test_matrices_come_from_the_seed_alone():
    shapes = {"omega": (5, 3), "psi": (2, 5, 4)}
    a, b = TestMatrices.draw(3, shapes), TestMatrices.draw(3, shapes, dtype=F64)
    torch.manual_seed(0)  # the global generator plays no part
    c = TestMatrices.draw(3, shapes)
    assert a.checksum == b.checksum == c.checksum and torch.equal(a["psi"], c["psi"])
    assert a["psi"].dtype == torch.float32
    torch.testing.assert_close(b["psi"].float(), a["psi"], rtol=0, atol=0)
    assert TestMatrices.draw(4, shapes).checksum != a.checksum
    swapped = TestMatrices.draw(3, {"psi": (2, 5, 4), "omega": (5, 3)})
    assert swapped.checksum != a.checksum
    assert TestMatrices.checksum_of({"psi": a["psi"].flip(-1)}) != TestMatrices.checksum_of({"psi": a["psi"]})


def synthetic_window(e=64, h=4, s=32, sequences=128, rank=3, noise=1.0, seed=0):
    """Means of a window whose score gradient is a rank-`rank` teacher difference plus per-sequence noise, on
    LayerNorm-like inputs (G = −mask(XΔ*Xᵀ) + noise, causal rows summing to zero)."""
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randn(h, e, rank, generator=gen, dtype=F64) @ torch.randn(h, rank, e, generator=gen, dtype=F64) / e
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    x = layer_norm_inputs(sequences, s, e, gen, decay=0.1)
    g = -(x.unsqueeze(1) @ delta @ x.mT.unsqueeze(1)) + noise * torch.randn(sequences, h, s, s, generator=gen,
                                                                             dtype=F64)
    g = g.masked_fill(~mask, 0.0)
    g = g - mask * g.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    c = torch.einsum("bse,bsf->ef", x, x) / sequences
    n = torch.einsum("bse,bhst,btf->hef", x, g, x) / sequences
    return c, n


def test_sketch_energy_share_gradient_near_low_rank():
    # A regression guard of the reconstruction, not a quality claim: the gradient's bottleneck of a low-rank signal
    # under noise is nearly low rank, and a sketch of k = 8 catches nearly all of its top-7 energy.
    c, n = synthetic_window()
    gen = torch.Generator().manual_seed(1)
    h, e, d, p = 4, 64, 2, 7
    w_q, w_k = (torch.randn(h, e, d, generator=gen, dtype=F64) / e**0.5 for _ in range(2))
    log_tau = torch.zeros(h, dtype=F64)
    u, s, v, _ = FormGrowth(w_q, w_k, log_tau, Moments(c, n, None), "gradient").bottleneck("gradient")
    sketched = SketchedFormGrowth(w_q, w_k, log_tau, form_sketch(n, c, h, SketchSize.of(8)).means(), "gradient")
    u_s, _, v_s, _ = sketched.bottleneck("gradient")
    full = (u * s.unsqueeze(-2)) @ v.mT
    captured = (u_s[..., :p].mT @ full @ v_s[..., :p]).square().sum((-2, -1))
    assert (captured / s[:, :p].square().sum(-1)).min() >= 0.95


@pytest.mark.parametrize("ridge", [0.5, 2.0])
def test_ridge_natural_is_the_regularised_gauss_newton_step(ridge):
    gen = torch.Generator().manual_seed(6)
    h, e, d = 3, 10, 2
    c = covariance(e, gen)
    n = low_rank_n(h, e, 1, 4, c, gen)
    w_q, w_k, log_tau = form_weights(h, h, e, d, gen)
    mo = Moments(c, n, None)
    shifted = torch.linalg.inv(c + ridge * torch.trace(c) / e * torch.eye(e, dtype=F64))
    delta = FormGrowth(w_q, w_k, log_tau, mo, "natural", ridge=ridge).direction("natural")
    expected = -(shifted @ n @ shifted)
    close(delta / delta.norm(), expected / expected.norm(), 1e-12)
    # Null and 0 are the pseudo-inverse, bit for bit; the ridge is natural's alone.
    energy = torch.tensor(1.0, dtype=F64)
    for no_ridge in (None, 0.0):
        assert torch.equal(direction("natural", mo, energy, RCOND, no_ridge), direction("natural", mo, energy, RCOND))
    assert torch.equal(direction("gradient", mo, energy, RCOND, ridge), direction("gradient", mo, energy, RCOND))
    with pytest.raises(ValueError, match="ridge must be ≥ 0"):
        direction("natural", mo, energy, RCOND, -1.0)
    # The value side: C̄_j + ρ_jI with ρ_j from each head's own C̄_j.
    base = torch.randn(h, e, 5, generator=gen, dtype=F64) * torch.arange(1, h + 1, dtype=F64)[:, None, None]
    c_v, n_v = base @ base.mT, torch.randn(h, e, 7, generator=gen, dtype=F64)
    w_v, w_o = torch.randn(h, e, d, generator=gen, dtype=F64), torch.randn(h, d, 7, generator=gen, dtype=F64)
    delta_v = ValueGrowth(w_v, w_o, Moments(c_v, n_v, None), "natural", ridge=ridge).direction("natural")
    rho = ridge * torch.diagonal(c_v, dim1=-2, dim2=-1).sum(-1) / e
    expected_v = -torch.linalg.solve(c_v + rho[:, None, None] * torch.eye(e, dtype=F64), n_v)
    close(delta_v / delta_v.norm(), expected_v / expected_v.norm(), 1e-12)


@pytest.mark.parametrize("ridge", [None, 0.3])
def test_nystrom_solve_inverts_the_estimate_off_its_range_too(ridge):
    # Statistics inside range(Ĉ) never see the Woodbury term (I − UUᵀ)/ρ; a right-hand side outside it does.
    gen = torch.Generator().manual_seed(8)
    root = torch.randn(3, 12, 4, generator=gen, dtype=F64) @ torch.diag(torch.tensor([1.0, 0.5, 1e-3, 0.0], dtype=F64))
    rhs = torch.randn(3, 12, 5, generator=gen, dtype=F64)
    c = root @ root.mT
    if ridge is None:
        expected = psd_pinv(c, RCOND) @ rhs
    else:
        rho = ridge * torch.diagonal(c, dim1=-2, dim2=-1).sum(-1) / 12
        expected = torch.linalg.solve(c + rho[:, None, None] * torch.eye(12, dtype=F64), rhs)
    close(nystrom_solve(root, rhs, ridge, RCOND), expected, 1e-12)


def test_thin_svd_is_the_svd_of_the_product():
    gen = torch.Generator().manual_seed(7)
    left, right = torch.randn(2, 9, 3, generator=gen, dtype=F64), torch.randn(2, 7, 3, generator=gen, dtype=F64)
    u, s, v = thin_svd(left, right)
    close((u * s.unsqueeze(-2)) @ v.mT, left @ right.mT, 1e-14)
    close(s, torch.linalg.svdvals(left @ right.mT)[:, :3], 1e-14)
    close(u.mT @ u, torch.eye(3, dtype=F64).expand(2, 3, 3), 1e-14)
    flipped_u, flipped_v = canonical_signs(-u, -v)
    assert torch.equal(flipped_u, canonical_signs(u, v)[0]) and torch.equal(flipped_v, canonical_signs(u, v)[1])


def test_a_sketch_refuses_what_it_cannot_give():
    full, sketched = qk_pair(1, "natural", None)
    moments = sketched.moments
    w = (sketched.w_q, sketched.w_k, sketched.log_tau)
    with pytest.raises(ValueError, match="method under a sketch must be one of natural, gradient, random, zero"):
        SketchedFormGrowth(*w, moments, "pinv")
    with pytest.raises(ValueError, match="size_by under a sketch"):
        SketchedFormGrowth(*w, moments, "random", size_by="pinv")

    @register_direction("sketch_test_direction")
    def doubled(mo, rcond):
        return -2 * mo.n

    try:
        with pytest.raises(ValueError, match="method under a sketch"):
            SketchedFormGrowth(*w, moments, "sketch_test_direction")
    finally:
        del DIRECTIONS["sketch_test_direction"]
    random = SketchedFormGrowth(*w, moments, "random")  # a baseline is sized by the gradient's sketched bottleneck
    assert random.grow(0.5, 3 + 2, generator=torch.Generator().manual_seed(0)).w_q.shape[-1] == 5
