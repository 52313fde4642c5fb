"""When growth happens and that a resumed run does the same: the schedule's counters, resume from checkpoints
written by the CLI at every step (bit-equal to the uninterrupted run), `grow_at_steps` under accumulation."""

import pytest
import torch

from lit_growattn.commands.cli import main

from conftest import REPO

# 5 batches an epoch; growths at epochs 1 and 2, each from the epoch's last 3 batches (batches 2, 3, 4).
EPOCHS = [
    "--trainer.max_epochs=3", "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=1",
    "--trainer.callbacks.init_args.statistics.batches=3", "--trainer.callbacks.init_args.growth.method=natural",
]
# grow_at_steps under accumulation 2: an epoch of 5 micro-batches has 3 optimizer steps (the last one flushes).
STEPS = [
    "--trainer.max_epochs=3", "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=1",
    "--trainer.accumulate_grad_batches=2", "--trainer.callbacks.init_args.schedule=lit_growattn.AtSteps",
    "--trainer.callbacks.init_args.schedule.init_args.steps=[4, 8]", "--trainer.callbacks.init_args.statistics.batches=3",
    "--trainer.callbacks.init_args.growth.method=natural",
]


def cli_fit(out, schedule, ckpt_path=None, config="configs/recall_grow.yaml", data_args=True):
    """`python -m lit_growattn fit --config configs/recall_grow.yaml …` (or `config`) with a checkpoint after every optimizer
    step (`step=N.ckpt`) and at every epoch end (`end-of-epoch=E.ckpt`); returns the last one's content.
    `data_args`: a small recall dataset (the arguments of the recall configs' data module)."""
    recall = ["--data.init_args.num_train_examples=320", "--data.init_args.num_val_examples=64"] if data_args else []
    main([
        "fit", "--config", str(REPO / config), *schedule, *recall,
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={out}",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.init_args.dirpath={out}/ckpt", "--trainer.callbacks.init_args.filename={step}",
        "--trainer.callbacks.init_args.every_n_train_steps=1", "--trainer.callbacks.init_args.save_top_k=-1",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.init_args.dirpath={out}/ckpt", "--trainer.callbacks.init_args.filename=end-of-{epoch}",
        "--trainer.callbacks.init_args.monitor=val/loss", "--trainer.callbacks.init_args.save_top_k=-1",
        *([f"--ckpt_path={ckpt_path}"] if ckpt_path else []),
    ])
    last = max((out / "ckpt").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    return torch.load(last, map_location="cpu", weights_only=False)


def growth_history(ckpt) -> list[dict]:
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("GrowAttentionCallback")]
    # Everything but the wall times, which differ from run to run.
    return [{k: v for k, v in e.items() if k not in ("seconds", "timings")} for e in state["history"]]


def assert_same_run(resumed, full):
    assert growth_history(resumed) == growth_history(full)
    assert resumed["state_dict"].keys() == full["state_dict"].keys()
    assert all(torch.equal(resumed["state_dict"][k], full["state_dict"][k]) for k in full["state_dict"])
    assert resumed["hyper_parameters"]["d_head"] == full["hyper_parameters"]["d_head"]


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("epochs")
    return out, cli_fit(out, EPOCHS)


def test_uninterrupted_run_grows_at_each_epoch_start(epoch_run):
    _, full = epoch_run
    assert [(e["event"], e["step"], e["epoch"], e["batch"]) for e in growth_history(full)] == [
        ("epoch 1", 5, 1, 0), ("epoch 2", 10, 2, 0)]
    assert full["hyper_parameters"]["d_head"] == [15]


@pytest.mark.parametrize("checkpoint", [
    "step=3.ckpt",  # inside the first statistics window (after its first batch)
    "step=5.ckpt",  # the last batch of the epoch before a growth (Lightning skips on_train_epoch_start here)
    "end-of-epoch=0.ckpt",  # between the window and the growth: after the epoch's validation
    "step=6.ckpt",  # just after the first growth
    "step=8.ckpt",  # inside the second window, with grown shapes
])
def test_resume_from_any_step_is_bit_equal_with_the_same_history(epoch_run, tmp_path, checkpoint):
    out, full = epoch_run
    assert_same_run(cli_fit(tmp_path, EPOCHS, ckpt_path=out / "ckpt" / checkpoint), full)


def test_grow_at_steps_with_accumulation_grows_between_windows_and_resumes(tmp_path):
    full = cli_fit(tmp_path / "full", STEPS)
    # Step 4 is reached after batch 1 of epoch 1, step 8 after batch 3 of epoch 2: both at an even batch,
    # where no accumulation window is open. The first window crosses the end of epoch 0.
    assert [(e["event"], e["step"], e["epoch"], e["batch"]) for e in growth_history(full)] == [
        ("step 4", 4, 1, 2), ("step 8", 8, 2, 4)]
    # step=7.ckpt lies inside the second window (epoch 2, batches 1, 2, 3).
    assert_same_run(cli_fit(tmp_path / "resumed", STEPS, ckpt_path=tmp_path / "full/ckpt/step=7.ckpt"), full)


def test_steps_closer_than_the_window_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"AtSteps \[5\] leave less than statistics.batches=3 micro-batches"):
        main(["fit", "--config", str(REPO / "configs/recall_grow.yaml"), *STEPS[:-3],
              "--trainer.callbacks.init_args.schedule.init_args.steps=[4, 5]", "--trainer.callbacks.init_args.statistics.batches=3",
              "--trainer.accumulate_grad_batches=1", "--data.init_args.num_train_examples=320",
              "--data.init_args.num_val_examples=64", f"--trainer.logger.init_args.save_dir={tmp_path}"])
