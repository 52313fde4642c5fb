"""Grouped growth (GQA keys shared by a group of query heads, rotary columns) and the growth plan, as unit tests on
tiny float64 forms: each grown form against an independent float64 reference (the truncated SVD of the group's
stacked bottlenecks, or the plain form's growth it must equal), the refusals a user meets, and how a plan sizes,
settles and memoises its growths. Fast: the mutation run's selection for growth/grouped.py and growth/plan.py."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lit_growattn.growth import DIRECTIONS, FormGrowth, FormStats, GroupedGrowth, GrowthPlan, growth_for
from lit_growattn.growth.factorize import FAN_IN_FLOOR
from lit_growattn.growth.grouped import check_modes, is_grouped, refused_mode
from lit_growattn.growth.linalg import psd_sqrt
from lit_growattn.growth.stats import Moments

F64 = torch.float64
HEADS, KV, E, D = 4, 2, 8, 2  # two groups of two query heads; input size e′ = 8, head size 2
GROUP = HEADS // KV


def weights(heads=HEADS, kv=KV, e=E, d=D, seed=0, dtype=F64):
    """w_q, w_k, log_tau of a form, with a different temperature per head (so that a group's mean τ̄ matters)."""
    g = torch.Generator().manual_seed(seed)
    w_q = torch.randn(heads, e, d, generator=g, dtype=F64) / e**0.5
    w_k = torch.randn(kv, e, d, generator=g, dtype=F64) / e**0.5
    log_tau = torch.linspace(-0.4, 0.3, heads, dtype=F64)
    return w_q.to(dtype), w_k.to(dtype), log_tau.to(dtype)


def statistics(heads=HEADS, e=E, seed=0, pinv=False, b=3, s=10) -> FormStats:
    """Float64 sums of LayerNorm inputs (C̄ singular) with a random gain per instance and random score gradients."""
    g = torch.Generator().manual_seed(100 + seed)
    gain = torch.empty(b, 1, 1, dtype=F64).uniform_(0.5, 2.0, generator=g)
    x = gain * F.layer_norm(torch.randn(b, s, e, generator=g, dtype=F64), (e,))
    grad = torch.randn(b, heads, s, s, generator=g, dtype=F64) / s
    stats = FormStats(heads, e, pinv=pinv, dtype=F64)
    stats.update(x, grad @ x.unsqueeze(1))
    return stats


def grouped(method="natural", truncation="euclidean", seed=0, **kwargs) -> GroupedGrowth:
    moments = statistics(seed=seed, pinv=method == "pinv").means()
    return GroupedGrowth(*weights(seed=seed), moments, method, rotary=2, truncation=truncation, **kwargs)


def keys_per_head(w_k, heads):
    return w_k.repeat_interleave(heads // w_k.shape[0], 0)


def bilinear(w_q, w_k, log_tau):
    """M_h = τ_h W_Qh W_K(h//g)ᵀ (H, e′, e′)."""
    return log_tau.exp()[:, None, None] * w_q @ keys_per_head(w_k, w_q.shape[0]).mT


def unreachable(delta, w_q, w_k, log_tau):
    """Per group, the residual (g·e′ × e′) of its heads' ΔM_h stacked after the best first-order change of the
    factors, δM_h = τ_h (δW_Qh W_Kᵀ + W_Qh δW_Kᵀ) with δW_K shared by the group: a least-squares problem solved
    whole, one column per unknown."""
    heads, e, d = w_q.shape
    kv = w_k.shape[0]
    g, tau = heads // kv, log_tau.exp()
    out = []
    for grp in range(kv):
        members = range(grp * g, (grp + 1) * g)
        columns = []
        for j_pos, h in enumerate(members):  # δW_Qh: this head's block only
            for i in range(e * d):
                dq = torch.zeros(e * d, dtype=F64)
                dq[i] = 1
                blocks = [torch.zeros(e * e, dtype=F64) for _ in members]
                blocks[j_pos] = (tau[h] * dq.view(e, d) @ w_k[grp].T).reshape(-1)
                columns.append(torch.cat(blocks))
        for i in range(e * d):  # δW_K: every head of the group
            dk = torch.zeros(e * d, dtype=F64)
            dk[i] = 1
            columns.append(torch.cat([(tau[h] * w_q[h] @ dk.view(e, d).T).reshape(-1) for h in members]))
        basis = torch.stack(columns, 1)
        target = torch.cat([delta[h].reshape(-1) for h in members])
        # The unknowns overlap (col(W_Q) × col(W_K) is reached both ways): an SVD-based solver for the rank deficiency.
        fit = basis @ torch.linalg.lstsq(basis, target.unsqueeze(1), driver="gelsd").solution
        out.append((target - fit.squeeze(1)).view(g * e, e))
    return torch.stack(out)


def stacked_truncation(g: GroupedGrowth, delta, p: int, roots=None):
    """The reference: per group, the best rank-p approximation of what no first-order change of the factors reaches
    of its heads' ΔM_h stacked (g·e′ × e′, `unreachable`), in the coordinates of roots = (C̄^½, C̄^-½) (None:
    euclidean), back in X′'s coordinates, per head (H, e′, e′); and its singular values (KV, e′)."""
    eye = torch.eye(E, dtype=F64)
    root, inverse = (eye, eye) if roots is None else roots
    stacked = unreachable(root @ delta @ root, root @ g.w_q, root @ g.w_k, g.log_tau)
    u, s, vh = torch.linalg.svd(stacked)
    best = (u[..., :p] * s[:, None, :p]) @ vh[:, :p]
    return inverse @ best.reshape(HEADS, E, E) @ inverse, s


def plain_twin(g: GroupedGrowth, **kwargs) -> FormGrowth:
    """The same form as a plain one: every query head with its own copy of its group's keys."""
    return FormGrowth(g.w_q, keys_per_head(g.w_k, HEADS), g.log_tau, g.moments, g.method, rcond=g.rcond, **kwargs)


def new_columns(grown, d=D):
    return grown.w_q[..., d:], grown.w_k[..., d:]


# -- GroupedGrowth: the grown form ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["natural", "gradient", "pinv"])
@pytest.mark.parametrize("truncation", ["euclidean", "whitened"])
@pytest.mark.parametrize("temperature", ["keep", "rescale"])
def test_a_gqa_group_grows_by_the_truncated_svd_of_its_stacked_bottlenecks(method, truncation, temperature):
    g = grouped(method, truncation, seed=1)  # a seed where pinv's bottleneck passes the sign check (seed 0's does not)
    alpha, p = 0.7, 3
    grown = g.grow(alpha, D + p, temperature=temperature)
    assert not grown.fell_back and grown.method == method and grown.alpha == alpha
    assert grown.w_q.shape == (HEADS, E, D + p) and grown.w_k.shape == (KV, E, D + p)
    assert grown.log_tau.shape == (HEADS,)
    # The direction is the plain form's (keys repeated per query head): ΔM counts every column as M does.
    delta = plain_twin(g).direction(method)
    torch.testing.assert_close(g.direction(method), delta, rtol=1e-12, atol=0)
    roots = psd_sqrt(g.moments.c, g.rcond) if truncation == "whitened" else None
    best, s = stacked_truncation(g, delta, p, roots)
    change = bilinear(grown.w_q.double(), grown.w_k.double(), grown.log_tau) - bilinear(g.w_q, g.w_k, g.log_tau)
    scale = float(change.abs().max())
    torch.testing.assert_close(change, alpha * best, rtol=0, atol=1e-10 * scale)
    torch.testing.assert_close(grown.spectrum, s[:, :p], rtol=1e-10, atol=1e-12 * float(s.max()))
    assert grown.predicted_decrease == pytest.approx(-float((g.moments.n * change).sum()), rel=1e-10)
    assert grown.predicted_decrease > 0
    # What the truncation left of Z = M + αΔM, per group, measured in the truncation's coordinates.
    root = torch.eye(E, dtype=F64) if roots is None else roots[0]
    left = (root @ (alpha * delta - change) @ root).square().sum((-2, -1)).reshape(KV, GROUP).sum(-1)
    torch.testing.assert_close(grown.discarded_energy, left, rtol=1e-9, atol=1e-12 * float(left.max()))


@pytest.mark.parametrize("temperature", ["keep", "rescale"])
def test_new_gqa_columns_split_each_pairs_scores_evenly_between_the_query_and_key_factor(temperature):
    """Per pair j of a group, with τ̄ the group's mean temperature (the one K column serves every head of the group):
    τ̄‖K_j‖² = ασ_j and Σ_h ‖τ′_h Q_h,j‖² = ασ_j τ̄, so that neither factor dwarfs the other (Adam moves both alike)."""
    g = grouped("natural")
    alpha, p = 0.5, 3
    grown = g.grow(alpha, D + p, temperature=temperature)
    tau_group = grown.log_tau.exp().reshape(KV, GROUP).mean(-1)
    new_q, new_k = new_columns(grown)
    sigma = grown.spectrum
    torch.testing.assert_close(tau_group[:, None] * new_k.square().sum(1), alpha * sigma, rtol=1e-10, atol=0)
    q_energy = (grown.log_tau.exp()[:, None, None] * new_q).square().sum(1).reshape(KV, GROUP, p).sum(1)
    torch.testing.assert_close(q_energy, alpha * sigma * tau_group[:, None], rtol=1e-10, atol=0)


@pytest.mark.parametrize("temperature", ["keep", "rescale"])
def test_a_gqa_growth_keeps_the_old_columns_and_says_how_adam_carries_them(temperature):
    """The old columns, the 2 rotary ones first, stay in place, each times the same c = (τ/τ′)^½, so that
    τ′ c² W_Q W_Kᵀ = M and every rotary pair rotates as before; the carries select them and undo c on their moments
    (gradients scale by 1/c)."""
    g = grouped("gradient")
    grown = g.grow(0.5, D + 3, temperature=temperature)
    c = ((D + 3) / D) ** 0.25 if temperature == "rescale" else 1.0
    torch.testing.assert_close(grown.log_tau, g.log_tau - 2 * math.log(c), rtol=0, atol=1e-15)
    for name, old in (("w_q", g.w_q), ("w_k", g.w_k)):
        carry = grown.carries[name]
        torch.testing.assert_close(getattr(grown, name)[carry.old_index], c * old, rtol=1e-15, atol=0)
        assert carry.first_scale * c == pytest.approx(1) and carry.second_scale * c**2 == pytest.approx(1)
    assert torch.equal(grown.log_tau[grown.carries["log_tau"].old_index], grown.log_tau)
    assert set(grown.carries) == {"w_q", "w_k", "log_tau"}


@pytest.mark.parametrize("truncation", ["euclidean", "whitened"])
@pytest.mark.parametrize("temperature", ["keep", "rescale"])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_rotary_forms_without_shared_keys_grow_as_the_plain_form_appends(truncation, temperature, alpha):
    """Group size 1: the stacked SVD is each head's own, so the growth is FormGrowth's append, column for column
    (up to the sign of each singular pair, so the columns are compared through their outer products)."""
    w_q, w_k, log_tau = weights(kv=HEADS)
    moments = statistics().means()
    g = GroupedGrowth(w_q, w_k, log_tau, moments, "natural", rotary=2, truncation=truncation)
    plain = FormGrowth(w_q, w_k, log_tau, moments, "natural", truncation=truncation)
    grown, twin = g.grow(alpha, D + 4, temperature=temperature), plain.grow(alpha, D + 4, temperature=temperature)
    for ours, theirs in zip(new_columns(grown), new_columns(twin)):
        outer = lambda w: w @ w.mT  # noqa: E731
        torch.testing.assert_close(outer(ours), outer(theirs), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(bilinear(grown.w_q, grown.w_k, grown.log_tau),
                               bilinear(twin.w_q, twin.w_k, twin.log_tau), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grown.log_tau, twin.log_tau, rtol=1e-15, atol=0)
    assert torch.equal(grown.w_q[..., :D], twin.w_q[..., :D]) and grown.carries == twin.carries
    torch.testing.assert_close(grown.spectrum, twin.spectrum, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(grown.discarded_energy, twin.discarded_energy, rtol=1e-9, atol=1e-14)
    assert grown.predicted_decrease == pytest.approx(twin.predicted_decrease, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(g.column_gains(), plain.column_gains(), rtol=1e-9, atol=1e-14)
    assert g.rank(0.05, E) == plain.rank(0.05, E)


@pytest.mark.parametrize("truncation", ["euclidean", "whitened"])
def test_at_zero_step_a_gqa_growth_keeps_the_function_with_the_query_columns_of_a_unit_step(truncation):
    """Zero fan-in: α = 0 appends the Q columns that α = 1 would (so the zero K columns get gradient at once)."""
    g = grouped("natural", truncation)
    still, unit = g.grow(0.0, D + 3), g.grow(1.0, D + 3)
    assert torch.equal(still.w_k[..., D:], torch.zeros(KV, E, 3))
    assert torch.equal(bilinear(still.w_q, still.w_k, still.log_tau), bilinear(g.w_q, g.w_k, g.log_tau))
    torch.testing.assert_close(still.w_q, unit.w_q, rtol=1e-12, atol=0)
    assert still.w_q[..., D:].abs().amax((0, 1)).min() > 0
    assert still.predicted_decrease == 0 and torch.equal(still.discarded_energy, torch.zeros(KV, dtype=F64))
    assert not still.fell_back and still.method == "natural"


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_a_vanishing_pair_of_a_gqa_group_gets_a_floored_query_column_and_a_zero_key_column(scale):
    """N̄ whose heads share one row direction b per group: each group's stacked bottleneck has rank 1, so its pairs
    after the first vanish; they append Q columns of at least the floor's share of the strongest pair, K columns 0.
    Whatever the scale of the weights (σ scales as their square): what vanishes is relative to the strongest pair."""
    w_q, w_k, log_tau = weights()
    w_q, w_k = scale * w_q, scale * w_k
    c = statistics().means().c
    g_ = torch.Generator().manual_seed(7)
    a = torch.randn(HEADS, E, 1, generator=g_, dtype=F64)
    b = keys_per_head(torch.randn(KV, 1, E, generator=g_, dtype=F64), HEADS)
    b[GROUP:] *= 1e-3  # a weak second group: the vanishing cut-off is relative to each group's own strongest pair
    g = GroupedGrowth(w_q, w_k, log_tau, Moments(c, a @ b, None), "gradient")
    alpha, p = 0.5, 3
    grown = g.grow(alpha, D + p)
    best, s = stacked_truncation(g, g.direction("gradient"), 1)
    change = bilinear(grown.w_q, grown.w_k, grown.log_tau) - bilinear(w_q, w_k, log_tau)
    torch.testing.assert_close(change, alpha * best, rtol=0, atol=1e-10 * float(change.abs().max()))
    new_q, new_k = new_columns(grown)
    assert (new_k[..., 0].abs().amax(-1) > 0).all() and torch.equal(new_k[..., 1:], torch.zeros(KV, E, p - 1))
    tau_group = log_tau.exp().reshape(KV, GROUP).mean(-1)
    q_energy = (log_tau.exp()[:, None, None] * new_q).square().sum(1).reshape(KV, GROUP, p).sum(1)
    floor = FAN_IN_FLOOR * s[:, :1] * tau_group[:, None]
    torch.testing.assert_close(q_energy[:, 1:], floor.expand(KV, p - 1), rtol=1e-10, atol=0)
    torch.testing.assert_close(grown.spectrum[:, 0], s[:, 0], rtol=1e-10, atol=0)
    assert (grown.spectrum[:, 1:] < 1e-12 * s[:, :1]).all()
    energy = g.direction("gradient").square().sum((-2, -1)).reshape(KV, GROUP).sum(-1)
    torch.testing.assert_close(grown.discarded_energy, alpha**2 * (energy - s[:, 0] ** 2), rtol=1e-9,
                               atol=1e-12 * float(energy.max()))


def test_a_gqa_growth_returns_the_forms_dtype_and_computes_in_float64():
    w_q, w_k, log_tau = weights(dtype=torch.float32)
    moments = statistics().means()
    g32 = GroupedGrowth(w_q, w_k, log_tau, moments, "natural")
    g64 = GroupedGrowth(w_q.double(), w_k.double(), log_tau.double(), moments, "natural")
    grown32, grown64 = g32.grow(0.5, D + 2), g64.grow(0.5, D + 2)
    assert {t.dtype for t in (grown32.w_q, grown32.w_k, grown32.log_tau)} == {torch.float32}
    for name in ("w_q", "w_k", "log_tau"):
        torch.testing.assert_close(getattr(grown32, name), getattr(grown64, name).float(), rtol=0, atol=0)
    assert grown32.predicted_decrease == pytest.approx(grown64.predicted_decrease, rel=1e-12)


def test_a_direction_that_fails_the_sign_check_falls_back_to_the_gradients_growth(monkeypatch):
    monkeypatch.setitem(DIRECTIONS, "ascent", lambda moments, rcond: moments.n)  # ⟨N̄, ΔM⟩ > 0: never descends
    moments = statistics().means()
    ascent = GroupedGrowth(*weights(), moments, "ascent")
    grown = ascent.grow(0.5, D + 2)
    assert grown.fell_back and grown.method == "gradient" and grown.predicted_decrease > 0
    gradient = GroupedGrowth(*weights(), moments, "gradient").grow(0.5, D + 2)
    assert not gradient.fell_back
    for name in ("w_q", "w_k", "log_tau"):
        torch.testing.assert_close(getattr(grown, name), getattr(gradient, name), rtol=0, atol=0)
    still = ascent.grow(0.0, D + 2)  # no step, no prediction to check
    assert not still.fell_back and still.method == "ascent"
    # The fallback grows with the settings asked for.
    rescaled = ascent.grow(0.5, D + 2, temperature="rescale")
    assert rescaled.fell_back
    torch.testing.assert_close(rescaled.log_tau, GroupedGrowth(*weights(), moments, "gradient").grow(
        0.5, D + 2, temperature="rescale").log_tau, rtol=0, atol=0)


def test_a_growth_that_predicts_no_decrease_falls_back_unless_it_is_the_gradients_own():
    """A zero gradient: nothing to grow along, so every growth predicts exactly 0, which fails the sign check (≤ 0)
    of any direction but the gradient, the fallback itself."""
    c = statistics().means().c
    zero = Moments(c, torch.zeros(HEADS, E, E, dtype=F64), None)
    natural = GroupedGrowth(*weights(), zero, "natural").grow(0.5, D + 2)
    assert natural.predicted_decrease == 0 and natural.fell_back and natural.method == "gradient"
    gradient = GroupedGrowth(*weights(), zero, "gradient").grow(0.5, D + 2)
    assert gradient.predicted_decrease == 0 and not gradient.fell_back and gradient.method == "gradient"


# -- GroupedGrowth: sizes and rates ----------------------------------------------------------------------------------

def test_gqa_rank_counts_per_group_the_stacked_singular_values_above_a_share_of_the_forms_largest():
    g = grouped("natural")
    s = stacked_truncation(g, g.direction("natural"), 1)[1]
    # This form's stacked spectra relative to the largest (group 1's first), then round-off (rank e′ − d = 6):
    spectra = torch.tensor([[0.6107, 0.5003, 0.3995, 0.3156, 0.1916, 0.1514, 0, 0],
                            [1.0000, 0.6224, 0.3930, 0.2607, 0.1943, 0.1593, 0, 0]], dtype=F64)
    torch.testing.assert_close(s / s.max(), spectra, rtol=0, atol=1e-4)
    # The most in any group (group 0 decides at 0.3), relative to the form's largest, not the group's.
    counts = {0.999: 1, 0.7: 1, 0.5: 2, 0.39: 3, 0.3: 4, 0.25: 4, 0.16: 5, 0.1: 6, 1e-12: 6}
    assert {t: g.rank(t, E) for t in counts} == counts
    assert g.rank(1.0, E) == 1 and g.rank(2.0, E) == 1  # nothing above: still one column
    assert g.rank(0.1, D + 3) == 3 and g.rank(0.1, 99) == E - D  # capped by max_d_head, never beyond e′
    assert g.rank(0.1, D) == 0 and g.rank(1.0, D) == 0 and g.rank(0.1, D - 1) == 0  # no room: no column
    # A baseline is sized by the direction it names, or the gradient's.
    assert grouped("random", size_by="natural").rank(0.05, E) == g.rank(0.05, E)
    assert grouped("zero").rank(0.4, E) == grouped("gradient").rank(0.4, E) == 3 != g.rank(0.4, E)


def test_gqa_rank_stays_within_e_when_zero_key_columns_leave_a_wider_bottleneck():
    """A zero K column (an earlier growth's zero fan-in key) spans nothing, so the bottleneck keeps e′ − d + 1
    pairs; the form still has room for only e′ − d columns."""
    w_q, w_k, log_tau = weights()
    w_k[..., -1] = 0
    g = GroupedGrowth(w_q, w_k, log_tau, statistics().means(), "natural")
    assert int((g.bottleneck("natural")[1] > 1e-8).sum(-1).max()) == E - D + 1
    assert g.rank(1e-6, E) == E - D and g.rank(1e-6, E + 5) == E - D


def test_gqa_gains_against_a_float32_gradient_are_rated_in_float64():
    g = grouped("natural", "whitened")
    n = statistics(seed=3).means().n
    torch.testing.assert_close(g.column_gains(n.float()), g.column_gains(n.float().double()), rtol=1e-12, atol=0)


def test_the_natural_direction_of_a_gqa_form_uses_the_cut_off_given():
    """rcond = 0.2 drops C̄'s eigenvalue at 0.18 of the largest from C̄⁺ (the default 1e-6 keeps it)."""
    moments = statistics().means()
    g = GroupedGrowth(*weights(), moments, "natural", rcond=0.2)
    torch.testing.assert_close(g.direction("natural"), plain_twin(g).direction("natural"), rtol=1e-12, atol=0)
    assert not torch.allclose(g.direction("natural"), grouped("natural").direction("natural"), rtol=1e-3)


# -- GroupedGrowth: baselines --------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["random", "zero"])
def test_gqa_baselines_draw_seeded_gaussian_columns_scaled_per_head(method):
    g = grouped(method)

    def draw(growth, alpha=0.5, seed=5, **kwargs):
        return growth.grow(alpha, D + 3, generator=torch.Generator().manual_seed(seed), **kwargs)

    grown = draw(g)
    new_q, new_k = new_columns(grown)
    assert new_q.shape == (HEADS, E, 3) and new_k.shape == (KV, E, 3)
    assert grown.discarded_energy.shape == (KV,) and not grown.discarded_energy.any()
    assert grown.spectrum.shape == (KV, 0) and grown.method == method and not grown.fell_back
    for name in ("w_q", "w_k"):  # the same seed, the same columns; α does not enter
        assert torch.equal(getattr(draw(g, alpha=0.0), name), getattr(grown, name))
        assert torch.equal(getattr(draw(g, alpha=2.0), name), getattr(grown, name))
    assert not torch.equal(draw(g, seed=6).w_q, grown.w_q)
    torch.manual_seed(0)  # without a generator: torch's global one
    first = g.grow(0.5, D + 3).w_q
    torch.manual_seed(0)
    assert torch.equal(g.grow(0.5, D + 3).w_q, first) and not torch.equal(first, grown.w_q)
    if method == "zero":
        assert torch.equal(new_k, torch.zeros(KV, E, 3))
        assert torch.equal(bilinear(grown.w_q, grown.w_k, grown.log_tau), bilinear(g.w_q, g.w_k, g.log_tau))
    else:
        assert new_k.abs().amax((1, 2)).min() > 0
    # σ of each head's columns is the RMS of its own old columns: scaling one head's old columns scales its draw.
    w_q, w_k, log_tau = weights()
    w_q[1] *= 3.0
    w_k[0] *= 5.0
    scaled = draw(GroupedGrowth(w_q, w_k, log_tau, g.moments, method))
    factor_q = torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=F64)[:, None, None]
    torch.testing.assert_close(new_columns(scaled)[0], factor_q * new_q, rtol=1e-14, atol=0)
    torch.testing.assert_close(new_columns(scaled)[1], torch.tensor([5.0, 1.0], dtype=F64)[:, None, None] * new_k,
                               rtol=1e-14, atol=0)
    # The columns are the generator's float64 standard normal draws, the query columns' first, times that RMS
    # (so that one seed gives the same columns whatever the form's dtype: a resumed run or another rank).
    seeded = torch.Generator().manual_seed(5)
    unit_q, unit_k = (torch.randn(heads, E, 3, generator=seeded, dtype=F64) for heads in (HEADS, KV))
    rms = lambda w: w.square().mean((1, 2), keepdim=True).sqrt()  # noqa: E731
    torch.testing.assert_close(new_q, unit_q * rms(g.w_q), rtol=1e-15, atol=0)
    if method == "random":
        torch.testing.assert_close(new_k, unit_k * rms(g.w_k), rtol=1e-15, atol=0)
    # With temperature='rescale' the old columns are multiplied by c, and the new ones drawn at the scale of those.
    c = ((D + 3) / D) ** 0.25
    rescaled = draw(g, temperature="rescale")
    torch.testing.assert_close(new_columns(rescaled)[0], c * new_q, rtol=1e-14, atol=0)
    torch.testing.assert_close(new_columns(rescaled)[1], c * new_k, rtol=1e-14, atol=0)


def test_a_float32_baseline_draws_the_float64_columns_of_the_same_seed():
    w_q, w_k, log_tau = weights(dtype=torch.float32)
    moments = statistics().means()
    grown32 = GroupedGrowth(w_q, w_k, log_tau, moments, "random").grow(0.0, D + 2,
                                                                      generator=torch.Generator().manual_seed(1))
    grown64 = GroupedGrowth(w_q.double(), w_k.double(), log_tau.double(), moments, "random").grow(
        0.0, D + 2, generator=torch.Generator().manual_seed(1))
    assert grown32.w_q.dtype == torch.float32
    torch.testing.assert_close(grown32.w_q, grown64.w_q.float(), rtol=0, atol=0)
    torch.testing.assert_close(grown32.w_k, grown64.w_k.float(), rtol=0, atol=0)


# -- GroupedGrowth: refusals and choosing the class ----------------------------------------------------------------

def form(heads=HEADS, kv=KV, rotary=0):
    w_q, w_k, log_tau = weights(heads, kv)
    return SimpleNamespace(w_q=w_q, w_k=w_k, log_tau=log_tau, rotary=rotary)


ROTARY_REPLACE = ("mode='replace' refactors every query/key column, but the first 2 columns are rotary (RoPE rotates "
                  "them by position, so they are not one bilinear form of X): use mode='append', which keeps them and "
                  "appends position-independent columns")
GQA_REPLACE = "mode='replace' cannot share one K factor among a GQA group's query heads: use mode='append'"
FULL_RANK = ("line_search='full_rank' rates M + αΔM refactored at full rank (a replace), which rotary or GQA columns "
             "cannot take: use line_search='low_rank'")


def test_replace_and_the_full_rank_line_search_are_refused_for_rotary_or_shared_keys_with_the_fix():
    plain, gqa, rotary = form(kv=HEADS), form(), form(kv=HEADS, rotary=2)
    assert refused_mode(rotary, "replace") == ROTARY_REPLACE
    assert refused_mode(form(rotary=2), "replace") == ROTARY_REPLACE  # both: the rotary columns are named first
    assert refused_mode(gqa, "replace") == GQA_REPLACE
    assert refused_mode(gqa, "append", "full_rank") == FULL_RANK == refused_mode(rotary, "append", "full_rank")
    for f in (plain, gqa, rotary):
        assert refused_mode(f, "append") is None and refused_mode(f, "append", "low_rank") is None
    assert refused_mode(plain, "replace") is None and refused_mode(plain, "replace", "full_rank") is None
    assert refused_mode(SimpleNamespace(w_q=plain.w_q, w_k=plain.w_k), "replace") is None  # no rotary attribute
    named = [(0, "layers.0.a", plain), (1, "layers.1.b", gqa)]
    check_modes(named, "append", "low_rank")
    check_modes(named[:1], "replace", "full_rank")
    with pytest.raises(ValueError, match=f"^{re.escape('layers.1.b: ' + GQA_REPLACE)}$"):
        check_modes(named, "replace", "low_rank")
    with pytest.raises(ValueError, match=f"^{re.escape('layers.1.b: ' + FULL_RANK)}$"):
        check_modes(named, "append", "full_rank")


def test_forms_with_shared_keys_or_rotary_columns_grow_by_grouped_growth_with_the_settings_given():
    moments = statistics().means()
    assert not is_grouped(form(kv=HEADS)) and is_grouped(form()) and is_grouped(form(kv=HEADS, rotary=2))
    assert not is_grouped(SimpleNamespace(w_q=torch.zeros(2, E, D), w_k=torch.zeros(2, E, D)))
    plain = growth_for(form(kv=HEADS), moments, "gradient", truncation="whitened", rcond=1e-4, size_by="gradient")
    assert type(plain) is FormGrowth and plain.method == "gradient" and plain.truncation == "whitened"
    assert plain.rcond == 1e-4
    for f in (form(), form(kv=HEADS, rotary=2)):
        g = growth_for(f, moments, "random", truncation="whitened", rcond=1e-4, size_by="natural")
        assert type(g) is GroupedGrowth and g.method == "random" and g.sizing_method == "natural"
        assert g.rotary == f.rotary and g.rcond == 1e-4 and g.group == HEADS // f.w_k.shape[0]
        # The truncation and its cut-off reached the growth: its columns are rated in those coordinates.
        built = GroupedGrowth(f.w_q, f.w_k, f.log_tau, moments, "natural", truncation="whitened", rcond=1e-4)
        torch.testing.assert_close(g.column_gains(), built.column_gains(), rtol=1e-12, atol=0)
        euclidean = GroupedGrowth(f.w_q, f.w_k, f.log_tau, moments, "natural", rcond=1e-4).column_gains()
        assert not torch.allclose(g.column_gains(), euclidean, rtol=1e-3)
        default_cut_off = GroupedGrowth(f.w_q, f.w_k, f.log_tau, moments, "natural", truncation="whitened")
        assert not torch.allclose(g.column_gains(), default_cut_off.column_gains(), rtol=1e-3)
    assert growth_for(form(), moments).method == "natural"  # the default method
    default = growth_for(form(), moments, "natural")
    assert default.rotary == 0 and default.rcond == 1e-6 and default.dtype == F64


def test_a_grouped_growth_refuses_bad_settings_naming_the_fix():
    moments = statistics().means()
    w_q, w_k, log_tau = weights()
    for kv in (3, 8):
        with pytest.raises(ValueError, match=f"^4 query heads cannot share {kv} key heads evenly$"):
            GroupedGrowth(w_q, torch.zeros(kv, E, D, dtype=F64), log_tau, moments)
    with pytest.raises(ValueError, match="^method must be one of .*; got 'newton'"):
        GroupedGrowth(w_q, w_k, log_tau, moments, "newton")
    with pytest.raises(ValueError, match="^truncation must be one of euclidean, whitened; got 'spectral'$"):
        GroupedGrowth(w_q, w_k, log_tau, moments, truncation="spectral")
    with pytest.raises(ValueError, match="^size_by='natural' only applies to the baselines"):
        GroupedGrowth(w_q, w_k, log_tau, moments, "gradient", size_by="natural")
    g = GroupedGrowth(w_q, w_k, log_tau, moments, rotary=2)
    with pytest.raises(ValueError, match=f"^{re.escape(ROTARY_REPLACE)}$"):
        g.grow(0.5, D + 1, mode="replace")
    with pytest.raises(ValueError, match=f"^{re.escape(GQA_REPLACE)}$"):
        GroupedGrowth(w_q, w_k, log_tau, moments).grow(0.5, D + 1, mode="replace")
    with pytest.raises(ValueError, match="^mode must be one of append, replace; got 'insert'$"):
        g.grow(0.5, D + 1, mode="insert")
    with pytest.raises(ValueError, match="^temperature must be one of keep, rescale; got 'cool'$"):
        g.grow(0.5, D + 1, temperature="cool")
    for alpha in (-0.1, float("nan")):
        with pytest.raises(ValueError, match=f"^step size α must be ≥ 0, got {alpha}$"):
            g.grow(alpha, D + 1)
    for d_new in (D - 1, E + 1):
        with pytest.raises(ValueError, match=f"^d_new={d_new} must lie between the current d_head 2 and e′ = 8$"):
            g.grow(0.5, d_new)
    assert g.grow(0.5, D).w_q.shape[-1] == D and g.grow(0.5, E).w_q.shape[-1] == E  # both ends allowed


# -- GrowthPlan ----------------------------------------------------------------------------------------------------

def plan_of(forms, **kwargs) -> GrowthPlan:
    stats = [statistics(seed=i, pinv=kwargs.get("method") == "pinv") for i in range(len(forms))]
    return GrowthPlan.build(forms, stats, **kwargs)


def test_a_plan_grows_each_form_by_grow_by_within_max_d_head_and_e():
    forms = {"a": form(kv=HEADS), "b": form(), "c": form(kv=HEADS, rotary=2)}
    assert plan_of(forms).d_new == {"a": D + 1, "b": D + 1, "c": D + 1}  # grow_by=1 by default
    assert plan_of(forms, grow_by=3).d_new == {"a": D + 3, "b": D + 3, "c": D + 3}
    assert plan_of(forms, grow_by={"a": 1, "b": 2, "c": 0}).d_new == {"a": D + 1, "b": D + 2, "c": D}
    assert plan_of(forms, grow_by=3, max_width=D + 2).d_new == {"a": D + 2, "b": D + 2, "c": D + 2}
    assert plan_of(forms, grow_by=99).d_new == {"a": E, "b": E, "c": E}  # never past e′
    assert plan_of(forms, grow_by=2, max_width=99).d_new == {"a": D + 2, "b": D + 2, "c": D + 2}
    assert plan_of(forms, grow_by=2, max_width=1).d_new == {"a": D, "b": D, "c": D}  # already past max: kept
    plan = plan_of(forms, grow_by=2)
    assert type(plan.forms["a"]) is FormGrowth and type(plan.forms["b"]) is GroupedGrowth
    assert type(plan.forms["c"]) is GroupedGrowth
    for name in forms:
        assert plan.grow(name, 0.5).w_q.shape[-1] == D + 2


def test_a_plan_with_dynamic_rank_sizes_each_form_by_its_spectrum_capped_by_grow_by():
    forms = {"a": form(kv=HEADS), "b": form()}
    plan = plan_of(forms, grow_by=None, dynamic_rank=0.05)
    expected = {name: D + g.rank(0.05, E) for name, g in plan.forms.items()}
    assert plan.d_new == expected and all(D < d <= E for d in expected.values())
    assert max(expected.values()) > D + 1  # so that the caps below cap something
    assert plan_of(forms, grow_by=1, dynamic_rank=0.05).d_new == {"a": D + 1, "b": D + 1}
    assert plan_of(forms, grow_by={"a": 1, "b": 99}, dynamic_rank=0.05).d_new == {"a": D + 1, "b": expected["b"]}
    assert plan_of(forms, grow_by=None, dynamic_rank=0.05, max_width=D + 1).d_new == {"a": D + 1, "b": D + 1}
    assert plan_of(forms, grow_by=None, dynamic_rank=1e-12).d_new == {"a": E, "b": E}
    assert plan_of(forms, grow_by=0, dynamic_rank=0.05).d_new == {"a": D, "b": D}  # sized later (resized)


def test_forms_of_a_group_grow_to_the_largest_size_among_them():
    forms = {"layers.0.a": form(kv=HEADS), "layers.0.b": form(), "layers.1.a": form()}
    layer = lambda name: name.split(".")[1]  # noqa: E731
    grow_by = {"layers.0.a": 1, "layers.0.b": 3, "layers.1.a": 2}
    assert plan_of(forms, grow_by=grow_by, group_of=layer).d_new == {"layers.0.a": D + 3, "layers.0.b": D + 3,
                                                                     "layers.1.a": D + 2}
    assert plan_of(forms, grow_by=grow_by).d_new == {name: D + p for name, p in grow_by.items()}
    wider = {**forms, "layers.1.b": SimpleNamespace(**{**vars(form()), "w_q": weights(d=D + 1)[0],
                                                       "w_k": weights(d=D + 1)[1]})}
    with pytest.raises(ValueError, match=re.escape("forms ['layers.1.a', 'layers.1.b'] must share their width to grow "
                                                   "together")):
        plan_of(wider, grow_by=1, group_of=layer)
    assert plan_of(wider, grow_by=1).d_new["layers.1.b"] == D + 2  # alone, each form keeps its own size


def test_a_plan_refuses_mismatched_statistics_and_a_missing_size():
    forms = {"a": form(kv=HEADS), "b": form()}
    with pytest.raises(ValueError, match=r"^1 statistics for 2 forms$"):
        GrowthPlan.build(forms, [statistics()])
    with pytest.raises(ValueError, match="^give grow_by, or dynamic_rank to choose it from the spectrum$"):
        plan_of(forms, grow_by=None)
    with pytest.raises(ValueError, match="^line_search must be one of low_rank, full_rank; got 'exact'$"):
        plan_of(forms, line_search="exact")


def test_a_plan_passes_its_settings_to_every_growth():
    forms = {"a": form(kv=HEADS), "b": form()}
    generator = torch.Generator().manual_seed(3)
    plan = plan_of(forms, method="random", truncation="whitened", rcond=1e-4, size_by="natural", mode="append",
                   temperature="rescale", line_search="low_rank", generator=generator, grow_by=2)
    for i, (name, g) in enumerate(plan.forms.items()):
        assert g.method == "random" and g.sizing_method == "natural" and g.rcond == 1e-4
        built = growth_for(forms[name], statistics(seed=i).means(), "random", truncation="whitened", rcond=1e-4,
                           size_by="natural")
        torch.testing.assert_close(g.column_gains(), built.column_gains(), rtol=1e-12, atol=0)
    assert (plan.mode, plan.temperature, plan.line_search, plan.generator) == ("append", "rescale", "low_rank",
                                                                               generator)
    # The statistics' means reach the growths in the order of the forms.
    for i, g in enumerate(plan.forms.values()):
        torch.testing.assert_close(g.moments.n, statistics(seed=i).means().n, rtol=0, atol=0)
    grown = plan.grow("b", 0.5)  # the first draw of the plan's generator, at temperature='rescale'
    alone = GroupedGrowth(*weights(), plan.forms["b"].moments, "random").grow(
        0.5, D + 2, temperature="rescale", generator=torch.Generator().manual_seed(3))
    for name in ("w_q", "w_k", "log_tau"):
        torch.testing.assert_close(getattr(grown, name), getattr(alone, name), rtol=0, atol=0)
    with pytest.raises(ValueError, match="^baseline 'random' only appends columns; use mode='append'$"):
        plan_of({"a": form(kv=HEADS)}, method="random", mode="replace").grow("a", 0.5)
    replaced = plan_of({"a": form(kv=HEADS)}, mode="replace").grow("a", 0.5)
    assert replaced.carries["w_q"].old_index is None  # every column rotated: mode='replace' reached the growth


def test_a_plan_built_by_hand_appends_keeps_the_temperature_and_rates_the_growth_itself():
    growths = {"a": grouped("natural"), "b": growth_for(form(kv=HEADS), statistics().means())}
    plan = GrowthPlan(growths, {"a": D + 2, "b": D + 1})
    grown = plan.grow("a", 0.5)
    assert grown.w_q.shape[-1] == D + 2 and torch.equal(grown.log_tau, growths["a"].log_tau)
    assert plan.grow("b", 0.5).carries["w_q"].old_index is not None  # appended, the old columns kept
    assert plan.trial("a", 0.5) is grown and plan.generator is None


def test_a_resized_plan_keeps_its_growths_and_settings_and_grows_to_the_new_sizes():
    generator = torch.Generator().manual_seed(3)
    forms = {"a": form(kv=HEADS), "b": form()}
    plan = plan_of(forms, grow_by=0, temperature="rescale", line_search="full_rank", generator=generator)
    assert plan.d_new == {"a": D, "b": D}
    resized = plan.resized({"a": D + 3, "b": D + 1})
    assert resized.d_new == {"a": D + 3, "b": D + 1} and plan.d_new == {"a": D, "b": D}
    assert all(resized.forms[name] is plan.forms[name] for name in forms)  # directions and bottlenecks computed once
    assert (resized.mode, resized.temperature, resized.line_search, resized.generator) == (
        "append", "rescale", "full_rank", generator)
    grown = resized.grow("a", 0.5)
    assert grown.w_q.shape[-1] == D + 3 and plan.grow("a", 0.5).w_q.shape[-1] == D  # its own memo
    torch.testing.assert_close(grown.log_tau, plan.forms["a"].log_tau + 0.5 * torch.tensor(D / (D + 3)).log())
    assert resized.trial("a", 0.5).w_q.shape[-1] == E  # still the full-rank line search
    baseline = plan_of(forms, method="zero", grow_by=0, generator=generator).resized({"a": D + 1, "b": D + 2})
    assert baseline.generator is generator and baseline.grow("b", 0.5).w_q.shape[-1] == D + 2
    replacing = plan_of({"a": form(kv=HEADS)}, grow_by=0, mode="replace").resized({"a": D + 2})
    assert replacing.mode == "replace" and replacing.grow("a", 0.5).carries["w_q"].old_index is None


def test_a_plan_memoises_each_growth_and_a_baseline_draws_once_whatever_the_step():
    forms = {"a": form(kv=HEADS), "b": form()}
    plan = plan_of(forms, grow_by=2)
    assert plan.grow("a", 0.5) is plan.grow("a", 0.5) and plan.grow("a", 0.5) is not plan.grow("a", 0.25)
    assert plan.trial("b", 0.5) is plan.grow("b", 0.5)  # the low-rank line search rates the growth itself
    assert plan.grow("b", 0.5) is not plan.grow("a", 0.5)
    full = plan_of(forms, grow_by=2, line_search="full_rank")
    trial = full.trial("a", 0.5)
    assert trial is full.trial("a", 0.5) and trial is not full.grow("a", 0.5) and trial.w_q.shape[-1] == E
    assert full.trial("a", 0.25) is not trial
    for method in ("random", "zero"):
        baseline = plan_of(forms, method=method, grow_by=2, generator=torch.Generator().manual_seed(0))
        assert baseline.grow("b", 0.5) is baseline.grow("b", 1.0) is baseline.trial("b", 0.0)
        assert baseline.grow("a", 0.5) is not baseline.grow("b", 0.5)
