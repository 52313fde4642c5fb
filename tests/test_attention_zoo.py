import math

import pytest
import torch

from lit_growattn.attention import ATTENTIONS
from lit_growattn.attention.diff import DiffAttention
from lit_growattn.attention.dint import DintAttention
from lit_growattn.attention.lowrank_dint import LowRankDintAttention
from lit_growattn.attention.mha import MultiHeadAttention
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT
from lit_growattn.module import GrowAttentionLM

from conftest import reference_output, reference_values, required_args

def augmented(x, bias):
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1) if bias else x


def causal_mask(s, dtype):
    return torch.full((s, s), float("-inf"), dtype=dtype).triu(1)


def softmax_map(tau, q, k):
    """softmax(τ·QKᵀ + causal mask) for one head, q, k (b, s, d)."""
    return torch.softmax(tau * q @ k.transpose(-1, -2) + causal_mask(q.shape[1], q.dtype), dim=-1)


def form_map(form, x, j):
    xa = augmented(x, form.bias)
    return softmax_map(form.log_tau[j].exp(), xa @ form.w_q[j], xa @ form.w_k[j])


def lowrank_map(m, x, j):
    xa = augmented(x, m.bias)
    return softmax_map(m.log_tau[j].exp(), xa @ m.down_q[j] @ m.up_q[j], xa @ m.down_k[j] @ m.up_k[j])


def reference_diff(attn, x, layer_idx):
    b, s, _ = x.shape
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
    lam = (
        torch.exp((attn.lambda_q1 * attn.lambda_k1).sum())
        - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
        + lam_init
    )
    v = reference_values(attn.value, x)
    heads = []
    for j in range(attn.value.n_head):
        y = (form_map(attn.qk, x, j) - lam * form_map(attn.qk2, x, j)) @ v[:, :, j]
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.norm.weight
        heads.append(y * (1 - lam_init))
    return reference_output(attn.value, heads)


def reference_dint(attn, x, second_map):
    """(λ·A3 + A1 − λ·A2)·V, A3 row i = mean of A1 rows ≤ i, written with explicit maps."""
    b, s, _ = x.shape
    running_mean = torch.ones(s, s, dtype=x.dtype).tril() / torch.arange(1, s + 1, dtype=x.dtype)[:, None]
    v = reference_values(attn.value, x)
    heads = []
    for j in range(attn.value.n_head):
        a1, a2 = form_map(attn.qk, x, j), second_map(attn.qk2, x, j)
        lam = attn.lam[j]
        heads.append((lam * running_mean @ a1 + a1 - lam * a2) @ v[:, :, j])
    return reference_output(attn.value, heads)


@pytest.mark.parametrize("bias", [False, True])
def test_diff_matches_explicit_reference(bias):
    torch.manual_seed(0)
    attn = DiffAttention(GPTConfig(n_embd=24, n_head=4, d_head=5, d_v=3, bias=bias), layer_idx=3).double()
    with torch.no_grad():
        attn.norm.weight.uniform_(0.5, 1.5)  # a non-trivial gain
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    torch.testing.assert_close(attn(x), reference_diff(attn, x, layer_idx=3), atol=1e-10, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_dint_matches_explicit_reference(bias):
    torch.manual_seed(0)
    attn = DintAttention(GPTConfig(n_embd=24, n_head=3, d_head=5, d_v=4, bias=bias), layer_idx=1).double()
    with torch.no_grad():
        attn.lam.uniform_(-1, 1)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    torch.testing.assert_close(attn(x), reference_dint(attn, x, form_map), atol=1e-10, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_lowrank_dint_matches_explicit_reference(bias):
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=24, n_head=3, d_head=5, d_v=4, bias=bias)
    attn = LowRankDintAttention(cfg, layer_idx=1, rank=2).double()
    with torch.no_grad():
        attn.lam.uniform_(-1, 1)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    torch.testing.assert_close(attn(x), reference_dint(attn, x, lowrank_map), atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_future_tokens_never_change_earlier_outputs(name):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_embd=32, n_head=4, d_head=3, bias=True,
                    attention=name, attention_args=required_args(name))
    model = GPT(cfg).double()
    idx = torch.randint(0, 50, (1, 16))
    changed = idx.clone()
    changed[0, 9:] = (changed[0, 9:] + 1) % 50
    torch.testing.assert_close(model(idx)[:, :9], model(changed)[:, :9], atol=1e-12, rtol=0)
    assert not torch.allclose(model(idx)[:, 9:], model(changed)[:, 9:])


@pytest.mark.parametrize("name, forms, heads", [("diff", 2, 2), ("dint", 2, 4), ("lowrank_dint", 1, 4)])
def test_growable_forms_share_d_head_and_capture_statistics(name, forms, heads):
    """Every growable map goes through QKForm.attend, so growth statistics are captured for each of them."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=16, n_head=4, d_head=[3, 5], n_layer=2, attention=name, attention_args=required_args(name))
    attn = ATTENTIONS[name](cfg, 1, **cfg.attention_args).double()
    assert len(attn.qk_forms()) == forms
    assert all(f.d_head == 5 and f.n_head == heads for f in attn.qk_forms())
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    captured = {}
    for mode in ("extend", "explicit"):
        for form in attn.qk_forms():
            form.capture = mode
        attn(x).pow(2).sum().backward()
        captured[mode] = [form.take_captured() for form in attn.qk_forms()]
    for extended, explicit in zip(captured["extend"], captured["explicit"]):
        assert len(extended) == len(explicit) == 1
        torch.testing.assert_close(extended[0][1], explicit[0][1], atol=1e-10, rtol=0)
        assert extended[0][1].abs().sum() > 0


def test_diff_has_the_parameter_count_of_mha_apart_from_lambda_and_norm():
    cfg = GPTConfig(n_embd=32, n_head=4, d_head=6)
    diff, mha = DiffAttention(cfg, 0), MultiHeadAttention(cfg, 0)
    extra = {"lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "norm.weight"}
    shared = sum(p.numel() for n, p in diff.named_parameters() if n not in extra)
    assert shared == sum(p.numel() for p in mha.parameters())
    torch.testing.assert_close(diff.lam, diff.lam.new_tensor(0.2), atol=0.2, rtol=0)  # λ_init(0) = 0.2, vectors small


def test_diff_needs_an_even_number_of_heads():
    with pytest.raises(ValueError, match="n_head must be even, got 3"):
        GPT(GPTConfig(n_embd=24, n_head=3, attention="diff"))


def test_dint_lambda_starts_at_the_diff_schedule_and_is_configurable():
    cfg = GPTConfig(n_embd=16, n_head=2, d_head=4)
    torch.testing.assert_close(DintAttention(cfg, 2).lam, torch.full((2,), 0.8 - 0.6 * math.exp(-0.6)))
    torch.testing.assert_close(LowRankDintAttention(cfg, 2, rank=1, lambda_init=0.0).lam, torch.zeros(2))


@pytest.mark.parametrize("d2_ratio", [1 / 9, 1 / 81, 1.0])
def test_lowrank_score_variance_follows_d2(d2_ratio):
    """At init, Var(scores of map 2) / Var(scores of map 1) = (1/9) / d2_ratio: equal for d2 = d/9.
    256 heads × 528 causal pairs of tokens: the ratio's spread over seeds is about 3 %; tolerance 15 %."""
    torch.manual_seed(0)
    d = 8
    attn = LowRankDintAttention(GPTConfig(n_embd=256, n_head=256, d_head=d), 0, rank=4, d2_ratio=d2_ratio)
    torch.testing.assert_close(attn.qk2.log_tau.exp(), torch.full((256,), 1 / math.sqrt(d * d2_ratio)))
    x = torch.randn(2, 32, 256)
    s1, s2 = attn.qk.scores(x), attn.qk2.scores(x)
    kept = torch.isfinite(s1)
    ratio = (s2[kept].var() / s1[kept].var()).item()
    assert ratio == pytest.approx((1 / 9) / d2_ratio, rel=0.15)


def test_lowrank_dint_loads_checkpoints_of_grown_layers():
    """After growth the hparams record the new d_head; the second map keeps the width it was built with."""
    torch.manual_seed(0)
    args = dict(n_layer=2, n_embd=16, n_head=2, block_size=8, attention="lowrank_dint", attention_args={"rank": 2})
    saved = GrowAttentionLM(d_head=[3, 4], **args)
    with torch.no_grad():
        saved.model.blocks[0].attn.lam.fill_(0.3)
    grown = GrowAttentionLM(d_head=[6, 4], **args)
    grown.load_state_dict(saved.state_dict())
    idx = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(grown(idx), saved(idx))


def test_lowrank_dint_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank ≥ 1 and d2_ratio > 0"):
        GPT(GPTConfig(n_embd=16, n_head=2, attention="lowrank_dint", attention_args={"rank": 0}))
