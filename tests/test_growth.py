"""Directions, factorisation, step size and growth plans, float64 against brute-force references."""

import math

import pytest
import torch
import torch.nn.functional as F

from lit_growattn.attention.qk import QKForm
from lit_growattn.growth import (
    DIRECTIONS,
    Carry,
    FormGrowth,
    FormStats,
    FormWeights,
    Growth,
    GrowthPlan,
    candidate_steps,
    choose_step,
    installed,
    loss_rounding,
    register_direction,
)
from lit_growattn.growth.factorize import FAN_IN_FLOOR, sizing_method
from lit_growattn.growth.linalg import psd_sqrt
from lit_growattn.growth.solvers import direction

F64 = torch.float64
GROWING = ["gradient", "natural", "pinv", "zero"]  # every method that keeps the function at α = 0
GROWING_MODES = [(m, mode) for m in GROWING for mode in ("replace", "append") if (m, mode) != ("zero", "replace")]


class Problem:
    """A small attention regression: a QKForm, fixed values V and an MSE to a target.

    Inputs are LayerNorm outputs (C = X′ᵀX′ singular) with a random gain per instance, so instances differ.
    """

    def __init__(self, seed=0, b=4, s=12, e=8, h=2, d=2, bias=False, dv=3):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.form = QKForm(e, h, d, bias=bias).double()
        gain = torch.empty(b, 1, 1, dtype=F64).uniform_(0.5, 2.0, generator=g)
        self.x = gain * F.layer_norm(torch.randn(b, s, e, generator=g, dtype=F64), (e,))
        self.v = torch.randn(b, h, s, dv, generator=g, dtype=F64)
        self.target = torch.randn(b, h, s, dv, generator=g, dtype=F64)
        self.xa = self.form.augment(self.x)

    def loss(self, form=None):
        return F.mse_loss((form or self.form).attend(self.x, self.v), self.target)

    def scores(self, m):
        """Explicit causal scores (b, h, s, s) of the bilinear form M (h, e′, e′)."""
        s = torch.einsum("bse,hef,btf->bhst", self.xa, m, self.xa)
        return s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))

    def loss_of_scores(self, s):
        return F.mse_loss(torch.softmax(s, -1) @ self.v, self.target)

    def loss_of_m(self, m):
        """The same loss with M installed directly."""
        return self.loss_of_scores(self.scores(m))

    def score_grads(self):
        """G = ∂L/∂S (b, h, s, s) by autograd on explicit scores."""
        s = self.scores(self.form.bilinear().detach())
        s.requires_grad_()
        self.loss_of_scores(s).backward()
        return s.grad

    def stats(self, method="pinv"):
        self.form.zero_grad()
        self.form.capture = "explicit"
        self.loss().backward()
        self.form.capture = None
        stats = FormStats.empty_like(self.form, method, dtype=F64)
        for xa, gx in self.form.take_captured():
            stats.update(xa, gx, 1.0)
        return stats

    def growth(self, method, truncation="euclidean", size_by=None):
        if not hasattr(self, "moments"):
            self.moments = self.stats("pinv").means()
        return FormGrowth.from_form(self.form, self.moments, method, truncation=truncation, size_by=size_by)

    def installed(self, grown):
        form = QKForm(self.form.n_embd, self.form.n_head, 1, bias=self.form.bias).double()
        form.set_weights(grown.w_q, grown.w_k, grown.log_tau)
        return form


def bilinear(grown):
    return grown.log_tau.exp()[:, None, None] * grown.w_q @ grown.w_k.mT


def projector(w):
    return w @ torch.linalg.pinv(w, rtol=1e-10)


# -- directions -----------------------------------------------------------------------------------

@pytest.mark.parametrize("s", [21, 5])  # s ≥ e′ and s < e′
@pytest.mark.parametrize("bias", [False, True])
def test_pinv_direction_is_mean_of_per_instance_pseudo_inverses(s, bias):
    p = Problem(s=s, bias=bias)
    g = p.score_grads()
    xp = torch.stack([torch.linalg.pinv(x, rtol=1e-10) for x in p.xa])  # brute force, s × e′ per instance
    expected = -torch.einsum("bes,bhst,bft->hef", xp, g, xp)  # G already carries the 1/b of the mean loss
    got = DIRECTIONS["pinv"](p.stats().means(), 1e-6)
    assert torch.allclose(got, expected, rtol=0, atol=1e-8 * expected.abs().max())


@pytest.mark.parametrize("s", [21, 5])
def test_pinv_solution_closest_to_m_solves_the_normal_equations(s):
    """Z = M − C⁺NC⁺ solves C Z C = X′ᵀ B X′ with the descent target B = S − G (η = 1), one instance."""
    p = Problem(b=1, s=s)
    m = p.form.bilinear().detach()
    z = m - p.stats().means().p
    x, g = p.xa[0], p.score_grads()[0]
    c = x.T @ x
    b_target = x @ m @ x.T - g
    assert torch.allclose(c @ z @ c, x.T @ b_target @ x, rtol=0, atol=1e-9)


def test_natural_direction_solves_kronecker_equations_on_the_range():
    mo = Problem(s=5).stats().means()  # s < e′: C̄ of rank < e′
    delta = DIRECTIONS["natural"](mo, 1e-6)
    assert torch.allclose(mo.c @ delta @ mo.c, -mo.n, rtol=0, atol=1e-10)


@pytest.mark.parametrize("method", list(DIRECTIONS))
def test_normalised_direction_moves_scores_by_their_rms(method):
    """Exact for one instance, where the Kronecker approximation is an identity."""
    p = Problem(b=1)
    fg = p.growth(method)
    x = p.xa[0]
    assert torch.allclose((x @ fg.direction(method) @ x.T).norm(), (x @ fg.m @ x.T).norm(), rtol=1e-10)


# -- factorisation --------------------------------------------------------------------------------

@pytest.mark.parametrize("s", [21, 5])
def test_truncation_residuals(s):
    p = Problem(b=1, s=s)
    euclid, whitened = p.growth("gradient"), p.growth("gradient", "whitened")
    z = euclid.m + 0.5 * euclid.direction("gradient")
    grown_e, grown_w = euclid.grow(0.5, 4, mode="replace"), whitened.grow(0.5, 4, mode="replace")
    tail = torch.linalg.svdvals(z)[:, 4:].square().sum(-1)
    assert torch.allclose((z - bilinear(grown_e)).square().sum((-2, -1)), tail, rtol=1e-10)
    assert torch.allclose(grown_e.discarded_energy, tail, rtol=1e-10)
    x = p.xa[0]
    score_residual = lambda grown: (x @ (z - bilinear(grown)) @ x.T).norm()  # noqa: E731
    # Whitened truncation minimises the score residual: never larger, up to the round-off of the two norms.
    rounding = 100 * p.xa.shape[-1] ** 2 * torch.finfo(z.dtype).eps * score_residual(grown_e)
    assert score_residual(grown_w) <= score_residual(grown_e) + rounding


@pytest.mark.parametrize("truncation", ["euclidean", "whitened"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", ["keep", "rescale"])
@pytest.mark.parametrize("method, mode", GROWING_MODES)
def test_zero_step_keeps_the_function_and_new_columns_learn(method, mode, temperature, bias, truncation):
    p = Problem(bias=bias)
    before = p.form.attend(p.x, p.v).detach()
    grown = p.growth(method, truncation).grow(0.0, 5, mode=mode, temperature=temperature)
    form = p.installed(grown)
    assert form.d_head == 5
    assert torch.allclose(form.attend(p.x, p.v), before, rtol=0, atol=1e-10)
    p.loss(form).backward()
    assert form.w_k.grad[..., 2:].norm(dim=1).min() > 1e-8  # every new K column gets gradient at once


@pytest.mark.parametrize("temperature", ["keep", "rescale"])
@pytest.mark.parametrize("mode", ["replace", "append"])
@pytest.mark.parametrize("method", list(DIRECTIONS))
def test_positive_step_gives_the_truncated_form(method, mode, temperature):
    p = Problem(bias=True)
    fg, alpha, d, d_new = p.growth(method), 0.5, 2, 5
    grown = fg.grow(alpha, d_new, mode=mode, temperature=temperature)
    delta = fg.direction(grown.method)
    if temperature == "rescale":
        assert torch.allclose(grown.log_tau, fg.log_tau + 0.5 * math.log(d / d_new))
    if mode == "replace":
        u, s, vh = torch.linalg.svd(fg.m + alpha * delta)
        expected = u[..., :d_new] @ torch.diag_embed(s[:, :d_new]) @ vh[:, :d_new]
        assert grown.carries["w_q"].old_index is None
    else:
        pq, pk = projector(fg.w_q), projector(fg.w_k)
        eye = torch.eye(fg.e_in, dtype=F64)
        u, s, vh = torch.linalg.svd((eye - pq) @ delta @ (eye - pk))
        expected = fg.m + alpha * u[..., : d_new - d] @ torch.diag_embed(s[:, : d_new - d]) @ vh[:, : d_new - d]
        new_q, new_k = grown.w_q[..., d:], grown.w_k[..., d:]
        assert (pq @ new_q).abs().max() < 1e-10 and (pk @ new_k).abs().max() < 1e-10  # orthogonal to the old spans
        c = grown.w_q[..., :d] / fg.w_q
        assert torch.allclose(c, torch.full_like(c, (d_new / d) ** 0.25 if temperature == "rescale" else 1.0))
    assert grown.w_q[..., d:].norm(dim=1).min() > 1e-6 and grown.w_k[..., d:].norm(dim=1).min() > 1e-6
    assert torch.allclose(bilinear(grown), expected, rtol=0, atol=1e-10)
    assert math.isclose(grown.predicted_decrease, -float((fg.moments.n * (expected - fg.m)).sum()), rel_tol=1e-8)


def test_append_rescale_carry_matches_the_new_gradients():
    """Old slices of the rescaled weights get gradient first_scale × the old gradient; log τ's is unchanged."""
    p = Problem(bias=True)
    p.stats()
    old_grads = {n: getattr(p.form, n).grad.clone() for n in ("w_q", "w_k", "log_tau")}
    grown = p.growth("natural").grow(0.0, 6, mode="append", temperature="rescale")
    form = p.installed(grown)
    p.loss(form).backward()
    for name, carry in grown.carries.items():
        new = getattr(form, name).grad[carry.old_index]
        assert torch.allclose(new, carry.first_scale * old_grads[name], atol=1e-12)
        assert math.isclose(carry.second_scale, carry.first_scale**2)


def test_dynamic_rank_counts_the_bottleneck_spectrum():
    fg = Problem(e=12, h=3).growth("natural")
    s = fg.bottleneck("natural")[1]
    assert fg.rank(1e-12, 12) == 12 - 2  # capped by max_d_head
    assert fg.rank(0.999999, 12) == 1
    # A lower share of the largest σ keeps at least as many columns (within the room of 10).
    ranks = [fg.rank(share, 12) for share in (0.9, 0.5, 0.3, 0.1, 0.01)]
    assert ranks == sorted(ranks) and 1 <= ranks[0] and ranks[-1] <= 10
    assert fg.rank(0.3, 2) == 0  # already at max_d_head


def test_baselines_match_the_old_column_scale():
    fg = Problem(e=40, d=8).growth("random")
    grown = fg.grow(0.0, 40, generator=torch.Generator().manual_seed(0))
    for old, new in ((fg.w_q, grown.w_q[..., 8:]), (fg.w_k, grown.w_k[..., 8:])):
        assert torch.allclose(new.square().mean((1, 2)).sqrt(), old.square().mean((1, 2)).sqrt(), rtol=0.1)
    with pytest.raises(ValueError):
        fg.grow(0.0, 10, mode="replace")


def test_a_baseline_is_sized_by_the_direction_it_names_and_keeps_its_random_columns():
    p = Problem(e=12, h=3)
    natural, sized = p.growth("natural"), p.growth("random", size_by="natural")
    for share in (0.9, 0.5, 0.1):
        assert sized.rank(share, 12) == natural.rank(share, 12)
    torch.testing.assert_close(sized.column_gains(), natural.column_gains())  # float64 defaults
    torch.testing.assert_close(p.growth("random").column_gains(), p.growth("gradient").column_gains())  # the default
    grown = sized.grow(0.0, 6, generator=torch.Generator().manual_seed(0))
    assert grown.w_q[..., 2:].abs().min() > 0 and grown.w_k[..., 2:].abs().min() > 0  # random pairs, not zero fan-in


def test_grow_refuses_bad_arguments_with_messages():
    fg = Problem().growth("natural")  # d_head 2, e′ 8
    cases = [
        (dict(mode="insert"), "mode must be one of append, replace; got 'insert'"),
        (dict(temperature="warm"), "temperature must be one of keep, rescale; got 'warm'"),
        (dict(alpha=-0.5), "step size α must be ≥ 0, got -0.5"),
        (dict(d_new=1), "d_new=1 must lie between the current d_head 2 and e′ = 8"),
        (dict(d_new=9), "d_new=9 must lie between the current d_head 2 and e′ = 8"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=f"^{message}$"):
            fg.grow(**{"alpha": 0.5, "d_new": 4, **kwargs})
    with pytest.raises(ValueError, match="^baseline 'random' only appends columns; use mode='append'$"):
        Problem().growth("random").grow(0.0, 4, mode="replace")


def test_growth_to_the_same_head_size_refactorises():
    fg = Problem().growth("natural")
    grown = fg.grow(0.0, 2, mode="replace")
    assert grown.w_q.shape[-1] == 2
    torch.testing.assert_close(bilinear(grown), fg.m, rtol=0, atol=1e-10)


def test_baseline_columns_come_from_the_generator_alone():
    fg = Problem().growth("random")
    draws = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        draws.append(fg.grow(0.0, 4, generator=torch.Generator().manual_seed(0)).w_q)
    assert torch.equal(draws[0], draws[1])


@pytest.fixture
def ascent():
    """A registered direction that raises the loss to first order (+N̄), removed afterwards."""
    register_direction("ascent")(lambda moments, rcond: moments.n)
    yield "ascent"
    del DIRECTIONS["ascent"]


@pytest.mark.parametrize("mode, temperature", [("append", "keep"), ("replace", "rescale")])
def test_a_direction_that_ascends_falls_back_to_the_gradient(ascent, mode, temperature):
    p = Problem()
    fg = p.growth(ascent)
    kept = fg.grow(0.0, 4, mode=mode, temperature=temperature)  # α = 0 changes nothing: no sign to check
    assert (kept.method, kept.fell_back) == (ascent, False)
    grown = fg.grow(0.5, 4, mode=mode, temperature=temperature)
    assert (grown.method, grown.fell_back) == ("gradient", True)
    assert grown.predicted_decrease > 0
    gradient = p.growth("gradient").grow(0.5, 4, mode=mode, temperature=temperature)
    for name in ("w_q", "w_k", "log_tau"):
        torch.testing.assert_close(getattr(grown, name), getattr(gradient, name), rtol=0, atol=0)


def test_a_direction_that_predicts_no_decrease_falls_back_too():
    register_direction("standstill")(lambda moments, rcond: torch.zeros_like(moments.n))
    try:
        grown = Problem().growth("standstill").grow(0.5, 4)
    finally:
        del DIRECTIONS["standstill"]
    assert (grown.method, grown.fell_back) == ("gradient", True)
    p = Problem()
    moments = p.stats("pinv").means()
    flat = moments._replace(n=torch.zeros_like(moments.n))
    itself = FormGrowth.from_form(p.form, flat, "gradient").grow(0.5, 4)  # the gradient has nothing to fall back to
    assert (itself.method, itself.fell_back, itself.predicted_decrease) == ("gradient", False, 0.0)


def test_gains_accept_a_float32_n():
    fg = Problem().growth("natural")
    gains = fg.column_gains()
    torch.testing.assert_close(fg.column_gains(fg.moments.n.float()), gains, rtol=1e-5, atol=1e-6 * gains.abs().max())


def test_dynamic_rank_is_the_largest_count_of_any_head():
    fg = Problem(e=12, h=3).growth("natural")
    s = fg.bottleneck("natural")[1]
    for share in (0.5, 0.2, 0.05):
        count = max(int((row > share * s.max()).sum()) for row in s)
        assert fg.rank(share, 12) == max(1, min(count, 10))


@pytest.mark.parametrize("mode, b, s, d_new", [("replace", 4, 12, 4), ("append", 4, 12, 4), ("append", 1, 5, 8)])
def test_discarded_energy_is_each_heads_residual(mode, b, s, d_new):
    """‖Z − M′‖² per head, Z = M + αΔM (euclidean truncation: the coordinates are M's own); the last case appends
    vanishing bottleneck pairs too (five inputs), which add nothing to M′."""
    fg, alpha = Problem(h=3, b=b, s=s).growth("natural"), 0.5
    grown = fg.grow(alpha, d_new, mode=mode)
    residual = (fg.m + alpha * fg.direction(grown.method) - bilinear(grown)).square().sum((-2, -1))
    torch.testing.assert_close(grown.discarded_energy, residual, rtol=1e-8, atol=1e-12)


def test_replace_at_zero_step_takes_the_bottleneck_pairs_for_its_new_columns():
    """At α = 0, M has rank d: the d_new − d trailing pairs vanish, and each head's new Q columns become zero fan-in
    columns of its bottleneck pairs 0, 1, …; their K columns and σ are zero."""
    fg = Problem(h=3).growth("natural")
    grown = fg.grow(0.0, 5, mode="replace")
    u, s, _, _ = fg.bottleneck("natural")
    sigma = s[:, :3].clamp_min(FAN_IN_FLOOR * s[:, :1])
    expected_q = u[:, :, :3] * (sigma / fg.log_tau.exp()[:, None]).sqrt().unsqueeze(1)
    torch.testing.assert_close(grown.w_q[..., 2:], expected_q, rtol=1e-8, atol=1e-12)
    assert (grown.w_k[..., 2:] == 0).all()
    assert (grown.spectrum[:, 2:] == 0).all() and (grown.spectrum[:, :2] > 0).all()


def test_append_at_zero_step_adds_zero_fan_in_columns_with_a_floor():
    """α = 0: every new pair is zero fan-in (K columns zero), Q columns u_j (max(σ_j, floor·σ_0) / τ′)^½ of the
    bottleneck pairs in order; the trailing pairs of a rank-deficient bottleneck take the floor. τ′ ≠ 1 (rescale)."""
    fg = Problem(h=3, b=1, s=5).growth("natural")
    grown = fg.grow(0.0, 8, mode="append", temperature="rescale")
    u, s, _, _ = fg.bottleneck("natural")
    assert (s[:, 4:] < FAN_IN_FLOOR * s[:, :1]).all()  # five LayerNorm inputs: rank ≤ 4 left once M's span is out
    sigma = s[:, :6].clamp_min(FAN_IN_FLOOR * s[:, :1])
    expected_q = u[:, :, :6] * (sigma / grown.log_tau.exp()[:, None]).sqrt().unsqueeze(1)
    torch.testing.assert_close(grown.w_q[..., 2:], expected_q, rtol=1e-8, atol=1e-12)
    assert (grown.w_k[..., 2:] == 0).all()


def test_growth_carries_say_what_each_tensor_keeps():
    fg = Problem().growth("natural")
    replaced = fg.grow(0.5, 4, mode="replace").carries
    assert replaced == {"w_q": Carry(None), "w_k": Carry(None), "log_tau": Carry((slice(None),))}
    appended = fg.grow(0.5, 4, mode="append", temperature="rescale").carries
    c = 2 ** 0.25  # (d_new / d)^¼
    assert set(appended) == {"w_q", "w_k", "log_tau"} and appended["log_tau"] == Carry((slice(None),))
    for name in ("w_q", "w_k"):
        carry = appended[name]
        assert carry.old_index[2].indices(4) == (0, 2, 1)  # the first d = 2 columns of the grown tensor
        assert carry.first_scale == pytest.approx(1 / c) and carry.second_scale == pytest.approx(1 / c**2)


def test_baseline_columns_are_float64_normal_draws_at_each_heads_scale():
    fg = Problem(h=3).growth("random")
    grown = fg.grow(0.0, 5, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    noise_q, noise_k = (torch.randn(3, 8, 3, generator=g, dtype=F64) for _ in range(2))
    rms = lambda w: w.square().mean((1, 2), keepdim=True).sqrt()  # noqa: E731
    torch.testing.assert_close(grown.w_q[..., 2:], noise_q * rms(fg.w_q), rtol=1e-12, atol=0)
    torch.testing.assert_close(grown.w_k[..., 2:], noise_k * rms(fg.w_k), rtol=1e-12, atol=0)
    assert grown.spectrum.shape == (3, 0) and torch.equal(grown.discarded_energy, torch.zeros(3, dtype=F64))
    zero = Problem(h=3).growth("zero").grow(0.0, 5, generator=torch.Generator().manual_seed(0))
    assert (zero.w_k[..., 2:] == 0).all() and zero.w_q[..., 2:].abs().min() > 0


def test_whitened_append_is_orthogonal_to_the_old_columns_in_the_data_metric():
    """In whitened coordinates (C̄^½, its eigenvalues clamped as `psd_sqrt` does) the new columns are orthogonal to
    the old ones (likewise K)."""
    fg = Problem(s=21).growth("natural", "whitened")
    grown = fg.grow(0.5, 5, mode="append")
    root = psd_sqrt(fg.moments.c, fg.rcond)[0]
    for new, old in ((grown.w_q[..., 2:], fg.w_q), (grown.w_k[..., 2:], fg.w_k)):
        overlap = (root @ new).mT @ (root @ old)
        assert overlap.abs().max() < 1e-10 * (root @ new).norm() * (root @ old).norm()
        assert (new.mT @ old).abs().max() > 1e-6  # not orthogonal in the plain metric: the test can tell


def test_form_growth_defaults_and_refusals():
    p = Problem()
    moments = p.stats("pinv").means()
    assert FormGrowth(p.form.w_q, p.form.w_k, p.form.log_tau, moments).method == "natural"
    assert FormGrowth.from_form(p.form, moments).method == "natural"
    with pytest.raises(ValueError, match="^method must be one of .*; got 'newton'"):
        FormGrowth.from_form(p.form, moments, "newton")
    with pytest.raises(ValueError, match="^truncation must be one of euclidean, whitened; got 'spectral'$"):
        FormGrowth.from_form(p.form, moments, truncation="spectral")


def test_sizing_method_of_directions_and_baselines():
    assert sizing_method("natural", None) == "natural" and sizing_method("random", None) == "gradient"
    assert sizing_method("random", "pinv") == "pinv" and sizing_method("natural", "natural") == "natural"
    message = ("^size_by='gradient' only applies to the baselines \\('random', 'zero'\\): method 'natural' is sized by its "
               "own direction; set size_by to null$")
    with pytest.raises(ValueError, match=message):
        sizing_method("natural", "gradient")
    with pytest.raises(ValueError, match="^size_by must be one of .*; got 'newton'"):
        sizing_method("random", "newton")


def test_growth_of_a_float32_form_is_float32():
    p = Problem()
    moments = p.stats("pinv").means()
    form = p.form.float()
    grown = FormGrowth.from_form(form, moments).grow(0.5, 4)
    assert grown.w_q.dtype == grown.w_k.dtype == grown.log_tau.dtype == torch.float32
    assert grown.alpha == 0.5


def test_direction_uses_the_forms_rcond():
    p = Problem(s=5)  # C̄ of low rank: the cut-off changes the natural direction
    moments = p.stats("pinv").means()
    coarse = FormGrowth.from_form(p.form, moments, rcond=0.3).direction("natural")
    raw = DIRECTIONS["natural"](moments, 0.3)
    torch.testing.assert_close(coarse / coarse.norm(), raw / raw.norm(), rtol=0, atol=1e-10)
    fine = FormGrowth.from_form(p.form, moments).direction("natural")
    assert (coarse / coarse.norm() - fine / fine.norm()).abs().max() > 1e-3


def test_direction_defaults_and_degenerate_sides():
    mo = Problem(s=5).stats().means()  # C̄ of low rank: the natural direction depends on the cut-off
    raw = DIRECTIONS["natural"](mo, 1e-6)
    assert torch.equal(direction("natural", mo, torch.tensor(0.0, dtype=F64)), raw)  # M = 0: left unscaled
    energy = torch.tensor(2.0, dtype=F64)
    torch.testing.assert_close(direction("natural", mo, energy), direction("natural", mo, energy, 1e-6), rtol=0, atol=0)
    with pytest.raises(ValueError, match="^method 'newton' has no direction; directions: natural, gradient, pinv"):
        direction("newton", mo, energy)


# -- descent and step size ------------------------------------------------------------------------

def test_descent_directions_lower_the_loss_and_the_seed_sign_raises_it():
    for seed in range(5):
        p = Problem(seed)
        fg, m, step = p.growth("natural"), p.form.bilinear().detach(), 1e-3
        base = p.loss_of_m(m)
        for method in ("gradient", "natural"):
            assert p.loss_of_m(m + step * fg.direction(method)) < base
        assert p.loss_of_m(m - step * fg.direction("gradient")) > base  # seed 000's B = S + ηG: ΔM = +N̄
        one = Problem(seed, b=1)  # per instance, the seed's pinv target C⁺NC⁺ with its literal sign
        m1, p_bar = one.form.bilinear().detach(), one.stats().means().p
        assert one.loss_of_m(m1 + step * p_bar / p_bar.norm()) > one.loss_of_m(m1)


def line_searched_loss(p, plan, alphas):
    """Install the trial growth of each α, evaluate, restore; then install the chosen growth."""
    originals = (p.form.w_q, p.form.w_k, p.form.log_tau)

    def loss_at(alpha):
        grown = plan.trial("f", alpha)
        p.form.set_weights(grown.w_q, grown.w_k, grown.log_tau)
        with torch.no_grad():
            loss = p.loss()
        p.form.w_q, p.form.w_k, p.form.log_tau = originals
        return loss

    best = alphas[choose_step([float(loss_at(a)) for a in alphas], alphas)]
    grown = plan.grow("f", best)
    with torch.no_grad():
        return p.loss(p.installed(grown)), grown


@pytest.mark.parametrize("method, mode", GROWING_MODES)
def test_line_searched_growth_never_raises_the_loss(method, mode):
    """α = 0 is a candidate and keeps the function, so the loss the growth is rated on can only go down; and it does
    go down, by a step α > 0, on some of the problems (a line search that always kept α = 0 would pass the first)."""
    alphas = candidate_steps(4)
    lowered = []
    for seed in range(3):
        p = Problem(seed, bias=bool(seed % 2))
        with torch.no_grad():
            before = p.loss()
        plan = GrowthPlan.build({"f": p.form}, [p.stats(method)], method=method, grow_by=2, mode=mode)
        after, grown = line_searched_loss(p, plan, alphas)
        assert after <= before + 1e-12
        assert grown.w_q.shape[-1] == 4
        lowered.append(float(before - after) > 1e-12)
    assert any(lowered) or method == "zero", lowered  # zero: new columns of zeros, the same function at any α


def test_full_rank_line_search_rates_the_untruncated_form():
    """λ_FR rates α by M + αΔM; the truncated growth it installs keeps the requested size and a finite loss."""
    for seed in range(6):
        p = Problem(seed)
        with torch.no_grad():
            before = p.loss()
        plan = GrowthPlan.build({"f": p.form}, [p.stats()], method="gradient", grow_by=1, line_search="full_rank")
        after, grown = line_searched_loss(p, plan, candidate_steps(4))
        assert grown.w_q.shape[-1] == 3 and torch.isfinite(after) and torch.isfinite(before)


def test_a_sign_fallback_grows_along_the_gradient_and_the_gradient_bottleneck_descends():
    """Over 50 random problems at α = 1: a direction that fails the sign check falls back to the gradient's."""
    for seed in range(50):
        p = Problem(seed, b=6, s=6, e=8, h=2)
        for method in ("natural", "pinv"):
            fg = p.growth(method)
            for mode in ("replace", "append"):
                grown = fg.grow(1.0, 4, mode=mode)
                if grown.fell_back:
                    assert grown.method == "gradient"
        assert p.growth("gradient").grow(1.0, 4, mode="append").predicted_decrease > 0  # bottleneck of −N̄: descent


def test_choose_step():
    alphas = candidate_steps(2)
    assert alphas == [0.0, 1.0, 0.5, 0.25]
    assert choose_step([1.0, 0.5, 0.7, 0.5], alphas) == 3  # tie → smaller α
    assert choose_step([1.0, float("nan"), 0.9, float("nan")], alphas) == 2
    assert choose_step([float("nan")] * 4, alphas) == 0
    assert choose_step(torch.tensor([1.0, 1.0, 1.0, 1.0]), alphas) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_step_that_beats_alpha_zero_by_round_off_only_is_not_chosen(dtype):
    alphas, loss, terms = [0.0, 1.0, 0.5], 2.5, 4096
    noise = loss_rounding(loss, dtype, terms)
    assert noise == pytest.approx(64 * torch.finfo(dtype).eps * loss)
    round_off = torch.tensor([loss, loss - 0.5 * noise, loss - 0.25 * noise], dtype=dtype)
    assert choose_step(round_off, alphas, terms) == 0
    real = torch.tensor([loss, loss - 4 * noise, loss - 0.5 * noise], dtype=dtype)
    assert choose_step(real, alphas, terms) == 1
    # Two real winners within round-off of each other: the smaller step.
    assert choose_step(torch.tensor([loss, loss - 8 * noise, loss - 7.5 * noise], dtype=dtype), alphas, terms) == 2


def test_plan_shares_sizes_memoises_and_full_rank_trial_is_untruncated():
    problems = [Problem(seed, e=12, h=2) for seed in range(3)]
    forms = {f"blocks.{i // 2}.f{i}": p.form for i, p in enumerate(problems)}
    plan = GrowthPlan.build(
        forms, [p.stats("gradient") for p in problems], method="gradient", grow_by=None, dynamic_rank=0.5,
        max_width=9, group_of=lambda name: name.split(".")[1], line_search="full_rank",
    )
    assert plan.d_new["blocks.0.f0"] == plan.d_new["blocks.0.f1"] and all(2 < d <= 9 for d in plan.d_new.values())
    assert plan.grow("blocks.1.f2", 0.5) is plan.grow("blocks.1.f2", 0.5)
    fg = plan.forms["blocks.1.f2"]
    trial = plan.trial("blocks.1.f2", 0.5)
    assert trial.w_q.shape[-1] == 12
    assert torch.allclose(bilinear(trial), fg.m + 0.5 * fg.direction("gradient"), rtol=0, atol=1e-10)


def test_plan_on_a_gpt_keeps_the_logits_at_zero_step():
    """The callback's path on a real model: capture on every form, one flat buffer, plan per layer, install."""
    from lit_growattn.model.config import GPTConfig
    from lit_growattn.growth import flatten_stats, unflatten_stats
    from lit_growattn.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=17, block_size=16, n_layer=2, n_head=2, n_embd=12, d_head=3, bias=True)).double()
    idx = torch.randint(0, 17, (3, 16))
    forms = {name: m for name, m in model.named_modules() if isinstance(m, QKForm)}
    stats = [FormStats.empty_like(f, "natural", dtype=F64) for f in forms.values()]
    for f in forms.values():
        f.capture = "extend"
    F.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
    for s, f in zip(stats, forms.values()):
        f.capture = None
        for xa, gx in f.take_captured():
            s.update(xa, gx, 1.0)
    stats = unflatten_stats(flatten_stats(stats), stats)
    plan = GrowthPlan.build(forms, stats, method="natural", grow_by=2, group_of=lambda n: n.split(".")[1])
    with torch.no_grad():
        before = model(idx)
        for name, f in forms.items():
            grown = plan.grow(name, 0.0)
            f.set_weights(grown.w_q, grown.w_k, grown.log_tau)
        assert model.head_sizes() == [5, 5]
        assert torch.allclose(model(idx), before, rtol=0, atol=1e-10)


def test_the_form_its_growth_and_the_grown_weights_read_one_shape():
    """A form, its FormGrowth (float64 copies) and the Growth it yields read head counts and sizes off (w_q, w_k,
    log_tau) alike, and a Growth installs as the FormWeights it is."""
    p = Problem(bias=True)  # e′ = 8 + 1
    g = p.growth("natural")
    grown = g.grow(0.5, 4)
    assert isinstance(grown, FormWeights)
    form = p.form
    sizes = lambda f: (f.n_head, f.n_kv_head, f.e_in, f.d_head)  # noqa: E731
    assert sizes(g) == sizes(form) == (2, 2, 9, 2)
    assert (grown.n_head, grown.n_kv_head, grown.e_in, grown.d_head) == (2, 2, 9, 4)
    grown.install(form)
    assert form.d_head == 4 and torch.equal(form.w_q, grown.w_q) and torch.equal(form.tau, grown.tau)


def test_installed_holds_a_candidate_inside_the_block_and_restores_the_same_parameters():
    torch.manual_seed(0)
    forms = {"a": QKForm(8, 2, 3), "b": QKForm(8, 2, 3)}
    before = {n: (f.w_q, f.w_k, f.log_tau) for n, f in forms.items()}
    wider = Growth(w_q=torch.randn(2, 8, 5), w_k=torch.randn(2, 8, 5), log_tau=torch.zeros(2), carries={},
                   predicted_decrease=0.0, discarded_energy=torch.zeros(2), spectrum=torch.zeros(2, 0), alpha=0.0,
                   method="natural")
    with pytest.raises(RuntimeError, match="rating failed"), installed(forms, {"a": wider}):
        assert forms["a"].d_head == 5 and torch.equal(forms["a"].w_q, wider.w_q)
        assert forms["b"].w_q is before["b"][0]  # not named in the candidate: left as it is
        raise RuntimeError("rating failed")
    for name, form in forms.items():
        assert (form.w_q, form.w_k, form.log_tau) == before[name] and form.d_head == 3  # the same objects
    with installed(forms, None):
        assert all(form.w_q is before[name][0] for name, form in forms.items())


def test_a_registry_refuses_a_second_object_under_a_taken_name_and_keeps_the_first():
    from lit_growattn.growth.registry import registrar

    table: dict = {}
    register = registrar(table, "growth direction")

    def mine():
        pass

    assert register("mine")(mine) is mine and table == {"mine": mine}
    assert register("mine")(mine) is mine  # the same object again (a module imported twice) is no conflict
    with pytest.raises(ValueError) as error:
        register("mine")(lambda: None)
    assert str(error.value) == f"growth direction 'mine' is already registered (by {__name__})"
    assert table == {"mine": mine}
