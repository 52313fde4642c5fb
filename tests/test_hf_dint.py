"""DINT conversion of Llama-family models: exact at λ = 0 (logits, greedy tokens with and without the KV cache),
λ learns at once, A3 causal and per document, save_pretrained round trip through the registered classes."""

from __future__ import annotations

import pytest

from conftest import needs_transformers

needs_transformers()

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lit_growattn.hf.dint import (DintAttention, DintSettings, d2_ratio_for_init, document_running_mean,  # noqa: E402
                                  document_starts)
from lit_growattn.dint.models import convert_to_dint  # noqa: E402

from hf_helpers import VOCAB, load, saved_tiny_model  # noqa: E402

MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3"]
SETTINGS = {"lowrank": DintSettings("lowrank", rank=2), "full": DintSettings("full")}


def greedy(model, prompt, use_cache):
    return model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=use_cache, pad_token_id=0,
                          min_new_tokens=20)


@pytest.mark.parametrize("kind", ["lowrank", "full"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_conversion_is_exact(tmp_path, model_type, kind):
    from transformers import AutoModelForCausalLM

    native = load(saved_tiny_model(model_type, tmp_path / "native"))
    converted = convert_to_dint(native, SETTINGS[kind], seed=3)
    layers = [layer.self_attn for layer in converted.model.layers]
    assert all(isinstance(a, DintAttention) and isinstance(a, type(native.model.layers[0].self_attn)) for a in layers)
    assert all(torch.equal(a.lam, torch.zeros(4)) for a in layers)
    converted.save_pretrained(tmp_path / "dint")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dint", dtype=torch.float32).eval()
    assert type(reloaded) is type(converted)
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = native(ids).logits
        for model in (converted, reloaded):
            assert (model(ids).logits - reference).abs().max() <= 1e-5
    prompt = ids[:2, :4]
    expected = greedy(native, prompt, use_cache=True)
    for use_cache in (True, False):
        assert torch.equal(greedy(reloaded, prompt, use_cache), expected)


def test_second_map_shapes_and_scale(tmp_path):
    native = load(saved_tiny_model("llama", tmp_path))  # 4 heads, 2 kv heads, head_dim 8, hidden 32
    attn = convert_to_dint(native, DintSettings("lowrank", rank=3)).model.layers[0].self_attn
    assert attn.second.down_q.shape == (4, 32, 3) and attn.second.up_q.shape == (4, 3, 8)
    assert attn.second.down_k.shape == (2, 32, 3) and attn.second.up_k.shape == (2, 3, 8)
    assert attn.q2_gain == pytest.approx(3.0)  # d₂ = d/9: 1/√d₂ = 3/√d
    assert d2_ratio_for_init("lowrank", 2048, 8, normalised=False) == pytest.approx(1 / 9)
    assert d2_ratio_for_init("full", 2048, None, normalised=False) == 1.0
    custom = convert_to_dint(native, DintSettings("lowrank", rank=3, d2_ratio=0.25)).model.layers[0].self_attn
    assert custom.q2_gain == pytest.approx(2.0)


def test_the_converted_model_keeps_dtype_mode_and_attention_implementation_and_names_its_class(tmp_path):
    """The DINT copy has the native model's dtype, train/eval mode and attention implementation, its config names its
    own type and class, the seed defaults to 0 (as `convert --seed`), and a second conversion gives the same class."""
    from transformers import AutoModelForCausalLM

    from lit_growattn.hf import dint

    native = AutoModelForCausalLM.from_pretrained(saved_tiny_model("llama", tmp_path), dtype=torch.bfloat16,
                                                  attn_implementation="eager")  # loaded in eval mode
    settings = DintSettings("lowrank", rank=2)
    converted = convert_to_dint(native, settings)
    assert {p.dtype for p in converted.parameters()} == {torch.bfloat16}
    assert not any(m.training for m in converted.modules())
    assert converted.config._attn_implementation == "eager"
    assert (converted.config.model_type, converted.config.architectures) == ("dint_llama", ["DintLlamaForCausalLM"])
    assert type(converted) is dint.DintLlamaForCausalLM and type(convert_to_dint(native, settings)) is type(converted)
    torch.testing.assert_close(converted.state_dict(), convert_to_dint(native, settings, seed=0).state_dict(),
                               atol=0, rtol=0)
    assert all(m.training for m in convert_to_dint(native.train(), settings).modules())


def test_weights_that_do_not_fit_the_dint_model_are_refused_by_name(tmp_path):
    """A native model with a weight its DINT model has no place for, or without one the DINT model needs."""
    settings = DintSettings("full")
    extra = load(saved_tiny_model("llama", tmp_path))
    extra.model.layers[1].self_attn.register_parameter("gate", torch.nn.Parameter(torch.zeros(4)))
    with pytest.raises(ValueError) as error:
        convert_to_dint(extra, settings)
    assert str(error.value) == ("the llama weights do not fit its DINT model: missing [], unexpected "
                                "['model.layers.1.self_attn.gate']")
    lacking = load(tmp_path)
    lacking.lm_head = torch.nn.Identity()
    with pytest.raises(ValueError) as error:
        convert_to_dint(lacking, settings)
    assert str(error.value) == "the llama weights do not fit its DINT model: missing ['lm_head.weight'], unexpected []"


def test_every_family_is_registered_with_the_auto_classes_once():
    """Importing lit_growattn.hf registers dint_<family> for each family; registering again changes nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_growattn.hf import dint

    before = {t: dint.dint_classes(t) for t in dint.FAMILIES}
    dint.register_all()
    for model_type, (config_cls, model_cls) in before.items():
        assert dint.dint_classes(model_type) == (config_cls, model_cls)
        assert type(AutoConfig.for_model(f"dint_{model_type}")) is config_cls
        assert AutoModelForCausalLM._model_mapping[config_cls] is model_cls


def test_lowrank_score_variance_matches_a_fresh_full_map():
    """The derivation behind d₂ = d/9, measured: scores of a fresh low-rank map scaled by 1/√d₂ have the variance
    of a fresh full map's scaled by 1/√d, over many draws of the init (float64)."""
    from lit_growattn.attention.lowrank_dint import uniform_parameter

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    e, r, d, n = 64, 4, 16, 4000
    x = torch.randn(2, e, dtype=torch.float64)
    full = [(x[0] @ uniform_parameter(e, d, fan_in=e).double()) @ (x[1] @ uniform_parameter(e, d, fan_in=e).double())
            for _ in range(n)]
    low = [(x[0] @ uniform_parameter(e, r, fan_in=e).double() @ uniform_parameter(r, d, fan_in=r).double())
           @ (x[1] @ uniform_parameter(e, r, fan_in=e).double() @ uniform_parameter(r, d, fan_in=r).double())
           for _ in range(n)]
    var_full = torch.stack(full).var() / d
    var_low = torch.stack(low).var() / (d * d2_ratio_for_init("lowrank", e, r, normalised=False))
    torch.set_grad_enabled(True)
    # Each variance estimate from 4000 draws of a heavy-tailed product has ~4% relative noise: 0.15 is 3 σ of the ratio.
    assert (var_low / var_full).item() == pytest.approx(1.0, abs=0.15)


def test_lambda_gets_gradient_at_first_step(tmp_path):
    native = load(saved_tiny_model("qwen2", tmp_path))
    model = convert_to_dint(native, DintSettings("lowrank", rank=2)).train()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    for layer in model.model.layers:
        assert layer.self_attn.lam.grad is not None and layer.self_attn.lam.grad.abs().min() > 0
        assert layer.self_attn.second.up_q.grad.abs().max() == 0  # λ = 0: the second map waits for λ


def test_document_running_mean_matches_loop():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
    starts = torch.tensor([[1, 0, 0, 1, 0, 0, 0], [0, 0, 1, 0, 1, 1, 0]], dtype=torch.bool)
    prior_sum, prior_count = torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.tensor([0.0, 5.0], dtype=torch.float64)
    means, last_sum, last_count = document_running_mean(y, starts, prior_sum, prior_count)
    for b in range(2):
        total, count = prior_sum[b].clone(), prior_count[b].item()
        for i in range(7):
            if starts[b, i]:
                total, count = torch.zeros_like(total), 0
            total, count = total + y[b, :, i], count + 1
            torch.testing.assert_close(means[b, :, i], total / count, rtol=0, atol=1e-12)
        torch.testing.assert_close(last_sum[b], total, rtol=0, atol=1e-12)
        assert last_count[b] == count


def test_a_document_starts_where_its_position_ids_restart_or_its_mask_shows_no_earlier_key():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]  # (b, 1, s, kv): no document boundary in it
    restarts = torch.tensor([[0, 1, 2, 0, 1]])
    expected = [[True, False, False, True, False]]
    assert document_starts(1, 5, restarts, causal, "cpu").tolist() == expected  # either source is enough
    packed = causal.clone()
    packed[..., 3:, :3] = False  # the second document's rows see none of the first's keys
    assert document_starts(1, 5, None, packed, "cpu").tolist() == expected
    additive = torch.zeros(1, 1, 5, 5).masked_fill(~packed, float("-inf"))  # the float form of the same mask
    assert document_starts(1, 5, torch.arange(5)[None], additive, "cpu").tolist() == expected



@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_equal_separate_runs(tmp_path, attn):
    """Two documents packed in one row (position_ids restart at 0) give each document's own outputs: A1 per
    document by the model's packed mask (transformers builds it only without a cache: use_cache=False, as in
    training), A3 by the running mean's restart; λ ≠ 0 so A3 and A2 count."""
    native = load(saved_tiny_model("llama", tmp_path), attn_implementation=attn)
    model = convert_to_dint(native, DintSettings("lowrank", rank=2))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.lam.fill_(0.3)
    a, b = torch.randint(0, VOCAB, (1, 6)), torch.randint(0, VOCAB, (1, 5))
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(6), torch.arange(5)])[None]
    with torch.no_grad():
        together = model(packed, position_ids=positions, use_cache=False).logits
        apart = torch.cat([model(a).logits, model(b).logits], 1)
    assert (together - apart).abs().max() <= 1e-5


def test_cached_decoding_keeps_a3_with_nonzero_lambda(tmp_path):
    native = load(saved_tiny_model("mistral", tmp_path))  # sliding window 4: the cache drops old keys
    model = convert_to_dint(native, DintSettings("full"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.lam.fill_(0.4)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(greedy(model, prompt, True), greedy(model, prompt, False))


def test_left_padded_batch_generates_like_single_prompts(tmp_path):
    native = load(saved_tiny_model("llama", tmp_path))
    model = convert_to_dint(native, DintSettings("lowrank", rank=2))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.lam.fill_(0.3)
    short, long = torch.randint(1, VOCAB, (1, 3)), torch.randint(1, VOCAB, (1, 6))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = (torch.arange(6) >= torch.tensor([[3], [0]])).long()
    out = model.generate(batch, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0, 6:], greedy(model, short, True)[0, 3:11])
    assert torch.equal(out[1, 6:], greedy(model, long, True)[0, 6:14])


def test_foreign_cache_is_refused(tmp_path):
    from transformers import DynamicCache

    native = load(saved_tiny_model("llama", tmp_path))
    model = convert_to_dint(native, DintSettings("full"))
    ids = torch.randint(0, VOCAB, (1, 6))
    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True)
    del cache.dint_running
    with pytest.raises(RuntimeError, match="running mean of A1·V beside the KV cache"):
        model(ids[:, :1], past_key_values=cache, use_cache=True)


def test_entropy_reference_is_the_original_models(tmp_path):
    """At λ = 0 the combined map is A1, so the entropy measured on the converted model is the original's; with
    λ ≠ 0 the combined map's rows still sum to 1 (A1, A2 and A3 rows each do) and the entropy changes."""
    from lit_growattn.dint.entropy import layer_entropies

    native = load(saved_tiny_model("qwen3", tmp_path))
    model = convert_to_dint(native, DintSettings("lowrank", rank=2))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    labels = torch.where(torch.arange(9) < 7, ids, -100)  # the last two rows are padding: not counted
    batches = [(ids, labels)]
    before = layer_entropies(native, batches)
    assert before.shape == (2,) and torch.allclose(layer_entropies(model, batches), before, atol=1e-5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.lam.fill_(0.5)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        maps = model(ids, output_attentions=True, use_cache=False).attentions
    assert torch.allclose(maps[0].sum(-1), torch.ones(2, 4, 9), atol=1e-5)
    model.set_attn_implementation("sdpa")
    assert (layer_entropies(model, batches) - before).abs().max() > 1e-3


def test_the_convert_command_passes_its_settings_and_seed_and_says_how_to_fine_tune(tmp_path, cli):
    """`convert --pretrained`: --rank, --d2_ratio and --seed reach the conversion, --overwrite replaces an earlier
    result, and the printed command fine-tunes the folder (with its tokenizer when the source has one)."""
    from hf_helpers import saved_tokenizer

    folder = saved_tiny_model("llama", tmp_path / "llama")
    out = tmp_path / "dint"
    args = ["convert", "--pretrained", folder, "--to", "lowrank_dint", "--rank", "2", "--d2_ratio", "0.25",
            "--seed", "3", "--out", out]
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    expected = convert_to_dint(load(folder), DintSettings("lowrank", rank=2, d2_ratio=0.25), seed=3).state_dict()
    converted = load(out)
    torch.testing.assert_close(converted.state_dict(), expected, atol=0, rtol=0)
    assert converted.config.dint == {"kind": "lowrank", "rank": 2, "d2_ratio": 0.25}  # d₂ sets no weight's shape
    fit = ("python -m lit_growattn fit --config <run config> --model=lit_growattn.hf.HFCausalLM "
           f"--model.init_args.config=null --model.init_args.pretrained={out} --model.init_args.growable=false")
    intro = (f"wrote {out} (lowrank_dint of {folder}; load it after `import lit_growattn.hf`, see {out / 'README.md'});"
             "\nfine-tune with a run config that has no growth callback (a DINT model does not grow), e.g. "
             "configs/hf_llama_dint_sft.yaml:\n  ")
    assert done.stdout == (intro + fit + f"\n  {folder} has no tokenizer: add --data.init_args.tokenizer=<the "
                           "model's tokenizer>\n")

    inside = tmp_path / "llama" / "dint"
    done = cli("convert", "--pretrained", folder, "--to", "dint", "--out", inside)
    assert done.stderr.splitlines()[0] == (f"error: ValueError: --out {inside} is inside the model folder --pretrained "
                                           f"({folder}), which is read to write it: it is never overwritten, not even "
                                           "with --overwrite; give --out a path outside it")

    saved_tokenizer(folder, ["some text to learn merges from"] * 4, vocab_size=300)
    done = cli(*args, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert done.stdout == intro + fit + f" --data.init_args.tokenizer={out}\n"
    assert (out / "tokenizer_config.json").is_file()


class TwoHeldOutSets(L.LightningDataModule):
    """Training data and two held-out sets (the module logs `val/loss` and `val/second/loss`); the entropy callback
    measures on the first."""

    val_names = ["", "second"]

    def __init__(self, train: Tensor, first: Tensor, second: Tensor):
        super().__init__()
        self.train, self.first, self.second = train, first, second

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.train, self.train), batch_size=4)

    def val_dataloader(self):
        return [DataLoader(TensorDataset(held, held), batch_size=2) for held in (self.first, self.second)]


def entropy_run(tmp_path, max_steps, ckpt_path=None, num_batches=1):
    """HFCausalLM (a tiny Llama) fitted with AttentionEntropyCallback: the trainer, the callback, the batches."""
    from lit_growattn.dint.entropy import AttentionEntropyCallback
    from lit_growattn.hf import HFCausalLM

    g = torch.Generator().manual_seed(5)
    tokens = lambda n: torch.randint(0, VOCAB, (n, 10), generator=g)  # noqa: E731
    train, first, second = tokens(8), tokens(4), tokens(4)
    data = TwoHeldOutSets(train, first, second)
    folder = tmp_path / "llama"
    if not folder.exists():
        saved_tiny_model("llama", folder)
    torch.manual_seed(0)
    module = HFCausalLM(pretrained=str(folder), growable=False, lr_schedule="constant", warmup_steps=0,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=0.05))
    callback = AttentionEntropyCallback(num_batches=num_batches)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=1,
                        default_root_dir=tmp_path / f"run_{max_steps}", callbacks=[callback])
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, callback, module, first[:2 * num_batches]


def test_the_entropy_callback_logs_each_layer_beside_the_reference_kept_across_a_resume(tmp_path):
    from lit_growattn.dint.entropy import layer_entropies

    native = load(saved_tiny_model("llama", tmp_path / "llama"))
    trainer, callback, module, first = entropy_run(tmp_path, max_steps=2)
    batch = [(first, first)]
    # The reference is the model as fit received it, on the first held-out set's first num_batches batches.
    torch.testing.assert_close(callback.reference, layer_entropies(native, batch))
    logged = trainer.callback_metrics
    for i in range(2):
        assert logged[f"attention/entropy_original/layer_{i}"].item() == pytest.approx(callback.reference[i].item())
        assert logged[f"attention/entropy/layer_{i}"].item() == pytest.approx(
            layer_entropies(module.model.eval(), batch)[i].item(), rel=1e-5)
    assert (callback.reference - layer_entropies(module.model, batch)).abs().max() > 1e-3  # it trained
    # Resumed, the callback keeps the reference of the run's start, not the entropy of the model it resumes.
    resumed_trainer, resumed, _, _ = entropy_run(tmp_path, max_steps=3, ckpt_path=trainer.checkpoint_callback.best_model_path)
    torch.testing.assert_close(resumed.reference, callback.reference)
    assert resumed_trainer.callback_metrics["attention/entropy_original/layer_1"].item() == pytest.approx(
        callback.reference[1].item())


def test_the_entropy_callback_refuses_what_it_cannot_measure():
    from lit_growattn.dint.entropy import AttentionEntropyCallback
    from lit_growattn.module import GrowAttentionLM

    with pytest.raises(ValueError) as error:
        AttentionEntropyCallback(num_batches=0)
    assert str(error.value) == "num_batches must be ≥ 1, got 0"
    assert AttentionEntropyCallback().num_batches == 2
    for module in (GrowAttentionLM(), L.LightningModule()):  # a `model` of another kind, and none at all
        with pytest.raises(TypeError) as error:
            AttentionEntropyCallback().setup(None, module, "fit")
        assert str(error.value) == ("AttentionEntropyCallback needs a module whose `model` is a transformers model "
                                    f"(e.g. lit_growattn.hf.HFCausalLM), not {type(module).__name__}")
