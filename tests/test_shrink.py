"""SVD shrinking of a query/key form: exact at full rank, optimal below it (float64 references); the per-layer sizes
under a K-cache budget against a brute-force optimum."""

import dataclasses
import itertools
import math

import pytest
import torch

from lit_growattn.growth.factorize import FAN_IN_FLOOR
from lit_growattn.growth.shrink import (
    BudgetShrink, ShrinkItem, allocate_ranks, allocate_sizes, budget_values, form_energy, shrink_form, shrink_items,
    shrink_to_budget, shrink_values, value_energy,
)
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT


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
    """The energy the shrunk forms keep, from shrink_form: ‖M‖² − discarded, summed over layers and query heads (the
    heads sharing a key shrunk together, as shrink_form does)."""
    total = 0.0
    for forms, r in zip(layers, ranks):
        for w_q, w_k, log_tau in forms:
            _, _, discarded = shrink_form(w_q, w_k, log_tau, r)
            keys = w_k.repeat_interleave(w_q.shape[0] // w_k.shape[0], dim=0)
            total += float((bilinear(w_q, keys, log_tau).square().sum((-2, -1)) - discarded).sum())
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
    with pytest.raises(ValueError, match="4 query heads cannot share 3 value heads evenly"):
        shrink_values(w_v, torch.cat([w_o, w_o[:1]]), 2)
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
        shrink_values(w_v, torch.cat([w_o, w_o[:1]]), 2)
    assert str(error.value) == "4 query heads cannot share 3 value heads evenly"
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


# -- activation-aware shrinking (whitened by the inputs' covariance C̄) ------------------------------------------

RCOND = 1e-6  # shrink_form's default: C̄'s eigenvalues are clamped up to RCOND·λ_max


def layer_norm_inputs(n=40, e=8, seed=0, scale=None):
    """X′ = [X | 1] with rows of X summing to zero, as after a LayerNorm: C̄ = X′ᵀX′/n is singular. `scale`: per
    input column, to make the activations anisotropic."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, e, generator=g, dtype=torch.float64)
    if scale is not None:
        x = x * scale
    x = x - x.mean(-1, keepdim=True)
    return torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], -1)


def full_rank_inputs(n=40, e=8, seed=0):
    """X′ = [X | 1] with X anisotropic and of full rank (C̄ invertible, nothing clamped)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, e, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, e, dtype=torch.float64)
    return torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], -1)


def covariance(x):
    return x.mT @ x / x.shape[0]


def grouped_bilinear(w_q, w_k, log_tau):
    return bilinear(w_q, w_k.repeat_interleave(w_q.shape[0] // w_k.shape[0], dim=0), log_tau)


def score_error(m, m_new, x):
    """‖X′(M − M′)X′ᵀ‖²_F per head: the error on the scores of every pair of the n positions."""
    return (x @ (m - m_new) @ x.mT).square().sum((-2, -1))


def best_factored_by_search(target, left, right, r, starts=10, iters=100):
    """Smallest ‖target − left P Qᵀ rightᵀ‖²_F over P (a, r), Q (b, r), by alternating least squares from random
    starts (no SVD, no whitening): each half-step is a linear least-squares problem in P or Q."""
    g = torch.Generator().manual_seed(1)
    best = math.inf
    for _ in range(starts):
        q = torch.randn(right.shape[1], r, generator=g, dtype=torch.float64)
        for _ in range(iters):
            # vec(left P Bᵀ) = (B ⊗ left) vec(P), column-major vec: transposes turn torch's row-major reshape into it.
            b = right @ q
            p = torch.linalg.lstsq(torch.kron(b, left), target.mT.reshape(-1, 1)).solution.reshape(r, -1).mT
            a = left @ p
            q = torch.linalg.lstsq(torch.kron(a, right), target.reshape(-1, 1)).solution.reshape(r, -1).mT
        best = min(best, float((target - left @ p @ q.mT @ right.mT).square().sum()))
    return best


def test_whitened_shrink_is_exact_when_rank_fits():
    x = layer_norm_inputs()
    c = covariance(x)
    assert torch.linalg.eigvalsh(c)[0] < 1e-12 * torch.linalg.eigvalsh(c)[-1]  # singular, as a LayerNorm makes it
    # The back-transform R⁻¹ amplifies round-off by up to cond(R)² = 1/RCOND on the clamped null space of C̄.
    tol = lambda m: 10 * m.shape[-1] * torch.finfo(torch.float64).eps / RCOND * float(m.abs().max())  # noqa: E731
    for kv in (2, 1):  # MHA, then one GQA group of 2 query heads
        w_q, w_k, log_tau = form(h=2, e=9, d=3, seed=kv)
        w_k = w_k[:kv]
        m = grouped_bilinear(w_q, w_k, log_tau)
        new_q, new_k, discarded = shrink_form(w_q, w_k, log_tau, 3, c)
        torch.testing.assert_close(grouped_bilinear(new_q, new_k, log_tau), m, rtol=0, atol=tol(m))
        # Nothing is discarded but round-off: σ_k ≤ e′·eps·σ_max for the pairs beyond the rank.
        assert discarded.max() <= (9 * torch.finfo(torch.float64).eps) ** 2 * form_energy(w_q, w_k, log_tau, c).sum()
    # With 2 rotary columns: those are copied bit for bit, the 3 NoPE columns refactored exactly.
    w_q, w_k, log_tau = form(h=2, e=9, d=5, seed=3)
    for d_new in (5, 3):
        new_q, new_k, _ = shrink_form(w_q, w_k[:1], log_tau, d_new, c, rotary=2)
        assert new_q.shape == (2, 9, d_new) and new_k.shape == (1, 9, d_new)
        assert torch.equal(new_q[..., :2], w_q[..., :2]) and torch.equal(new_k[..., :2], w_k[:1, :, :2])
        if d_new == 5:
            m = grouped_bilinear(w_q[..., 2:], w_k[:1, :, 2:], log_tau)
            nope = grouped_bilinear(new_q[..., 2:], new_k[..., 2:], log_tau)
            torch.testing.assert_close(nope, m, rtol=0, atol=tol(m))
    with pytest.raises(ValueError) as error:
        shrink_form(w_q, w_k[:1], log_tau, 1, c, rotary=2)
    assert str(error.value) == "can shrink a head size of 5 (2 of them rotary) to a size between 2 and 5, not 1"


def test_whitened_shrink_is_optimal_on_the_activations():
    """Below the rank, the whitened truncation's error on the activations' scores is n²·(discarded whitened energy),
    no larger than the weight SVD's, and no larger than the best rank-r form a search finds on the activations."""
    x = full_rank_inputs()
    n, c = x.shape[0], covariance(x)
    w_q, w_k, log_tau = form(h=2, e=9, d=4, seed=5)
    m = bilinear(w_q, w_k, log_tau)
    for r in (1, 2, 3):
        new_q, new_k, discarded = shrink_form(w_q, w_k, log_tau, r, c)
        error = score_error(m, bilinear(new_q, new_k, log_tau), x)
        torch.testing.assert_close(error, n ** 2 * discarded, rtol=1e-9, atol=0)
        svd_q, svd_k, _ = shrink_form(w_q, w_k, log_tau, r)
        assert (error < score_error(m, bilinear(svd_q, svd_k, log_tau), x)).all()
        for head in range(2):
            searched = best_factored_by_search(x @ m[head] @ x.mT, x, x, r)
            assert float(error[head]) <= searched * (1 + 1e-9)


def test_whitened_energy_kept_on_activations_is_at_least_the_weight_svds():
    """The issue's check, on LayerNorm-like (singular, anisotropic) inputs and a GQA group: at every size, the
    score energy ‖X′M′X′ᵀ‖-wise kept on the activations is at least what the weight SVD keeps there."""
    x = layer_norm_inputs(scale=torch.logspace(-1, 1, 8, dtype=torch.float64))
    c = covariance(x)
    w_q, w_k, log_tau = form(h=4, e=9, d=5, seed=6)
    w_k = w_k[:2]  # two groups of two query heads
    m = grouped_bilinear(w_q, w_k, log_tau)
    total = (x @ m @ x.mT).square().sum()

    def kept(r, c):
        new_q, new_k, _ = shrink_form(w_q, w_k, log_tau, r, c)
        return total - score_error(m, grouped_bilinear(new_q, new_k, log_tau), x).sum()

    gains = [float(kept(r, c) / kept(r, None)) for r in range(1, 5)]
    assert min(gains) >= 1 - 1e-9
    assert max(gains) > 1.01, gains  # and strictly more somewhere, on these anisotropic activations


def aligned(a, b):
    """b with each column's sign set to match a's (an SVD pair's signs are arbitrary, both flip together)."""
    signs = torch.sign((a * b).sum(-2, keepdim=True))
    return b * torch.where(signs == 0, 1.0, signs)


def test_an_identity_covariance_gives_the_weight_svd():
    w_q, w_k, log_tau = form(h=4, e=6, d=4, seed=7)
    c = torch.eye(6, dtype=torch.float64)
    for kv, r in ((4, 2), (2, 3)):
        plain, whitened = shrink_form(w_q, w_k[:kv], log_tau, r), shrink_form(w_q, w_k[:kv], log_tau, r, c)
        torch.testing.assert_close(aligned(plain[0], whitened[0]), plain[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(aligned(plain[1], whitened[1]), plain[1], rtol=0, atol=1e-12)
        torch.testing.assert_close(whitened[2], plain[2], rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(8)
    w_v, w_o = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((2, 7, 4), (4, 4, 5)))
    c = torch.eye(7, dtype=torch.float64).expand(4, 7, 7)
    plain, whitened = shrink_values(w_v, w_o, 2), shrink_values(w_v, w_o, 2, c)
    torch.testing.assert_close(aligned(plain[0], whitened[0]), plain[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(whitened[0] @ whitened[1][::2], plain[0] @ plain[1][::2], rtol=0, atol=1e-12)
    torch.testing.assert_close(whitened[2], plain[2], rtol=1e-12, atol=1e-12)


def test_a_gqa_group_shares_its_key_and_its_value():
    x = full_rank_inputs(e=8, seed=9)
    c = covariance(x)
    w_q, w_k, log_tau = form(h=4, e=9, d=3, seed=10)
    w_k = w_k[:2]
    m = grouped_bilinear(w_q, w_k, log_tau)
    # Exact when the rank fits: the stacked heads' forms are kept, with one key per group.
    new_q, new_k, _ = shrink_form(w_q, w_k, log_tau, 3, c)
    assert new_k.shape == (2, 9, 3)
    torch.testing.assert_close(grouped_bilinear(new_q, new_k, log_tau), m, rtol=0, atol=1e-9 * float(m.abs().max()))
    # Each group shrinks on its own: group 1 alone gives the same as within the whole form.
    new_q, new_k, discarded = shrink_form(w_q, w_k, log_tau, 2, c)
    alone = shrink_form(w_q[2:], w_k[1:], log_tau[2:], 2, c)
    torch.testing.assert_close(grouped_bilinear(alone[0], alone[1], log_tau[2:]),
                               grouped_bilinear(new_q, new_k, log_tau)[2:], rtol=0, atol=1e-10)
    torch.testing.assert_close(alone[2], discarded[2:], rtol=1e-10, atol=0)
    # The stacked optimum beats shrinking each head alone and sharing the average of the group's keys.
    error = score_error(m, grouped_bilinear(new_q, new_k, log_tau), x).sum()
    torch.testing.assert_close(error, x.shape[0] ** 2 * discarded.sum(), rtol=1e-9, atol=0)
    own_q, own_k, _ = shrink_form(w_q, w_k.repeat_interleave(2, 0), log_tau, 2, c)
    averaged = own_k.reshape(2, 2, 9, 2).mean(1)
    assert error < score_error(m, grouped_bilinear(own_q, averaged, log_tau), x).sum()
    # The value side: two query heads read one value head, which the shrunk map still shares.
    g = torch.Generator().manual_seed(11)
    w_v, w_o = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((2, 9, 3), (4, 3, 5)))
    heads = torch.randn(4, 30, 9, generator=g, dtype=torch.float64)  # P_j per head
    c_heads = heads.mT @ heads / 30
    new_v, new_o, _ = shrink_values(w_v, w_o, 3, c_heads)
    assert new_v.shape == (2, 9, 3) and new_o.shape == (4, 3, 5)
    w_m = w_v.repeat_interleave(2, 0) @ w_o
    torch.testing.assert_close(new_v.repeat_interleave(2, 0) @ new_o, w_m, rtol=0, atol=1e-10 * float(w_m.abs().max()))


def test_a_gqa_value_group_is_whitened_by_the_mean_of_its_heads_covariances():
    """Below full rank, a group of query heads sharing a value head is weighed by the mean of their C̄_j: the same
    shrink as with each C̄_j replaced by that mean, whose error on it is `discarded`."""
    g = torch.Generator().manual_seed(13)
    w_v, w_o = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((2, 6, 4), (6, 4, 5)))
    heads = torch.randn(6, 30, 6, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, 6, dtype=torch.float64)
    c = heads.mT @ heads / 30  # one C̄_j per query head, different within each group of 3
    group_mean = c.reshape(2, 3, 6, 6).mean(1).repeat_interleave(3, 0)
    new_v, new_o, discarded = shrink_values(w_v, w_o, 2, c)
    same = shrink_values(w_v, w_o, 2, group_mean)
    for found, expected in zip((new_v, new_o, discarded), same):
        torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    e = w_v.repeat_interleave(3, 0) @ w_o - new_v.repeat_interleave(3, 0) @ new_o  # (H, e′, e)
    error = (e.mT @ group_mean @ e).diagonal(dim1=-2, dim2=-1).sum(-1)  # tr(Eᵀ C̄_g E) per head
    torch.testing.assert_close(error, discarded, rtol=1e-9, atol=0)
    assert not torch.allclose(shrink_values(w_v, w_o, 2, c[[0, 0, 0, 3, 3, 3]])[2], discarded)  # the mean matters


def test_the_kept_share_is_the_energy_of_the_kept_columns():
    items = [ShrinkItem(0, "d_v", 1, 1, 3, (4.0, 2.0, 1.0)), ShrinkItem(1, "d_v", 2, 1, 2, (3.0, 0.5)),
             ShrinkItem(0, "d_head", 2, 1, 2, (1.0, 1.0))]
    shrunk = BudgetShrink(items, [2, 1, 1])
    assert shrunk.kept_share("d_v") == 9 / 10.5 and shrunk.kept_share("d_head") == 0.5
    # On a model: 1 − the discarded energy over the whole.
    g = torch.Generator().manual_seed(14)
    w_v, w_o = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((2, 6, 4), (2, 4, 5)))
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=5, d_head=4, d_v=4, bias=True)).double()
    (_, _, values), = model.named_value_maps()
    values.set_weights(w_v, w_o)
    energy = value_energy(values.w_v, values.w_o)
    shrunk = shrink_to_budget(list(model.named_value_maps()), 2)
    discarded = shrink_values(w_v, w_o, 2)[2]
    assert shrunk.sizes == [2]
    torch.testing.assert_close(shrunk.kept_share("d_v"), float(1 - discarded.sum() / energy.sum()), rtol=1e-12, atol=0)


def test_a_budget_allows_the_cache_values_its_decimal_does():
    """4.1 × 30 is 122.99999999999999 in floats: the budget still buys its 123rd value."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=5, n_head=3, n_embd=12, d_head=8, d_v=8, bias=True)).double()
    units = [*model.named_qk_forms(), *model.named_value_maps()]
    items = shrink_items(units)
    assert [i.cost for i in items] == [3] * 10 and budget_values(4.1, items) == 123
    assert budget_values(4, items) == 120 and budget_values(4.099, items) == 122
    shrunk = shrink_to_budget(units, 4.1)
    assert shrunk.values_per_token() == 123 and sum(model.head_sizes() + model.value_sizes()) == 41
    for bad in (math.nan, math.inf, 0.0, -2.0):
        with pytest.raises(ValueError) as error:
            shrink_to_budget(units, bad)
        assert str(error.value) == (f"a budget of {bad:g} is not a mean head size: give a finite number of columns "
                                    "above 0")


def test_value_whitening_uses_each_heads_attention_mixed_inputs():
    g = torch.Generator().manual_seed(12)
    w_v, w_o = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((3, 7, 4), (3, 4, 6)))
    heads = torch.randn(3, 25, 7, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, 7, dtype=torch.float64)
    c = heads.mT @ heads / 25  # C̄_j of P_j = A_j X′, one per head
    w_m = w_v @ w_o
    for r in (1, 2, 3):
        new_v, new_o, discarded = shrink_values(w_v, w_o, r, c)
        error = (heads @ (w_m - new_v @ new_o)).square().sum((-2, -1))
        torch.testing.assert_close(error, 25 * discarded, rtol=1e-9, atol=0)  # one-sided: n, not n²
        plain_v, plain_o, _ = shrink_values(w_v, w_o, r)
        assert (error < (heads @ (w_m - plain_v @ plain_o)).square().sum((-2, -1))).all()
        eye = torch.eye(6, dtype=torch.float64)
        for head in range(3):
            searched = best_factored_by_search(heads[head] @ w_m[head], heads[head], eye, r)
            assert float(error[head]) <= searched * (1 + 1e-9)
    new_v, new_o, discarded = shrink_values(w_v, w_o, 4, c)
    torch.testing.assert_close(new_v @ new_o, w_m, rtol=0, atol=1e-10 * float(w_m.abs().max()))
    w_o[0, 1:] = 0  # head 0 has rank 1: shrunk to 3, two pairs vanish and become zero fan-in
    new_v, new_o, _ = shrink_values(w_v, w_o, 3, c)
    assert (new_o[0, 1:] == 0).all() and (new_v[0, :, 1:].norm(dim=0) > 0).all()
    torch.testing.assert_close(new_v[0] @ new_o[0], w_v[0] @ w_o[0], rtol=0, atol=1e-10 * float(w_m.abs().max()))


def random_items(seed, layers=3, kv=8, value_kv=2, rotary=2):
    """Both sides of `layers` layers: query/key columns cost kv, value columns value_kv; the query/key side holds
    `rotary` leading rotary columns (energy 0), the value side one column; energies fall with the column."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for layer in range(layers):
        for side, cost, held, width in (("d_head", kv, rotary, 6), ("d_v", value_kv, 1, 5)):
            energy = torch.rand(width - (held if side == "d_head" else 0), generator=g, dtype=torch.float64)
            energy = energy.sort(descending=True).values * 10 ** (3 * torch.rand(1, generator=g, dtype=torch.float64))
            padding = [0.0] * (held if side == "d_head" else 0)
            items.append(ShrinkItem(layer, side, cost, held, width, tuple(padding + energy.tolist())))
    return items


@pytest.mark.parametrize("seed", range(5))
def test_allocation_never_exceeds_the_budget_and_holds_rotary_columns(seed):
    items = random_items(seed)
    least = sum(i.cost * i.held for i in items)
    for budget in range(least, sum(i.cost * i.width for i in items) + 1, 3):
        sizes = allocate_sizes(items, budget)
        spent = sum(i.cost * s for i, s in zip(items, sizes))
        assert spent <= budget and all(i.held <= s <= i.width for i, s in zip(items, sizes))
        assert all(s == i.width or budget - spent < i.cost for i, s in zip(items, sizes))  # nothing more fits
        # The sides are compared by their shares of each side's energy: scaling one side's changes nothing.
        louder = [dataclasses.replace(i, gains=tuple(1e3 * g for g in i.gains)) if i.side == "d_v" else i
                  for i in items]
        assert allocate_sizes(louder, budget) == sizes
    with pytest.raises(ValueError) as error:
        allocate_sizes(items, least - 1)
    assert str(error.value) == (f"a budget of {least - 1} cache values per token is below what the layers keep "
                                f"whatever ({least}): give at least {least}")
    # One side alone is allocated by its energies as they are: the K-only allocation of `allocate_ranks`.
    forms = [layer(4, seed=10 * seed + i, h=4, kv=2) for i in range(3)]
    for budget in range(6, 2 * 12 + 1):
        qk = [ShrinkItem(i, "d_head", 2, 1, 4, tuple(form_energy(*f[0]).tolist())) for i, f in enumerate(forms)]
        assert allocate_sizes(qk, budget) == allocate_ranks(forms, budget)
    # With each layer's input covariance, by the whitened energies.
    cs = [covariance(full_rank_inputs(e=4, seed=i)) for i in range(3)]
    whitened = [ShrinkItem(i, "d_head", 2, 1, 4, tuple(form_energy(*f[0], c=c).tolist()))
                for i, (f, c) in enumerate(zip(forms, cs))]
    chosen = {budget: allocate_ranks(forms, budget, covariances=cs) for budget in range(6, 25)}
    assert chosen == {budget: allocate_sizes(whitened, budget) for budget in chosen}
    assert chosen != {budget: allocate_ranks(forms, budget) for budget in chosen}  # the covariances matter


def test_a_model_shrinks_to_a_mean_head_size_as_allocate_ranks_chooses():
    """`shrink_to_budget` without covariances: the K-only sizes are `allocate_ranks`' (weight SVD), each form is
    `shrink_form`'s; both sides: the mean over the cache heads is within the budget."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=8, d_head=4, d_v=4, bias=True)).double()
    forms = [(layer, name, form) for layer, name, form in model.named_qk_forms()]
    before = [(f.w_q.detach().clone(), f.w_k.detach().clone(), f.log_tau.detach().clone()) for _, _, f in forms]
    shrunk = shrink_to_budget(forms, 2.5)
    expected = allocate_ranks([[w] for w in before], 2.5 * 2 * 3)
    assert shrunk.per_layer("d_head") == expected == model.head_sizes()
    for (_, _, f), w, size in zip(forms, before, expected):
        torch.testing.assert_close(f.w_q.detach(), shrink_form(*w, size)[0], rtol=0, atol=0)
    assert shrunk.mean() <= 2.5 and shrunk.values_per_token() == 2 * sum(expected)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=8, d_head=4, d_v=4, bias=True)).double()
    both = shrink_to_budget([*model.named_qk_forms(), *model.named_value_maps()], 3)
    assert both.sides() == ["d_head", "d_v"] and both.mean() <= 3 < both.mean() + 2 / 12
    assert model.value_sizes() == both.per_layer("d_v") and 0 < both.kept_share("d_v") < 1
