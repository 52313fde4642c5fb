"""Growth of converted Hugging Face attention (float64): function kept at α = 0, first-order prediction at small α,
shared K columns per GQA group, rotary columns untouched. Statistics capture leaves the forward as it is (dropout,
bfloat16, autocast); a checkpoint of narrower heads loads; weight decay spares the query/key bias row."""

from __future__ import annotations

import pytest

from conftest import needs_transformers

needs_transformers()

import torch  # noqa: E402

from hf_helpers import VOCAB, load, saved_tiny_model, tiny_config  # noqa: E402
from lit_growattn.growth import FormStats  # noqa: E402
from lit_growattn.growth.grouped import GroupedGrowth, growth_for, refused_mode  # noqa: E402
from lit_growattn.hf import make_growable  # noqa: E402


def _model_and_batch(tmp_path, model_type: str):
    model = load(saved_tiny_model(model_type, tmp_path)).double()
    make_growable(model)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    return model, ids


def _forms(model):
    return [layer.self_attn if hasattr(layer, "self_attn") else layer.attn
            for layer in (model.model.layers if hasattr(model, "model") else model.transformer.h)]


def _loss(model, ids) -> torch.Tensor:
    # Not the model's own loss: transformers' ForCausalLMLoss upcasts to float32, which would hide float64 effects.
    logits = model(ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _growths(model, ids, method="natural", capture="extend", **kwargs):
    forms = _forms(model)
    for f in forms:
        f.capture = capture
    _loss(model, ids).backward()
    growths = []
    for f in forms:
        f.capture = None
        stats = FormStats.empty_like(f, method, dtype=torch.float64)
        for xa, gx in f.take_captured():
            stats.update(xa, gx)
        growths.append(growth_for(f, stats.means(), method, **kwargs))
    model.zero_grad()
    return forms, growths


def _install(forms, grown):
    for f, g in zip(forms, grown):
        f.set_weights(g.w_q, g.w_k, g.log_tau)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
def test_alpha_zero_keeps_logits(tmp_path, model_type):
    model, ids = _model_and_batch(tmp_path, model_type)
    with torch.no_grad():
        before = model(ids).logits
    forms, growths = _growths(model, ids)
    _install(forms, [g.grow(0.0, g.d_head + 3) for g in growths])
    assert all(f.d_head == growths[0].d_head + 3 for f in forms)
    with torch.no_grad():
        assert (model(ids).logits - before).abs().max() <= 1e-12


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method", ["natural", "gradient"])
def test_first_order_prediction(tmp_path, model_type, method):
    model, ids = _model_and_batch(tmp_path, model_type)
    with torch.no_grad():
        before = float(_loss(model, ids))
    forms, growths = _growths(model, ids, method)
    # Not smaller: the models' RMSNorms compute in float32 even on float64 inputs, which sets a noise floor.
    alpha = 1e-3
    grown = [g.grow(alpha, g.d_head + 2) for g in growths]
    predicted = sum(g.predicted_decrease for g in grown)
    _install(forms, grown)
    with torch.no_grad():
        realised = before - float(_loss(model, ids))
    assert predicted > 0
    # Second-order terms are O(α²) against the first-order O(α) change (measured: 0.2 % at α = 1e-3).
    assert realised == pytest.approx(predicted, rel=1e-2)


def test_gqa_group_shares_new_keys_and_matches_stacked_svd(tmp_path):
    model, ids = _model_and_batch(tmp_path, "llama")
    forms, growths = _growths(model, ids)
    g, form = growths[0], forms[0]
    assert isinstance(g, GroupedGrowth) and g.group == 2
    p, alpha = 3, 0.5
    grown = g.grow(alpha, g.d_head + p)
    d, tau = g.d_head, grown.log_tau.exp()
    # Each key head carries one set of new columns; each query head reads its group's.
    assert grown.w_k.shape == (2, 32, d + p)
    change = tau[:, None, None] * grown.w_q[..., d:] @ grown.w_k[..., d:].repeat_interleave(2, 0).mT  # (H, e, e)
    # Reference: per group, α × the best rank-p approximation of the stacked bottlenecks.
    u, s, v, _ = g.bottleneck("natural")
    for group in range(2):
        stacked = (u[group, :, :p] * s[group, :p]) @ v[group, :, :p].mT
        assert torch.allclose(change[2 * group: 2 * group + 2].reshape(-1, 32), alpha * stacked, atol=1e-12)
    # Both heads of a group see the identical key columns: their changes share the right factor's row space.
    for group in range(2):
        a, b = change[2 * group], change[2 * group + 1]
        k_span = grown.w_k[group, :, d:]
        proj = k_span @ torch.linalg.pinv(k_span)
        assert torch.allclose(a @ proj, a, atol=1e-12) and torch.allclose(b @ proj, b, atol=1e-12)


@pytest.mark.parametrize("temperature", ["keep", "rescale"])
def test_rotary_columns_bit_identical(tmp_path, temperature):
    model, ids = _model_and_batch(tmp_path, "qwen3")
    forms, growths = _growths(model, ids)
    before = [(f.w_q.detach().clone(), f.w_k.detach().clone()) for f in forms]
    _install(forms, [g.grow(0.25, g.d_head + 2, temperature=temperature) for g in growths])
    for f, (w_q, w_k) in zip(forms, before):
        r = f.rotary
        if temperature == "keep":
            assert torch.equal(f.w_q[..., :r], w_q[..., :r]) and torch.equal(f.w_k[..., :r], w_k[..., :r])
        else:  # the old columns are scaled by c = (d_new/d)^¼ and τ by (d/d_new)^½: the scores are kept
            c = ((r + 2) / r) ** 0.25
            assert torch.allclose(f.w_q[..., :r], c * w_q[..., :r], rtol=1e-15, atol=0)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_replace_across_rotary_columns_is_refused(tmp_path):
    model, ids = _model_and_batch(tmp_path, "llama")
    form = _forms(model)[0]
    assert "rotary" in refused_mode(form, "replace")
    assert refused_mode(form, "append") is None
    forms, growths = _growths(model, ids)
    with pytest.raises(ValueError, match="rotary"):
        growths[0].grow(0.5, growths[0].d_head + 1, mode="replace")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_explicit_and_extended_capture_agree(tmp_path, model_type, attn):
    model = load(saved_tiny_model(model_type, tmp_path), attn_implementation=attn).double()
    make_growable(model)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))  # longer than Mistral's window
    (_, extended), (_, explicit) = (_growths(model, ids, capture=mode) for mode in ("extend", "explicit"))
    for a, b in zip(extended, explicit):
        # Llama's and Mistral's eager attention take the softmax in float32 even for float64 inputs.
        scale = 1e-12 if attn == "sdpa" or model_type == "gpt2" else 1e-5
        torch.testing.assert_close(a.moments.n, b.moments.n, rtol=0, atol=scale * float(a.moments.n.abs().max()))


def _set_capture(model, mode: str | None) -> None:
    for f in _forms(model):
        f.capture = mode


@pytest.mark.parametrize("model_type, mode", [("llama", "train"), ("gpt2", "eval")])
def test_explicit_capture_leaves_the_forward_as_it_is(tmp_path, model_type, mode):
    """In training (Llama: no attention dropout), and in eval mode where a training run would drop out (GPT-2 with
    attn_pdrop 0.3): the explicit score map gives the logits the model gives without capture."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    if model_type == "gpt2":
        config.attn_pdrop = 0.3
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / model_type)
    model = load(tmp_path / model_type).double().train(mode == "train")
    make_growable(model)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits
    _set_capture(model, "explicit")
    captured = model(ids).logits
    torch.testing.assert_close(captured, plain, rtol=0, atol=1e-12)


def test_explicit_capture_of_a_bfloat16_model_gives_its_logits(tmp_path):
    """precision bf16-true: the score map's softmax in float32, its weights back in bfloat16 for the values."""
    model = load(saved_tiny_model("llama", tmp_path), attn_implementation="eager")
    make_growable(model)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits
    _set_capture(model, "explicit")
    captured = model(ids).logits
    assert captured.dtype == torch.bfloat16
    torch.testing.assert_close(captured, plain)  # bfloat16's tolerances; measured equal


def test_explicit_capture_under_bfloat16_autocast_records_in_the_inputs_dtype(tmp_path):
    """bf16-mixed on the CPU, where capture=auto picks `explicit`: the scores' gradient comes in bfloat16, X′ in
    float32; G·X′ is recorded in float32, as the extended queries record it."""
    model = load(saved_tiny_model("llama", tmp_path))
    make_growable(model)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    recorded = {}
    for mode in ("extend", "explicit"):
        _set_capture(model, mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        recorded[mode] = [f.take_captured() for f in _forms(model)]
        model.zero_grad()
    for extended, explicit in zip(recorded["extend"], recorded["explicit"]):
        (xa, gx), (xa_explicit, gx_explicit) = extended[0], explicit[0]
        assert xa.dtype == gx.dtype == xa_explicit.dtype == gx_explicit.dtype == torch.float32
        # bfloat16 scores on both paths: they agree to its round-off (measured 0.4 % of the largest entry).
        torch.testing.assert_close(gx_explicit, gx, rtol=0, atol=0.02 * float(gx.abs().max()))


def test_a_checkpoint_of_narrower_heads_loads_into_a_module_built_wider():
    """E.g. init_from a checkpoint taken before a growth, or of a shrunk model, into a module built at the grown
    size: the module takes the checkpoint's head sizes."""
    from lit_growattn.hf import HFCausalLM

    torch.manual_seed(0)
    narrow = HFCausalLM(config=tiny_config("llama").to_dict(), head_sizes=[10, 12])
    state = narrow.state_dict()
    wide = HFCausalLM(config=tiny_config("llama").to_dict(), head_sizes=[14, 14])
    wide.load_state_dict(state)
    assert wide.head_sizes() == [10, 12] and wide.hparams["head_sizes"] == [10, 12]
    loaded = wide.state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("model_type, bias", [("llama", False), ("qwen2", True), ("gpt2", True)])
def test_weight_decay_spares_the_query_key_bias_row(model_type, bias):
    """W_Q and W_K decay as the other matrices do; where q/k have a bias (its last row), they are in the no-decay
    group and the decay is applied to their other rows only."""
    from lit_growattn.hf import HFCausalLM

    torch.manual_seed(0)
    module = HFCausalLM(config=tiny_config(model_type).to_dict())
    decay, no_decay = (set(map(id, group["params"])) for group in module.parameter_groups())
    forms = [named.form for named in module.growable_forms()]
    assert all((id(f.w_q) in no_decay, id(f.w_k) in no_decay, id(f.w_q) in decay) == (bias, bias, not bias)
               for f in forms)
    optimizer = torch.optim.AdamW(module.parameter_groups(), lr=0.5, weight_decay=0.1)
    w_q = forms[0].w_q
    w_q.grad = torch.zeros_like(w_q)
    before = w_q.detach().clone()
    module.on_before_optimizer_step(optimizer)
    if bias:  # decoupled decay by 1 − lr·wd on every row but the bias row
        torch.testing.assert_close(w_q[:, :-1], (1 - 0.5 * 0.1) * before[:, :-1])
        assert torch.equal(w_q[:, -1], before[:, -1])
    else:  # AdamW's own step decays it
        assert torch.equal(w_q, before)


def _hf_event(tmp_path, folder, method, ridge, sketch):
    """One float64 growth event of both sides at step 4 through HFCausalLM and the callback, from 4 statistics
    batches, sketched with k = e′ = 16 (exact for any statistics) or in full."""
    import lightning as L

    from callback_helpers import SketchEventProbe, recall_data, trainer
    from lit_growattn import AtSteps, GrowthSettings, StatisticsSettings
    from lit_growattn.hf import HFCausalLM

    L.seed_everything(0)
    data = recall_data(batch_size=8, examples=64)
    probe = SketchEventProbe(AtSteps([4]), growth=GrowthSettings(grow="both", columns=2, value_columns=2,
                                                                 method=method, ridge=ridge),
                             statistics=StatisticsSettings(batches=4, **({"sketch": "on", "sketch_size": 16}
                                                                         if sketch else {})))
    module = HFCausalLM(pretrained=str(folder), warmup_steps=0)
    trainer(tmp_path, [probe], max_epochs=1, max_steps=5, precision="64-true", enable_checkpointing=False).fit(
        module, data)
    return probe, module


@pytest.mark.filterwarnings("ignore:statistics.sketch_size=16 keeps k \\+ l = 40 columns per head")
@pytest.mark.parametrize("method, full_ridge", [("gradient", None), ("natural", 1.0)])
def test_hf_sketch_event_equals_full(tmp_path, method, full_ridge):
    """A tiny Llama (hidden 16, 4 query heads sharing 2 KV heads, RoPE) loaded with from_pretrained: its sketched
    event (k = e′) grows the function the full statistics grow at the sketch's ridge, through the HF capture (columns
    after RoPE, keys per KV head), the grouped query/key growth (rotary columns kept) and the grouped value growth."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from callback_helpers import sketch_tolerance

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    full, full_module = _hf_event(tmp_path / "full", tmp_path / "llama", method, full_ridge, sketch=False)
    sketched, module = _hf_event(tmp_path / "sketch", tmp_path / "llama", method, None, sketch=True)
    assert module.head_sizes() == full_module.head_sizes() == [6, 6]
    assert module.value_sizes() == full_module.value_sizes() == [6, 6]
    (want,), (got,) = full.history, sketched.history
    assert (want.get("sketch"), got["sketch"]) == (None, {"k": 16, "l": 24, "k_c": 16}) and got["alpha"] == want["alpha"]
    [(want_products, _)], [(got_products, cond)] = full.events, sketched.events
    tolerance = sketch_tolerance(16, cond)
    assert got["predicted_decrease"] == pytest.approx(want["predicted_decrease"], rel=tolerance)
    for a, b in zip(got_products, want_products, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance * float(b.abs().max()))
