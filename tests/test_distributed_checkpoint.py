"""A distributed checkpoint folder, as `fit` under ModelParallelStrategy writes it by default, is read wherever a
checkpoint file is: read_checkpoint, init_from, export, convert, and the CLI's `--ckpt_path`. Each is compared with
the same run's checkpoint written as one file (save_distributed_checkpoint=False).

The runs are one process with a mesh of one (gloo), in this process: a few seconds each, shared by the module."""

import os
import shutil
from unittest import mock
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings
from lit_growattn.commands import convert, export
from lit_growattn.training.checkpoint import read_checkpoint, read_hyperparameters

from callback_helpers import recall_data, tiny_module
from conftest import needs_transformers
from hf_helpers import saved_tiny_model

GROWN = {"d_head": [4, 4], "d_v": [10, 10]}  # the sizes after the growth at epoch 1 (from 2 and 8)


def fit_one_process(module_of, out: Path, distributed: bool) -> Path:
    """The last checkpoint of a 2-epoch run growing both sides of every layer at epoch 1, under
    ModelParallelStrategy in this process; `module_of(data)` builds the model."""
    L.seed_everything(0, verbose=False)
    data = recall_data(batch_size=4, examples=16)
    growth = GrowAttentionCallback(schedule=AtEpochs([1]), growth=GrowthSettings(grow="both", columns=2,
                                   value_columns=2), statistics=StatisticsSettings(batches=2))
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1,
                                     save_distributed_checkpoint=distributed)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="32-true", max_epochs=2,
                        logger=False, default_root_dir=out, callbacks=[growth, ModelCheckpoint(out)],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=1, deterministic=True)
    with mock.patch.dict(os.environ):  # the strategy sets MASTER_PORT and others for its process group
        try:
            trainer.fit(module_of(data), data)
        finally:
            dist.destroy_process_group()  # the strategy leaves it for a later stage; other tests make their own
    (checkpoint,) = out.glob("*.ckpt")
    return checkpoint


def both_forms(module_of, out: Path) -> dict[str, Path]:
    """The same run's last checkpoint as a distributed checkpoint "folder" and as one "file"."""
    return {form: fit_one_process(module_of, out / form, form == "folder") for form in ("folder", "file")}


@pytest.fixture(scope="module")
def grown(tmp_path_factory) -> dict[str, Path]:
    return both_forms(lambda data: tiny_module(data, dropout=0.0), tmp_path_factory.mktemp("grown"))


def test_a_folder_reads_as_the_file_of_the_same_run(grown):
    folder, file = read_checkpoint(grown["folder"]), read_checkpoint(grown["file"])
    assert grown["folder"].is_dir() and (grown["folder"] / ".metadata").is_file() and grown["file"].is_file()
    assert folder["state_dict"].keys() == file["state_dict"].keys()
    for name, tensor in file["state_dict"].items():
        assert folder["state_dict"][name].dtype == tensor.dtype and torch.equal(folder["state_dict"][name], tensor)
    assert folder["state_dict"]["model.blocks.0.attn.qk.w_q"].shape[-1] == GROWN["d_head"][0]
    assert folder["hyper_parameters"] == file["hyper_parameters"]
    assert {k: folder["hyper_parameters"][k] for k in GROWN} == GROWN
    assert (folder["epoch"], folder["global_step"]) == (file["epoch"], file["global_step"])
    assert "optimizer_states" not in folder  # weights only
    assert read_hyperparameters(grown["folder"]) == file["hyper_parameters"]


def test_init_from_a_folder_builds_the_model_init_from_the_file_builds(grown):
    data = recall_data(batch_size=4, examples=16)
    from_folder, from_file = (tiny_module(data, init_from=str(grown[form])) for form in ("folder", "file"))
    assert (from_folder.head_sizes(), from_folder.value_sizes()) == (GROWN["d_head"], GROWN["d_v"])
    want = from_file.state_dict()
    got = from_folder.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)


def test_convert_of_a_folder_writes_what_convert_of_the_file_writes(grown, tmp_path, capsys):
    for form in ("folder", "file"):
        convert.main(["--ckpt", str(grown[form]), "--to", "mha", "--d_head", "2", "--out", str(tmp_path / f"{form}.ckpt")])
    assert "wrote" in capsys.readouterr().out
    folder, file = (read_checkpoint(tmp_path / f"{form}.ckpt") for form in ("folder", "file"))
    assert folder["hyper_parameters"] == file["hyper_parameters"] and folder["hyper_parameters"]["d_head"] == [2, 2]
    assert folder["state_dict"].keys() == file["state_dict"].keys()
    assert all(torch.equal(folder["state_dict"][name], tensor) for name, tensor in file["state_dict"].items())
    configs = [yaml.safe_load((tmp_path / f"{form}.yaml").read_text()) for form in ("folder", "file")]
    assert [c["init_args"].pop("init_from") for c in configs] == [str(tmp_path / f"{f}.ckpt") for f in ("folder", "file")]
    assert configs[0] == configs[1]


def test_export_of_a_folder_writes_what_export_of_the_file_writes(tmp_path_factory, capsys):
    needs_transformers()
    from lit_growattn.hf import HFCausalLM

    out = tmp_path_factory.mktemp("hf")
    llama = saved_tiny_model("llama", out / "llama")
    checkpoints = both_forms(lambda data: HFCausalLM(pretrained=llama, vocab_size=data.vocab_size,
                                                     block_size=data.max_seq_len, warmup_steps=0, lr_schedule="cosine"),
                             out)
    for form, checkpoint in checkpoints.items():
        export.main(["--ckpt", str(checkpoint), "--out", str(out / f"{form}_export")])
    assert "wrote" in capsys.readouterr().out
    written = {form: sorted(p.name for p in (out / f"{form}_export").iterdir()) for form in checkpoints}
    assert written["folder"] == written["file"] and "config.json" in written["file"]
    # Each file as exported from the file, but for the README's names of the export and the checkpoint it came from.
    for name in written["file"]:
        folder, file = ((out / f"{form}_export" / name).read_bytes() for form in ("folder", "file"))
        if name == "README.md":
            for path in (lambda form: out / f"{form}_export", checkpoints.get):
                folder = folder.replace(str(path("folder")).encode(), str(path("file")).encode())
        assert folder == file, name


def test_the_cli_evaluates_a_folder_with_the_settings_it_was_trained_with(tmp_path, cli):
    """As for a checkpoint file, LightningCLI builds the model from the checkpoint's hyperparameters (its grown
    sizes), and the model settings of the command that differ are named."""
    run = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
                    "max_epochs": 2, "limit_val_batches": 1, "default_root_dir": str(tmp_path),
                    "strategy": {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                 "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1}}},
        "model": {"class_path": "lit_growattn.GrowAttentionLM", "init_args": {
            "n_layer": 2, "n_head": 2, "n_embd": 16, "d_head": 2, "d_v": 8, "warmup_steps": 0}},
        "data": {"class_path": "lit_growattn.data.FusedRecallDataModule", "init_args": {
            "num_keys": 8, "num_values": 4, "num_kv_pairs": 4, "num_train_examples": 16, "num_val_examples": 8,
            "batch_size": 4}},
    }
    growth = {"class_path": "lit_growattn.GrowAttentionCallback", "init_args": {
        "schedule": {"class_path": "lit_growattn.AtEpochs", "init_args": {"epochs": [1]}},
        "growth": {"columns": 2}, "statistics": {"batches": 2}}}
    train = tmp_path / "train.yaml"
    train.write_text(yaml.safe_dump({**run, "trainer": {**run["trainer"], "callbacks": [growth]}}))
    # The strategy sets MASTER_PORT and others for its process group, whose store this process may keep listening
    # on: left set, they would send the processes that later tests launch to a port in use.
    with mock.patch.dict(os.environ):
        try:
            trained = cli("fit", "--config", train)
            assert trained.returncode == 0, trained.stderr[-3000:]
            folder = tmp_path / "checkpoints" / "last.ckpt"
            assert (folder / ".metadata").is_file() and read_hyperparameters(folder)["d_head"] == [4, 4]
            # With the config it was trained by, the growth callback included (which plays no part in validate).
            with pytest.warns(UserWarning) as warned:
                done = cli("validate", "--config", train, "--ckpt_path", folder, "--model.init_args.n_head=4")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert [str(w.message) for w in warned] == [
        f"validate evaluates {folder} with the model settings it was trained with, not the command's: n_head: 4 given, "
        "the checkpoint's 2 used. To evaluate other settings, give a checkpoint trained with them"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "val/loss" in done.stdout


@pytest.mark.parametrize("damage, message", [
    (lambda folder: (folder / "meta.pt").unlink(),
     r"the distributed checkpoint '.*' has no meta\.pt, where Lightning keeps its hyperparameters, epoch and step: it "
     r"is incomplete \(copied in part\?\); use another checkpoint"),
    (lambda folder: (folder / ".metadata").write_bytes((folder / ".metadata").read_bytes()[:200]),
     r"checkpoint '.*' is damaged \(truncated or overwritten\?\) and cannot be read; use another checkpoint"),
    (lambda folder: (folder / "__0_0.distcp").write_bytes((folder / "__0_0.distcp").read_bytes()[:200]),
     r"checkpoint '.*' is damaged \(truncated or overwritten\?\) and cannot be read; use another checkpoint"),
    (lambda folder: (folder / ".metadata").unlink(),
     r"'.*' is a folder without a \.metadata file, so neither a checkpoint file nor a distributed checkpoint: give a "
     r"\.ckpt file, or a checkpoint folder written by ModelParallelStrategy"),
])
def test_a_damaged_folder_is_named_with_what_to_do(grown, tmp_path, damage, message):
    folder = shutil.copytree(grown["folder"], tmp_path / "last.ckpt")
    damage(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        read_checkpoint(folder)


def test_a_metadata_file_naming_code_is_refused_unrun(grown, tmp_path):
    """torch reads `.metadata` with plain pickle, which would call what the file names; here nothing runs."""
    import pickle

    folder = shutil.copytree(grown["folder"], tmp_path / "last.ckpt")
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(ran),)

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"\.metadata holds Python objects such as posix\.mkdir beyond a distributed "
                                         r"checkpoint's description of its shards; .* so it is refused"):
        read_checkpoint(folder)
    assert not ran.exists()


@pytest.mark.parametrize("pickled", [b"pathlib._local\nPosixPath", b"pathlib._local\nWindowsPath",
                                     b"pathlib\nWindowsPath"])
def test_a_metadata_file_written_by_another_python_or_system_reads(grown, tmp_path, pickled):
    """The folder's path in `.metadata` is pickled as the writer's Python names it (`pathlib._local` from 3.13 on), a
    WindowsPath when written on Windows: each reads, as the path that nothing here uses."""
    import pickle

    from lit_growattn.training.checkpoint import _CheckedMetadataReader, module_shapes

    folder = shutil.copytree(grown["folder"], tmp_path / "last.ckpt")
    written = pickle.dumps(_CheckedMetadataReader(folder).read_metadata(), protocol=2)  # names "module\nname"
    assert written.count(b"pathlib\nPurePosixPath") == 1
    (folder / ".metadata").write_bytes(written.replace(b"pathlib\nPurePosixPath", pickled))
    shapes = module_shapes(folder)
    assert shapes["model.blocks.0.attn.qk.w_q"].shape[-1] == GROWN["d_head"][0]
    assert read_checkpoint(folder)["state_dict"].keys() == read_checkpoint(grown["file"])["state_dict"].keys()


def test_a_folder_given_to_a_run_off_model_parallel_names_what_reads_it(grown, tmp_path):
    """Lightning reads a folder under ModelParallelStrategy only (elsewhere: "Is a directory")."""
    data = recall_data(batch_size=4, examples=16)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path, limit_val_batches=1,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"is a distributed checkpoint \(a folder of shards\), which Lightning loads "
                                         r"under ModelParallelStrategy only: run with strategy=ModelParallelStrategy"
                                         r"\(data_parallel_size=N, .*init_from=<folder>"):
        trainer.validate(tiny_module(data, dropout=0.0), data, ckpt_path=grown["folder"])


@pytest.mark.parametrize("distributed", [True, False])
def test_validate_after_fit_evaluates_a_checkpoint_of_other_sizes(tmp_path, distributed):
    """On the trainer that fitted (and grew) the model, `validate(ckpt_path=...)` of a checkpoint from before the
    growth: the sharded blocks take its sizes again, and the fit's optimizer, which knows the replaced parameters,
    is not loaded into. It evaluates as a fresh trainer does."""
    L.seed_everything(0, verbose=False)
    data = recall_data(batch_size=4, examples=16)

    def growth() -> GrowAttentionCallback:
        return GrowAttentionCallback(schedule=AtEpochs([1]), growth=GrowthSettings(grow="both", columns=2,
                                     value_columns=2), statistics=StatisticsSettings(batches=2))

    def trainer(**kwargs):
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1,
                                         save_distributed_checkpoint=distributed)
        return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="32-true", max_epochs=2,
                         logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1, deterministic=True,
                         **kwargs)

    with mock.patch.dict(os.environ):
        try:
            fitted = trainer(callbacks=[growth(), ModelCheckpoint(tmp_path, save_top_k=-1)])
            module = tiny_module(data, dropout=0.0)
            fitted.fit(module, data)
            assert module.head_sizes() == GROWN["d_head"]
            (before,) = fitted.validate(module, data, ckpt_path=tmp_path / "epoch=0-step=4.ckpt", verbose=False)
            assert (module.head_sizes(), module.value_sizes()) == ([2, 2], [8, 8])
            (after,) = fitted.validate(module, data, ckpt_path=tmp_path / "epoch=1-step=8.ckpt", verbose=False)
            assert (module.head_sizes(), module.value_sizes()) == (GROWN["d_head"], GROWN["d_v"])
        finally:
            dist.destroy_process_group()
        try:
            fresh = [trainer(callbacks=[growth()]).validate(tiny_module(data, dropout=0.0), data, ckpt_path=tmp_path / name,
                                        verbose=False)[0] for name in ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt")]
        finally:
            dist.destroy_process_group()
    assert [before, after] == fresh
