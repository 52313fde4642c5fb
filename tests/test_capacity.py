"""The automatic schedule's decision (growth/capacity.py): per-column gains against either half of the window, the
cross-validated rule that noise cannot clear, the spare-width gate, and the end rule's loss fall."""

import pytest
import torch

from lit_growattn.growing.schedule import AutoSchedule
from lit_growattn.growth import FormGrowth
from lit_growattn.growth.capacity import (CapacityRule, decide, gated, key_components, layer_gains, layer_score,
                                          leading_block, loss_fall, pooled_with, without_key_direction)
from lit_growattn.growth.stats import Moments

from test_growth import Problem

F64 = torch.float64


@pytest.mark.parametrize("method", ["natural", "gradient", "pinv"])
@pytest.mark.parametrize("truncation", ["euclidean", "whitened"])
def test_column_gains_add_up_to_the_first_order_prediction_of_appending_them(method, truncation):
    fg = Problem(e=10, h=3, d=2).growth(method, truncation)
    gains = fg.column_gains()
    assert gains.shape == (3, 10)
    for p in (1, 3, 8):
        grown = fg.grow(1.0, 2 + p, mode="append")
        assert not grown.fell_back
        assert gains[:, :p].sum().item() == pytest.approx(grown.predicted_decrease, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("method", ["natural", "gradient"])
def test_score_is_the_first_order_prediction_of_the_whole_direction(method):
    # Replacing at full width truncates nothing: M′ − M = ΔM, whose prediction is the score.
    fg = Problem(e=8, h=2, d=2).growth(method)
    assert fg.score() == pytest.approx(fg.grow(1.0, 8, mode="replace").predicted_decrease, rel=1e-9)
    assert fg.score() > 0  # a descent direction


def test_gains_and_score_against_another_gradient_are_linear_in_it():
    fg = Problem(e=8, h=2, d=2).growth("natural")
    n1, n2 = torch.randn(2, *fg.moments.n.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(fg.column_gains(fg.moments.n), fg.column_gains(), rtol=0, atol=0)
    assert torch.allclose(fg.column_gains(n1 + 2 * n2), fg.column_gains(n1) + 2 * fg.column_gains(n2), rtol=1e-12, atol=1e-14)
    assert fg.score(n1 + 2 * n2) == pytest.approx(fg.score(n1) + 2 * fg.score(n2), rel=1e-12)


def halves(p: Problem, n_a: torch.Tensor, n_b: torch.Tensor, method="gradient"):
    """One-form layers [FormGrowth] of the whole window and of its halves, whose score gradients are n_a and n_b."""
    c = p.stats("natural").means().c
    grow = lambda n: [FormGrowth.from_form(p.form, Moments(c, n, None), method)]  # noqa: E731
    return grow((n_a + n_b) / 2), grow(n_a), grow(n_b)


def test_with_equal_halves_a_layer_takes_the_leading_columns_whose_ratio_clears_the_bar():
    p = Problem(e=12, h=3, d=2)
    n = p.stats("natural").means().n
    (full,), (a,), (b,) = halves(p, n, n)
    # gradient: gains σ_j², in descending order; the bottleneck has rank e − d = 10, beyond that only round-off.
    gains = layer_gains([a])
    existing = layer_score([a]) - gains.sum().item()  # ‖N̄‖² − ‖N̄⊥‖²: what the existing columns can gain
    ratios = (gains / existing)[:10].tolist()
    assert ratios == sorted(ratios, reverse=True) and existing > 0 and ratios[0] > 0
    rule = CapacityRule(ratio=(ratios[2] + ratios[3]) / 2)  # the bar lies between the third and fourth column
    decision = decide(1, [full], [a], [b], rule, max_d_head=12)
    assert (decision.layer, decision.d_head, decision.candidates, decision.columns) == (1, 2, 10, 3)
    assert decision.ratios == pytest.approx(ratios, rel=1e-9) and decision.bar == rule.ratio
    assert decision.existing == pytest.approx(existing, rel=1e-9)
    assert decision.agreement[:3] == pytest.approx([1.0] * 3, rel=1e-9)  # nothing is lost out of sample (per block)
    assert decision.shares == pytest.approx((gains / layer_score([a]))[:10].tolist(), rel=1e-9)  # per column
    assert 0 < decision.bottleneck < 1
    assert decide(1, [full], [a], [b], rule, max_d_head=4).columns == 2  # room below max_d_head
    assert decide(1, [full], [a], [b], rule, max_d_head=12, cap=1).columns == 1
    # Two forms of one layer (DIFF/DINT) add their gains and scores: the ratios stay.
    assert decide(1, [full] * 2, [a] * 2, [b] * 2, rule, max_d_head=12).ratios == pytest.approx(decision.ratios)


def test_noise_that_does_not_hold_out_cannot_clear_the_bar_and_signal_does():
    p = Problem(e=12, h=3, d=2)
    signal = p.stats("natural").means().n
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn(signal.shape, dtype=F64, generator=g) for _ in range(2)]
    noise = [z * signal.norm() / z.norm() for z in noise]  # as strong as the signal
    rule = CapacityRule(ratio=1e-3)
    # Independent noise in the halves: what each half fits does not hold out on the other.
    pure = decide(0, *halves(p, noise[0], noise[1]), rule, max_d_head=12)
    assert pure.columns == 0 and max(pure.agreement) < rule.agreement
    # The same noise, 1/10 of the signal's norm, over a common signal: the leading columns hold out.
    mixed = decide(0, *halves(p, signal + noise[0] / 10, signal + noise[1] / 10), rule, max_d_head=12)
    assert mixed.columns >= 1 and mixed.agreement[0] > rule.agreement


def test_a_layer_decides_on_its_pooled_checks_as_one_larger_window():
    p = Problem(e=12, h=3, d=2)
    signal = p.stats("natural").means().n
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn(signal.shape, dtype=F64, generator=g) for _ in range(2)]
    layer = halves(p, *(signal + z * signal.norm() / (4 * z.norm()) for z in noise))
    alone = decide(0, *layer, CapacityRule(ratio=1e-3), max_d_head=12)
    assert 0 < alone.agreement[0] < 1 and alone.pooled == 1
    # Two earlier checks whose gains all held out (agreement 1), with twice the existing columns' gain.
    clear = {**alone.as_dict(), "held_out": alone.in_sample, "existing": 2 * alone.existing}
    pooled = decide(0, *layer, CapacityRule(ratio=1e-3), max_d_head=12, earlier=[clear, clear])
    mean = lambda key: (2 * torch.tensor(clear[key], dtype=F64) + torch.tensor(getattr(alone, key), dtype=F64)) / 3  # noqa: E731
    assert pooled.pooled == 3
    # Three windows fit a third of one window's noise: in-sample gains lose two thirds of their excess over held-out.
    held = mean("held_out")
    in_sample = held + (mean("in_sample") - held) / 3
    existing_held_out = max(alone.existing_held_out, 0.0)  # signal's energy: a negative estimate is noise
    existing = existing_held_out + (5 * alone.existing / 3 - existing_held_out) / 3
    assert pooled.agreement == pytest.approx((held.cumsum(0) / in_sample.cumsum(0)).tolist(), rel=1e-9)  # per block
    assert pooled.ratios == pytest.approx((held / existing).tolist(), rel=1e-9)  # per column
    # A bar between this window's agreement and the pooled one: the window alone misses it, the pool clears it.
    rule = CapacityRule(ratio=1e-3, agreement=(alone.agreement[0] + pooled.agreement[0]) / 2)
    assert decide(0, *layer, rule, max_d_head=12).columns == 0
    assert decide(0, *layer, rule, max_d_head=12, earlier=[clear, clear]).columns >= 1
    # Evidence about another set of candidates (another width or cap) is not pooled.
    assert decide(0, *layer, rule, max_d_head=11, earlier=[clear, clear]).pooled == 1


def test_a_negative_held_out_existing_gain_does_not_let_every_column_qualify():
    p = Problem(e=12, h=3, d=2)
    n = p.stats("natural").means().n
    layer = halves(p, n, n)
    alone = decide(0, *layer, CapacityRule(), max_d_head=12)
    # Earlier windows whose held-out existing gain came out far below zero (noise): taken at face value the pooled
    # existing gain would be negative and every column's ratio infinite; as zero, a third of the in-sample one stays.
    noisy = {**alone.as_dict(), "existing_held_out": -1e6 * alone.existing}
    pooled = decide(0, *layer, CapacityRule(), max_d_head=12, earlier=[noisy, noisy])
    assert pooled.ratios == pytest.approx([h / (alone.existing / 3) for h in alone.held_out], rel=1e-9)


@pytest.mark.parametrize("held_out, in_sample, columns", [
    ([1.0, 1.0, 1.0], [3.0, 1.0, 1.0], 3),  # the first column fitted noise (agreement ⅓); the three hold out 0.6
    ([1.0, 1.0, 1.0], [3.0, 0.9, 5.0], 2),  # a third column of noise pulls the block's agreement under the bar
    ([1.0, 0.4, 1.0], [1.0, 0.4, 1.0], 1),  # all signal, but the second column gains under half the existing ones
    ([1.0, 1.0, 1.0], [3.0, 3.0, 3.0], 0),  # every block fits twice the noise it holds out
])
def test_a_layer_takes_its_leading_columns_that_each_clear_the_ratio_and_together_the_agreement(held_out, in_sample,
                                                                                                columns):
    held_out, in_sample = torch.tensor(held_out, dtype=F64), torch.tensor(in_sample, dtype=F64)
    ratios, agreement, taken = leading_block(held_out, in_sample, 1.0, CapacityRule())
    assert taken == columns
    assert ratios.tolist() == pytest.approx(held_out.tolist(), rel=1e-12)  # existing gain 1
    assert agreement.tolist() == pytest.approx((held_out.cumsum(0) / in_sample.cumsum(0)).tolist(), rel=1e-12)


def test_where_the_existing_columns_gain_nothing_a_column_that_does_not_hold_out_ends_the_block():
    # Ratios +∞ for every column that holds out: without a per-column bar a strong column would carry noise behind it.
    held_out, in_sample = torch.tensor([5.0, 0.1, -0.1, 0.1], dtype=F64), torch.tensor([5.0, 0.3, 0.3, 0.3], dtype=F64)
    ratios, agreement, taken = leading_block(held_out, in_sample, 0.0, CapacityRule())
    assert ratios.tolist() == [torch.inf, torch.inf, 0.0, torch.inf] and min(agreement.tolist()) > 0.5
    assert taken == 2


def test_only_an_unbroken_run_of_checks_at_the_current_width_is_pooled():
    check = lambda d_head, columns=0, raw=True: {"decisions": [  # noqa: E731
        {"layer": 0, "d_head": d_head, "columns": columns, **({"existing_held_out": 0.1} if raw else {})},
        {"layer": 1, "d_head": 7, "columns": 0, "existing_held_out": 0.1}]}
    history = [check(2), check(2, columns=1), check(3), {"skipped": True}, check(3), check(3), check(3)]
    assert len(pooled_with(history, 0, 3, pool=3)) == 2  # at most pool − 1 earlier checks
    assert len(pooled_with(history, 0, 3, pool=10)) == 3  # the skipped check ends the run
    assert pooled_with(history, 0, 4, pool=3) == []  # no check saw width 4
    assert pooled_with(history[:2], 0, 3, pool=3) == []  # the last check grew the layer
    assert pooled_with([check(3, raw=False)], 0, 3, pool=3) == []  # an older checkpoint's record: no raw gains
    assert len(pooled_with(history, 1, 7, pool=10)) == 3  # layers are pooled separately


def test_zero_gradient_predicts_no_gain_and_nothing_grows():
    p = Problem(e=8, h=2, d=2)
    zero = torch.zeros_like(p.stats("natural").means().n)
    decision = decide(0, *halves(p, zero, zero, "natural"), CapacityRule(ratio=1e-9), max_d_head=8)
    assert decision.columns == 0 and decision.score == 0 and decision.ratios == [0.0] * 6


def test_loss_fall_is_the_relative_decrease_per_check():
    history = [{"loss_before": x} for x in (2.0, 1.9, 1.8, 1.7)]
    assert loss_fall(history, 3) == pytest.approx(0.3 / (3 * 2.0))
    assert loss_fall(history, 1) == pytest.approx(0.1 / 1.8)
    assert loss_fall(history, 4) is None  # the loss four checks ago was never measured
    assert loss_fall([{"loss_before": 2.0}, {"skipped": True}], 1) is None


def test_no_end_of_growth_while_the_loss_falls_faster_than_min_fall():
    schedule = AutoSchedule(check_every=50, patience=2, min_fall=0.01)
    schedule.layers, schedule.max_d_head, schedule.start_sizes = [0], 16, [2]
    idle = lambda loss: {"d_head_before": [2], "d_head": [2], "loss_before": loss}  # noqa: E731
    falling = [idle(2.0), idle(2.0 * 0.97), idle(2.0 * 0.97**2)]  # 3 % a check: growth goes on being checked
    assert not schedule.finished(falling) and schedule.pending(falling).at == 200
    flat = [idle(2.0), idle(1.995), idle(1.99)]  # 0.25 % a check: two idle checks end it
    assert schedule.finished(flat) and schedule.pending(flat) is None
    grew = [idle(2.0), {"d_head_before": [2], "d_head": [3], "loss_before": 2.0}, idle(2.0)]
    assert not schedule.finished(grew)  # the last growth is within the patience


def test_checks_come_at_first_check_then_every_check_every_steps():
    idle = {"d_head_before": [1], "d_head": [1], "loss_before": 2.0}
    positions = {}
    for first_check in (16, None):
        schedule = AutoSchedule(check_every=50, first_check=first_check)
        schedule.layers, schedule.max_d_head, schedule.start_sizes = [0], 16, [1]
        positions[first_check] = [schedule.pending([idle] * n).at for n in range(3)]
    assert positions == {16: [16, 66, 116], None: [50, 100, 150]}


@pytest.mark.parametrize("kwargs, message", [
    (dict(ratio=0.0), "threshold is a positive ratio"),
    (dict(agreement=0.0), "agreement is a share"),
    (dict(min_fall=-0.1), "min_fall is a relative loss decrease"),
    (dict(pool=0), "pool is a number of checks"),
    (dict(spare_below=1.0), "spare_below is a share of an average component's cost"),
])
def test_bad_rules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CapacityRule(**kwargs)


@pytest.mark.parametrize("query_heads, key_heads", [(3, 3), (4, 2)])
def test_removing_a_key_component_removes_exactly_its_rank_one_part_of_every_query_head(query_heads, key_heads):
    g = torch.Generator().manual_seed(0)
    e, d, group = 7, 4, query_heads // key_heads
    w_q, w_k = torch.randn(query_heads, e, d, generator=g, dtype=F64), torch.randn(key_heads, e, d, generator=g, dtype=F64)
    log_tau = torch.randn(query_heads, generator=g, dtype=F64) / 4
    stacked = lambda w_k: (log_tau.exp()[:, None, None] * w_q @ w_k.repeat_interleave(group, 0).mT).reshape(  # noqa: E731
        key_heads, group * e, e)
    u, sigma, vh = torch.linalg.svd(stacked(w_k), full_matrices=False)
    keys = key_components(w_q, w_k, log_tau)
    assert keys.shape == (key_heads, d, e)
    for i in range(d):
        removed = stacked(w_k) - stacked(without_key_direction(w_k, keys[:, i]))
        part = sigma[:, i, None, None] * u[:, :, i, None] * vh[:, i, None, :]
        # Round-off of a few products of e-sized sums, relative to the largest singular value.
        assert torch.allclose(removed, part, atol=100 * e * torch.finfo(F64).eps * float(sigma.max()))


def test_a_layer_with_a_spare_component_takes_none_of_the_columns_it_wants():
    wanted = {"wanted": 3, "columns": 3, "spare_bar": 0.05}
    assert gated(wanted, [1.0, 0.5, 0.2])["columns"] == 3  # least used 0.2 / 0.57 of the mean
    spare = gated(wanted, [1.0, 0.5, 0.01])
    assert spare["columns"] == 0 and spare["wanted"] == 3 and spare["least_used"] == pytest.approx(0.01 / (1.51 / 3))
    assert spare["component_costs"] == [1.0, 0.5, 0.01]
    # A component whose removal lowers the loss, or a layer whose components cost nothing: width to spare.
    assert gated(wanted, [1.0, 0.5, -0.1])["columns"] == 0
    assert gated(wanted, [0.0, -0.0, 0.0]) | {"component_costs": None} == wanted | {
        "columns": 0, "least_used": 0.0, "component_costs": None}
