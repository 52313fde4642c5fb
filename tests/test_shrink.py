"""SVD shrinking of a query/key form: exact at full rank, optimal below it (float64 references); the per-layer sizes
under a K-cache budget against a brute-force optimum."""

import itertools
import math

import pytest
import torch

from lit_growattn.growth.factorize import FAN_IN_FLOOR
from lit_growattn.growth.shrink import allocate_ranks, shrink_form, shrink_values


def form(h=3, e=6, d=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w_q, w_k = torch.randn(h, e, d, generator=g, dtype=dtype), torch.randn(h, e, d, generator=g, dtype=dtype)
    log_tau = torch.randn(h, generator=g, dtype=dtype) * 0.3 - 1.0
    return w_q, w_k, log_tau


def bilinear(w_q, w_k, log_tau):
    return log_tau.exp()[:, None, None] * w_q @ w_k.mT


def best_rank_r_by_search(m: torch.Tensor, r: int, starts: int = 20, iters: int = 300) -> float:
    """Smallest ‖m − P Qᵀ‖²_F found by alternating least squares from random starts (no SVD involved)."""
    g = torch.Generator().manual_seed(1)
    best = math.inf
    for _ in range(starts):
        p = torch.randn(m.shape[0], r, generator=g, dtype=torch.float64)
        for _ in range(iters):
            q = torch.linalg.lstsq(p, m).solution.mT
            p = torch.linalg.lstsq(q, m.mT).solution.mT
        best = min(best, float((m - p @ q.mT).square().sum()))
    return best


def test_exact_when_rank_fits():
    w_q, w_k, log_tau = form(d=4)
    new_q, new_k, discarded = shrink_form(w_q, w_k, log_tau, 4)
    torch.testing.assert_close(bilinear(new_q, new_k, log_tau), bilinear(w_q, w_k, log_tau), rtol=0, atol=1e-12)
    # Nothing is discarded: what is left is round-off of the float64 factorisation, relative to the form's energy.
    energy = bilinear(w_q, w_k, log_tau).square().sum()
    assert discarded.abs().max() <= 100 * w_q.shape[-2] * torch.finfo(w_q.dtype).eps * energy
    # A form of rank 2 stored in 4 columns shrinks to 2 or 3 columns without loss.
    w_q[..., 2:] = 0
    for d_new in (2, 3):
        new_q, new_k, _ = shrink_form(w_q, w_k, log_tau, d_new)
        assert new_q.shape == (3, 6, d_new)
        torch.testing.assert_close(bilinear(new_q, new_k, log_tau), bilinear(w_q, w_k, log_tau), rtol=0, atol=1e-12)


def test_optimal_below_rank_against_search():
    w_q, w_k, log_tau = form(h=2, e=5, d=4, seed=3)
    m = bilinear(w_q, w_k, log_tau)
    for d_new in (1, 2, 3):
        new_q, new_k, discarded = shrink_form(w_q, w_k, log_tau, d_new)
        error = (m - bilinear(new_q, new_k, log_tau)).square().sum((-2, -1))
        torch.testing.assert_close(error, discarded, rtol=1e-10, atol=1e-12)
        for head in range(2):
            assert float(error[head]) <= best_rank_r_by_search(m[head], d_new) + 1e-9


def test_vanishing_pairs_are_zero_fan_in():
    w_q, w_k, log_tau = form(d=4)
    w_q[..., 1:] = 0  # rank 1: pairs 2 and 3 of a shrink to 3 vanish
    new_q, new_k, _ = shrink_form(w_q, w_k, log_tau, 3)
    assert (new_k[..., 1:] == 0).all() and (new_q[..., 1:].norm(dim=1) > 0).all()
    torch.testing.assert_close(bilinear(new_q, new_k, log_tau), bilinear(w_q, w_k, log_tau), rtol=0, atol=1e-12)


def test_keeps_dtype_and_refuses_bad_sizes():
    w_q, w_k, log_tau = form(dtype=torch.float32)
    new_q, new_k, _ = shrink_form(w_q, w_k, log_tau, 2)
    assert new_q.dtype == new_k.dtype == torch.float32
    for bad in (0, 5):
        with pytest.raises(ValueError, match="between 1 and 4"):
            shrink_form(w_q, w_k, log_tau, bad)


@pytest.mark.parametrize("scale", [1e-3, 10.0, 1e4])  # the largest σ below and above 1, and far above
def test_vanishing_pairs_get_the_floor_of_the_largest_singular_value(scale):
    """Zero fan-in Q columns u_j (floor · σ_max / τ)^½; a zero form uses σ_max = 1, so its Q columns are not zero."""
    w_q, w_k, log_tau = form(d=4)
    w_q = w_q * scale
    w_q[..., 1:] = 0
    new_q, _, _ = shrink_form(w_q, w_k, log_tau, 3)
    tau = log_tau.exp()
    u, s, _ = torch.linalg.svd(bilinear(w_q, w_k, log_tau))
    floor = (FAN_IN_FLOOR * s[:, :1] / tau[:, None]).sqrt().unsqueeze(1)
    torch.testing.assert_close(new_q[..., 1:].abs(), (u[:, :, 1:3] * floor).abs(), rtol=1e-8, atol=1e-14)

    zero_q, zero_k, discarded = shrink_form(torch.zeros_like(w_q), w_k, log_tau, 2)
    assert (zero_k == 0).all() and torch.equal(discarded, torch.zeros(3, dtype=torch.float64))
    norms = zero_q.norm(dim=1)
    torch.testing.assert_close(norms, (FAN_IN_FLOOR / tau[:, None]).sqrt().expand(3, 2), rtol=1e-10, atol=0)


def layer(d, seed, h=2, kv=None, e=5):
    """One layer's forms: a single (w_q, w_k, log_tau) of head size d, with kv key heads (GQA when kv < h)."""
    w_q, w_k, log_tau = form(h=h, e=e, d=d, seed=seed)
    return [(w_q, w_k[: kv or h], log_tau)]


def kept(layers, ranks) -> float:
    """The energy the shrunk forms keep, from shrink_form: ‖M‖² − discarded, summed over layers and query heads (each
    query head with its own copy of a shared key)."""
    total = 0.0
    for forms, r in zip(layers, ranks):
        for w_q, w_k, log_tau in forms:
            w_k = w_k.repeat_interleave(w_q.shape[0] // w_k.shape[0], dim=0)
            _, _, discarded = shrink_form(w_q, w_k, log_tau, r)
            total += float((bilinear(w_q, w_k, log_tau).square().sum((-2, -1)) - discarded).sum())
    return total


def brute_force(layers, budget, costs):
    """The ranks (1 … d per layer) within the budget that keep the most energy, by trying them all."""
    widths = [forms[0][0].shape[-1] for forms in layers]
    within = [r for r in itertools.product(*(range(1, d + 1) for d in widths))
              if sum(c * x for c, x in zip(costs, r)) <= budget]
    return max(kept(layers, r) for r in within)


@pytest.mark.parametrize("seed", range(4))
def test_allocation_keeps_the_most_energy_within_the_budget(seed):
    layers = [layer(d, seed=10 * seed + i) for i, d in enumerate((4, 3, 4))]
    layers[1][0][0].mul_(3.0)  # one layer's form is much larger: it should get more of the budget
    for budget in range(6, 2 * 11 + 1):  # 2 key heads per layer: 6 values (1 column each) … every column (22)
        ranks = allocate_ranks(layers, budget)
        assert 2 * sum(ranks) <= budget and min(ranks) >= 1 and ranks <= [4, 3, 4]
        assert kept(layers, ranks) == pytest.approx(brute_force(layers, budget, [2, 2, 2]), rel=1e-12)
    assert allocate_ranks(layers, 1e9) == [4, 3, 4]  # never wider than the layer is


def test_allocation_costs_a_column_per_key_head_and_never_exceeds_the_budget():
    layers = [layer(4, seed=1, h=4, kv=1), layer(4, seed=2, h=4, kv=4), layer(3, seed=3, h=4, kv=2)]
    for budget in range(7, 4 + 16 + 6 + 1):
        ranks = allocate_ranks(layers, budget)
        assert ranks[0] * 1 + ranks[1] * 4 + ranks[2] * 2 <= budget and min(ranks) >= 1
        # What is left over buys no further column: every layer is full or its next column costs too much.
        left = budget - (ranks[0] * 1 + ranks[1] * 4 + ranks[2] * 2)
        assert all(r == d or left < cost for r, d, cost in zip(ranks, [4, 4, 3], [1, 4, 2]))
    with pytest.raises(ValueError, match=r"below one column per layer \(7\): give at least 7"):
        allocate_ranks(layers, 6)


def test_shrinking_values_keeps_the_truncated_svd_and_zero_fan_in_for_vanishing_pairs():
    g = torch.Generator().manual_seed(0)
    w_v = torch.randn(3, 7, 4, generator=g, dtype=torch.float64)
    w_o = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    w_o[0, 1:] = 0  # head 0 has rank 1: a kept size of 2 has one vanishing pair
    new_v, new_o, discarded = shrink_values(w_v, w_o, 2)
    m, m_new = w_v @ w_o, new_v @ new_o
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    torch.testing.assert_close(m_new[1:], (u[1:, :, :2] * s[1:, None, :2]) @ vh[1:, :2])
    torch.testing.assert_close(m_new[0], m[0])  # rank 1 kept whole
    assert not new_o[0, 1].any() and new_v[0, :, 1].norm() > 0  # the vanishing pair: a live V column, a zero O row
    torch.testing.assert_close(discarded, s[:, 2:].square().sum(-1))
    with pytest.raises(ValueError, match="share 3 value heads"):
        shrink_values(w_v, torch.cat([w_o, w_o]), 2)
    with pytest.raises(ValueError, match="between 1 and 4, not 5"):
        shrink_values(w_v, w_o, 5)


def test_allocation_buys_by_energy_per_cache_value_when_layers_cost_differently():
    """Against a greedy reference that prices each next column by the energy shrink_form keeps with it."""
    layers = [layer(4, seed=1, h=4, kv=1), layer(4, seed=2, h=4, kv=4), layer(3, seed=3, h=4, kv=2)]
    costs, widths = [1, 4, 2], [4, 4, 3]

    def reference(budget):
        ranks, spent = [1, 1, 1], sum(costs)
        while fits := [i for i in range(3) if ranks[i] < widths[i] and spent + costs[i] <= budget]:
            def per_value(i):
                more = [r + (j == i) for j, r in enumerate(ranks)]
                return (kept(layers, more) - kept(layers, ranks)) / costs[i]
            best = max(fits, key=per_value)
            ranks[best] += 1
            spent += costs[best]
        return ranks

    chosen = {budget: allocate_ranks(layers, budget) for budget in range(7, 27)}
    assert chosen == {budget: reference(budget) for budget in chosen}
    assert len({tuple(r) for r in chosen.values()}) > 8  # the budgets lead to many different allocations


def test_shrinking_values_to_one_column_and_the_refusals_in_full():
    g = torch.Generator().manual_seed(0)
    w_v = torch.randn(3, 7, 4, generator=g, dtype=torch.float32)
    w_o = torch.randn(3, 4, 6, generator=g, dtype=torch.float32)
    new_v, new_o, _ = shrink_values(w_v, w_o, 1)
    assert new_v.shape == (3, 7, 1) and new_o.shape == (3, 1, 6)
    assert new_v.dtype == new_o.dtype == torch.float32  # the input's, from float64 arithmetic
    with pytest.raises(ValueError) as error:
        shrink_values(w_v, torch.cat([w_o, w_o]), 2)
    assert str(error.value) == ("6 query heads share 3 value heads: shrinking one shared value head for several "
                                "heads' maps is not a truncated SVD; it is refused")
    with pytest.raises(ValueError) as error:
        shrink_values(w_v, w_o, 0)
    assert str(error.value) == "can shrink a value head size of 4 to a size between 1 and 4, not 0"


@pytest.mark.parametrize("scale", [1e-3, 10.0, 1e4])  # the largest σ below and above 1, and far above
def test_vanishing_value_pairs_get_the_floor_of_the_largest_singular_value(scale):
    """A vanishing pair keeps a V column u_j (floor · σ_max)^½ and a zero O row; a zero map uses σ_max = 1."""
    g = torch.Generator().manual_seed(2)
    w_v = torch.randn(3, 7, 4, generator=g, dtype=torch.float64) * scale
    w_o = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    w_o[:, 1:] = 0  # rank 1: pairs 2 and 3 of a shrink to 3 vanish
    new_v, new_o, _ = shrink_values(w_v, w_o, 3)
    m = w_v @ w_o
    sigma_max = torch.linalg.matrix_norm(m, ord=2)
    torch.testing.assert_close(new_v @ new_o, m, rtol=1e-10, atol=1e-12 * scale)  # rank 1: kept whole
    assert (new_o[:, 1:] == 0).all()
    # Any orthonormal completion of the live column will do: the floor's length, orthogonal to it and each other.
    torch.testing.assert_close(new_v[..., 1:].norm(dim=1), (FAN_IN_FLOOR * sigma_max).sqrt()[:, None].expand(3, 2),
                               rtol=1e-8, atol=0)
    gram = new_v.mT @ new_v
    torch.testing.assert_close(gram - torch.diag_embed(gram.diagonal(dim1=-2, dim2=-1)), torch.zeros_like(gram),
                               rtol=0, atol=1e-12 * float(sigma_max.max()))
    zero_v, zero_o, _ = shrink_values(torch.zeros_like(w_v), w_o, 2)
    assert (zero_o == 0).all()
    torch.testing.assert_close(zero_v.norm(dim=1), torch.full((3, 2), FAN_IN_FLOOR ** 0.5, dtype=torch.float64),
                               rtol=1e-10, atol=0)
