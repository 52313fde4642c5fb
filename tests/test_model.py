import math

import pytest
import torch

from lit_growattn.attention import QKForm
from lit_growattn.attention.mha import MultiHeadAttention
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT
from lit_growattn.module import GrowAttentionLM

from conftest import reference_output, reference_values


def reference_mha(attn: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """softmax(τ·QKᵀ + causal mask)·V written out with explicit per-head loops."""
    b, s, e = x.shape
    form = attn.qk
    xa = torch.cat([x, torch.ones(b, s, 1, dtype=x.dtype)], -1) if form.bias else x
    v = reference_values(attn.value, x)
    mask = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)
    heads = []
    for j in range(form.n_head):
        q, k = xa @ form.w_q[j], xa @ form.w_k[j]
        a = torch.softmax(form.log_tau[j].exp() * q @ k.transpose(-1, -2) + mask, dim=-1)
        heads.append(a @ v[:, :, j])
    return reference_output(attn.value, heads)


@pytest.mark.parametrize("bias", [False, True])
def test_mha_matches_explicit_reference(bias):
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=24, n_head=3, d_head=5, d_v=7, bias=bias)
    attn = MultiHeadAttention(cfg, 0).double()
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    torch.testing.assert_close(attn(x), reference_mha(attn, x), atol=1e-10, rtol=0)


def test_temperature_initialised_per_head_and_receives_gradient():
    torch.manual_seed(0)
    attn = MultiHeadAttention(GPTConfig(n_embd=16, n_head=2, d_head=4), 0)
    torch.testing.assert_close(attn.qk.tau, torch.full((2,), 1 / math.sqrt(4)))
    attn(torch.randn(2, 6, 16)).pow(2).sum().backward()
    assert attn.qk.log_tau.grad is not None and (attn.qk.log_tau.grad.abs() > 0).all()


def test_future_tokens_never_change_earlier_outputs():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_embd=32, n_head=4, d_head=3, bias=True)).double()
    idx = torch.randint(0, 50, (1, 16))
    changed = idx.clone()
    changed[0, 9:] = (changed[0, 9:] + 1) % 50
    torch.testing.assert_close(model(idx)[:, :9], model(changed)[:, :9], atol=1e-12, rtol=0)
    assert not torch.allclose(model(idx)[:, 9:], model(changed)[:, 9:])


def test_per_layer_head_sizes_and_resize_for_grown_checkpoints():
    module = GrowAttentionLM(n_layer=2, n_embd=32, n_head=4, d_head=[2, 4], block_size=8)
    assert module.model.head_sizes() == [2, 4]
    grown = GrowAttentionLM(n_layer=2, n_embd=32, n_head=4, d_head=[6, 4], block_size=8)
    module.load_state_dict(grown.state_dict())
    assert module.model.head_sizes() == [6, 4]
    idx = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(module(idx), grown(idx))


def test_flops_count_the_weights_and_every_softmax_map_grown_or_not():
    seq_len, n_layer, n_head, d_head, d_v = 16, 2, 4, 3, 8

    def attention_flops(attention, **args):
        cfg = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=32, d_head=d_head, d_v=d_v, block_size=seq_len,
                        attention=attention, attention_args=args)
        model = GPT(cfg)
        weights = sum(p.numel() for name, p in model.named_parameters() if name != "wpe.weight")
        return model.flops_per_token(seq_len) - 6 * weights

    # Per layer and query: scores q·k over (s+1)/2 keys on average, then the same for the values; × 3 for training.
    one_map = n_layer * 3 * (seq_len + 1) * (n_head * d_head + n_head * d_v)
    assert attention_flops("mha") == one_map
    assert attention_flops("dint") == 2 * one_map
    assert attention_flops("lowrank_dint", rank=2) == 2 * one_map  # its low-rank map does not grow, it still costs


def test_weight_decay_never_on_temperatures():
    module = GrowAttentionLM(n_layer=1, n_embd=16, n_head=2, d_head=2, bias=True)
    decay, no_decay = module.parameter_groups()
    taus = {id(f.log_tau) for forms in module.model.qk_forms() for f in forms}
    assert taus <= {id(p) for p in no_decay["params"]}
    assert not taus & {id(p) for p in decay["params"]}
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention="nope"), r"unknown attention 'nope'; registered attentions: .*mha"),
        (dict(d_head=0), "d_head must be positive"),
        (dict(d_head=[4]), "d_head has 1 entries but n_layer is 2"),
        (dict(n_head=0), "n_head must be positive"),
        (dict(n_embd=30, n_head=4), "not divisible by n_head"),
        (dict(dropout=1.0), "dropout must be in"),
    ],
)
def test_bad_model_config_fails_with_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GrowAttentionLM(**{"n_layer": 2, **kwargs})


def test_qkform_rejects_nonpositive_sizes():
    with pytest.raises(ValueError, match="must be positive"):
        QKForm(8, 2, 0)


def test_explicit_capture_after_an_inference_mode_evaluation_at_the_same_length():
    # Lightning validates under inference_mode; the causal mask cached there must still serve a training step.
    form = QKForm(n_embd=8, n_head=2, d_head=3)
    x, v = torch.randn(2, 13, 8), torch.randn(2, 2, 13, 4)
    with torch.inference_mode():
        form.scores(x)
    form.capture = "explicit"
    form.attend(x, v).sum().backward()
    ((xa, gx),) = form.take_captured()
    assert gx.shape == (2, 2, 13, 8) and form.w_q.grad is not None
