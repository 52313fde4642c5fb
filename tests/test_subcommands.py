"""`python -m lit_growattn validate` and `test` as docs/configuration.md runs them, on the checkpoint that a fit
wrote: each logs the loss of that checkpoint's model on the held-out set, as a fresh evaluation measures it; the
help of `convert` and `export` as docs/commands.md shows it. (`fit`, `convert` and `export` through
`python -m lit_growattn`: tests/test_hf_dint_cli.py.)"""

import math
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_growattn.__main__ import main as command_line
from lit_growattn.commands.cli import main
from lit_growattn.module import GrowAttentionLM

from conftest import REPO, needs_transformers, run_command

# 4 training batches, 2 held-out batches of 64.
MQAR = ["--config", str(REPO / "configs/mqar.yaml"), "--data.init_args.num_train_examples=256",
        "--data.init_args.num_val_examples=128", "--trainer.enable_progress_bar=false"]


def last_logged(log_dir, tag: str) -> float:
    (event_file,) = log_dir.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars(tag)[-1].value


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A 4-step fit's last.ckpt, and the loss its own validation logged at the end."""
    out = tmp_path_factory.mktemp("fit")
    assert command_line(["fit", *MQAR, "--trainer.max_epochs=1", f"--trainer.logger.init_args.save_dir={out}"]) == 0
    (ckpt,) = out.rglob("last.ckpt")
    return ckpt, last_logged(out, "val/loss")


@pytest.fixture(scope="module")
def fresh_loss(fitted) -> float:
    """The checkpoint's mean loss over the held-out batches, measured here without the trainer."""
    ckpt, _ = fitted
    model = GrowAttentionLM.load_from_checkpoint(ckpt, map_location="cpu").eval()
    data = main([*MQAR], run=False).datamodule
    data.setup("validate")
    with torch.no_grad():
        losses = [model.loss(model(inputs), labels) for inputs, labels in data.val_dataloader()]
    assert len(losses) == 2
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize("subcommand, tag", [("validate", "val/loss"), ("test", "test/loss")])
def test_a_subcommand_logs_the_loss_of_the_checkpoint_it_evaluates(fitted, fresh_loss, tmp_path, subcommand, tag):
    ckpt, loss_at_fit = fitted
    done = run_command(subcommand, *MQAR, f"--ckpt_path={ckpt}", f"--trainer.logger.init_args.save_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    logged = last_logged(tmp_path, tag)
    assert math.isfinite(logged) and logged == pytest.approx(fresh_loss, rel=1e-5)
    assert loss_at_fit == pytest.approx(fresh_loss, rel=1e-5)  # the same weights as the fit's last validation
    assert tag in done.stdout  # Lightning's table of results


def _hf_args(tmp_path) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 150)
    return ["--config", str(REPO / "configs/hf_llama_grow.yaml"), f"--data.init_args.path={corpus}",
            "--data.init_args.batch_size=8", "--data.init_args.block_size=32", "--data.init_args.samples_per_epoch=16",
            "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1", "--model.init_args.warmup_steps=2",
            "--trainer.callbacks.init_args.growth.columns=2", "--trainer.callbacks.init_args.statistics.batches=2"]


def _mqar_args(tmp_path) -> list[str]:
    return ["--config", str(REPO / "configs/mqar_grow.yaml"), "--model.init_args.n_layer=1",
            "--model.init_args.n_embd=32", "--model.init_args.d_v=8", "--data.init_args.num_train_examples=128",
            "--data.init_args.num_val_examples=32", "--data.init_args.batch_size=32",
            "--trainer.callbacks.init_args.statistics.batches=1"]


@pytest.mark.parametrize("model_args", [_mqar_args, _hf_args], ids=["GrowAttentionLM", "HFCausalLM"])
def test_validate_and_test_evaluate_a_checkpoint_that_grew_both_sides(tmp_path, cli, model_args):
    """Run with the config as shipped (growth.grow=query_key): the checkpoint's growth state is a fit's alone, and
    its grown widths are restored before its weights load."""
    if model_args is _hf_args:
        needs_transformers()
    args = [*model_args(tmp_path), "--trainer.enable_progress_bar=false",
            "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]"]
    fit = cli("fit", *args, "--trainer.max_epochs=2", "--trainer.callbacks.init_args.growth.grow=both",
              "--trainer.callbacks.init_args.growth.value_columns=2", f"--trainer.logger.init_args.save_dir={tmp_path}")
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert re.search(r"d_head \S+ per layer, d_v \S+ per layer", fit.stdout + fit.stderr)
    (ckpt,) = tmp_path.rglob("last.ckpt")
    loss_at_fit = last_logged(tmp_path, "val/loss")  # the final weights', measured at the end of the last epoch
    for subcommand, tag in [("validate", "val/loss"), ("test", "test/loss")]:
        done = cli(subcommand, *args, f"--ckpt_path={ckpt}", f"--trainer.logger.init_args.save_dir={tmp_path / tag}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert last_logged(tmp_path / tag, tag) == pytest.approx(loss_at_fit, rel=1e-5)


@pytest.mark.parametrize("command", ["convert", "export"])
def test_docs_show_the_help_each_command_prints(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # the width the page's blocks were printed at
    monkeypatch.setenv("PYTHON_COLORS", "0")  # Python 3.14 colours help where FORCE_COLOR is set
    with pytest.raises(SystemExit) as exit_:
        command_line([command, "--help"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    page = (REPO / "docs/commands.md").read_text()
    shown = re.search(rf"```text\n\$ python -m lit_growattn {command} --help\n(.*?)```", page, re.S)
    assert shown is not None, f"docs/commands.md has no block for `{command} --help`"
    # Words compared, not line breaks: Python versions wrap the usage line differently.
    assert shown.group(1).split() == printed.split(), f"docs/commands.md shows another help; {command} prints:\n{printed}"


def test_evaluating_with_other_model_settings_says_the_checkpoints_are_used(fitted, tmp_path):
    ckpt, _ = fitted
    with pytest.warns(UserWarning) as caught:
        assert command_line(["validate", *MQAR, f"--ckpt_path={ckpt}", f"--trainer.logger.init_args.save_dir={tmp_path}",
                             "--model.init_args.n_embd=48", "--model.init_args.warmup_steps=7"]) == 0
    (message,) = [str(w.message) for w in caught if "model settings" in str(w.message)]
    # warmup_steps only trains: it is not named.
    assert message == (f"validate evaluates {ckpt} with the model settings it was trained with, not the command's: "
                       "n_embd: 48 given, the checkpoint's 64 used. To evaluate other settings, give a checkpoint "
                       "trained with them")
