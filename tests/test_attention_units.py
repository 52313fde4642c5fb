"""Small facts of the attention variants that a user sees in the shapes, settings and numbers of a model: per-layer
sizes, biases, GQA value maps, the layout back to nn.Linear, SDPA's padded widths, and which parameters are bias
rows. Fast unit tests, also in the mutation selection (docs/testing.md)."""

import pytest
import torch

from lit_growattn.attention.diff import DiffAttention
from lit_growattn.attention.lowrank_dint import LowRankQK
from lit_growattn.attention.sdpa import FLASH_MAX_WIDTH, FUSED_MULTIPLE, padded_widths
from lit_growattn.attention.value import ValueMap, to_linear
from lit_growattn.model.config import GPTConfig


@pytest.mark.parametrize("bias", [False, True])
def test_diff_attention_takes_each_layers_sizes_and_the_bias_setting(bias):
    cfg = GPTConfig(n_embd=16, n_head=4, n_layer=2, d_head=[3, 5], d_v=[4, 6], attention="diff", bias=bias)
    for layer, (d, d_v) in enumerate([(3, 4), (5, 6)]):
        attn = DiffAttention(cfg, layer)
        assert [f.d_head for f in attn.qk_forms()] == [d, d] and [f.bias for f in attn.qk_forms()] == [bias, bias]
        assert attn.value.d_v == 2 * d_v and attn.value.bias == bias
        assert [p.shape for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2)] == [(d_v,)] * 4


def test_a_grouped_value_maps_matrix_is_each_heads_own_product():
    torch.manual_seed(0)
    values = ValueMap(6, n_head=4, d_v=3, n_kv_head=2).double()
    with torch.no_grad():
        values.w_v.normal_(), values.w_o.normal_()
    expected = torch.stack([values.w_v[j // 2] @ values.w_o[j] for j in range(4)])
    torch.testing.assert_close(values.matrix(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_to_linear_gives_a_value_bias_only_where_there_is_one(bias):
    torch.manual_seed(0)
    values = ValueMap(6, n_head=2, d_v=3, bias=bias)
    v_weight, v_bias, o_weight, _ = to_linear(values)
    assert v_weight.shape == (2 * 3, 6) and o_weight.shape == (6, 2 * 3)
    if bias:
        assert torch.equal(v_bias, values.w_v[:, -1].reshape(-1).detach())
    else:
        assert v_bias is None


def test_padded_widths_are_multiples_of_8_and_common_up_to_flashs_limit():
    assert FUSED_MULTIPLE == 8
    assert padded_widths(3, 5) == (8, 8) and padded_widths(9, 2) == (16, 16) and padded_widths(16, 16) == (16, 16)
    wide = FLASH_MAX_WIDTH + 1
    assert padded_widths(wide, 3) == (-(-wide // 8) * 8, 8)
    assert all(isinstance(w, int) for w in padded_widths(wide, 3))


@pytest.mark.parametrize("bias", [False, True])
def test_low_rank_forms_name_their_down_projections_as_bias_rows_only_with_a_bias(bias):
    form = LowRankQK(16, 2, 4, rank=2, bias=bias, d2_ratio=0.5)
    assert form.bias_row_parameters() == ([form.down_q, form.down_k] if bias else [])


@pytest.mark.parametrize("bias", [False, True])
def test_dint_attention_gives_both_of_its_forms_the_bias_setting(bias):
    from lit_growattn.attention.dint import DintAttention

    attn = DintAttention(GPTConfig(n_embd=16, n_head=2, n_layer=1, d_head=3, attention="dint", bias=bias), 0)
    assert [f.bias for f in attn.qk_forms()] == [bias, bias] and [f.d_head for f in attn.qk_forms()] == [3, 3]


def test_dint_attention_takes_each_layers_value_size():
    from lit_growattn.attention.dint import DintAttention

    cfg = GPTConfig(n_embd=16, n_head=2, n_layer=2, d_head=3, d_v=[4, 6], attention="dint")
    assert [DintAttention(cfg, layer).value.d_v for layer in (0, 1)] == [4, 6]


@pytest.mark.parametrize("bias", [False, True])
def test_low_rank_dint_takes_a_rank_up_to_its_input_size_and_names_the_bound(bias):
    from lit_growattn.attention.lowrank_dint import LowRankDintAttention

    cfg = GPTConfig(n_embd=8, n_head=2, n_layer=1, d_head=3, attention="lowrank_dint", bias=bias)
    e_in = 8 + bias
    assert LowRankDintAttention(cfg, 0, rank=e_in).qk_forms()[0].d_head == 3  # the largest rank that adds rank
    with pytest.raises(ValueError) as refused:
        LowRankDintAttention(cfg, 0, rank=e_in + 1)
    assert str(refused.value) == (
        f"lowrank_dint rank={e_in + 1} exceeds n_embd{' + 1 (bias)' if bias else ''} = {e_in}: the second map's form "
        "has rank ≤ min(rank, n_embd, d_head) and d_head never exceeds n_embd, so a larger rank adds parameters, never "
        f"rank; use rank ≤ {e_in}")
    for rank, d2_ratio in [(0, 0.5), (2, 0.0), (2, -1.0)]:
        with pytest.raises(ValueError, match=f"needs rank ≥ 1 and d2_ratio > 0, got rank={rank}, d2_ratio={d2_ratio}$"):
            LowRankDintAttention(cfg, 0, rank=rank, d2_ratio=d2_ratio)


def test_bad_attention_names_and_widths_are_refused_with_the_whole_message():
    from lit_growattn.attention.registry import ATTENTIONS, attention_class
    from lit_growattn.attention.sdpa import causal_attention

    with pytest.raises(ValueError) as error:
        attention_class("nope")
    assert str(error.value) == (
        f"unknown attention 'nope'; registered attentions: {', '.join(sorted(ATTENTIONS))} (a new variant registers "
        "with lit_growattn.attention.register_attention; from the command line, import its module with "
        "`extensions: [module]`)")
    q, k = torch.zeros(1, 2, 5, 3), torch.zeros(1, 2, 5, 4)  # (b, h, s, d): widths 3 and 4, 5 positions
    with pytest.raises(ValueError) as error:
        causal_attention(q, k, torch.zeros(1, 2, 5, 4))
    assert str(error.value) == "queries and keys must have the same width, got 3 and 4"
