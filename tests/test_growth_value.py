"""The value side's maths (growth/value.py) against float64 references: statistics, α = 0, first order, GQA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_growattn.growth import sides
from lit_growattn.growth.linalg import psd_pinv
from lit_growattn.growth.stats import FormStats
from lit_growattn.growth.stats import flatten_stats, unflatten_stats
from lit_growattn.growth.value import ValueGrowth, ValueStats, ValueWeights, value_direction

F64 = torch.float64


class ValueProblem:
    """Fixed causal attention maps A (b, H, s, s) over LayerNorm inputs; Y = Σ_j A_j X′ W_V,j//g W_O,j; MSE to a target."""

    def __init__(self, seed=0, b=3, s=10, e=6, h=4, kv=4, d=2, bias=False):
        g = torch.Generator().manual_seed(seed)
        x = F.layer_norm(torch.randn(b, s, e, generator=g, dtype=F64), (e,))
        self.xa = torch.cat([x, torch.ones(b, s, 1, dtype=F64)], -1) if bias else x
        scores = torch.randn(b, h, s, s, generator=g, dtype=F64)
        self.a = torch.softmax(scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")), -1)
        e_in = self.xa.shape[-1]
        self.w_v = torch.randn(kv, e_in, d, generator=g, dtype=F64) / e_in**0.5
        self.w_o = torch.randn(h, d, e, generator=g, dtype=F64) / d**0.5
        self.target = torch.randn(b, s, e, generator=g, dtype=F64)
        self.p = self.a @ self.xa.unsqueeze(1)  # (b, H, s, e′)

    def output(self, w_v, w_o):
        m = w_v.repeat_interleave(w_o.shape[0] // w_v.shape[0], 0) @ w_o
        return torch.einsum("bhse,hef->bsf", self.p, m)

    def loss(self, w_v=None, w_o=None):
        return F.mse_loss(self.output(self.w_v if w_v is None else w_v, self.w_o if w_o is None else w_o), self.target)

    def stats(self):
        y = self.output(self.w_v, self.w_o).requires_grad_()
        (g_y,) = torch.autograd.grad(F.mse_loss(y, self.target), y)
        stats = ValueStats(self.p.shape[1], self.p.shape[-1], self.w_o.shape[-1], dtype=F64)
        stats.update(self.p, g_y)
        return stats

    def growth(self, method="natural", **kwargs):
        return ValueGrowth(self.w_v, self.w_o, self.stats().means(), method, **kwargs)


@pytest.mark.parametrize("bias", [False, True])
def test_n_is_the_gradient_of_each_heads_w_m(bias):
    p = ValueProblem(bias=bias)
    m = (p.w_v @ p.w_o).requires_grad_()
    F.mse_loss(torch.einsum("bhse,hef->bsf", p.p, m), p.target).backward()
    moments = p.stats().means()
    torch.testing.assert_close(moments.n, m.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(moments.c, torch.einsum("bhse,bhsf->hef", p.p, p.p) / p.p.shape[0])


def test_empty_sums_fit_the_value_map():
    p = ValueProblem(kv=2, e=6, h=4, bias=True)  # e′ = 7 with the bias row
    empty = ValueStats.empty_like(ValueWeights(p.w_v, p.w_o), dtype=F64, rcond=1e-3)
    assert empty.c_sum.shape == (4, 7, 7) and empty.n_sum.shape == (4, 7, 6) and empty.c_sum.dtype == F64
    assert empty.rcond == 1e-3 and not empty.c_sum.any() and not empty.n_sum.any() and empty.instances == 0
    empty.update(p.p, torch.zeros(3, 10, 6, dtype=F64))  # a captured pair of the map's shapes fits


def test_sums_merge_and_flatten_like_the_query_key_ones():
    p = ValueProblem()
    whole = p.stats()
    halves = [ValueStats(4, 6, 6, dtype=F64) for _ in range(2)]
    y = p.output(p.w_v, p.w_o).requires_grad_()
    (g_y,) = torch.autograd.grad(F.mse_loss(y, p.target), y)
    halves[0].update(p.p[:1], g_y[:1], 0.5)
    halves[1].update(p.p[1:], g_y[1:], 0.5)
    merged = halves[0] + halves[1]
    torch.testing.assert_close(merged.means().n, whole.means().n)  # weights 0.5 + 0.5: the same step's gradient
    torch.testing.assert_close(merged.c_sum, whole.c_sum)
    (back,) = unflatten_stats(flatten_stats([merged]), [merged])
    assert back.names == merged.names and all(torch.equal(a, b) for a, b in zip(back.tensors(), merged.tensors()))
    assert torch.equal(ValueStats.from_state_dict(merged.state_dict()).n_sum, merged.n_sum)
    with pytest.raises(ValueError, match="do not fit"):
        halves[0].update(p.p, g_y[..., :3])


def test_natural_direction_is_minus_c_pinv_n_scaled_to_the_output_energy():
    p = ValueProblem()
    mo = p.stats().means()
    m = p.w_v @ p.w_o
    delta = value_direction("natural", mo, m)
    raw = -(psd_pinv(mo.c, 1e-6) @ mo.n)
    scale = (delta / raw)[raw.abs() > 1e-8 * raw.abs().max()]
    torch.testing.assert_close(scale, scale.mean().expand_as(scale))  # one positive scalar for the whole map
    assert scale.mean() > 0
    energy = lambda w: (w * (mo.c @ w)).sum()  # noqa: E731
    torch.testing.assert_close(energy(delta), energy(m))
    assert (mo.n * delta).sum() < 0  # a descent direction


@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("method", ["natural", "gradient", "zero"])
def test_alpha_zero_keeps_the_function_and_appends_live_value_columns(kv, method):
    p = ValueProblem(kv=kv, bias=True)
    grown = p.growth(method).grow(0.0, 5, generator=torch.Generator().manual_seed(0))
    assert grown.w_v.shape == (kv, 7, 5) and grown.w_o.shape == (4, 5, 6)
    assert torch.equal(grown.w_v[..., :2], p.w_v) and torch.equal(grown.w_o[:, :2], p.w_o)
    assert not grown.w_o[:, 2:].any()
    torch.testing.assert_close(p.output(grown.w_v, grown.w_o), p.output(p.w_v, p.w_o))
    assert (grown.w_v[..., 2:].norm(dim=1) > 0).all()  # every new V column is live: its O row gets gradient at once


@pytest.mark.parametrize("kv", [4, 2])
@pytest.mark.parametrize("method", ["natural", "gradient"])
def test_a_small_step_changes_the_loss_as_the_first_order_prediction(kv, method):
    """L(α) − L(0) = −predicted(α) + O(α²): the error shrinks as α² (float64; α well above round-off)."""
    p = ValueProblem(kv=kv)
    vg = p.growth(method)
    errors = []
    for alpha in (1e-2, 1e-3):
        grown = vg.grow(alpha, 4)
        change = float(p.loss(grown.w_v, grown.w_o) - p.loss())
        assert grown.predicted_decrease > 0
        errors.append(abs(change + grown.predicted_decrease) / grown.predicted_decrease)
    assert errors[1] < 0.2 * errors[0] and errors[1] < 1e-2


def unreachable(delta, w_v, w_o):
    """Per group, the residual [R_j]_j (e′, g·e) of ΔW after the best first-order change of the factors,
    δW_M,j = δW_V W_O,j + W_V δW_O,j with δW_V shared by the group: a least-squares problem solved whole."""
    kv, e_in, d = w_v.shape
    h, _, e = w_o.shape
    g = h // kv
    out = []
    for grp in range(kv):
        heads = range(grp * g, (grp + 1) * g)
        columns = []  # the linear map (δW_V, δW_O,j …) → stacked δW_M, one column per unknown
        for i in range(e_in * d):
            dv = torch.zeros(e_in * d, dtype=F64)
            dv[i] = 1
            columns.append(torch.cat([(dv.view(e_in, d) @ w_o[j]).reshape(-1) for j in heads]))
        for j_pos, j in enumerate(heads):
            for i in range(d * e):
                do = torch.zeros(d * e, dtype=F64)
                do[i] = 1
                blocks = [torch.zeros(e_in * e, dtype=F64) for _ in heads]
                blocks[j_pos] = (w_v[grp] @ do.view(d, e)).reshape(-1)
                columns.append(torch.cat(blocks))
        basis = torch.stack(columns, 1)
        target = torch.cat([delta[j].reshape(-1) for j in heads])
        # The unknowns overlap (col(W_V) × row(W_O) is reached both ways): an SVD-based solver for the rank deficiency.
        fit = basis @ torch.linalg.lstsq(basis, target.unsqueeze(1), driver="gelsd").solution
        residual = (target - fit.squeeze(1)).view(g, e_in, e)
        out.append(torch.cat(list(residual), -1))
    return torch.stack(out)


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_new_columns_are_the_top_pair_of_what_the_current_factors_cannot_reach(kv):
    """A GQA group shares its new V column: the columns are the truncated SVD of its heads' residuals side by
    side, the residual of a least-squares fit by every first-order change of the factors (a shared δW_V)."""
    p = ValueProblem(kv=kv)
    vg = p.growth("gradient")
    grown = vg.grow(1.0, 3)
    reference = unreachable(vg.direction("gradient"), p.w_v, p.w_o)
    g = 4 // kv
    for grp in range(kv):
        u, s, vh = torch.linalg.svd(reference[grp])
        change = torch.cat([grown.w_v[grp, :, 2:] @ grown.w_o[j, 2:] for j in range(grp * g, (grp + 1) * g)], -1)
        torch.testing.assert_close(change, s[0] * torch.outer(u[:, 0], vh[0]), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(vg.bottleneck("gradient")[1][:, 0], torch.linalg.svdvals(reference)[:, 0])


def test_column_gains_add_up_to_the_predicted_decrease():
    vg = ValueProblem(kv=2).growth("natural")
    gains = vg.column_gains()
    for p in (1, 3):
        assert gains.shape[0] == 2
        torch.testing.assert_close(torch.tensor(vg.grow(1.0, 2 + p).predicted_decrease, dtype=F64), gains[:, :p].sum())


def test_gains_against_another_gradient_are_linear_in_it():
    """The automatic schedule rates columns fitted on one half of the window against the other half's N̄."""
    vg = ValueProblem(kv=2).growth("natural")
    n1, n2 = torch.randn(2, *vg.moments.n.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(vg.column_gains(vg.moments.n), vg.column_gains())
    assert not torch.allclose(vg.column_gains(n1), vg.column_gains(), rtol=1e-3)
    torch.testing.assert_close(vg.column_gains(n1 + 2 * n2), vg.column_gains(n1) + 2 * vg.column_gains(n2),
                               rtol=1e-12, atol=1e-14)


def test_a_value_growth_is_built_from_a_value_map_with_its_method_and_cut_off():
    p = ValueProblem(kv=2)
    values, moments = ValueWeights(p.w_v, p.w_o), p.stats().means()
    assert ValueWeights.of(values).w_v is p.w_v and ValueWeights.of(values).w_o is p.w_o
    gradient = ValueGrowth.from_values(values, moments, "gradient")
    assert gradient.method == "gradient" and ValueGrowth.from_values(values, moments).method == "natural"
    torch.testing.assert_close(gradient.direction("gradient"), p.growth("gradient").direction("gradient"), rtol=0, atol=0)
    # A cut-off that drops C̄'s weaker directions changes the natural direction.
    assert not torch.allclose(ValueGrowth.from_values(values, moments, rcond=0.5).direction("natural"),
                              p.growth().direction("natural"), rtol=1e-3)


def test_a_natural_growth_that_predicts_no_decrease_falls_back_to_the_gradient():
    p = ValueProblem(kv=2)
    vg = p.growth("natural")
    vg._directions["natural"] = -vg.direction("gradient")  # an ascent in place of the natural direction
    kept = vg.grow(0.0, 4)  # α = 0 changes nothing: no sign to check
    assert (kept.method, kept.fell_back) == ("natural", False)
    grown = vg.grow(0.5, 4)
    assert (grown.method, grown.fell_back) == ("gradient", True) and grown.predicted_decrease > 0
    gradient = p.growth("gradient").grow(0.5, 4)
    torch.testing.assert_close((grown.w_v, grown.w_o), (gradient.w_v, gradient.w_o), rtol=0, atol=0)


def test_the_gradient_direction_is_minus_n_scaled_and_a_zero_gradient_grows_nothing():
    p = ValueProblem(kv=2)
    vg = p.growth("gradient")
    delta, n = vg.direction("gradient"), vg.moments.n
    scale = (delta / -n).flatten()
    torch.testing.assert_close(scale, scale[:1].expand_as(scale), rtol=1e-10, atol=0)
    assert scale[0] > 0
    flat = vg.moments._replace(n=torch.zeros_like(n))
    for method in ("natural", "gradient"):
        still = ValueGrowth(p.w_v, p.w_o, flat, method)
        assert torch.equal(still.direction(method), torch.zeros_like(n))  # unscaled: no 0/0
        grown = still.grow(0.5, 4)
        assert grown.predicted_decrease == 0.0 and torch.isfinite(grown.w_v).all() and torch.isfinite(grown.w_o).all()
        torch.testing.assert_close(grown.w_v.repeat_interleave(2, 0) @ grown.w_o, still.matrix(), rtol=0, atol=1e-12)
    # A request for the current size grows nothing and changes nothing.
    same = vg.grow(0.5, 2)
    assert same.w_v.shape == p.w_v.shape and torch.equal(same.w_v, p.w_v) and torch.equal(same.w_o, p.w_o)


def test_baselines_draw_from_the_generator_and_zero_has_zero_o_rows():
    p = ValueProblem()
    a = p.growth("random").grow(1.0, 4, generator=torch.Generator().manual_seed(3))
    b = p.growth("random").grow(0.5, 4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.w_v, b.w_v) and torch.equal(a.w_o, b.w_o) and a.w_o[:, 2:].any()


def test_carries_place_the_old_moments_in_the_grown_tensors():
    grown = ValueProblem().growth().grow(0.5, 4)
    w_v, w_o = torch.zeros_like(grown.w_v), torch.zeros_like(grown.w_o)
    w_v[grown.carries["w_v"].old_index] = 1
    w_o[grown.carries["w_o"].old_index] = 1
    assert w_v.sum() == 4 * 6 * 2 and not w_v[..., 2:].any()
    assert w_o.sum() == 4 * 2 * 6 and not w_o[:, 2:].any()


def test_weights_install_through_set_weights():
    class Holder:
        def set_weights(self, w_v, w_o):
            self.w_v, self.w_o = w_v, w_o

    grown, holder = ValueProblem().growth().grow(0.5, 4), Holder()
    grown.install(holder)
    assert holder.w_v is grown.w_v and holder.w_o is grown.w_o and ValueWeights.of(holder).d_v == 4


@pytest.mark.parametrize("call, message", [
    (lambda vg: vg.grow(0.5, 4, mode="replace"), "only appends"),
    (lambda vg: vg.grow(0.5, 7), "min\\(e′, e\\) = 6"),
    (lambda vg: vg.grow(-1.0, 4), "α must be ≥ 0"),
])
def test_bad_requests_fail_with_the_reason(call, message):
    with pytest.raises(ValueError, match=message):
        call(ValueProblem().growth())


def test_uneven_groups_and_unknown_methods_are_refused():
    p = ValueProblem()
    with pytest.raises(ValueError, match="cannot share 3 value heads"):
        ValueGrowth(p.w_v[:3], p.w_o, p.stats().means())
    with pytest.raises(ValueError, match="pinv"):
        ValueGrowth(p.w_v, p.w_o, p.stats().means(), "pinv")


def test_each_new_pair_has_a_canonical_sign():
    """A pair and its negation make the same W_M: the largest entry of each u is positive, so that statistics equal
    up to round-off grow the same columns (compiled and eager runs)."""
    vg = ValueProblem(kv=2).growth()
    u, s, w, _ = vg.bottleneck("natural")
    live = s > 1e-10 * s[:, :1]
    largest = u.gather(1, u.abs().argmax(1, keepdim=True)).squeeze(1)
    assert (largest[live] > 0).all()


def test_rank_counts_singular_values_above_the_threshold_within_the_bound():
    vg = ValueProblem(kv=2).growth()
    s = vg.bottleneck("natural")[1]
    for share in (0.9, 0.6, 0.3, 0.2, 0.05):
        count = max(int((row > share * s.max()).sum()) for row in s)
        assert vg.rank(share, 6) == max(1, min(count, 4))  # at most max_width 6 − d_v 2
    # The spectra relative to the largest (group 0's first): 1, 0.42, 0.33, 0.20 and 0.78, 0.67, 0.35, 0.23.
    assert [vg.rank(share, 6) for share in (0.9, 0.6, 0.3, 0.21)] == [1, 2, 3, 4]
    assert vg.rank(1e-9, 3) == 1  # a cap of 3 leaves one column
    assert vg.rank(1e-9, 2) == 0 and vg.rank(0.9, 2) == 0  # no room: no column, whatever the spectrum


def test_random_columns_have_the_old_columns_scale():
    p = ValueProblem(d=3)
    grown = p.growth("random").grow(1.0, 6, generator=torch.Generator().manual_seed(0))
    for old, new in ((p.w_v, grown.w_v[..., 3:]), (p.w_o, grown.w_o[:, 3:])):
        ratio = new.square().mean() / old.square().mean()
        assert 0.5 < ratio < 2  # the same RMS up to the draw (27–54 values per head)


@pytest.mark.parametrize("kv", [1, 2])
def test_discarded_energy_is_the_directions_energy_the_kept_pairs_leave_out(kv):
    vg = ValueProblem(kv=kv).growth("gradient")
    _, s, _, energy = vg.bottleneck("gradient")
    torch.testing.assert_close(energy, vg.direction("gradient").square().sum((-2, -1)).reshape(kv, -1).sum(-1))
    grown = vg.grow(0.5, 4)
    torch.testing.assert_close(grown.discarded_energy, 0.25 * (energy - s[:, :2].square().sum(-1)))
    assert (grown.discarded_energy > 0).all()
    assert grown.alpha == 0.5 and torch.equal(grown.spectrum, s[:, :2])


def test_the_sides_pick_the_value_maps_types_and_pass_their_settings():
    p = ValueProblem(kv=2)
    values = ValueWeights(p.w_v, p.w_o)
    assert values.side == "d_v" and values.column_cost == 2  # a column lengthens the V cache of both KV heads
    assert values.tensor_names() == ("w_v", "w_o") and values.leading_tensor is p.w_v
    empty = values.empty_sums("natural", dtype=F64)
    assert isinstance(empty, ValueStats) and empty.c_sum.shape == (4, 6, 6) and empty.c_sum.dtype == F64
    stats = p.stats()
    restored = sides.stats_from_state_dict(stats.state_dict())
    assert isinstance(restored, ValueStats) and torch.equal(restored.n_sum, stats.n_sum)
    assert isinstance(sides.stats_from_state_dict(FormStats(3, 5).state_dict()), FormStats)
    grown = sides.growth_for(values, stats.means(), "random", size_by="natural")
    assert isinstance(grown, ValueGrowth) and (grown.method, grown.sizing_method) == ("random", "natural")


def test_a_float32_map_grows_in_float64_and_returns_float32():
    p = ValueProblem(kv=2)
    grown = ValueGrowth(p.w_v.float(), p.w_o.float(), p.stats().means()).grow(0.5, 4)
    exact = p.growth().grow(0.5, 4)
    assert grown.w_v.dtype == grown.w_o.dtype == torch.float32
    torch.testing.assert_close(grown.w_v, exact.w_v.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grown.w_o, exact.w_o.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["random", "zero"])
def test_baselines_are_the_generators_float64_draws_scaled_by_each_heads_rms(method):
    """The new V columns and O rows are the generator's own N(0, 1) float64 draws, V's first, times the RMS of each
    kv head's old V columns and each head's old O rows; `zero` keeps the draws of V and zeroes the O rows. The
    spectrum and discarded energy of a baseline are empty: no direction was factored."""
    p = ValueProblem(kv=2, d=3)
    grown = p.growth(method).grow(1.0, 5, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    w_v, w_o = p.w_v.double(), p.w_o.double()
    new_v = torch.randn(w_v.shape[0], w_v.shape[1], 2, generator=g, dtype=torch.float64)
    new_o = torch.randn(w_o.shape[0], 2, w_o.shape[2], generator=g, dtype=torch.float64)
    new_v = new_v * w_v.square().mean((1, 2), keepdim=True).sqrt()
    new_o = new_o * w_o.square().mean((1, 2), keepdim=True).sqrt() if method == "random" else torch.zeros_like(new_o)
    torch.testing.assert_close(grown.w_v, torch.cat([w_v, new_v], -1).to(p.w_v.dtype), rtol=0, atol=0)
    torch.testing.assert_close(grown.w_o, torch.cat([w_o, new_o], -2).to(p.w_o.dtype), rtol=0, atol=0)
    assert grown.discarded_energy.shape == (2,) and not grown.discarded_energy.any()
    assert grown.spectrum.shape == (2, 0)
