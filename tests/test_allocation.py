"""The automatic schedule's rule (growth/allocation.py): per-column gains against either half of the window, the noise
floor that fitted noise cannot clear, the purchase across layers within an allowance, and the K-cache cost of a
column."""

import itertools

import pytest
import torch

from lit_growattn.growth import FormGrowth, FormWeights, ValueWeights, column_costs
from lit_growattn.growth.allocation import Offer, allocate, layer_gains, offer
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


def test_gains_against_another_gradient_are_linear_in_it():
    fg = Problem(e=8, h=2, d=2).growth("natural")
    n1, n2 = torch.randn(2, *fg.moments.n.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fg.column_gains(fg.moments.n), fg.column_gains())
    assert torch.allclose(fg.column_gains(n1 + 2 * n2), fg.column_gains(n1) + 2 * fg.column_gains(n2), rtol=1e-12, atol=1e-14)


def halves(p: Problem, n_a: torch.Tensor, n_b: torch.Tensor, method="natural"):
    """One-form layers [FormGrowth] fitted on two halves of a window whose score gradients are n_a and n_b."""
    c = p.stats("natural").means().c
    return ([FormGrowth.from_form(p.form, Moments(c, n, None), method)] for n in (n_a, n_b))


def test_an_offer_holds_the_gains_held_out_and_in_sample_of_each_half():
    p = Problem(e=8, h=2, d=2)
    n = p.stats("natural").means().n
    noise = torch.randn(n.shape, dtype=F64, generator=torch.Generator().manual_seed(3)) * n.abs().mean()
    a, b = halves(p, n + noise, n - noise)
    found = offer(3, "d_head", a, b, cost=2, room=4)
    held = (layer_gains(a, [b[0].moments.n]) + layer_gains(b, [a[0].moments.n])) / 2
    seen = (layer_gains(a) + layer_gains(b)) / 2
    assert (found.layer, found.width, found.cost, found.columns) == (3, 2, 2, 0)
    assert found.held_out == pytest.approx(held[:4].tolist(), rel=1e-12)
    assert found.in_sample == pytest.approx(seen[:4].tolist(), rel=1e-12)
    assert offer(3, "d_head", a, b, cost=2, room=0).held_out == []


def test_with_equal_halves_every_column_with_a_gain_clears_the_floor():
    # Equal halves fit no noise: held out equals in sample, and g > ĝ − g = 0 holds for every column that gains.
    p = Problem(e=8, h=2, d=2)
    n = p.stats("natural").means().n
    found = offer(0, "d_head", *halves(p, n, n), cost=2, room=6)
    assert found.held_out == pytest.approx(found.in_sample, rel=1e-12)
    gaining = next((j for j, g in enumerate(found.held_out) if not g > 0), len(found.held_out))
    assert found.above_floor == gaining > 0


def test_noise_alone_rarely_clears_the_floor_and_signal_plus_noise_does():
    """Halves with independent noise and no common signal: what one half fits does not hold out on the other, so
    (almost) no column clears the floor; with a common signal twice the noise, most of the 10 candidates do (measured:
    none of 200 noise columns, 3–10 of 10 with the signal)."""
    p = Problem(e=12, h=3, d=2)
    n = p.stats("natural").means().n
    scale = n.abs().mean()
    noise_only, with_signal = [], []
    for seed in range(20):
        e_a, e_b = torch.randn(2, *n.shape, dtype=F64, generator=torch.Generator().manual_seed(seed)) * scale / 2
        noise_only.append(offer(0, "d_head", *halves(p, e_a, e_b), cost=3, room=10).above_floor)
        with_signal.append(offer(0, "d_head", *halves(p, n + e_a, n + e_b), cost=3, room=10).above_floor)
    assert sum(noise_only) <= 2 and sum(with_signal) / 20 > 5


@pytest.mark.parametrize("held_out, in_sample, above", [
    ([3.0, 2.0, 1.0], [4.0, 5.0, 1.5], 1),  # fitted noise 1, 3, 0.5: the second column's 2 does not exceed 3
    ([3.0, 2.0, 1.0], [3.0, 2.0, 1.0], 3),  # no fitted noise
    ([0.0, 2.0], [0.0, 2.0], 0),  # a column that gains nothing ends the layer's offer, however good the next one
    ([1.0, 1.0], [2.0, 1.5], 0),  # g = ĝ − g is not above the floor
    ([-1.0], [-3.0], 0),  # a held-out loss increase
])
def test_a_layers_leading_columns_above_the_floor_are_those_that_gain_more_than_their_fitted_noise(held_out, in_sample,
                                                                                                   above):
    assert Offer(0, 1, 1, held_out, in_sample).above_floor == above


def bought(offers, allowance):
    return [o.columns for o in allocate(offers, allowance)]


def test_columns_are_bought_by_gain_per_cache_value_across_layers():
    wide = Offer(0, 1, cost=4, held_out=[8.0, 4.0, 3.0], in_sample=[8.0, 4.0, 3.0])  # 2, 1, 0.75 per value
    narrow = Offer(1, 1, cost=2, held_out=[3.0, 3.0, 1.0], in_sample=[3.0, 3.0, 1.0])  # 1.5, 1.5, 0.5 per value
    assert bought([wide, narrow], 4) == [1, 0]
    assert bought([wide, narrow], 8) == [1, 2]
    # The next best (wide's 1 per value) costs 4: the 3 left buy narrow's third column instead.
    assert bought([wide, narrow], 11) == [1, 3]
    assert bought([wide, narrow], 12) == [2, 2]
    assert bought([wide, narrow], 14) == [2, 3]
    assert bought([wide, narrow], float("inf")) == [3, 3]
    assert bought([wide, narrow], 1) == [0, 0]
    # Ties go to the lower layer; what the allowance cannot pay for in one layer may still buy in another.
    assert bought([Offer(1, 1, 1, [1.0], [1.0]), Offer(0, 1, 1, [1.0], [1.0])], 1) == [0, 1]
    assert bought([Offer(0, 1, 5, [9.0], [9.0]), Offer(1, 1, 1, [1.0], [1.0])], 3) == [0, 1]


def test_the_two_sides_of_a_layer_are_offers_of_their_own_bought_by_gain_per_cache_value():
    keys = Offer(0, 2, cost=4, held_out=[4.0, 1.0], in_sample=[4.0, 1.0])  # 1, 0.25 per value
    values = Offer(0, 2, cost=2, held_out=[3.0, 1.0], in_sample=[3.0, 1.0], side="d_v")  # 1.5, 0.5 per value
    assert bought([keys, values], 2) == [0, 1]
    assert bought([keys, values], 6) == [1, 1]
    assert bought([keys, values], 8) == [1, 2]
    assert bought([keys, values], float("inf")) == [2, 2]
    # Equal gain per value in one layer: the query/key side first.
    tied = Offer(0, 2, cost=2, held_out=[2.0], in_sample=[2.0], side="d_v")
    assert bought([tied, Offer(0, 2, 4, [4.0], [4.0])], 4) == [0, 1]


def test_before_the_last_check_columns_below_the_floor_are_never_bought_and_a_layer_buys_in_order():
    noisy = Offer(0, 1, cost=1, held_out=[1.0, 9.0], in_sample=[5.0, 9.0])  # its first column fails the floor
    clean = Offer(1, 1, cost=1, held_out=[0.5, 0.1], in_sample=[0.5, 0.1])
    assert bought([noisy, clean], float("inf")) == [0, 2]
    # Its record is what a check recorded before the last check filled: no `filled`, so old runs resume bit-equal.
    assert "filled" not in allocate([noisy, clean], 1)[0].as_dict()


def test_at_the_last_check_the_floor_orders_but_does_not_withhold():
    noisy = Offer(0, 1, cost=1, held_out=[1.0, 9.0], in_sample=[5.0, 9.0])  # its first column fails the floor
    clean = Offer(1, 1, cost=1, held_out=[0.5, 0.1], in_sample=[0.5, 0.1])
    # The clean layer's columns above the floor come first; what is left goes to the noisy layer, which stays narrow.
    assert [o.columns for o in allocate([noisy, clean], 1, fill_to=4)] == [0, 1]
    last = allocate([noisy, clean], 3, fill_to=4)
    assert [o.columns for o in last] == [1, 2] and [o.filled for o in last] == [1, 0]
    assert [o.columns for o in allocate([noisy, clean], 4, fill_to=4)] == [2, 2]  # the allowance is spent


def test_at_the_last_check_columns_above_the_floor_go_by_gain_per_cache_value():
    # Both columns clear the floor; the allowance pays for one: 1.5 per value beats 1 per value (not the lower layer).
    per_value_1 = Offer(0, 1, cost=2, held_out=[2.0], in_sample=[2.0])
    per_value_1_5 = Offer(1, 1, cost=1, held_out=[1.5], in_sample=[1.5])
    assert [o.columns for o in allocate([per_value_1, per_value_1_5], 2, fill_to=4)] == [0, 1]


def test_the_fill_breaks_equal_widths_by_gain_per_value_then_the_query_key_side():
    # Below the floor (held-out 0.1 or 0.2 against a fitted noise of 0.8 or 0.9), at equal widths.
    low, high = Offer(0, 1, 1, [0.1], [1.0]), Offer(1, 1, 1, [0.2], [1.0])
    assert [o.columns for o in allocate([low, high], 1, fill_to=4)] == [0, 1]
    values, keys = Offer(0, 2, 1, [0.1], [1.0], side="d_v"), Offer(0, 2, 1, [0.1], [1.0])
    assert [o.columns for o in allocate([values, keys], 1, fill_to=4)] == [0, 1]


def test_what_the_statistics_leave_goes_to_the_narrowest_sides_first():
    # Nothing above the floor (held-out gains all 0): widths 8, 1, 2 fill 1, then 1 and 2 in turn (ties: the lower
    # layer), so the narrow layers level up toward uniform and the wide one waits.
    offers = [Offer(layer, width, 1, [0.0] * 6, [0.0] * 6) for layer, width in enumerate([8, 1, 2])]
    assert [[o.columns for o in allocate(offers, n, fill_to=4)] for n in range(1, 6)] == [
        [0, 1, 0], [0, 2, 0], [0, 2, 1], [0, 3, 1], [0, 3, 2]]
    assert [o.filled for o in allocate(offers, 5, fill_to=4)] == [0, 3, 2]


def test_a_concentrated_layer_keeps_its_columns_and_the_others_widen():
    # The 8-layer pattern: layer 0 at 7 with 2 columns above the floor, the others at 1 with none; 4 values per
    # column (4 heads), and 4 × 8 × 4 = 128 − 4 × (7 + 7) = 72 values left of budget 4: 18 columns.
    noisy = [1.0] * 8  # in-sample gains whose fitted noise (0.9) the held-out 0.1 does not clear
    offers = [Offer(0, 7, 4, [2.0, 1.5] + [0.1] * 6, [2.0, 1.5] + noisy[2:])] + [
        Offer(layer, 1, 4, [0.1] * 8, noisy) for layer in range(1, 8)]
    last = allocate(offers, 72, fill_to=4)
    widths = [o.width + o.columns for o in last]
    assert last[0].above_floor == 2 and sum(4 * o.columns for o in last) == 72
    # Layer 0 keeps its 2 columns above the floor; the other 16 level layers 1–7 (ties: the lower layer).
    assert widths == [9, 4, 4, 3, 3, 3, 3, 3]


@pytest.mark.parametrize("seed", range(20))
def test_the_fill_counts_gqa_and_value_costs_and_never_exceeds_the_allowance(seed):
    # Query/key and value offers of three layers, mha (cost 8) or GQA (cost 2) per side, competing in one allowance.
    g = torch.Generator().manual_seed(seed)
    offers = []
    for layer, side in itertools.product(range(3), ("d_head", "d_v")):
        held = torch.rand(5, generator=g, dtype=F64).sort(descending=True).values
        noise = torch.rand(5, generator=g, dtype=F64) * 2
        offers.append(Offer(layer, int(torch.randint(1, 4, (1,), generator=g)), [8, 2][int(torch.randint(0, 2, (1,),
                            generator=g))], held.tolist(), (held * (1 + noise)).tolist(), side=side))
    allowance = float(torch.randint(0, 60, (1,), generator=g))
    last = allocate(offers, allowance, fill_to=4)
    spent = sum(o.cost * o.columns for o in last)
    assert spent <= allowance
    room = [o.cost for o in last if o.columns < len(o.held_out)]
    assert not room or allowance - spent < min(room)  # all but less than one column's cost is spent


@pytest.mark.parametrize("fill_to", [None, 4.0])
@pytest.mark.parametrize("seed", range(20))
def test_the_allowance_is_never_exceeded_and_at_equal_costs_the_best_columns_are_bought(seed, fill_to):
    g = torch.Generator().manual_seed(seed)
    offers = []
    for layer in range(3):
        held = torch.rand(4, generator=g, dtype=F64).sort(descending=True).values
        offers.append(Offer(layer, 1, int(torch.randint(1, 4, (1,), generator=g)), held.tolist(),
                            (held * (1 + torch.rand(4, generator=g, dtype=F64))).tolist()))
    allowance = float(torch.randint(0, 15, (1,), generator=g))
    result = allocate(offers, allowance, fill_to)
    assert sum(o.cost * o.columns for o in result) <= allowance
    if fill_to is not None:
        # The whole allowance is spent, but for less than one column's cost; no column toward the budget is bought
        # while a column above the floor still fits.
        room = [o.cost for o in result if o.columns < len(o.held_out)]
        assert not room or allowance - sum(o.cost * o.columns for o in result) < min(room)
        if any(o.filled for o in result):
            assert all(o.columns >= o.above_floor or allowance - sum(p.cost * p.columns for p in result) < o.cost
                       for o in result)
        return
    assert all(o.columns <= o.above_floor for o in result)
    # With gains decreasing within each layer, greedy by gain per value is optimal when every cost divides the
    # others; check it against every purchase within the allowance where the costs are equal.
    if len({o.cost for o in offers}) == 1:
        gain = lambda counts: sum(sum(o.held_out[:c]) for o, c in zip(offers, counts))  # noqa: E731
        feasible = [c for c in itertools.product(*(range(o.above_floor + 1) for o in offers))
                    if sum(o.cost * k for o, k in zip(offers, c)) <= allowance]
        assert gain([o.columns for o in result]) == pytest.approx(max(map(gain, feasible)), rel=1e-12)


def test_a_column_costs_one_value_per_key_head_of_every_form_of_its_layer_and_per_value_head():
    # mha: 4 heads; GQA: 8 query heads sharing 2 key heads; DIFF's two maps of 4 heads in layer 2.
    form = lambda q, k: FormWeights(torch.zeros(q, 9, 2), torch.zeros(k, 9, 2), torch.zeros(q))  # noqa: E731
    # Value maps: 4 value heads for 4 query heads; 2 value heads shared by 8 query heads (GQA).
    values = lambda kv, h: ValueWeights(torch.zeros(kv, 9, 3), torch.zeros(h, 3, 8))  # noqa: E731
    units = [(0, form(4, 4)), (1, form(8, 2)), (2, form(4, 4)), (2, form(4, 4)), (0, values(4, 4)), (1, values(2, 8))]
    assert column_costs(units) == {(0, "d_head"): 4, (1, "d_head"): 2, (2, "d_head"): 8, (0, "d_v"): 4,
                                   (1, "d_v"): 2}


def test_zero_gradient_offers_no_column():
    p = Problem(e=8, h=2, d=2)
    zero = torch.zeros_like(p.stats("natural").means().n)
    found = offer(0, "d_head", *halves(p, zero, zero), cost=2, room=6)
    assert found.held_out == [0.0] * 6 and found.above_floor == 0
    assert bought([found], float("inf")) == [0]
