"""Statistics capture and FormStats: float64 against explicit references."""

import re

import pytest
import torch
import torch.nn.functional as F

from lit_growattn.attention.qk import QKForm
from lit_growattn.growth import FormStats, NonFiniteStatistics, flatten_stats, unflatten_stats
from lit_growattn.growth.linalg import column_basis, psd_pinv, psd_sqrt

F64 = torch.float64
B, S, E, H, D, DV = 4, 11, 7, 3, 2, 5


def inputs(b=B, s=S, e=E, seed=0):
    """LayerNorm-like inputs (rows sum to zero, so C = XᵀX is singular, as in a transformer) and values."""
    g = torch.Generator().manual_seed(seed)
    x = F.layer_norm(torch.randn(b, s, e, generator=g, dtype=F64), (e,))
    return x, torch.randn(b, H, s, DV, generator=g, dtype=F64)


def make_form(bias, seed=0):
    torch.manual_seed(seed)
    return QKForm(E, H, D, bias=bias).double()


def loss_fn(y):
    return (y.sin() * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).mean()


def reference_n(form, x, v):
    """Σ_i X′ᵢᵀ Gᵢ X′ᵢ (h, e′, e′) from an independent explicit attention with S.retain_grad()."""
    xa = form.augment(x)
    s = form.tau[:, None, None] * torch.einsum("bse,hed,hfd,btf->bhst", xa, form.w_q, form.w_k, xa)
    s = s.masked_fill(~torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril(), float("-inf"))
    s.retain_grad()
    loss_fn(torch.softmax(s, -1) @ v).backward()
    return torch.einsum("bse,bhst,btf->hef", xa, s.grad, xa)


def capture_pairs(form, x, v, capture, loss_scale=1.0):
    form.capture = capture
    (loss_scale * loss_fn(form.attend(x, v))).backward()
    form.capture = None
    return form.take_captured()


def stats_of(form, pairs, weight=1.0, method="gradient", into=None):
    stats = into if into is not None else FormStats.empty_like(form, method, dtype=F64)
    for xa, gx in pairs:
        stats.update(xa, gx, weight)
    return stats


def captured_stats(form, x, v, capture, weight=1.0, method="gradient", loss_scale=1.0):
    return stats_of(form, capture_pairs(form, x, v, capture, loss_scale), weight, method)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("capture", ["extend", "explicit"])
def test_capture_paths_match_explicit_reference(capture, bias):
    form, (x, v) = make_form(bias), inputs()
    expected = reference_n(form, x, v)
    stats = captured_stats(form, x, v, capture)
    assert torch.allclose(stats.n_sum, expected, rtol=0, atol=1e-10)
    xa = form.augment(x).reshape(-1, form.w_q.shape[1])
    assert torch.allclose(stats.c_sum, xa.T @ xa, rtol=0, atol=1e-10)
    assert stats.instances == B and stats.weight == 1


def test_n_bar_is_the_gradient_of_the_mean_loss():
    """∂L/∂W_Q = τ N̄ W_K and ∂L/∂W_K = τ N̄ᵀ W_Q: the statistics are autograd's gradient w.r.t. M."""
    form, (x, v) = make_form(True), inputs()
    n_bar = captured_stats(form, x, v, "explicit").means().n
    tau = form.tau.detach()[:, None, None]
    assert torch.allclose(form.w_q.grad, tau * n_bar @ form.w_k.detach(), atol=1e-12)
    assert torch.allclose(form.w_k.grad, tau * n_bar.mT @ form.w_q.detach(), atol=1e-12)


def test_accumulation_and_ranks_match_one_big_batch():
    """2 ranks × accumulate 2 × batch 4 (loss ÷ 2, weight ½ per micro-batch, buffers summed) = 1 rank × batch 16."""
    form, (x, v) = make_form(False), inputs(b=16)
    whole = captured_stats(form, x, v, "explicit", method="pinv").means()
    ranks = []
    for rank in range(2):
        acc = FormStats.empty_like(form, "pinv", dtype=F64)
        for micro in range(2):
            part = slice(8 * rank + 4 * micro, 8 * rank + 4 * micro + 4)
            acc = acc + captured_stats(form, x[part], v[part], "extend", weight=0.5, method="pinv", loss_scale=0.5)
        ranks.append(flatten_stats([acc]))
    (reduced,) = unflatten_stats(sum(ranks), [acc])
    for got, want in zip(reduced.means(), whole):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-12)


def test_add_equals_accumulating_both():
    form, (x, v) = make_form(True), inputs()
    both = FormStats.empty_like(form, "pinv", dtype=F64)
    parts = []
    for half in (slice(0, 2), slice(2, 4)):
        pairs = capture_pairs(form, x[half], v[half], "explicit")
        parts.append(stats_of(form, pairs, 0.5, "pinv"))
        stats_of(form, pairs, 0.5, into=both)
    total = parts[0] + parts[1]
    for name in both.names:
        assert torch.allclose(getattr(total, name), getattr(both, name), rtol=0, atol=1e-12)
    assert parts[0].weight == 0.5  # the operands are untouched


def test_flatten_round_trip_and_state_dict():
    forms = [make_form(False, 0), make_form(True, 1)]
    methods = ["pinv", "gradient"]
    stats = [captured_stats(f, *inputs(seed=i), "explicit", method=m) for i, (f, m) in enumerate(zip(forms, methods))]
    flat = flatten_stats(stats)
    assert flat.ndim == 1 and flat.numel() == sum(t.numel() for s in stats for t in s.tensors())
    back = unflatten_stats(flat.clone(), [FormStats.empty_like(f, m, dtype=F64) for f, m in zip(forms, methods)])
    for a, b in zip(stats, back):
        assert a.names == b.names and all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
        c = FormStats.from_state_dict(a.state_dict())
        assert all(torch.equal(x, y) for x, y in zip(a.tensors(), c.tensors()))
    with pytest.raises(ValueError):
        unflatten_stats(flat[:-1], stats)


def test_non_finite_input_raises_and_leaves_sums_untouched():
    form, (x, v) = make_form(False), inputs()
    stats = captured_stats(form, x, v, "explicit")
    before = [t.clone() for t in stats.tensors()]
    gx = torch.zeros(B, H, S, E, dtype=F64)
    gx[1, 2, 3, 4] = float("nan")
    with pytest.raises(NonFiniteStatistics):
        stats.update(x, gx, 1.0)
    gx[1, 2, 3, 4] = float("inf")
    with pytest.raises(NonFiniteStatistics):
        stats.update(x, gx, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, stats.tensors()))
    stats.n_sum[0, 0, 0] = float("nan")  # e.g. another rank's NaN arriving through the all-reduce
    with pytest.raises(NonFiniteStatistics):
        stats.means()


def test_float32_accumulation_is_default():
    form, (x, v) = make_form(False), inputs()
    stats = stats_of(form, capture_pairs(form, x, v, "explicit"), into=FormStats.empty_like(form, "pinv"))
    assert stats.n_sum.dtype == torch.float32 and stats.means().n.dtype == torch.float64


def filled(method="gradient", rcond=1e-6, seed=0):
    form = make_form(False, seed)
    stats = FormStats.empty_like(form, method, dtype=F64, rcond=rcond)
    x, _ = inputs(seed=seed)
    xa = form.augment(x)
    stats.update(xa, torch.randn(B, H, S, xa.shape[-1], generator=torch.Generator().manual_seed(seed), dtype=F64))
    return stats


def test_defaults_and_means_of_the_sums():
    stats = FormStats(H, E)
    assert stats.pinv_sum is None and stats.rcond == 1e-6 and stats.c_sum.dtype == torch.float32
    filled_stats, (x, _) = filled(), inputs()
    xa = make_form(False).augment(x)
    torch.testing.assert_close(filled_stats.means().c, torch.einsum("bse,bsf->ef", xa, xa) / B)  # C̄: per instance


@pytest.mark.parametrize("emptied", ["weight", "instances"])
def test_means_refuse_empty_and_non_finite_sums(emptied):
    stats = filled()
    state = stats.state_dict()
    state[emptied].zero_()  # one count without the other: nothing to divide by
    stats.load_state_dict(state)
    with pytest.raises(ValueError, match="^no statistics were accumulated$"):
        stats.means()
    stats.n_sum[0, 0, 0] = stats.c_sum[0, 0] = float("nan")
    with pytest.raises(NonFiniteStatistics, match="^non-finite values in the summed statistics: c_sum, n_sum$"):
        stats.means()


def test_finite_check_sums_in_float64():
    """Two float32 values near the float32 maximum: finite, though their float32 sum would overflow."""
    stats = FormStats(H, E)
    stats.update(torch.zeros(1, 2, E), torch.zeros(1, H, 2, E))
    stats.c_sum[0, 0] = stats.c_sum[1, 1] = 3e38
    assert stats.means().c[0, 0] == pytest.approx(3e38)


def test_difference_undoes_the_sum_and_mismatches_are_refused():
    a, b = filled(seed=0), filled(seed=1)
    for name, t, expected in zip(a.names, ((a + b) - b).tensors(), a.tensors()):
        torch.testing.assert_close(t, expected, rtol=1e-12, atol=1e-12, msg=name)
    message = "^cannot combine statistics of forms with different shapes or methods$"
    with pytest.raises(ValueError, match=message):
        a + filled("pinv")
    other_width = FormStats.empty_like(QKForm(E + 1, H, D).double(), dtype=F64)
    with pytest.raises(ValueError, match=message):
        a + other_width


def test_state_round_trip_keeps_rcond_and_refuses_other_keys():
    stats = filled("pinv", rcond=1e-3)
    restored = FormStats.from_state_dict(stats.state_dict())
    assert restored.rcond == 1e-3 and restored.names == stats.names
    for t, expected in zip(restored.tensors(), stats.tensors()):
        assert torch.equal(t, expected)
    state = stats.state_dict()
    del state["pinv_sum"]
    message = ("state has ['c_sum', 'instances', 'n_sum', 'rcond', 'weight'], "
               "expected ['c_sum', 'instances', 'n_sum', 'pinv_sum', 'rcond', 'weight']")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        stats.load_state_dict(state)


def test_unflatten_casts_to_the_statistics_dtype_and_checks_the_size():
    like = [FormStats.empty_like(make_form(False), dtype=torch.float32)]
    flat = flatten_stats([filled()])  # float64 sums
    (out,) = unflatten_stats(flat, like)
    assert all(t.dtype == torch.float32 for t in out.tensors())
    with pytest.raises(ValueError, match=f"^buffer has {flat.numel() - 1} values, the statistics need {flat.numel()}$"):
        unflatten_stats(flat[1:], like)


def test_psd_pinv_and_roots_of_singular_and_zero_matrices():
    a = torch.diag(torch.tensor([0.0, 2.0, 4.0], dtype=F64))
    torch.testing.assert_close(psd_pinv(a, 1e-6), torch.diag(torch.tensor([0.0, 0.5, 0.25], dtype=F64)))
    assert torch.equal(psd_pinv(torch.zeros(3, 3, dtype=F64), 1e-6), torch.zeros(3, 3, dtype=F64))
    rank_one = torch.diag(torch.tensor([0.0, 0.0, 4.0], dtype=F64))
    root, inverse_root = psd_sqrt(rank_one, 0.25)  # clamped up to 0.25 · 4 = 1
    torch.testing.assert_close(root, torch.diag(torch.tensor([1.0, 1.0, 2.0], dtype=F64)))
    torch.testing.assert_close(inverse_root, torch.diag(torch.tensor([1.0, 1.0, 0.5], dtype=F64)))
    with pytest.raises(ValueError, match="^cannot whiten with a zero input covariance$"):
        psd_sqrt(torch.zeros(3, 3, dtype=F64), 1e-6)
    small = torch.diag(torch.tensor([0.25, 0.5], dtype=F64))  # λ_max < 1 is no reason to refuse
    torch.testing.assert_close(psd_sqrt(small, 1e-6)[0], small.sqrt())


def test_column_basis_drops_the_columns_below_round_off():
    """The cut-off is max(e, d) · ε · σ_max of each matrix: a σ of 1e-14 is noise beside 1e3, not beside 1."""
    eye = torch.eye(2, dtype=F64)
    loud_and_faint = torch.diag(torch.tensor([1e3, 1e-14], dtype=F64))
    assert torch.equal(column_basis(loud_and_faint).abs(), torch.diag(torch.tensor([1.0, 0.0], dtype=F64)))
    assert torch.equal(column_basis(torch.zeros(3, 2, dtype=F64)), torch.zeros(3, 2, dtype=F64))
    many = torch.diag(torch.tensor([1.0, 1e-14], dtype=F64)).expand(50, 2, 2)  # 50 heads: the head count is no size
    torch.testing.assert_close(column_basis(many).abs(), eye.expand(50, 2, 2), rtol=0, atol=1e-12)
