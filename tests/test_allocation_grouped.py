"""The automatic schedule's gains on forms whose query heads share keys (GQA) or carry rotary columns
(growth/grouped.py), float64: each group's column gain is the first-order loss change of actually appending that
column, on a hand-built GQA form and on a tiny Llama (RoPE and GQA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_growattn.growth import GroupedGrowth
from lit_growattn.growth.stats import Moments

from conftest import needs_transformers

F64 = torch.float64
EPS = torch.finfo(F64).eps


class GroupedProblem:
    """A GQA attention regression: H query heads, KV key heads (head h reads key head h // (H/KV)), LayerNorm inputs
    with a random gain per instance, fixed values and an MSE to a target; no rotary columns."""

    def __init__(self, b=3, s=10, e=8, heads=4, kv=2, d=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.group = heads // kv
        self.w_q = torch.randn(heads, e, d, generator=g, dtype=F64) / e**0.5
        self.w_k = torch.randn(kv, e, d, generator=g, dtype=F64) / e**0.5
        self.log_tau = torch.full((heads,), d**-0.5, dtype=F64).log()
        gain = torch.empty(b, 1, 1, dtype=F64).uniform_(0.5, 2.0, generator=g)
        self.x = gain * F.layer_norm(torch.randn(b, s, e, generator=g, dtype=F64), (e,))
        self.v = torch.randn(b, heads, s, 3, generator=g, dtype=F64)
        self.target = torch.randn(b, heads, s, 3, generator=g, dtype=F64)

    def loss_of_scores(self, scores):
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        return F.mse_loss(torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ self.v, self.target)

    def loss(self, w_q=None, w_k=None):
        """The loss with the form's factors (or appended ones) in place: the path a grown model takes."""
        w_q, w_k = (self.w_q if w_q is None else w_q), (self.w_k if w_k is None else w_k)
        q = self.log_tau.exp()[:, None, None] * torch.einsum("bse,hed->bhsd", self.x, w_q)
        k = torch.einsum("bse,hed->bhsd", self.x, w_k).repeat_interleave(self.group, 1)
        return self.loss_of_scores(q @ k.mT)

    def loss_of_m(self, m):
        return self.loss_of_scores(torch.einsum("bse,hef,btf->bhst", self.x, m, self.x))

    def m(self):
        return self.log_tau.exp()[:, None, None] * self.w_q @ self.w_k.repeat_interleave(self.group, 0).mT

    def growth(self, method="natural", truncation="euclidean", size_by=None) -> GroupedGrowth:
        scores = torch.einsum("bse,hef,btf->bhst", self.x, self.m(), self.x).requires_grad_()
        self.loss_of_scores(scores).backward()
        n = torch.einsum("bse,bhst,btf->hef", self.x, scores.grad, self.x)  # ∂L/∂M_h, exactly
        c = torch.einsum("bse,bsf->ef", self.x, self.x) / self.x.shape[0]
        return GroupedGrowth(self.w_q, self.w_k, self.log_tau, Moments(c, n, None), method, truncation=truncation,
                             size_by=size_by)


def appended(g: GroupedGrowth, w_q, w_k, group: int, j: int, step: float):
    """w_q, w_k with group `group`'s bottleneck pair j appended at step `step` (any sign; euclidean coordinates),
    every other group's new columns zero: τ_h Q_new,h K_newᵀ = step σ_j u_{j,h} v_jᵀ for the group's heads h."""
    u, s, v, _ = g.bottleneck(g.sizing_method)
    heads = slice(group * g.group, (group + 1) * g.group)
    new_q, new_k = w_q.new_zeros(*w_q.shape[:2], 1), w_k.new_zeros(*w_k.shape[:2], 1)
    new_q[heads, :, 0] = step * s[group, j] * u[group, :, j].reshape(g.group, -1) / g.log_tau[heads].exp()[:, None]
    new_k[group, :, 0] = v[group, :, j]
    return torch.cat([w_q, new_q], -1), torch.cat([w_k, new_k], -1)


def central_slope(loss_at, step: float) -> float:
    """−dL/dstep at 0 by a central difference: error O(step²) from the third derivative, not O(step)."""
    return (loss_at(-step) - loss_at(step)) / (2 * step)


@pytest.mark.parametrize("method", ["natural", "gradient"])
def test_gqa_column_gains_are_the_first_order_change_of_appending_each_column(method):
    p = GroupedProblem()
    g = p.growth(method)
    gains = g.column_gains()
    assert gains.shape == (2, 8)
    step = 1e-4
    # Central difference in float64 on a loss of O(1): truncation O(step²) ≈ 1e-8 relative, round-off
    # ≈ eps·L/step ≈ 1e-12; the tolerance sits between them with a margin of 100 on the truncation.
    for group in range(2):
        for j in range(3):
            slope = central_slope(lambda a: float(p.loss(*appended(g, p.w_q, p.w_k, group, j, a))), step)
            assert slope == pytest.approx(float(gains[group, j]), rel=1e-6, abs=1e4 * EPS / step)
    assert (gains[:, 0] > 0).all()  # the leading column of a descent direction's bottleneck descends


@pytest.mark.parametrize("truncation", ["euclidean", "whitened"])
def test_gqa_gains_add_up_to_the_prediction_of_growing_and_are_linear_in_the_gradient(truncation):
    p = GroupedProblem()
    g = p.growth("natural", truncation)
    gains = g.column_gains()
    for cols in (1, 2, 5):
        grown = g.grow(1.0, 2 + cols)
        assert not grown.fell_back
        assert float(gains[:, :cols].sum()) == pytest.approx(grown.predicted_decrease, rel=1e-9, abs=1e-14)
    # Against another gradient the gains are linear in it (what the held-out halves of the window use).
    n1, n2 = torch.randn(2, *g.moments.n.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    gains_of = g.column_gains
    assert torch.allclose(gains_of(n1 + 2 * n2), gains_of(n1) + 2 * gains_of(n2), rtol=1e-12, atol=1e-14)
    # The bottleneck's energy is per group, as the stacked SVD is.
    u, s, v, energy = g.bottleneck("natural")
    assert energy.shape == (2,) and (s.square().sum(-1) <= energy * (1 + 1e-12)).all()


def test_rotary_gqa_column_gains_are_the_first_order_change_of_appending_nope_columns(tmp_path):
    needs_transformers()
    from test_hf_growth import _growths, _loss, _model_and_batch

    model, ids = _model_and_batch(tmp_path, "llama")
    forms, growths = _growths(model, ids)
    g = growths[0]
    assert isinstance(g, GroupedGrowth) and forms[0].rotary == g.d_head == 8
    gains = g.column_gains()
    w_q, w_k, log_tau = (t.detach().clone() for t in (forms[0].w_q, forms[0].w_k, forms[0].log_tau))

    def loss_at(group, j, a):
        forms[0].set_weights(*appended(g, w_q, w_k, group, j, a), log_tau)
        with torch.no_grad():
            return float(_loss(model, ids))

    # The models' RMSNorms compute in float32, which leaves a loss noise of about 1e-9 here, so the step is larger
    # than above: round-off ≈ 1e-9 / step = 1e-8 and truncation O(step²) ≈ 2e-8 (measured), against gains ≥ 3e-5.
    step = 0.1
    for group in range(2):
        for j in range(2):
            slope = central_slope(lambda a: loss_at(group, j, a), step)
            assert slope == pytest.approx(float(gains[group, j]), rel=1e-2, abs=0)
    forms[0].set_weights(w_q, w_k, log_tau)
    assert torch.equal(forms[0].w_q[..., :8], w_q[..., :8])  # the rotary columns were never touched


def test_a_gqa_baseline_is_sized_by_the_direction_it_names():
    p = GroupedProblem()
    torch.testing.assert_close(p.growth("random", size_by="natural").column_gains(), p.growth("natural").column_gains())
