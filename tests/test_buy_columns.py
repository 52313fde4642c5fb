"""The one allocator of a cache budget (growth/allocation.buy_columns): what is held, the limits, the tie order, an
exactly equal ratio, and that its two adapters (the automatic schedule's `allocate`, the post-hoc shrink's
`allocate_ranks`) give the answers of the loops they replaced."""

import random
from dataclasses import asdict

import pytest
import torch

from lit_growattn.growth.allocation import Offer, allocate, buy_columns
from lit_growattn.growth.shrink import allocate_ranks, form_energy


def test_buys_the_largest_gain_per_cost_while_the_budget_lasts():
    # Gains per cost: a 6, 4, 1; b 5, 3. Bought in the order a, b, a (8 spent), b (10), a (13).
    assert buy_columns([[18.0, 12.0, 3.0], [10.0, 6.0]], [3, 2], 8) == [2, 1]
    assert buy_columns([[18.0, 12.0, 3.0], [10.0, 6.0]], [3, 2], 10) == [2, 2]
    assert buy_columns([[18.0, 12.0, 3.0], [10.0, 6.0]], [3, 2], 13) == [3, 2]
    assert buy_columns([[18.0], [10.0]], [3, 2], 1) == [0, 0]


def test_a_cheaper_column_still_fits_when_the_best_one_does_not():
    assert buy_columns([[100.0], [1.0]], [5, 1], 4) == [0, 1]


def test_a_priority_orders_the_columns_and_the_budget_still_binds():
    # Narrowest first (the last check's fill), whatever the gains: a holds 1 (spent), so b, then a (a tie goes to
    # the earlier item), then b.
    narrowest = lambda i, count: (-count,)  # noqa: E731
    assert buy_columns([[9.0, 9.0, 9.0], [1.0, 1.0, 1.0]], [1, 1], 4, held=[1, 0], priority=narrowest) == [2, 2]
    assert buy_columns([[9.0, 9.0, 9.0], [1.0, 1.0, 1.0]], [1, 1], 2, held=[1, 0], priority=narrowest) == [1, 1]
    # Costs 3 and 2 against 7: the priority picks the order, the budget still stops it short of 7.
    bought = buy_columns([[1.0] * 5, [1.0] * 5], [3, 2], 7, priority=narrowest)
    assert bought == [1, 2] and 3 * bought[0] + 2 * bought[1] <= 7


def test_held_columns_are_spent_already_and_the_next_gain_is_the_one_after_them():
    gains = [[9.0, 8.0, 1.0], [9.0, 2.0, 0.5]]
    assert buy_columns(gains, [1, 1], 3, held=[1, 1]) == [2, 1]  # spent 2 of 3; a's 8 beats b's 2
    assert buy_columns(gains, [1, 1], 2, held=[1, 1]) == [1, 1]  # nothing more fits
    assert buy_columns(gains, [1, 1], 1, held=[1, 1]) == [1, 1]  # held over the budget: kept, nothing bought


def test_limits_stop_an_item_before_its_gains_run_out():
    gains = [[5.0, 4.0, 3.0], [1.0, 1.0, 1.0]]
    assert buy_columns(gains, [1, 1], 4, limits=[1, 3]) == [1, 3]
    assert buy_columns(gains, [1, 1], 100) == [3, 3]  # default limit: every gain
    assert buy_columns(gains, [1, 1], 100, limits=[0, 0]) == [0, 0]


def test_an_exactly_equal_ratio_goes_to_the_largest_tie_key_then_to_the_earlier_item():
    gains = [[4.0], [2.0], [4.0]]  # per cost 2, 2, 2 exactly
    costs = [2, 1, 2]
    assert buy_columns(gains, costs, 2) == [1, 0, 0]  # no tie key: the earlier item
    assert buy_columns(gains, costs, 2, tie=[(0,), (0,), (1,)]) == [0, 0, 1]
    assert buy_columns(gains, costs, 2, tie=[(0,), (1,), (0,)]) == [0, 1, 0]
    assert buy_columns(gains, costs, 2, tie=[(-1, True), (-1, False), (-2, True)]) == [1, 0, 0]


def old_allocate(offers, allowance):
    """allocate as it was before buy_columns (growth/allocation.py at 5432392)."""
    bought = {o.key: 0 for o in offers}
    left = allowance
    while True:
        options = [(o.held_out[bought[o.key]] / o.cost, -o.layer, o.side == "d_head", o) for o in offers
                   if bought[o.key] < o.above_floor and o.cost <= left]
        if not options:
            return [Offer(**{**asdict(o), "columns": bought[o.key]}) for o in offers]
        *_, best = max(options, key=lambda option: option[:3])
        bought[best.key] += 1
        left -= best.cost


def old_allocate_ranks(layers, budget):
    """allocate_ranks as it was before buy_columns (growth/shrink.py at 5432392), less its refusal, with today's
    rating of a column (`form_energy`: the query heads of a GQA group stacked, no longer one by one)."""
    gains = [sum(form_energy(*form) for form in forms) for forms in layers]
    costs = [sum(w_k.shape[0] for _, w_k, _ in forms) for forms in layers]
    spent = sum(costs)
    ranks = [1] * len(layers)
    while True:
        fits = [i for i, gain in enumerate(gains) if ranks[i] < len(gain) and spent + costs[i] <= budget]
        if not fits:
            return ranks
        best = max(fits, key=lambda i: float(gains[i][ranks[i]]) / costs[i])
        ranks[best] += 1
        spent += costs[best]


@pytest.mark.parametrize("seed", range(20))
def test_allocate_gives_the_answers_of_its_former_loop(seed):
    rng = random.Random(seed)
    # Few distinct gains and costs, so that exact ties between layers and sides happen often.
    offers = []
    for layer in range(rng.randint(1, 4)):
        for side in rng.sample(["d_head", "d_v"], rng.randint(1, 2)):
            room = rng.randint(0, 5)
            held_out = sorted((rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(room)), reverse=True)
            in_sample = [h + rng.choice([0.0, 0.25, 2.0]) for h in held_out]
            offers.append(Offer(layer, rng.randint(1, 8), rng.choice([1, 2, 4]), held_out, in_sample, side=side))
    for allowance in (0, 1, 2.5, 3, 7.75, 12, 40, float("inf")):
        assert allocate(offers, allowance) == old_allocate(offers, allowance)


@pytest.mark.parametrize("seed", range(4))
def test_allocate_ranks_gives_the_answers_of_its_former_loop(seed):
    g = torch.Generator().manual_seed(seed)

    def form(h, kv, d):
        return torch.randn(h, 6, d, generator=g), torch.randn(kv, 6, d, generator=g), torch.randn(h, generator=g)

    layers = [[form(4, 1, 4)], [form(4, 4, 3), form(4, 4, 3)], [form(4, 2, 5)]]
    for budget in range(1 + 8 + 2, 1 * 4 + 8 * 3 + 2 * 5 + 2):
        assert allocate_ranks(layers, budget) == old_allocate_ranks(layers, budget)
    with pytest.raises(ValueError, match=r"below one column per layer \(11\): give at least 11"):
        allocate_ranks(layers, 10)
