"""Export: a grown model round-trips save_pretrained → AutoModelForCausalLM.from_pretrained (after `import
lit_growattn.hf`), an ungrown one exports as its original architecture; equal logits and greedy generation. The
Python export writes into the working directory for a model built from a config, keeps an `out` that appeared
meanwhile; registering again keeps every grown type loadable; an exported DINT model says how to load it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, needs_transformers

needs_transformers()

import torch  # noqa: E402

import lit_growattn.hf  # noqa: E402, F401  (registers the grown model types)
from hf_helpers import VOCAB, load, same_model, saved_tiny_model  # noqa: E402
from lit_growattn.hf import make_growable  # noqa: E402
from lit_growattn.hf.export import export  # noqa: E402


def _growable(tmp_path, model_type: str):
    model = load(saved_tiny_model(model_type, tmp_path / "src"))
    make_growable(model)
    return model


@torch.no_grad()
def _perturb(model, grow_by: int, same_tau: bool = False) -> None:
    """Learned-looking temperatures (per head, or one per layer) and `grow_by` random NoPE columns per layer."""
    gen = torch.Generator().manual_seed(3)
    for name, m in model.named_modules():
        if hasattr(m, "log_tau") and hasattr(m, "set_weights"):
            shift = torch.randn(1 if same_tau else m.n_head, generator=gen) * 0.3
            extra = lambda w: torch.randn(*w.shape[:2], grow_by, generator=gen) * 0.2  # noqa: E731
            m.set_weights(torch.cat([m.w_q, extra(m.w_q)], -1), torch.cat([m.w_k, extra(m.w_k)], -1),
                          m.log_tau + shift.expand(m.n_head))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
def test_grown_model_round_trips(tmp_path, model_type):
    model = _growable(tmp_path, model_type)
    _perturb(model, grow_by=3)
    assert export(model, tmp_path / "out") == f"growattn_{model_type}"
    loaded = load(tmp_path / "out")
    assert type(loaded).__name__.startswith("GrowAttn")
    same_model(model.eval(), loaded)


@pytest.mark.parametrize("model_type, same_tau", [("llama", False), ("qwen2", False), ("qwen3", True), ("gpt2", False)])
def test_ungrown_model_exports_as_its_original_architecture(tmp_path, model_type, same_tau):
    model = _growable(tmp_path, model_type)
    _perturb(model, grow_by=0, same_tau=same_tau)
    assert export(model, tmp_path / "out") == model_type
    loaded = load(tmp_path / "out")
    assert not type(loaded).__name__.startswith("GrowAttn")
    same_model(model.eval(), loaded)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_grown_folder_whose_widths_end_native_exports_as_its_original_architecture(tmp_path, model_type):
    """A growattn_<type> model shrunk back to its original widths writes the original config and class (its weights
    are q_proj/k_proj/…, which a growattn_<type> config would load random)."""
    model = _growable(tmp_path, model_type)
    _perturb(model, grow_by=3)
    assert export(model, tmp_path / "grown") == f"growattn_{model_type}"
    grown = load(tmp_path / "grown")
    with torch.no_grad():
        for m in grown.modules():
            if hasattr(m, "log_tau") and hasattr(m, "set_weights"):
                m.set_weights(m.w_q[..., :-3], m.w_k[..., :-3], m.log_tau)
    assert export(grown, tmp_path / "out") == model_type
    loaded = load(tmp_path / "out")
    assert not type(loaded).__name__.startswith("GrowAttn") and "qk_head_sizes" not in loaded.config.to_dict()
    same_model(grown.eval(), loaded)


def test_qwen3_with_per_head_temperatures_keeps_the_growable_form(tmp_path):
    # q_norm is scale-invariant: per-head temperatures have no place in the native Qwen3 attention.
    model = _growable(tmp_path, "qwen3")
    _perturb(model, grow_by=0)
    assert export(model, tmp_path / "out") == "growattn_qwen3"
    same_model(model.eval(), load(tmp_path / "out"))


LOADS_AFTER_IMPORT = """
import sys
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import lit_growattn
print("AFTER lit_growattn:", sorted(m for m in sys.modules if m.startswith("lit_growattn.hf")),
      "growattn_llama" in CONFIG_MAPPING)
import lit_growattn.hf
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
print("LOADED:", type(model).__name__)
with torch.no_grad():
    torch.save(model(torch.arange(12)[None] % 96).logits, sys.argv[2])
"""


def test_import_lit_growattn_leaves_transformers_alone_and_the_hf_import_loads_an_export(tmp_path):
    """In a fresh process: `import lit_growattn` imports nothing of lit_growattn.hf and registers no model type;
    after `import lit_growattn.hf`, the exported folder loads as a downloaded model does (no remote code)."""
    model = _growable(tmp_path, "llama")
    _perturb(model, grow_by=2)
    assert export(model, tmp_path / "out") == "growattn_llama"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    child = subprocess.run([sys.executable, "-c", LOADS_AFTER_IMPORT, str(tmp_path / "out"), str(tmp_path / "l.pt")],
                           env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "AFTER lit_growattn: [] False" in child.stdout
    assert "LOADED: GrowAttnLlamaForCausalLM" in child.stdout
    with torch.no_grad():
        expected = model.eval()(torch.arange(12)[None] % 96).logits
    torch.testing.assert_close(torch.load(tmp_path / "l.pt"), expected, rtol=0, atol=1e-5)


def test_exported_grown_folder_continues_training_from_its_sizes(tmp_path):
    from lit_growattn.hf import HFCausalLM

    model = _growable(tmp_path, "llama")
    _perturb(model, grow_by=2)
    export(model, tmp_path / "out")
    module = HFCausalLM(pretrained=str(tmp_path / "out"))
    assert module.head_sizes() == [10, 10]
    same_model(model.eval(), module.model.eval())


def test_fewer_rotary_columns_are_the_rope_of_a_smaller_head_dim_and_round_trip(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from hf_helpers import tiny_config
    from lit_growattn.hf import HFCausalLM

    config = tiny_config("llama").to_dict()  # head_dim 8
    module = HFCausalLM(config=config, rotary_dim=4)
    attn = module.model.model.layers[0].self_attn
    assert (attn.rotary, attn.d_head, attn.value.d_v) == (4, 4, 8) and module.head_sizes() == [4, 4]
    # The rotary part is exactly RoPE at head_dim 4 (frequencies 1 and 0.01 of head_dim 8's 1, 0.1, 0.01, 0.001).
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None].expand(2, -1)
    wide = LlamaRotaryEmbedding(module.model.config)(x, positions)
    q, k = attn.queries_keys(x, wide)
    small = LlamaRotaryEmbedding(tiny_config("llama", head_dim=4))(x, positions)
    ref_q, ref_k = apply_rotary_pos_emb(attn.project(x, attn.w_q), attn.project(x, attn.w_k), *small)
    torch.testing.assert_close(q, ref_q * attn.tau[:, None, None], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, ref_k, rtol=1e-6, atol=1e-6)
    # Grown by NoPE columns up to head_dim, it still needs the grown form (fewer rotary columns) and round-trips.
    _perturb(module.model, grow_by=4)
    assert module.head_sizes() == [8, 8]
    assert export(module.model, tmp_path / "out") == "growattn_llama"
    loaded = load(tmp_path / "out")
    assert [layer.self_attn.rotary for layer in loaded.model.layers] == [4, 4]
    same_model(module.model.eval(), loaded)


def test_fewer_rotary_columns_are_refused_where_they_cannot_apply(tmp_path):
    from lit_growattn.hf import HFCausalLM

    with pytest.raises(ValueError, match="rotary_dim=3 must be even and divide the 8 rotary columns"):
        HFCausalLM(config={"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                           "intermediate_size": 64, "vocab_size": 64}, rotary_dim=3)
    with pytest.raises(ValueError, match="for growable models trained from scratch"):
        HFCausalLM(pretrained=saved_tiny_model("llama", tmp_path / "src"), rotary_dim=4)
    with pytest.raises(ValueError, match="rotary_dim is refused for qwen3 models"):
        _growable(tmp_path, "qwen3").model.layers[0].self_attn.keep_rotary(4)


def test_a_model_built_from_a_config_exports_into_the_working_directory(tmp_path, monkeypatch):
    from hf_helpers import tiny_config
    from lit_growattn.hf import HFCausalLM

    torch.manual_seed(0)
    model = HFCausalLM(config=tiny_config("llama").to_dict(), head_sizes=[10, 10]).model
    assert model.config.name_or_path == ""  # loaded from no folder: nothing to keep `out` apart from
    monkeypatch.chdir(tmp_path)
    assert export(model, "out") == "growattn_llama"
    same_model(model.eval(), load(tmp_path / "out"))


def test_an_out_folder_that_another_process_wrote_meanwhile_is_kept_and_named_as_the_argument(tmp_path, monkeypatch):
    import lit_growattn.hf.export as hf_export

    model = _growable(tmp_path, "llama")
    out = tmp_path / "out"
    save_export = hf_export.save_export

    def another_process_writes_out(*args):
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
        return save_export(*args)

    monkeypatch.setattr(hf_export, "save_export", another_process_writes_out)
    with pytest.raises(FileExistsError) as error:
        export(model, out)
    assert str(error.value) == (f"out {out} appeared while this one was written (another process wrote it): nothing "
                                "was replaced, and what was written here is discarded; give overwrite=True to replace "
                                "it, or another path")
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "out", "src"]


def test_registering_again_keeps_every_grown_model_type_with_its_classes():
    """`import lit_growattn.hf` registered growattn_<type> for each supported type; registering again (a reload of
    the package) changes nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_growattn.hf.export import grown_classes, register
    from lit_growattn.hf.surgery import NATIVE_ATTENTION

    before = {t: grown_classes(t) for t in NATIVE_ATTENTION}
    register()
    for model_type, (config_cls, model_cls) in before.items():
        assert grown_classes(model_type) == (config_cls, model_cls)
        assert type(AutoConfig.for_model(f"growattn_{model_type}")) is config_cls
        assert AutoModelForCausalLM._model_mapping[config_cls] is model_cls
    # Named after the native classes, and found by name in their module (what pickling does)
    import lit_growattn.hf.export as module

    config_cls, model_cls = before["llama"]
    assert (config_cls.__name__, model_cls.__name__) == ("GrowAttnLlamaConfig", "GrowAttnLlamaForCausalLM")
    assert getattr(module, "GrowAttnGPT2Config") is before["gpt2"][0]
    assert all(c.__module__ == "lit_growattn.hf.export" for pair in before.values() for c in pair)
    with pytest.raises(AttributeError) as error:
        module.GrowAttnBertConfig  # noqa: B018
    assert str(error.value) == "GrowAttnBertConfig"


def test_an_exported_model_pickles(tmp_path):
    """torch.save of a whole model and ddp_spawn pickle it: its grown classes are found by name."""
    import pickle

    model = load(saved_tiny_model("llama", tmp_path / "native"))
    make_growable(model)
    export(model, tmp_path / "grown")
    grown = load(tmp_path / "grown")
    copy = pickle.loads(pickle.dumps(grown))
    assert type(copy) is type(grown) and type(copy.config) is type(grown.config)
    ids = torch.arange(12)[None] % VOCAB
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, grown(ids).logits)


def test_an_exported_dint_model_says_how_to_load_it(tmp_path, cli):
    """A DINT model (converted, then fine-tuned with growable=false) is a model type that only `import
    lit_growattn.hf` registers: its export gets the README.md that says so, and the printed line points to it."""
    from lit_growattn.hf.dint import DintSettings
    from lit_growattn.dint.models import convert_pretrained
    from lit_growattn.hf import HFCausalLM

    dint = tmp_path / "dint"
    convert_pretrained(saved_tiny_model("llama", tmp_path / "src"), dint, DintSettings("full"))
    torch.manual_seed(0)
    module = HFCausalLM(pretrained=str(dint), growable=False)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "run.ckpt")
    out = tmp_path / "out"
    done = cli("export", "--ckpt", tmp_path / "run.ckpt", "--out", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (f"wrote {out}: model type dint_llama, no tokenizer files ({dint} has "
                                            f"none); load it after `import lit_growattn.hf` ({out / 'README.md'})")
    assert "import lit_growattn.hf  # registers dint_llama" in (out / "README.md").read_text()
    same_model(module.model.eval(), load(out))
