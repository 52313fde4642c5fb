"""SVD shrinking of a query/key form: exact at full rank, optimal below it (float64 references)."""

import math

import pytest
import torch

from lit_growattn.growth.factorize import FAN_IN_FLOOR
from lit_growattn.growth.shrink import shrink_form


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


@pytest.mark.parametrize("scale", [1e-3, 10.0])  # the largest σ below and above 1
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
