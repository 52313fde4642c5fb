"""Conversion of Hugging Face attention into growable attention is exact (fp32 logits, greedy generation), GPT-2's
attention dropout and caches included, and hands the attention kernel what the native attention does; a growable
model pickles (its generated classes are found by name); GPT-2 cross-attention is refused."""

from __future__ import annotations

import pytest

from conftest import needs_transformers

needs_transformers()

import torch  # noqa: E402

from lit_growattn.hf import GrowableAttention, make_growable  # noqa: E402
from hf_helpers import VOCAB, load, saved_tiny_model, tiny_config  # noqa: E402

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


def _gpt2_with_attention_dropout(tmp_path):
    """A tiny GPT-2 folder whose only dropout is the attention's (attn_pdrop 0.3)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("gpt2")
    config.attn_pdrop = 0.3
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gpt2_attention_dropout_is_the_native_ones_in_training_and_off_in_eval(tmp_path, attn):
    folder = _gpt2_with_attention_dropout(tmp_path)
    native, converted = load(folder, attn_implementation=attn), load(folder, attn_implementation=attn)
    make_growable(converted)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        evaluated = native(ids).logits
        torch.testing.assert_close(converted(ids).logits, evaluated, rtol=0, atol=1e-5)
        logits = []
        for model in (native.train(), converted.train()):
            torch.manual_seed(5)  # the same dropout masks
            logits.append(model(ids).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
    assert (logits[0] - evaluated).abs().max() > 1e-2  # dropped out


def test_gpt2_continues_from_an_encoder_decoder_cache_as_the_native_one(tmp_path):
    """transformers' GPT-2 takes its self-attention cache out of an EncoderDecoderCache; so does the growable one."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    folder = saved_tiny_model("gpt2", tmp_path)
    native, converted = load(folder), load(folder)
    make_growable(converted)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = []
    with torch.no_grad():
        for model in (native, converted):
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            model(ids[:, :8], past_key_values=cache, use_cache=True)
            logits.append(model(ids[:, 8:], past_key_values=cache, use_cache=True).logits)
            assert cache.self_attention_cache.get_seq_length() == 12
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_the_attention_kernel_gets_the_keyword_arguments_the_native_attention_gives_it(tmp_path, model_type,
                                                                                      monkeypatch):
    """A kernel registered with transformers (flash kernels read position_ids, for packed sequences) is called with
    what the native attention passes it; Llama's growable attention adds the sliding window (None) it reads."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def recording(module, q, k, v, mask, **kwargs):
        seen.append(sorted(kwargs))
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "recording", recording)
    folder = saved_tiny_model(model_type, tmp_path)
    native, converted = load(folder, attn_implementation="recording"), load(folder, attn_implementation="recording")
    make_growable(converted)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        calls = []
        for model in (native, converted):
            seen.clear()
            model(ids)
            calls.append(seen[0])
    window = ["sliding_window"] if model_type == "llama" else []
    assert calls == [["dropout", "position_ids", "scaling", "use_cache"],
                     sorted(["dropout", "position_ids", "scaling", "use_cache", *window])]


def test_gpt2_cross_attention_is_refused():
    from transformers import AutoModelForCausalLM

    config = tiny_config("gpt2")
    config.add_cross_attention = True
    with pytest.raises(ValueError) as error:
        make_growable(AutoModelForCausalLM.from_config(config))
    assert str(error.value) == "GPT-2 cross-attention is not supported; only causal self-attention grows"
    # Called as cross-attention, the converted self-attention of a GPT-2 without it refuses too.
    model = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    make_growable(model)
    x = torch.zeros(1, 4, 32)
    with pytest.raises(ValueError) as error:
        model.transformer.h[0].attn(x, encoder_hidden_states=x)
    assert str(error.value) == "growable GPT-2 attention is causal self-attention only"


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_growable_model_pickles(tmp_path, model_type):
    """Pickling (ddp_spawn, torch.save of a whole model) finds the generated attention class by name in its module."""
    import pickle

    model = load(saved_tiny_model(model_type, tmp_path))
    make_growable(model)
    copy = pickle.loads(pickle.dumps(model))
    attention = next(name for name, m in model.named_modules() if isinstance(m, GrowableAttention))
    assert type(copy.get_submodule(attention)) is type(model.get_submodule(attention))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, model(ids).logits)


def test_every_growable_class_is_found_by_name_and_other_names_are_not():
    """Also in a process that has not made the class yet (one that unpickles a model): the module makes it."""
    import lit_growattn.hf.growable as growable
    from lit_growattn.hf.surgery import NATIVE_ATTENTION, native_attention_class

    for native in map(native_attention_class, NATIVE_ATTENTION):
        found = getattr(growable, f"Growable{native.__name__}")
        assert found is growable.growable_class(native) and found.__bases__[-1] is native
    with pytest.raises(AttributeError) as error:
        growable.GrowableBertAttention  # noqa: B018
    assert str(error.value) == "GrowableBertAttention"
