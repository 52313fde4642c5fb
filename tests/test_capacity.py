"""The automatic schedule's decision (growth/capacity.py): per-column gains, the rule, its calibration."""

import pytest
import torch

from lit_growattn.growth import FormGrowth
from lit_growattn.growth.capacity import CapacityRule, current_ratio, decide, layer_gains, observed_ratio
from lit_growattn.growth.stats import Moments

from test_growth import Problem


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


def test_zero_gradient_predicts_no_gain_and_nothing_grows():
    p = Problem(e=8, h=2, d=2)
    moments = p.stats("natural").means()
    still = FormGrowth.from_form(p.form, Moments(moments.c, torch.zeros_like(moments.n), None), "natural")
    assert torch.equal(layer_gains([still]), torch.zeros(8, dtype=torch.float64))
    assert decide(0, [still], loss=1.0, rule=CapacityRule(1e-12), ratio=1.0, max_d_head=8).columns == 0


def test_decide_takes_the_leading_columns_that_clear_the_bar_within_the_room():
    e, d = 12, 2
    fg = Problem(e=e, h=3, d=d).growth("gradient")  # gradient: gains are σ², in descending order
    gains = layer_gains([fg]).tolist()
    # The bottleneck has rank ≤ e − d: only those gains are ordered by the maths, the others are round-off.
    rank = e - d
    assert gains[:rank] == sorted(gains[:rank], reverse=True) and gains[rank - 1] > 0
    assert max(abs(g) for g in gains[rank:]) <= 100 * e * torch.finfo(torch.float64).eps * gains[0]
    rule = CapacityRule(threshold=1.0, realised_ratio=1.0)
    loss = (gains[2] + gains[3]) / 2  # the bar lies between the third and fourth column
    decision = decide(1, [fg], loss, rule, ratio=1.0, max_d_head=12)
    assert (decision.layer, decision.d_head, decision.candidates, decision.columns) == (1, 2, 10, 3)
    assert decision.bar == loss and decision.gains == pytest.approx(gains[:10])
    assert decide(1, [fg], loss, rule, ratio=1.0, max_d_head=4).columns == 2  # room below max_d_head
    assert decide(1, [fg], loss, rule, ratio=1.0, max_d_head=12, cap=1).columns == 1
    assert decide(1, [fg], loss, rule, ratio=0.0, max_d_head=12).columns == 0  # a distrusted prediction
    # Two forms of one layer (DIFF/DINT) add their gains column by column.
    assert layer_gains([fg, fg]) == pytest.approx(2 * layer_gains([fg]))


def test_calibration_starts_at_the_measured_ratio_and_only_falls():
    rule = CapacityRule(1e-4, realised_ratio=0.004)
    assert current_ratio([], rule) == 0.004
    assert current_ratio([{"observed_ratio": 0.05}], rule) == 0.004  # a lucky growth is not trusted beyond
    assert current_ratio([{"observed_ratio": 0.001}, {"d_head": [2]}], rule) == 0.001
    grown = [{"gains": [0.004, 0.002, 0.001], "columns": 2, "ratio": 0.004}, {"gains": [1.0], "columns": 0, "ratio": 0.004}]
    assert observed_ratio(0.015, grown) == pytest.approx(0.01)  # 0.015 of a predicted 1.5
    assert observed_ratio(0.0, grown) == 0.0 and observed_ratio(-1.0, grown) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(threshold=0.0), "threshold must be positive"),
    (dict(realised_ratio=0.0), "realised_ratio is a share"),
    (dict(realised_ratio=2.0), "realised_ratio is a share"),
])
def test_bad_rules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CapacityRule(**kwargs)
