"""The model configuration a checkpoint recorded is the truth: `export` and `HFCausalLM.load_from_checkpoint` refuse a
pretrained folder whose config differs from it (given with --pretrained, or replaced in place), naming the fields, and
where they proceed the logits are the trained module's. An exported tokenizer keeps its special tokens, whether it
was given as a folder or as that folder's tokenizer.json."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import needs_transformers

needs_transformers()

import lightning  # noqa: E402
import torch  # noqa: E402

from hf_helpers import instruct_tokenizer, load, saved_tiny_model, tiny_config  # noqa: E402
from lit_growattn.hf import HFCausalLM  # noqa: E402

VOCAB = 320


def same_shaped(folder, model_type: str = "llama", **settings) -> str:
    """A tiny random model of `model_type` saved in `folder`, `settings` on its config (a llama has the weight shapes
    of the trained one: its state dict would load without a word)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    config = tiny_config(model_type, vocab=VOCAB)
    for name, value in settings.items():
        setattr(config, name, value)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def trained(folder, ckpt, **recorded):
    """A checkpoint of the model in `folder`, grown to query/key head size 10, as fit writes it (state dict and
    hyperparameters, `recorded` added); its weights are moved off the folder's, so that only the checkpoint has them.
    Returns the checkpoint and the trained module."""
    torch.manual_seed(0)
    module = HFCausalLM(pretrained=str(folder), head_sizes=[10, 10])
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {**module.hparams, **recorded},
                "pytorch-lightning_version": lightning.__version__}, ckpt)
    return ckpt, module.eval()


IDS = torch.arange(24).reshape(2, 12) * 7 % VOCAB


def same_logits(module, model) -> None:
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(IDS).logits, module.eval()(IDS), rtol=0, atol=1e-5)


def refusal(done) -> str:
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stderr[done.stderr.index("error:"):]


@pytest.fixture
def run(tmp_path):
    """A tiny Llama folder with its own tokenizer (bos, eos, pad), and a checkpoint trained from it."""
    folder = tmp_path / "llama"
    instruct_tokenizer(folder, chat_template=False)
    saved_tiny_model("llama", folder, vocab=VOCAB)
    return folder, *trained(folder, tmp_path / "run.ckpt")


@pytest.mark.parametrize("model_type, settings, differs", [
    ("llama", {"tie_word_embeddings": True}, "tie_word_embeddings: recorded False, folder True"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters: recorded {'rope_theta': 10000.0, 'rope_type': 'default'}, folder {'factor': 2.0, "
     "'rope_theta': 10000.0, 'rope_type': 'linear'}"),
    ("gpt2", {}, "model_type: recorded 'llama', folder 'gpt2'"),
])
def test_export_refuses_a_pretrained_folder_of_another_config_naming_the_fields(run, tmp_path, cli, model_type,
                                                                                settings, differs):
    _, ckpt, _ = run
    other = same_shaped(tmp_path / "other", model_type, **settings)
    report = refusal(cli("export", "--ckpt", ckpt, "--out", tmp_path / "out", "--pretrained", other))
    assert f"{other} is not the model this checkpoint was trained from" in report
    assert f"({differs})" in report  # only the fields that differ, not the loading ones (architectures, …)
    assert "export: --pretrained DIR" in report and "missing" not in report.lower()
    assert not (tmp_path / "out").exists()


def test_a_folder_replaced_in_place_is_refused_and_the_fixes_it_names_give_the_trained_logits(run, tmp_path, cli):
    folder, ckpt, module = run
    shutil.copytree(folder, tmp_path / "kept")
    shutil.rmtree(folder)
    same_shaped(folder, tie_word_embeddings=True)
    differs = "tie_word_embeddings: recorded False, folder True"
    assert differs in refusal(cli("export", "--ckpt", ckpt, "--out", tmp_path / "out"))
    with pytest.raises(ValueError, match=f"{folder} is not the model this checkpoint was trained from: .*{differs}"):
        HFCausalLM.load_from_checkpoint(ckpt)

    # As the refusal advises: the folder the model was trained from, given; or the replaced one moved away.
    same_logits(HFCausalLM.load_from_checkpoint(ckpt, pretrained=str(tmp_path / "kept")), module.model)
    done = cli("export", "--ckpt", ckpt, "--out", tmp_path / "out", "--pretrained", tmp_path / "kept")
    assert done.returncode == 0, done.stderr
    same_logits(module, load(tmp_path / "out"))
    shutil.move(folder, tmp_path / "away")
    same_logits(HFCausalLM.load_from_checkpoint(ckpt), module.model)
    # export rebuilds the model too, and asks for the tokenizer, which was the lost folder's: a copy given is taken.
    assert "--tokenizer DIR" in refusal(cli("export", "--ckpt", ckpt, "--out", tmp_path / "again"))
    done = cli("export", "--ckpt", ckpt, "--out", tmp_path / "again", "--tokenizer", tmp_path / "kept")
    assert done.returncode == 0, done.stderr
    same_logits(module, load(tmp_path / "again"))
    assert special_tokens(tmp_path / "again") == special_tokens(tmp_path / "kept")


def refusal_of(folder, differs: str) -> str:
    """The whole refusal of a pretrained folder whose config differs from the recorded one in `differs`."""
    return (f"{folder} is not the model this checkpoint was trained from: its config.json differs from the config the "
            f"checkpoint recorded ({differs}). Point at the folder the model was trained from (export: --pretrained "
            f"DIR; Python: HFCausalLM.load_from_checkpoint(CKPT, pretrained=DIR)); where that folder is lost, move "
            f"{folder} away: the model is then rebuilt from the config the checkpoint recorded (export also needs the "
            f"tokenizer the model was trained with: --tokenizer DIR, a copy of it)")


@pytest.mark.parametrize("side", ["folder", "checkpoint"])
def test_a_field_only_one_config_has_is_a_difference_and_every_field_is_named(tmp_path, side):
    """A field that this transformers release does not know (e.g. one a newer release wrote) is kept as written: on
    one side only, the two configs are not known to describe the same model."""
    from transformers import AutoConfig

    folder = tmp_path / "llama"
    saved_tiny_model("llama", folder, vocab=VOCAB)
    extra = {"qk_clip": 5.0, "tie_word_embeddings": True}
    if side == "folder":  # edited after training
        ckpt, _ = trained(folder, tmp_path / "run.ckpt")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | extra))
        differs = "qk_clip: recorded None, folder 5.0; tie_word_embeddings: recorded False, folder True"
    else:  # as a checkpoint of a folder since restored to an earlier config records it
        ckpt, _ = trained(folder, tmp_path / "run.ckpt",
                          pretrained_config=AutoConfig.from_pretrained(folder).to_dict() | extra)
        differs = "qk_clip: recorded 5.0, folder None; tie_word_embeddings: recorded True, folder False"
    with pytest.raises(ValueError) as error:
        HFCausalLM.load_from_checkpoint(ckpt)
    assert str(error.value) == refusal_of(folder, differs)


@pytest.mark.parametrize("written", [
    dict(transformers_version="4.40.0", architectures=["SomethingElse"], dtype="bfloat16", _name_or_path="elsewhere",
         _attn_implementation="eager"),
    dict(use_cache=False, pad_token_id=0, eos_token_id=5, bos_token_id=4, output_hidden_states=True),
], ids=["how it was written", "tokens and switches"])
def test_a_folder_differing_only_in_how_it_was_written_exports_the_trained_model(run, tmp_path, cli, written):
    folder, ckpt, module = run
    config = json.loads((folder / "config.json").read_text())
    config.update(written)
    (folder / "config.json").write_text(json.dumps(config))
    done = cli("export", "--ckpt", ckpt, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    same_logits(module, load(tmp_path / "out"))


def special_tokens(folder) -> dict[str, str | None]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return {name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "pad_token")}


@pytest.mark.parametrize("form", ["folder", "tokenizer.json", "tokenizer.json, folder moved"])
def test_an_exported_tokenizer_keeps_the_special_tokens_training_had(tmp_path, cli, form):
    folder = tmp_path / "llama"
    trained_with = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    instruct_tokenizer(folder, chat_template=False)
    saved_tiny_model("llama", folder, vocab=VOCAB)
    assert special_tokens(folder) == trained_with
    # As fit records `--data.init_args.tokenizer=DIR` or `=DIR/tokenizer.json`: the absolute path given.
    tokenizer = folder if form == "folder" else folder / "tokenizer.json"
    ckpt, _ = trained(folder, tmp_path / "run.ckpt", tokenizer=str(tokenizer))
    moved = []
    if form.endswith("moved"):
        shutil.move(folder, tmp_path / "moved")
        moved = ["--pretrained", tmp_path / "moved"]
    done = cli("export", "--ckpt", ckpt, "--out", tmp_path / "out", *moved)
    assert done.returncode == 0, done.stderr
    assert special_tokens(tmp_path / "out") == trained_with
