"""`python -m lit_growattn export|convert` never lose a user's files: they write beside the target and rename it into
place, refuse their own source, an existing folder or file (unless --overwrite), and a file where a folder goes; a
write that fails or is killed leaves the old target whole. Export copies the tokenizer the model was trained with,
finds a moved pretrained folder with --pretrained, refuses non-finite weights and says how to load what it wrote;
no refusal of an unreadable checkpoint advises loading it with weights_only=False."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, needs_transformers

needs_transformers()

import torch  # noqa: E402

from hf_helpers import TEXT, VOCAB, load, saved_tiny_model, saved_tokenizer  # noqa: E402
from lit_growattn.commands.export import TOKENIZER_FILES  # noqa: E402


def refused(done: Done, *phrases) -> str:
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    report = done.stderr[done.stderr.index("error:"):]
    for phrase in phrases:
        assert str(phrase) in report, (phrase, report)
    return report


def refusal(done: Done) -> str:
    """The report's first line, `error: TYPE: MESSAGE`: the whole of a one-line refusal."""
    return refused(done).splitlines()[0]


def printed(done: Done) -> list[str]:
    """What a command that succeeded printed, by line."""
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def snapshot(folder) -> dict[str, bytes]:
    """Every file under folder, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hf_checkpoint(path, pretrained, head_sizes=None, growable=True, **recorded):
    """A checkpoint of lit_growattn.hf.HFCausalLM as fit writes it (state_dict and hyper_parameters), with `recorded`
    added to its hyperparameters (e.g. the tokenizer fit recorded)."""
    from lit_growattn.hf import HFCausalLM

    torch.manual_seed(0)
    module = HFCausalLM(pretrained=str(pretrained), head_sizes=head_sizes, growable=growable)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {**module.hparams, **recorded}}, path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama folder with its own BPE tokenizer, and a checkpoint of it grown to query/key head size 10."""
    root = tmp_path_factory.mktemp("model")
    folder = root / "llama"
    saved_tokenizer(folder, [TEXT] * 20, vocab_size=300)
    saved_tiny_model("llama", folder, vocab=320)
    return folder, hf_checkpoint(root / "grown.ckpt", folder, head_sizes=[10, 10])


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """A tiny Llama folder without tokenizer files."""
    folder = tmp_path_factory.mktemp("bare") / "llama"
    saved_tiny_model("llama", folder, vocab=320)
    return folder


@pytest.fixture(scope="module")
def from_config(tmp_path_factory):
    """A checkpoint of HFCausalLM trained from a config (no pretrained folder) on data that named no tokenizer."""
    from hf_helpers import tiny_config
    from lit_growattn.hf import HFCausalLM

    torch.manual_seed(0)
    module = HFCausalLM(config=tiny_config("llama", vocab=320).to_dict())
    path = tmp_path_factory.mktemp("from_config") / "scratch.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


def lone_tokenizer_json(folder) -> str:
    """A BPE with an <eos> special token saved as a tokenizer.json alone in `folder` (no tokenizer_config.json
    beside it), as `tokenizers` writes one; returns the file's path."""
    saved_tokenizer(folder, [TEXT] * 20, vocab_size=300)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    return str(folder / "tokenizer.json")


# -- item 4: never destroy a folder ------------------------------------------------------------------------------

def test_export_refuses_its_own_source_even_with_overwrite(model, cli):
    folder, ckpt = model
    before = snapshot(folder)
    for out, relation in ((folder, "is"), (folder / "sub", "is inside"), (folder.parent, "holds")):
        for overwrite in ([], ["--overwrite"]):
            refused(cli("export", "--ckpt", ckpt, "--out", out, *overwrite), f"--out {out} {relation}", "never overwritten")
    assert snapshot(folder) == before and not (folder / "sub").exists()


def test_export_refuses_a_folder_holding_its_checkpoint(model, tmp_path, cli):
    folder, ckpt = model
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ckpt, run / "last.ckpt")
    refused(cli("export", "--ckpt", run / "last.ckpt", "--out", run, "--overwrite"), "holds the checkpoint")
    assert (run / "last.ckpt").read_bytes() == ckpt.read_bytes()


def test_export_names_the_source_it_refuses_to_overwrite(model, tmp_path, cli):
    """Each of what export reads, named, even with --overwrite: the pretrained folder the model is built from, the
    one the checkpoint names (it still exists when --pretrained names a copy), the tokenizer, the checkpoint."""
    folder, ckpt = model
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    other = saved_tokenizer(tmp_path / "other", [TEXT[::-1]] * 20, vocab_size=280)
    on_other = hf_checkpoint(tmp_path / "other.ckpt", folder, tokenizer=other)
    before = snapshot(folder.parent), snapshot(tmp_path)
    for checkpoint, out, pretrained, relation, source, what in (
            (ckpt, folder, [], "is", folder, "the model's pretrained folder"),
            (ckpt, folder, ["--pretrained", copy], "is", folder, "the pretrained folder the checkpoint names"),
            (on_other, other, [], "is", other, "the model's tokenizer"),
            (on_other, tmp_path, [], "holds", on_other, "the checkpoint")):
        assert refusal(cli("export", "--ckpt", checkpoint, "--out", out, *pretrained, "--overwrite")) == (
            f"error: ValueError: --out {out} {relation} {what} ({source}), which is read to write it: it is never "
            "overwritten, not even with --overwrite; give --out a path outside it")
    assert (snapshot(folder.parent), snapshot(tmp_path)) == before


def test_export_into_an_existing_folder_needs_overwrite_and_then_replaces_it(model, tmp_path, cli):
    folder, ckpt = model
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused(cli("export", "--ckpt", ckpt, "--out", out), f"--out {out} already exists (notes.txt", "--overwrite")
    assert snapshot(out) == {"notes.txt": b"mine"}
    done = cli("export", "--ckpt", ckpt, "--out", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert not (out / "notes.txt").exists() and load(out).config.qk_head_sizes == [10, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it
    (tmp_path / "empty").mkdir()  # an empty folder is no one's work: taken without --overwrite
    assert cli("export", "--ckpt", ckpt, "--out", tmp_path / "empty").returncode == 0


def test_export_refuses_a_file_as_its_folder(model, tmp_path, cli):
    folder, ckpt = model
    file = tmp_path / "model.bin"
    file.write_text("not a folder")
    refused(cli("export", "--ckpt", ckpt, "--out", file), f"--out {file} is a file")
    refused(cli("export", "--ckpt", ckpt, "--out", file / "sub"), f"inside {file}, which is a file")
    assert file.read_text() == "not a folder"


def test_an_export_failing_midway_leaves_the_old_folder_whole(model, tmp_path, cli, monkeypatch):
    from transformers import PreTrainedModel

    folder, ckpt = model
    out = tmp_path / "out"
    assert cli("export", "--ckpt", ckpt, "--out", out).returncode == 0
    before = snapshot(out)
    save_pretrained = PreTrainedModel.save_pretrained

    def half_then_fail(self, directory, **kwargs):
        save_pretrained(self, directory, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", half_then_fail)
    refused(cli("export", "--ckpt", ckpt, "--out", out, "--overwrite"), "disk full")
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


KILLED_EXPORT = """
import sys, time
from pathlib import Path
from transformers import PreTrainedModel
from lit_growattn.__main__ import main

save_pretrained = PreTrainedModel.save_pretrained

def save_then_wait(self, directory, **kwargs):  # the weights are written, the tokenizer not yet
    save_pretrained(self, directory, **kwargs)
    Path(sys.argv[1]).touch()
    time.sleep(120)

PreTrainedModel.save_pretrained = save_then_wait
main(["export", *sys.argv[2:]])
"""


def test_an_export_killed_midway_leaves_the_old_folder_whole(model, tmp_path, cli):
    """A real `kill -9`, made deterministic: the child signals (a marker file) once the weights are written and
    waits there, so the kill always lands with the new folder half-written."""
    folder, ckpt = model
    out = tmp_path / "out"
    assert cli("export", "--ckpt", ckpt, "--out", out).returncode == 0
    before = snapshot(out)
    marker = tmp_path / "weights_written"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(marker), "--ckpt", str(ckpt), "--out", str(out),
                              "--overwrite"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the export never reached its weights"
            time.sleep(0.1)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert snapshot(out) == before
    (partial,) = [p for p in tmp_path.iterdir() if p.name not in ("out", marker.name)]
    assert partial.name.startswith(".out.") and partial.name.endswith(".partial")  # hidden, named after its target
    assert (partial / "model.safetensors").exists() and not (partial / "tokenizer.json").exists()


def test_convert_pretrained_never_replaces_its_source_and_needs_overwrite(model, tmp_path, cli):
    folder, _ = model
    before = snapshot(folder)
    for args in (["--out", folder, "--overwrite"], ["--out", folder / "dint"]):
        refused(cli("convert", "--pretrained", folder, "--to", "dint", *args), "never overwritten")
    assert snapshot(folder) == before
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    refused(cli("convert", "--pretrained", folder, "--to", "dint", "--out", tmp_path / "taken"), "already exists")
    refused(cli("convert", "--pretrained", folder, "--to", "dint", "--out", tmp_path / "taken" / "keep.txt"), "is a file")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def mha_ckpt(tmp_path_factory):
    """A checkpoint of the project's GPT (mha), as `convert --ckpt` takes it."""
    from lit_growattn.module import GrowAttentionLM

    torch.manual_seed(0)
    module = GrowAttentionLM(vocab_size=32, block_size=12, n_layer=1, n_embd=16, n_head=2, d_head=4)
    path = tmp_path_factory.mktemp("mha") / "mha.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


def test_convert_ckpt_writes_its_files_whole_and_never_onto_its_source(mha_ckpt, tmp_path, cli, monkeypatch):
    original = mha_ckpt.read_bytes()
    for out, relation in ((mha_ckpt, "is"), (mha_ckpt.parent, "holds"), (mha_ckpt / "x.ckpt", "is inside")):
        refused(cli("convert", "--ckpt", mha_ckpt, "--to", "dint", "--out", out, "--overwrite"),
                f"--out {out} {relation} the checkpoint", "not even with --overwrite")
    assert mha_ckpt.read_bytes() == original and sorted(p.name for p in mha_ckpt.parent.iterdir()) == ["mha.ckpt"]
    out = tmp_path / "dint.ckpt"
    assert cli("convert", "--ckpt", mha_ckpt, "--to", "dint", "--out", out).returncode == 0
    written = out.read_bytes(), out.with_suffix(".yaml").read_text()
    refused(cli("convert", "--ckpt", mha_ckpt, "--to", "dint", "--out", out), f"--out {out} already exists")
    refused(cli("convert", "--ckpt", mha_ckpt, "--to", "dint", "--out", out.with_suffix(".yaml"), "--overwrite"),
            "ends in .yaml")

    import yaml

    def checkpoint_written_then_fail(*args, **kwargs):  # the model config, the second of the two files
        (partial,) = tmp_path.glob(".dint.ckpt.*.partial")
        assert torch.load(partial, weights_only=True)["hyper_parameters"]["attention"] == "lowrank_dint"
        raise OSError("disk full")

    monkeypatch.setattr(yaml, "safe_dump", checkpoint_written_then_fail)
    refused(cli("convert", "--ckpt", mha_ckpt, "--to", "lowrank_dint", "--rank", "2", "--out", out, "--overwrite"),
            "disk full")
    assert (out.read_bytes(), out.with_suffix(".yaml").read_text()) == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dint.ckpt", "dint.yaml"]
    monkeypatch.undo()
    done = cli("convert", "--ckpt", mha_ckpt, "--to", "lowrank_dint", "--rank", "2", "--out", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert torch.load(out, weights_only=True)["hyper_parameters"]["attention"] == "lowrank_dint"
    assert "lowrank_dint" in out.with_suffix(".yaml").read_text()


def test_convert_puts_the_checkpoint_in_place_before_its_config(mha_ckpt, tmp_path, cli, monkeypatch):
    """The config names the checkpoint (init_from): a failure to put the checkpoint in place leaves the old pair, not
    a new config beside the old checkpoint; a failure after it, on the config, is reported as such."""
    out = tmp_path / "dint.ckpt"
    assert cli("convert", "--ckpt", mha_ckpt, "--to", "dint", "--out", out).returncode == 0
    written = out.read_bytes(), out.with_suffix(".yaml").read_bytes()
    real_replace = os.replace

    def refusing(suffix):
        def replace(src, dst):
            if str(dst).endswith(suffix):
                raise OSError("read-only file system")
            return real_replace(src, dst)
        return replace

    convert = ("convert", "--ckpt", mha_ckpt, "--to", "lowrank_dint", "--rank", "2", "--out", out, "--overwrite")
    monkeypatch.setattr(os, "replace", refusing(".ckpt"))
    refused(cli(*convert), "read-only file system")
    assert (out.read_bytes(), out.with_suffix(".yaml").read_bytes()) == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dint.ckpt", "dint.yaml"]
    monkeypatch.setattr(os, "replace", refusing(".yaml"))
    refused(cli(*convert), f"{out} is the new checkpoint, but its model config could not be put in place, so "
            f"{out.with_suffix('.yaml')} is not its config", "run the conversion again with --overwrite")
    assert torch.load(out, weights_only=True)["hyper_parameters"]["attention"] == "lowrank_dint"
    assert out.with_suffix(".yaml").read_bytes() == written[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dint.ckpt", "dint.yaml"]


def test_convert_keeps_a_checkpoint_that_appeared_while_it_converted(mha_ckpt, tmp_path, cli, monkeypatch):
    """check_output found no --out, then another process wrote one: without --overwrite it is kept, with no config
    of this conversion beside it."""
    import yaml

    out = tmp_path / "dint.ckpt"
    real_dump = yaml.safe_dump

    def another_process_writes_out(*args, **kwargs):
        out.write_bytes(b"theirs")
        return real_dump(*args, **kwargs)

    monkeypatch.setattr(yaml, "safe_dump", another_process_writes_out)
    refused(cli("convert", "--ckpt", mha_ckpt, "--to", "dint", "--out", out),
            f"FileExistsError: --out {out} appeared while this one was written", "nothing was replaced", "--overwrite")
    assert out.read_bytes() == b"theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["dint.ckpt"]


def test_convert_checkpoint_from_python_never_writes_onto_its_source_and_writes_whole(mha_ckpt, tmp_path, monkeypatch):
    from lit_growattn.commands.convert import convert_checkpoint

    original = mha_ckpt.read_bytes()
    for dst, relation in ((mha_ckpt, "is"), (mha_ckpt.parent, "holds"), (mha_ckpt / "x.ckpt", "is inside")):
        for overwrite in (False, True):
            with pytest.raises(ValueError, match=re.escape(f"dst_path {dst} {relation} the checkpoint src_path") +
                               ".*not even with overwrite=True"):
                convert_checkpoint(mha_ckpt, dst, to="mha", d_head=2, overwrite=overwrite)
    assert mha_ckpt.read_bytes() == original and sorted(p.name for p in mha_ckpt.parent.iterdir()) == ["mha.ckpt"]
    out = tmp_path / "small.ckpt"
    convert_checkpoint(mha_ckpt, out, to="mha", d_head=2)
    before = out.read_bytes()
    with pytest.raises(ValueError, match=re.escape(f"dst_path {out} already exists: give overwrite=True to replace")):
        convert_checkpoint(mha_ckpt, out, to="mha", d_head=3)
    save = torch.save

    def written_then_fail(obj, path, *args, **kwargs):
        save(obj, path, *args, **kwargs)
        assert torch.load(path, weights_only=True)["hyper_parameters"]["d_head"] == [3]  # whole, not yet in place
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", written_then_fail)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(mha_ckpt, out, to="mha", d_head=3, overwrite=True)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["small.ckpt"]
    monkeypatch.undo()
    convert_checkpoint(mha_ckpt, out, to="mha", d_head=3, overwrite=True)
    assert torch.load(out, weights_only=True)["hyper_parameters"]["d_head"] == [3]


def test_convert_pretrained_from_python_never_writes_onto_its_source_and_writes_whole(model, tmp_path, monkeypatch):
    from transformers import AutoConfig

    import lit_growattn.dint.models as models
    from lit_growattn.hf.dint import DintSettings

    folder, _ = model
    settings = DintSettings("full")
    before = snapshot(folder.parent)
    for out, relation in ((folder, "is"), (folder.parent, "holds"), (folder / "dint", "is inside")):
        for overwrite in (False, True):
            with pytest.raises(ValueError, match=re.escape(f"out {out} {relation} the model folder src ({folder})") +
                               ".*not even with overwrite=True"):
                models.convert_pretrained(str(folder), out, settings, overwrite=overwrite)
    assert snapshot(folder.parent) == before
    out = tmp_path / "dint"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=re.escape(f"out {out} already exists (keep.txt): give overwrite=True")):
        models.convert_pretrained(str(folder), out, settings)

    def weights_written_then_fail(partial, *args):  # the loading files, the last ones
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in partial.iterdir()}
        raise OSError("disk full")

    monkeypatch.setattr(models, "write_loading_files", weights_written_then_fail)
    with pytest.raises(OSError, match="disk full"):
        models.convert_pretrained(str(folder), out, settings, overwrite=True)
    assert snapshot(out) == {"keep.txt": b"mine"} and sorted(p.name for p in tmp_path.iterdir()) == ["dint"]
    monkeypatch.undo()
    models.convert_pretrained(str(folder), out, settings, overwrite=True)
    assert AutoConfig.from_pretrained(out).model_type == "dint_llama" and not (out / "keep.txt").exists()


def test_export_from_python_never_writes_onto_its_source_and_writes_whole(model, tmp_path, monkeypatch):
    import transformers.modeling_utils

    from lit_growattn.hf import HFCausalLM
    from lit_growattn.hf.export import export

    folder, _ = model
    grown = {d: HFCausalLM(pretrained=str(folder), head_sizes=[d, d]).model for d in (10, 12)}
    before = snapshot(folder.parent)
    for out, relation in ((folder, "is"), (folder.parent, "holds"), (folder / "sub", "is inside")):
        for overwrite in (False, True):
            with pytest.raises(ValueError, match=re.escape(f"out {out} {relation} the folder the model was loaded "
                                                           f"from ({folder})") + ".*not even with overwrite=True"):
                export(grown[10], out, overwrite=overwrite)
    assert snapshot(folder.parent) == before
    out = tmp_path / "out"
    export(grown[10], out)
    old = snapshot(out)
    with pytest.raises(ValueError, match=re.escape(f"out {out} already exists (config.json") + ".*give overwrite=True"):
        export(grown[12], out)

    def config_written_then_fail(*args, **kwargs):  # the weights, after config.json
        (partial,) = tmp_path.glob(".out.*.partial")
        assert (partial / "config.json").is_file()
        raise OSError("disk full")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", config_written_then_fail)
    with pytest.raises(OSError, match="disk full"):
        export(grown[12], out, overwrite=True)
    assert snapshot(out) == old and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.undo()
    export(grown[12], out, overwrite=True)
    assert load(out).config.qk_head_sizes == [12, 12]


def test_export_onto_a_link_replaces_the_folder_it_points_to_and_keeps_the_link(model, tmp_path, cli):
    folder, ckpt = model
    real = tmp_path / "v1"
    assert cli("export", "--ckpt", ckpt, "--out", real).returncode == 0
    (real / "notes.txt").write_text("old")
    link = tmp_path / "latest"
    link.symlink_to(real)
    refused(cli("export", "--ckpt", ckpt, "--out", link), f"--out {link} already exists", "--overwrite")
    done = cli("export", "--ckpt", ckpt, "--out", link, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and link.resolve() == real and not (real / "notes.txt").exists()
    assert load(link).config.qk_head_sizes == [10, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v1"]  # nothing hidden left beside them


def test_convert_pretrained_names_what_it_cannot_convert_and_writes_nothing(tmp_path):
    """From Python: a folder without config.json, a model type DINT does not cover, a weights file holding an object."""
    import lit_growattn.dint.models as models
    from lit_growattn.hf.dint import DintSettings

    out, settings = tmp_path / "dint", DintSettings("full")
    with pytest.raises(FileNotFoundError) as error:
        models.convert_pretrained(str(tmp_path), out, settings)
    assert str(error.value) == (f"--pretrained {str(tmp_path)!r} is not a model folder (no config.json): give a local "
                                "folder written by save_pretrained (models are never downloaded here)")
    gpt2 = saved_tiny_model("gpt2", tmp_path / "gpt2")
    with pytest.raises(ValueError) as error:
        models.convert_pretrained(gpt2, out, settings)
    assert str(error.value) == "DINT conversion supports model types llama, mistral, qwen2, qwen3, not 'gpt2'"
    pickled = tmp_path / "pickled"
    saved_tiny_model("llama", pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": RunsCode()}, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError) as error:
        models.convert_pretrained(str(pickled), out, settings)
    assert str(error.value) == (
        f"a weights file of {pickled} holds Python objects such as {os.getcwd.__module__}.getcwd beyond tensors and "
        "plain containers; loading them could run code from the file, so it is refused. If you trust the file, save "
        "only its tensors and plain values (a checkpoint's 'state_dict' and 'hyper_parameters') to a new file.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "pickled"]


def slow_tokenizer_files(folder) -> None:
    """The tokenizer of `folder` as vocab.json, merges.txt and a tokenizer_config.json naming GPT2Tokenizer: no
    tokenizer.json."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(folder).backend_tokenizer.model.save(str(folder))
    (folder / "tokenizer.json").unlink()
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<eos>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("tokenizer", ["tokenizer.json alone", "tokenizer_config.json without tokenizer.json"])
def test_convert_pretrained_writes_the_model_its_tokenizer_and_how_to_load_them(bare_model, tmp_path, tokenizer):
    """convert_pretrained with its defaults (seed 0): the converted weights, src's tokenizer (in either form a
    folder may hold it), and a README.md naming the folder, its model type and where it came from."""
    from transformers import AutoTokenizer

    import lit_growattn.dint.models as models
    from lit_growattn.hf.dint import DintSettings
    from lit_growattn.dint.models import convert_to_dint
    from lit_growattn.hf.loading import MODEL_CARD

    src = tmp_path / "llama"
    shutil.copytree(bare_model, src)
    lone_tokenizer_json(src)
    if tokenizer != "tokenizer.json alone":
        slow_tokenizer_files(src)
    out, settings = tmp_path / "dint", DintSettings("lowrank", rank=2)
    converted = models.convert_pretrained(str(src), out, settings)
    expected = convert_to_dint(load(src), settings, seed=0).state_dict()
    torch.testing.assert_close(load(out).state_dict(), expected, atol=0, rtol=0)
    torch.testing.assert_close(converted.state_dict(), expected, atol=0, rtol=0)
    assert (out / "README.md").read_text() == MODEL_CARD.format(name=str(out), model_type="dint_llama",
                                                                origin=f"the DINT conversion of {src}")
    assert AutoTokenizer.from_pretrained(out)(TEXT).input_ids == AutoTokenizer.from_pretrained(src)(TEXT).input_ids


def test_convert_pretrained_keeps_an_out_that_appeared_while_it_converted(model, tmp_path, monkeypatch):
    """Without overwrite, an `out` another process wrote meanwhile is kept, and the refusal names the option as the
    Python caller gives it."""
    import lit_growattn.dint.models as models
    from lit_growattn.hf.dint import DintSettings

    folder, _ = model
    out = tmp_path / "dint"
    write_loading_files = models.write_loading_files

    def another_process_writes_out(*args):
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
        write_loading_files(*args)

    monkeypatch.setattr(models, "write_loading_files", another_process_writes_out)
    with pytest.raises(FileExistsError) as error:
        models.convert_pretrained(str(folder), out, DintSettings("full"))
    assert str(error.value) == (f"out {out} appeared while this one was written (another process wrote it): nothing "
                                "was replaced, and what was written here is discarded; give overwrite=True to replace "
                                "it, or another path")
    assert snapshot(out) == {"theirs.txt": b"theirs"} and sorted(p.name for p in tmp_path.iterdir()) == ["dint"]


def test_convert_names_a_damaged_weights_file(model, tmp_path, cli):
    folder, _ = model
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    refused(cli("convert", "--pretrained", damaged, "--to", "dint", "--out", tmp_path / "dint"),
            f"ValueError: {weights} is damaged", "save or download the model folder again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged"]


# -- item 8: the low-rank DINT rank ------------------------------------------------------------------------------

def test_convert_bounds_the_rank_by_the_head_size(model, tmp_path, cli):
    folder, _ = model  # hidden 32, head size 8
    refused(cli("convert", "--pretrained", folder, "--to", "lowrank_dint", "--rank", "1000", "--out", tmp_path / "d"),
            "rank=1000 exceeds the head size 8", "use rank ≤ 8")
    assert not (tmp_path / "d").exists() and list(tmp_path.iterdir()) == []


# -- item 9: what convert and export print -----------------------------------------------------------------------

def test_the_fine_tune_command_that_convert_prints_runs(model, tmp_path, cli):
    from lit_growattn.data.arithmetic import make_rows, write_jsonl

    folder, _ = model
    done = cli("convert", "--pretrained", folder, "--to", "lowrank_dint", "--rank", "2", "--out", tmp_path / "dint")
    assert done.returncode == 0, done.stderr
    assert "import lit_growattn.hf" in (tmp_path / "dint" / "README.md").read_text()
    (command,) = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("python -m lit_growattn fit")]
    args = shlex.split(command.replace("<run config>", str(REPO / "configs" / "hf_llama_dint_sft_tiny.yaml")))[3:]
    rows = write_jsonl(tmp_path / "rows.jsonl", make_rows(24, seed=0))
    # As printed, plus what every run supplies: its data, and here a short run under tmp_path.
    done = cli(*args, f"--data.init_args.path={rows}", f"--data.init_args.cache_dir={tmp_path / 'cache'}",
               "--trainer.max_steps=2", f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}")
    assert done.returncode == 0, done.stderr[-3000:]
    (ckpt,) = tmp_path.rglob("last.ckpt")
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["pretrained"] == str(tmp_path / "dint")


def test_a_grown_export_prints_what_it_wrote_and_its_readme_names_the_folder_and_checkpoint(model, tmp_path, cli):
    _, ckpt = model
    out = tmp_path / "grown"
    assert printed(cli("export", "--ckpt", ckpt, "--out", out)) == [
        f"wrote {out}: model type growattn_llama, query/key head sizes [10, 10], value head sizes [8, 8], tokenizer "
        f"files tokenizer.json, tokenizer_config.json; load it after `import lit_growattn.hf` ({out / 'README.md'})"]
    readme = (out / "README.md").read_text().splitlines()
    assert readme[0] == f"# {out}"
    assert readme[2].startswith(f"A `growattn_llama` model written by lit_growattn (`python -m lit_growattn export` "
                                f"of {ckpt}). ")
    assert f'model = AutoModelForCausalLM.from_pretrained("{out}")' in readme


def test_export_of_a_folder_without_tokenizer_files_or_growable_heads_says_so(bare_model, tmp_path, cli):
    ckpt = hf_checkpoint(tmp_path / "run.ckpt", bare_model, growable=False)
    out = tmp_path / "out"
    assert printed(cli("export", "--ckpt", ckpt, "--out", out)) == [
        f"wrote {out}: model type llama, no tokenizer files ({bare_model} has none)"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_export_of_a_model_trained_from_a_config_on_no_named_tokenizer_says_so(from_config, tmp_path, cli):
    out = tmp_path / "out"
    assert printed(cli("export", "--ckpt", from_config, "--out", out)) == [
        f"wrote {out}: model type llama, query/key head sizes [8, 8], value head sizes [8, 8], no tokenizer (the "
        "checkpoint names none)"]


LOADS_WITHOUT_IMPORT = """
import builtins
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def prompt(question=""):
    print("PROMPTED:", question.splitlines()[0])
    raise EOFError  # as a closed stdin answers


builtins.input = prompt
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print("TOKENIZER:", tokenizer.eos_token, "lit_growattn" in sys.modules)
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
except ValueError as error:
    print("REFUSED:", error)
import lit_growattn.hf
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
print("LOADED:", type(model).__name__)
with torch.no_grad():
    torch.save(model(torch.arange(12)[None] % 96).logits, sys.argv[2])
"""


def test_a_grown_export_says_how_to_load_it_and_its_tokenizer_loads_without_the_import_or_a_prompt(model, tmp_path,
                                                                                                    cli):
    folder, ckpt = model
    done = cli("export", "--ckpt", ckpt, "--out", tmp_path / "grown")
    assert done.returncode == 0, done.stderr
    assert "model type growattn_llama" in done.stdout and "load it after `import lit_growattn.hf`" in done.stdout
    assert "import lit_growattn.hf" in (tmp_path / "grown" / "README.md").read_text()
    assert "auto_map" not in json.loads((tmp_path / "grown" / "config.json").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    child = subprocess.run([sys.executable, "-c", LOADS_WITHOUT_IMPORT, str(tmp_path / "grown"), str(tmp_path / "l.pt")],
                           env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "PROMPTED" not in child.stdout
    assert "TOKENIZER: <eos> False" in child.stdout  # the tokenizer needs neither lit_growattn nor remote code
    # No remote code to trust: the model type is lit_growattn's, and transformers says it does not know it.
    assert "REFUSED: The checkpoint you are trying to load has model type `growattn_llama`" in child.stdout
    assert "LOADED: GrowAttnLlamaForCausalLM" in child.stdout
    with torch.no_grad():
        expected = load(tmp_path / "grown")(torch.arange(12)[None] % VOCAB).logits  # this process imported it
    torch.testing.assert_close(torch.load(tmp_path / "l.pt"), expected, rtol=0, atol=1e-6)


# -- item 5: the tokenizer the model was trained with, a moved folder, non-finite weights ------------------------

def test_export_of_a_moved_folder_takes_pretrained(model, tmp_path, cli):
    folder, _ = model
    moved = tmp_path / "was_here"
    shutil.copytree(folder, moved)
    ckpt = hf_checkpoint(tmp_path / "run.ckpt", moved, tokenizer=str(moved))
    ckpt_of_file = hf_checkpoint(tmp_path / "file.ckpt", moved, tokenizer=str(moved / "tokenizer.json"))
    shutil.move(moved, tmp_path / "now_here")
    assert refusal(cli("export", "--ckpt", ckpt, "--out", tmp_path / "out")) == (
        f"error: FileNotFoundError: the model was trained with the tokenizer of {moved}, which is not a folder or file "
        "here (moved?): give --pretrained DIR, the folder's new place, or --tokenizer DIR, a copy of its tokenizer "
        "kept elsewhere")
    done = cli("export", "--ckpt", ckpt, "--out", tmp_path / "out", "--pretrained", tmp_path / "now_here")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    # A new place without the tokenizer: --pretrained was given, so the fix left is --tokenizer.
    for name in TOKENIZER_FILES:
        (tmp_path / "now_here" / name).unlink(missing_ok=True)
    for trained_with, lost in ((ckpt_of_file, "tokenizer.json"), (ckpt, "tokenizer files")):
        recorded = torch.load(trained_with, weights_only=True)["hyper_parameters"]["tokenizer"]
        assert refusal(cli("export", "--ckpt", trained_with, "--out", tmp_path / "out2", "--pretrained",
                           tmp_path / "now_here")) == (
            f"error: FileNotFoundError: --pretrained {tmp_path / 'now_here'} holds no {lost}, and the model was "
            f"trained with the tokenizer of {recorded}: give --tokenizer PATH, where a copy of that tokenizer is now")
    assert not (tmp_path / "out2").exists()
    # The folder where it was recorded, still there but without its tokenizer: what it lacks is named.
    in_place = hf_checkpoint(tmp_path / "in_place.ckpt", tmp_path / "now_here", tokenizer=str(tmp_path / "now_here"))
    assert refusal(cli("export", "--ckpt", in_place, "--out", tmp_path / "out3")) == (
        f"error: FileNotFoundError: the model was trained with the tokenizer of {tmp_path / 'now_here'}, which holds no "
        "tokenizer files: give --pretrained DIR, the folder's new place, or --tokenizer DIR, a copy of its tokenizer "
        "kept elsewhere")


def test_a_tokenizer_folder_holding_only_tokenizer_json_is_exported_with_a_config(bare_model, tmp_path, cli):
    """A folder with a tokenizer.json alone (no tokenizer_config.json): the export gets the same config as a lone
    tokenizer.json file, so AutoTokenizer does not pick a class by the model type."""
    source = Path(lone_tokenizer_json(tmp_path / "tok")).parent
    ckpt = hf_checkpoint(tmp_path / "run.ckpt", bare_model, tokenizer=str(source))
    out = tmp_path / "out"
    assert printed(cli("export", "--ckpt", ckpt, "--out", out)) == [
        f"wrote {out}: model type llama, query/key head sizes [8, 8], value head sizes [8, 8], tokenizer files "
        "tokenizer.json, tokenizer_config.json"]
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"tokenizer_class": "PreTrainedTokenizerFast"}


def test_export_names_a_file_that_is_not_a_checkpoint(tmp_path, cli):
    tensor = tmp_path / "tensor.ckpt"
    torch.save(torch.zeros(2), tensor)
    assert refusal(cli("export", "--ckpt", tensor, "--out", tmp_path / "out")) == (
        f"error: ValueError: {str(tensor)!r} holds a Tensor, not a checkpoint (the dictionary of state_dict, "
        "hyper_parameters, … that Lightning writes): give a checkpoint written by `python -m lit_growattn fit` or "
        "`convert`")


def test_export_names_a_pretrained_folder_that_is_not_there(model, tmp_path, cli):
    folder, ckpt = model
    (tmp_path / "empty").mkdir()
    for pretrained, problem in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "empty", "holds no config.json")):
        refused(cli("export", "--ckpt", ckpt, "--out", tmp_path / "out", "--pretrained", pretrained),
                f"--pretrained {pretrained} {problem}: give the model folder the checkpoint was trained from ({folder} ")
    assert not (tmp_path / "out").exists()


def test_export_copies_the_tokenizer_the_model_was_trained_with(model, tmp_path, cli):
    folder, _ = model
    on_bytes = hf_checkpoint(tmp_path / "bytes.ckpt", folder, tokenizer="bytes")
    assert printed(cli("export", "--ckpt", on_bytes, "--out", tmp_path / "bytes")) == [
        f"wrote {tmp_path / 'bytes'}: model type llama, query/key head sizes [8, 8], value head sizes [8, 8], no "
        "tokenizer files: the model was trained on raw bytes (token ids 0–255, the bytes of UTF-8 text)"]
    assert not [p.name for p in (tmp_path / "bytes").iterdir() if p.name.startswith("tokenizer")]

    other = saved_tokenizer(tmp_path / "other", [TEXT[::-1]] * 20, vocab_size=280)
    on_other = hf_checkpoint(tmp_path / "other.ckpt", folder, tokenizer=other)
    assert cli("export", "--ckpt", on_other, "--out", tmp_path / "other_export").returncode == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the tokenizer's own config, never one written here
        assert (tmp_path / "other_export" / name).read_bytes() == (tmp_path / "other" / name).read_bytes()

    shutil.rmtree(tmp_path / "other")
    assert refusal(cli("export", "--ckpt", on_other, "--out", tmp_path / "gone")) == (
        f"error: FileNotFoundError: the model was trained with the tokenizer of {other}, which is not a folder or file "
        "here (moved?): put it there, or give --tokenizer, where a copy of it is now (export copies the tokenizer the "
        "model was trained with, never another)")


def test_export_refuses_a_tokenizer_option_that_does_not_exist(model, tmp_path, cli):
    _, ckpt = model
    missing = tmp_path / "tokenizer.json"
    assert refusal(cli("export", "--ckpt", ckpt, "--out", tmp_path / "out", "--tokenizer", missing)) == (
        f"error: FileNotFoundError: --tokenizer {missing} does not exist: give the folder (or tokenizer.json) of the "
        "tokenizer the model was trained with")
    assert list(tmp_path.iterdir()) == []


def test_export_of_a_lone_tokenizer_json_writes_the_config_that_autotokenizer_loads_it_by(bare_model, tmp_path, cli):
    """A tokenizer.json with no tokenizer_config.json beside it (as `tokenizers` saves one): export copies it and
    writes a tokenizer_config.json naming its class; AutoTokenizer loads the training tokenizer, special tokens too."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    source = lone_tokenizer_json(tmp_path / "tok")
    ckpt = hf_checkpoint(tmp_path / "run.ckpt", bare_model, tokenizer=source)
    out = tmp_path / "out"
    assert printed(cli("export", "--ckpt", ckpt, "--out", out)) == [
        f"wrote {out}: model type llama, query/key head sizes [8, 8], value head sizes [8, 8], tokenizer files "
        "tokenizer.json, tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == Path(source).read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"tokenizer_class": "PreTrainedTokenizerFast"}
    trained, loaded = Tokenizer.from_file(source), AutoTokenizer.from_pretrained(out)
    special = lambda added: {i: token.content for i, token in added.items() if token.special}  # noqa: E731
    assert special(loaded.added_tokens_decoder) == special(trained.get_added_tokens_decoder()) == {0: "<eos>"}
    assert loaded.get_vocab() == trained.get_vocab(with_added_tokens=True)
    assert loaded(TEXT[:40] + "<eos>").input_ids == trained.encode(TEXT[:40] + "<eos>").ids


def test_export_finds_a_recorded_tokenizer_json_in_the_moved_folder_by_its_name(bare_model, tmp_path, cli):
    """Trained with the model folder's tokenizer.json (the file, not the folder): the folder's new place
    (--pretrained) holds it under the same name, and it is exported as that lone file is, with a config."""
    moved = tmp_path / "was_here"
    shutil.copytree(bare_model, moved)
    ckpt = hf_checkpoint(tmp_path / "run.ckpt", moved, tokenizer=lone_tokenizer_json(moved))
    shutil.move(moved, tmp_path / "now_here")
    out = tmp_path / "out"
    assert printed(cli("export", "--ckpt", ckpt, "--out", out, "--pretrained", tmp_path / "now_here")) == [
        f"wrote {out}: model type llama, query/key head sizes [8, 8], value head sizes [8, 8], tokenizer files "
        "tokenizer.json, tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "now_here" / "tokenizer.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"tokenizer_class": "PreTrainedTokenizerFast"}


def test_export_refuses_a_checkpoint_not_of_hf_causal_lm(mha_ckpt, tmp_path, cli):
    weights = tmp_path / "weights.ckpt"  # a state dict saved alone: no hyperparameters at all
    torch.save(torch.load(mha_ckpt, weights_only=True)["state_dict"], weights)
    config_only = tmp_path / "config_only.ckpt"  # another module's: a config, but no pretrained folder
    torch.save({"state_dict": {}, "hyper_parameters": {"config": {"model_type": "llama"}}}, config_only)
    for path in (mha_ckpt, weights, config_only):
        assert refusal(cli("export", "--ckpt", path, "--out", tmp_path / "out")) == (
            f"error: ValueError: {path} is not a checkpoint of lit_growattn.hf.HFCausalLM (its hyperparameters have "
            "no pretrained/config); for GrowAttentionLM checkpoints use `python -m lit_growattn convert`")
    assert not (tmp_path / "out").exists()


def test_export_refuses_pretrained_for_a_checkpoint_trained_from_a_config(from_config, model, tmp_path, cli):
    folder, _ = model
    assert refusal(cli("export", "--ckpt", from_config, "--out", tmp_path / "out", "--pretrained", folder)) == (
        f"error: ValueError: {from_config} was trained from a config, not a pretrained folder: leave out --pretrained")
    assert not (tmp_path / "out").exists()


def test_export_refuses_non_finite_weights(model, tmp_path, cli):
    folder, ckpt = model
    saved = torch.load(ckpt, weights_only=True)
    saved["state_dict"]["model.model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    torch.save(saved, tmp_path / "nan.ckpt")
    refused(cli("export", "--ckpt", tmp_path / "nan.ckpt", "--out", tmp_path / "out"), "TrainingDiverged",
            "non-finite weights (1 tensors: model.model.layers.1.mlp.up_proj.weight)", "not exported")
    assert not (tmp_path / "out").exists()


# -- item 10: no refusal advises the unsafe load -----------------------------------------------------------------

class RunsCode:
    def __reduce__(self):
        return os.getcwd, ()


def unreadable_checkpoints(folder):
    """Files that weights_only loading refuses, each in a way torch's message advises weights_only=False."""
    import pickle

    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    with open(folder / "plain_pickle.ckpt", "wb") as f:  # pickle.dump of an object, not torch.save
        pickle.dump({"state_dict": {}, "hyper_parameters": {"x": RunsCode()}}, f)
    torch.save({"state_dict": {}, "hyper_parameters": {"x": RunsCode()}}, folder / "object.ckpt")
    torch.jit.save(torch.jit.script(Identity()), folder / "torchscript.ckpt")
    (folder / "text.ckpt").write_text("not a checkpoint\n")
    return sorted(folder.glob("*.ckpt"))


# The files are made unreadable on purpose: a TorchScript archive (torch.jit deprecates making one) and a plain
# pickle (a protocol torch.load does not expect).
@pytest.mark.filterwarnings("ignore:`torch.jit.s.*` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*TorchScript archive:UserWarning")
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_no_refusal_of_a_checkpoint_advises_weights_only_false(tmp_path, cli):
    fit = ["fit", "--config", REPO / "configs/recall_grow.yaml", f"--trainer.default_root_dir={tmp_path}",
           f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}"]
    cases = [(path, ["convert", "--ckpt", path, "--to", "dint", "--out", tmp_path / "out.ckpt"])
             for path in unreadable_checkpoints(tmp_path)]
    cases += [(path, ["export", "--ckpt", path, "--out", tmp_path / "out"]) for path, _ in cases]
    plain_pickle = tmp_path / "plain_pickle.ckpt"  # the reported case, also on fit's two ways of reading a checkpoint
    cases += [(plain_pickle, [*fit, f"--ckpt_path={plain_pickle}"]),
              (plain_pickle, [*fit, f"--model.init_args.init_from={plain_pickle}"])]
    # A model folder whose weights file holds an object: read by transformers, on the way of convert and fit.
    folder = tmp_path / "model"
    saved_tokenizer(folder, [TEXT] * 20, vocab_size=300)
    saved_tiny_model("llama", folder, vocab=320)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": RunsCode()}, folder / "pytorch_model.bin")
    cases += [(folder, ["convert", "--pretrained", folder, "--to", "dint", "--out", tmp_path / "dint"]),
              ("a file being loaded", ["fit", "--config", REPO / "configs/hf_llama_grow.yaml", "--model.init_args.config=null",
                                       f"--model.init_args.pretrained={folder}", f"--data.init_args.tokenizer={folder}",
                                       f"--data.init_args.path={folder / 'config.json'}",
                                       f"--trainer.default_root_dir={tmp_path}",
                                       f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}"])]
    for path, args in cases:
        done = cli(*args)
        report = refused(done, path)
        assert "weights_only=False" not in done.stderr and "set to `False`" not in done.stderr, report
        assert "refused" in report or "damaged" in report, report


def test_a_tokenizer_folder_inside_the_model_folder_is_the_one_exported(model, tmp_path, cli):
    """Trained with a tokenizer kept in a subfolder of the model folder, which has a tokenizer of its own: the export
    takes the subfolder's, the one the model was trained with."""
    folder, _ = model
    holder = tmp_path / "llama"
    shutil.copytree(folder, holder)
    own = saved_tokenizer(holder / "custom_tok", [TEXT[::-1]] * 20, vocab_size=280)
    ckpt = hf_checkpoint(tmp_path / "run.ckpt", holder, head_sizes=[10, 10], tokenizer=own)
    assert cli("export", "--ckpt", ckpt, "--out", tmp_path / "out").returncode == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (holder / "custom_tok" / name).read_bytes()


def test_exporting_a_model_loaded_from_an_earlier_export_drops_its_loader_and_nothing_else(model, tmp_path):
    """An export of before the loader was dropped names an auto_map in config.json: writing the loading files
    removes it and leaves config.json as save_pretrained wrote it."""
    from lit_growattn.hf.loading import write_loading_files

    folder, _ = model
    written = tmp_path / "export"
    shutil.copytree(folder, written)
    as_saved = (written / "config.json").read_bytes()
    config = json.loads(as_saved)
    config["auto_map"] = {"AutoModelForCausalLM": "loader.GrowAttnLlamaForCausalLM"}
    (written / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_loading_files(written, "growattn_llama", str(written), "a test")
    assert (written / "config.json").read_bytes() == as_saved
