"""Conversion of Hugging Face attention into growable attention is exact (fp32 logits, greedy generation)."""

from __future__ import annotations

import pytest

from conftest import needs_transformers

needs_transformers()

import torch  # noqa: E402

from lit_growattn.hf import GrowableAttention, make_growable  # noqa: E402
from hf_helpers import VOCAB, load, saved_tiny_model  # noqa: E402

MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]


def _greedy(model, prompt: torch.Tensor) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_conversion_is_exact(tmp_path, model_type, attn):
    folder = saved_tiny_model(model_type, tmp_path)
    native, converted = load(folder, attn_implementation=attn), load(folder, attn_implementation=attn)
    names = make_growable(converted)
    assert len(names) == 2
    for name in names:
        module = converted.get_submodule(name)
        assert isinstance(module, GrowableAttention) and isinstance(module, type(native.get_submodule(name)))
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        delta = (native(ids).logits - converted(ids).logits).abs().max()
    assert delta <= 1e-5
    prompt = ids[:1, :4]
    assert torch.equal(_greedy(native, prompt), _greedy(converted, prompt))


def test_gqa_layout(tmp_path):
    model = load(saved_tiny_model("llama", tmp_path))
    make_growable(model)
    attn = model.model.layers[0].self_attn
    assert attn.w_q.shape == (4, 32, 8) and attn.w_k.shape == (2, 32, 8) and attn.rotary == 8
    assert torch.allclose(attn.tau, torch.full((4,), 8**-0.5))


def test_unsupported_model_type_lists_the_supported(tmp_path):
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    model = AutoModelForCausalLM.from_config(GPTNeoXConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                           num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match="supported model types: gpt2, llama, mistral, qwen2, qwen3"):
        make_growable(model)


def test_converting_twice_is_refused(tmp_path):
    model = load(saved_tiny_model("qwen2", tmp_path))
    make_growable(model)
    with pytest.raises(ValueError, match="converted already"):
        make_growable(model)
