"""`python -m lit_growattn validate` and `test` as docs/configuration.md runs them, on the checkpoint that a fit
wrote: each logs the loss of that checkpoint's model on the held-out set, as a fresh evaluation measures it.
(`fit`, `convert` and `export` through `python -m lit_growattn`: tests/test_hf_dint_cli.py.)"""

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_growattn.__main__ import main as command_line
from lit_growattn.commands.cli import main
from lit_growattn.module import GrowAttentionLM

from conftest import REPO, run_command

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
