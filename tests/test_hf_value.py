"""Value growth on Hugging Face models (docs/value.md): the growable attention's value map (W_V per KV head, W_O per
query head) keeps the function at α = 0, captures A·X′ as an explicit softmax map gives it, loads state dicts and
growattn folders of the former v_proj/o_proj layout exactly, exports natively or as growattn_<type> with
v_head_sizes (growth through `python -m lit_growattn fit` with growth.grow: both: tests/test_hf_fit.py)."""

from __future__ import annotations

import json

import pytest

from conftest import needs_transformers

needs_transformers()

import torch  # noqa: E402
import yaml  # noqa: E402

import lit_growattn.hf  # noqa: E402, F401  (registers the grown model types)
from hf_helpers import VOCAB, load, same_model, saved_tiny_model, tiny_config  # noqa: E402
from lit_growattn.attention.value import to_linear  # noqa: E402
from lit_growattn.growth.value import ValueGrowth, ValueStats  # noqa: E402
from lit_growattn.hf import HFCausalLM, make_growable  # noqa: E402
from lit_growattn.hf.export import export  # noqa: E402

TYPES = ["llama", "qwen2", "qwen3", "mistral", "gpt2"]


def _attention(model) -> list:
    return [m for m in model.modules() if isinstance(m, lit_growattn.hf.GrowableAttention)]


def _growable(tmp_path, model_type: str, **kwargs):
    model = load(saved_tiny_model(model_type, tmp_path / "src"), **kwargs).double()
    make_growable(model)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 14), generator=torch.Generator().manual_seed(2))


def _loss(model, ids) -> torch.Tensor:
    logits = model(ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("model_type", TYPES)
def test_value_growth_at_alpha_zero_keeps_the_logits(tmp_path, model_type):
    model, ids = _growable(tmp_path, model_type), _ids()
    with torch.no_grad():
        before = model(ids).logits
    values = [attn.value for attn in _attention(model)]
    for v in values:
        v.capture = True
    _loss(model, ids).backward()
    for v in values:
        v.capture = None
        stats = ValueStats.empty_like(v, dtype=torch.float64)
        for p, g_y in v.take_captured():
            stats.update(p, g_y)
        d_v = v.d_v
        ValueGrowth.from_values(v, stats.means(), "natural").grow(0.0, d_v + 3).install(v)
        # GQA (4 query heads, 2 KV heads; GPT-2 has none): one new V column per group, live, one zero O row per head.
        assert v.w_v.shape[:1] == (2 if model_type != "gpt2" else 4,) and v.w_o.shape[:2] == (4, d_v + 3)
        assert v.w_v[..., d_v:].abs().amax() > 0 and not v.w_o[:, d_v:].any()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-10, rtol=0)


@pytest.mark.parametrize("qk_capture", [None, "extend", "explicit"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_captured_attention_of_the_input_is_the_softmax_map_applied_to_it(tmp_path, model_type, qk_capture):
    """The reference A_j = softmax(q_j k_g(j)ᵀ, causal), written out in float64 from the queries and keys the
    attention computes, and G_Y the gradient of the attention's output; the capture (through sdpa, beside the query/key side's) leaves logits and gradients as
    they were."""
    model, ids = _growable(tmp_path, model_type), _ids()
    plain = _loss(model, ids)
    plain.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    seen, outputs = {}, {}
    for i, attn in enumerate(_attention(model)):
        def keep_output(module, args, out, i=i):
            out[0].retain_grad()
            outputs[i] = out[0]
        attn.register_forward_hook(keep_output)
        def spy(x, q, k, *args, i=i, attend=attn.attend, **kwargs):
            seen[i] = x, q, k
            return attend(x, q, k, *args, **kwargs)
        attn.attend = spy
        attn.capture, attn.value.capture = qk_capture, True
    captured = _loss(model, ids)
    captured.backward()
    torch.testing.assert_close(captured, plain, atol=1e-12, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-12, rtol=0)
    for i, attn in enumerate(_attention(model)):
        ((p, g_y),) = attn.value.take_captured()
        x, q, k = seen[i]
        k = k.repeat_interleave(attn.n_head // attn.n_kv_head, 1)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        a = torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf")), -1)
        xa = torch.cat([x, torch.ones_like(x[..., :1])], -1) if attn.value.bias else x
        torch.testing.assert_close(p, a @ xa.unsqueeze(1), atol=1e-12, rtol=0)
        torch.testing.assert_close(g_y, outputs[i].grad, atol=0, rtol=0)  # ∂L/∂Y of the attention's output


def _former_layout(state_dict: dict, model_type: str) -> dict:
    """`state_dict` as the attention stored it before the value map: v_proj/o_proj Linear modules (GPT-2: a
    v_proj Linear and the Conv1D c_proj, weight (in, out))."""
    old = dict(state_dict)
    for key in [k for k in state_dict if k.endswith("value.w_v")]:
        prefix = key.removesuffix("value.w_v")
        w_v, w_o = old.pop(key), old.pop(f"{prefix}value.w_o")
        o_bias = old.pop(f"{prefix}value.o_bias", None)
        bias = w_v.shape[1] == w_o.shape[2] + 1
        holder = type("Holder", (), dict(w_v=w_v, w_o=w_o, o_bias=o_bias, bias=bias, e_in=w_v.shape[1],
                                          e_out=w_o.shape[2]))
        v_weight, v_bias, o_weight, o_bias = to_linear(holder)
        o_name, o_weight = ("c_proj", o_weight.T) if model_type == "gpt2" else ("o_proj", o_weight)
        old |= {f"{prefix}v_proj.weight": v_weight, f"{prefix}{o_name}.weight": o_weight}
        old |= {f"{prefix}v_proj.bias": v_bias} if v_bias is not None else {}
        old |= {f"{prefix}{o_name}.bias": o_bias} if o_bias is not None else {}
    return old


@pytest.mark.parametrize("model_type, settings", [("llama", {"attention_bias": True}), ("qwen2", {}), ("gpt2", {})])
def test_a_state_dict_of_the_former_layout_loads_exactly(model_type, settings):
    torch.manual_seed(0)
    trained = HFCausalLM(config={**tiny_config(model_type).to_dict(), **settings})
    state = trained.state_dict()
    assert any(k.endswith("value.o_bias") for k in state) == (model_type != "qwen2")  # Qwen2: a v bias, no o bias
    old = _former_layout(state, model_type)
    assert not any(".value." in k for k in old)
    torch.manual_seed(1)
    fresh = HFCausalLM(config={**tiny_config(model_type).to_dict(), **settings})
    fresh.load_state_dict(old)
    assert fresh.state_dict().keys() == state.keys()
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())


@torch.no_grad()
def _widen_values(model, by: int) -> None:
    """`by` random value columns per KV head and O rows per query head (by = 0: new values in the same width)."""
    gen = torch.Generator().manual_seed(3)
    for attn in _attention(model):
        v = attn.value
        w_v = torch.cat([v.w_v, torch.randn(*v.w_v.shape[:2], by, generator=gen, dtype=v.w_v.dtype)], -1)
        w_o = torch.cat([v.w_o, torch.randn(v.n_head, by, v.e_out, generator=gen, dtype=v.w_o.dtype) * 0.2], 1)
        v.set_weights(w_v + 0.1 * torch.randn(w_v.shape, generator=gen, dtype=w_v.dtype), w_o)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_grown_value_width_exports_and_loads_back(tmp_path, model_type):
    model = _growable(tmp_path, model_type).float()
    _widen_values(model, by=3)
    assert export(model, tmp_path / "out") == f"growattn_{model_type}"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["v_head_sizes"] == [11, 11] and config["qk_head_sizes"] == [8, 8]
    loaded = load(tmp_path / "out")
    assert [a.value.d_v for a in _attention(loaded)] == [11, 11]
    same_model(model.eval(), loaded)


@pytest.mark.parametrize("model_type, settings", [("llama", {"attention_bias": True}), ("qwen2", {}), ("gpt2", {})])
def test_value_maps_of_the_original_width_export_natively(tmp_path, model_type, settings):
    torch.manual_seed(0)
    model = HFCausalLM(config={**tiny_config(model_type).to_dict(), **settings}).model.eval()
    _widen_values(model, by=0)
    assert export(model, tmp_path / "out") == model_type
    loaded = load(tmp_path / "out")
    assert not type(loaded).__name__.startswith("GrowAttn")
    same_model(model, loaded)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_growattn_folder_of_the_former_layout_loads_exactly(tmp_path, model_type):
    """A grown folder written before the value map: v_proj/o_proj (c_proj) tensors, no v_head_sizes."""
    from safetensors.torch import load_file, save_file

    model = _growable(tmp_path, model_type).float()
    for attn in _attention(model):
        attn.resize(attn.d_head + 2)
    assert export(model, tmp_path / "out") == f"growattn_{model_type}"
    (weights,) = (tmp_path / "out").glob("*.safetensors")
    save_file({k: v.contiguous() for k, v in _former_layout(load_file(weights), model_type).items()}, weights,
              metadata={"format": "pt"})
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    del config["v_head_sizes"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    same_model(model.eval(), load(tmp_path / "out"))


def test_a_growattn_folder_of_the_former_layout_without_safetensors_weights_is_named(tmp_path):
    """The former layout's weights are rewritten from .safetensors files; a folder saved otherwise (e.g. with
    safe_serialization=False) is named, with the fix."""
    model = _growable(tmp_path, "llama").float()
    for attn in _attention(model):
        attn.resize(attn.d_head + 2)
    out = tmp_path / "out"
    export(model, out)
    config = json.loads((out / "config.json").read_text())
    del config["v_head_sizes"]
    (out / "config.json").write_text(json.dumps(config))
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(FileNotFoundError) as error:
        load(out)
    assert str(error.value) == f"{out} has no .safetensors weights; save the model again with save_pretrained"


def test_resuming_the_optimizer_of_a_former_layout_checkpoint_is_refused_with_the_fix():
    from types import SimpleNamespace

    module = HFCausalLM(config=tiny_config("llama").to_dict())
    old = {"state_dict": _former_layout(module.state_dict(), "llama")}
    module.on_load_checkpoint(old)  # loading its weights (init_from, load_from_checkpoint) is fine
    module._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"))
    with pytest.raises(ValueError) as error:
        module.on_load_checkpoint(old)
    assert str(error.value) == (
        "this checkpoint stores the attention's value and output projections as the modules v_proj and o_proj "
        "(GPT-2: c_proj), which this version keeps per head (W_V, W_O) so that the value side can grow: its weights "
        "load, but its optimizer state cannot resume. Continue from its weights with "
        "`--model.init_args.init_from=<ckpt>` (a new optimizer), or resume it with the version that wrote it")
    native = HFCausalLM(config=tiny_config("llama").to_dict(), growable=False)  # its own v_proj: resumes
    native._trainer = module._trainer
    native.on_load_checkpoint({"state_dict": native.state_dict()})


@pytest.mark.parametrize("sizes, named", [(dict(head_sizes=[8, 8]), "head_sizes"),
                                          (dict(v_head_sizes=[8, 8]), "v_head_sizes"),
                                          (dict(head_sizes=[8, 8], v_head_sizes=[8, 8]), "head_sizes and v_head_sizes")])
def test_head_sizes_without_growable_attention_are_refused_naming_the_fix(sizes, named):
    with pytest.raises(ValueError, match=f"^{named} size growable attention, but growable=false keeps the model's own "
                                         f"attention: set growable=true"):
        HFCausalLM(config=tiny_config("llama").to_dict(), growable=False, **sizes)
