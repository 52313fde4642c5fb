"""What a user does from the command line works, fails clearly, or stops: checkpoints written by the CLI,
checkpoint callbacks, divergence, error reports, failed starts, resumed head sizes, the query/key bias row."""

import os
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_growattn.__main__ import main as command_line
from lit_growattn.commands.cli import main
from lit_growattn.commands.convert import convert_checkpoint
from lit_growattn.training.divergence import NonFiniteLosses, TrainingDiverged
from lit_growattn.module import GrowAttentionLM

from conftest import REPO

MQAR = str(REPO / "configs/mqar.yaml")
RECALL = str(REPO / "configs/recall_grow.yaml")
SMALL_MQAR = ["--data.init_args.num_train_examples=256", "--data.init_args.num_val_examples=64"]


def checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*.ckpt"))


def test_convert_a_cli_checkpoint_then_fine_tune_it_from_the_written_config(tmp_path, tiny_cli_args):
    main(["fit", "--config", MQAR, *tiny_cli_args, *SMALL_MQAR])
    (last,) = tmp_path.rglob("last.ckpt")
    out = tmp_path / "dint.ckpt"
    assert command_line(["convert", "--ckpt", str(last), "--to", "lowrank_dint", "--rank", "2", "--out", str(out)]) == 0
    converted = torch.load(out, weights_only=True)
    assert not any(k.startswith("_") for k in converted["hyper_parameters"])

    fine_tune = ["--config", MQAR, "--model", str(out.with_suffix(".yaml")), *tiny_cli_args, *SMALL_MQAR,
                 f"--trainer.logger.init_args.save_dir={tmp_path / 'fine_tune'}"]
    cli = main(fine_tune, run=False)
    assert cli.model.hparams.attention == "lowrank_dint"
    torch.testing.assert_close(cli.model.state_dict()["model.blocks.0.attn.qk.w_q"],
                               converted["state_dict"]["model.blocks.0.attn.qk.w_q"])
    main(["fit", *fine_tune])
    (tuned,) = (tmp_path / "fine_tune").rglob("last.ckpt")
    assert GrowAttentionLM.load_from_checkpoint(tuned).hparams.attention == "lowrank_dint"


class RunsCode:
    """Unpickling this would create `marker`: what a checkpoint from elsewhere could do with weights_only=False."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker),)


def test_checkpoints_that_could_run_code_are_refused(tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"attention": RunsCode(marker)}}, path)
    with pytest.raises(ValueError, match="beyond tensors and plain containers.*refused"):
        convert_checkpoint(path, tmp_path / "out.ckpt", rank=2)
    with pytest.raises(ValueError, match="refused"):
        GrowAttentionLM(init_from=str(path))
    assert not marker.exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint file at"):
        convert_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out.ckpt", rank=2)


# -- checkpoint callbacks ------------------------------------------------------------------------

def test_without_a_checkpoint_callback_the_cli_keeps_last_ckpt(tiny_cli_args):
    cli = main(["--config", MQAR, *tiny_cli_args, *SMALL_MQAR], run=False)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert callback.save_last is True


def test_a_checkpoint_callback_from_the_command_line_is_exactly_the_users(tmp_path, tiny_cli_args):
    main(["fit", "--config", MQAR, *tiny_cli_args, *SMALL_MQAR,
          "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
          "--trainer.callbacks.init_args.save_top_k=-1", "--trainer.callbacks.init_args.every_n_train_steps=2"])
    assert checkpoints(tmp_path) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]  # per 2 steps, no last.ckpt


def test_a_checkpoint_callback_from_yaml_keeps_one_per_epoch(tmp_path, tiny_cli_args):
    overlay = tmp_path / "every_epoch.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": [{
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"every_n_epochs": 1, "save_top_k": -1, "save_last": True}}]}}))
    main(["fit", "--config", MQAR, "--config", str(overlay), *tiny_cli_args, *SMALL_MQAR, "--trainer.max_epochs=2"])
    assert checkpoints(tmp_path) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]


# -- divergence ----------------------------------------------------------------------------------

DIVERGE = ["fit", "--config", RECALL, "--model.init_args.optimizer.init_args.lr=100",
           "--model.init_args.warmup_steps=1", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
           "--trainer.enable_model_summary=false", "--trainer.callbacks.init_args.statistics.batches=2"]


def test_a_diverged_run_stops_with_an_error_naming_step_and_loss(tmp_path, capsys):
    rc = command_line([*DIVERGE, "--trainer.limit_train_batches=30", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert re.search(r"error: TrainingDiverged: .*non-finite for 10 consecutive steps, the last nan at step \d+", err)
    assert checkpoints(tmp_path) == []  # epoch 0 never ended: nothing to save, nothing non-finite saved


def test_a_diverged_run_never_overwrites_the_last_finite_checkpoint(tmp_path, capsys):
    rc = command_line([*DIVERGE, "--trainer.limit_train_batches=30", f"--trainer.logger.init_args.save_dir={tmp_path}",
                       "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                       "--trainer.callbacks.init_args.every_n_train_steps=1",
                       "--trainer.callbacks.init_args.save_last=true"])
    assert rc == 1
    assert "parameter tensors are non-finite" in capsys.readouterr().err
    (last,) = tmp_path.rglob("last.ckpt")
    state = torch.load(last, weights_only=True)["state_dict"]
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


class NanLosses(GrowAttentionLM):
    """A tiny model whose training loss is NaN on the micro-batches `nan_at(batch_idx)` picks. The NaN is added as a
    constant, so the gradients, and the weights, stay finite: only the divergence check sees it."""

    def __init__(self, **kwargs):
        super().__init__(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, d_head=4, **kwargs)
        self.nan_at = lambda batch_idx: False

    @classmethod
    def at(cls, nan_at, **kwargs) -> "NanLosses":
        """`nan_at` is set after construction: a function is no hyperparameter (it cannot be saved)."""
        model = cls(**kwargs)
        model.nan_at = nan_at
        return model

    def training_step(self, batch, batch_idx):
        self.batch_idx = batch_idx
        return super().training_step(batch, batch_idx)

    def loss(self, logits, labels):
        loss = super().loss(logits, labels)
        return loss + float("nan") if self.training and self.nan_at(self.batch_idx) else loss


def nan_fit(model, ckpt_path=None, **trainer_args):
    tokens = torch.randint(0, 16, (64, 8))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=2)
    trainer = L.Trainer(**{**dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0),
                           **trainer_args})
    trainer.fit(model, loader, loader, ckpt_path=ckpt_path)  # validation loader given, and limited to none
    return trainer


def test_divergence_counts_optimizer_steps_not_micro_batches():
    # NaN on the first micro-batch of each window of 2: every optimizer step is non-finite, though no two
    # micro-batches in a row are.
    model = NanLosses.at(lambda batch_idx: batch_idx % 2 == 0, max_nonfinite_steps=3)
    with pytest.raises(TrainingDiverged, match=r"non-finite for 3 consecutive steps, the last nan at step 2 \(epoch 0, "
                                               r"batch 4\)"):
        nan_fit(model, accumulate_grad_batches=2)
    assert model.trainer.global_step == 2  # stopped before the 3rd optimizer step, after 6 micro-batches


def test_the_count_of_nonfinite_steps_survives_a_checkpoint_round_trip(tmp_path):
    always = lambda batch_idx: True  # noqa: E731
    nan_fit(NanLosses.at(always, max_nonfinite_steps=3), max_steps=2, enable_checkpointing=True,
            callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2)])
    (ckpt,) = tmp_path.glob("*.ckpt")  # mid-epoch, after 2 non-finite steps
    saved = torch.load(ckpt, weights_only=True)
    assert saved[NonFiniteLosses.CHECKPOINT_KEY] == 2
    resumed = NanLosses.at(always, max_nonfinite_steps=3)
    # A mid-epoch checkpoint of a plain DataLoader: Lightning says the data do not resume, which this test allows.
    with pytest.raises(TrainingDiverged, match=r"non-finite for 3 consecutive steps, the last nan at step 2 "), \
            pytest.warns(UserWarning, match="your dataloader is not resumable"):
        nan_fit(resumed, ckpt_path=ckpt, max_steps=10, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(tmp_path / "resumed", every_n_train_steps=2)])  # at the 1st step after it

    del saved[NonFiniteLosses.CHECKPOINT_KEY]  # a checkpoint from before the count was saved
    resumed.on_load_checkpoint(saved)
    assert resumed._nonfinite_losses.count == 0


def test_a_process_whose_own_losses_were_finite_raises_with_the_others():
    losses = NonFiniteLosses(2)
    another_process_diverged = lambda flag: True  # noqa: E731
    losses.observe(torch.tensor(1.0), lambda: "step 0", step_ends=True, any_process=another_process_diverged)
    with pytest.raises(TrainingDiverged, match="non-finite for 2 consecutive steps, the last on another process "
                                               r"\(finite on this one\) at step 1"):
        losses.observe(torch.tensor(1.0), lambda: "step 1", step_ends=True, any_process=another_process_diverged)



def test_a_limit_of_one_non_finite_step_stops_at_the_first_and_zero_is_refused():
    losses = NonFiniteLosses(1)
    with pytest.raises(TrainingDiverged, match="non-finite for 1 consecutive steps"):
        losses.observe(torch.tensor(float("nan")), lambda: "step 0", step_ends=True, any_process=lambda flag: flag)
    with pytest.raises(ValueError, match="max_nonfinite_steps must be ≥ 1, got 0"):
        NonFiniteLosses(0)

# -- error reports and failed starts -------------------------------------------------------------

def test_a_bad_value_is_reported_in_a_few_lines_with_the_projects_message(tmp_path, tiny_cli_args, capsys, monkeypatch):
    monkeypatch.delenv("LIT_GROWATTN_DEBUG", raising=False)
    assert command_line(["fit", "--config", MQAR, *tiny_cli_args, "--model.init_args.d_head=0"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Union subtypes" not in err
    report = err[err.index("error:"):].splitlines()
    assert report[0] == "error: ValueError: d_head must be positive, got 0"
    assert len(report) == 3 and "LIT_GROWATTN_DEBUG=1" in report[-1]

    monkeypatch.setenv("LIT_GROWATTN_DEBUG", "1")
    with pytest.raises(ValueError, match="Union subtypes"):  # the full story, for a bug report
        command_line(["fit", "--config", MQAR, *tiny_cli_args, "--model.init_args.d_head=0"])


def test_a_run_that_fails_at_setup_leaves_no_log_folder(tmp_path, tiny_cli_args, capsys):
    bad = ["fit", "--config", RECALL, *tiny_cli_args, "--trainer.callbacks.init_args.growth.max_d_head=200"]
    assert command_line(bad) == 1
    assert "error: ValueError: max_d_head=200 must lie between" in capsys.readouterr().err
    assert not list(tmp_path.rglob("version_*"))
    # A folder that already holds an earlier run's files is left alone.
    earlier = tmp_path / "lit_growattn" / "version_0"
    earlier.mkdir(parents=True)
    (earlier / "events.out.tfevents.1.otherhost.1.0").write_bytes(b"")
    assert command_line([*bad, "--trainer.logger.init_args.version=0"]) == 1
    assert (earlier / "events.out.tfevents.1.otherhost.1.0").exists()


def test_predict_is_not_offered(capsys):
    with pytest.raises(SystemExit) as exit_info:
        command_line(["predict", "--config", MQAR])
    assert exit_info.value.code == 2
    assert "'predict'" in capsys.readouterr().err


# -- head sizes after loading --------------------------------------------------------------------

def test_resuming_a_grown_checkpoint_records_its_head_size_at_once(tmp_path, tiny_cli_args):
    grow = ["--config", RECALL, *tiny_cli_args, "--trainer.limit_val_batches=1", "--trainer.max_epochs=2",
            "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]", "--trainer.callbacks.init_args.statistics.batches=2"]
    main(["fit", *grow])
    (grown,) = tmp_path.rglob("last.ckpt")
    assert torch.load(grown, weights_only=True)["hyper_parameters"]["d_head"] == [8]
    resumed = main([*grow, "--trainer.max_epochs=3", f"--trainer.logger.init_args.save_dir={tmp_path / 'resumed'}"],
                   run=False)
    assert resumed.model.hparams.d_head == 1  # the config's value, until the weights load
    resumed.trainer.fit(resumed.model, resumed.datamodule, ckpt_path=grown)
    assert resumed.model.hparams.d_head == [8]
    (epoch_2,) = (tmp_path / "resumed").rglob("epoch=2-*.ckpt")  # saved with no growth since the resume
    assert torch.load(epoch_2, weights_only=True)["hyper_parameters"]["d_head"] == [8]


def test_loading_weights_of_other_head_sizes_records_them_for_every_attention():
    torch.manual_seed(0)
    args = dict(n_layer=2, n_embd=16, n_head=2, block_size=8, attention="lowrank_dint", attention_args={"rank": 2})
    saved = GrowAttentionLM(d_head=[3, 4], **args)
    loaded = GrowAttentionLM(d_head=[6, 4], **args)
    loaded.load_state_dict(saved.state_dict())
    assert loaded.hparams.d_head == [3, 4]
    assert [b.attn.qk2.d_head for b in loaded.model.blocks] == [3, 4]


# -- the query/key bias row ----------------------------------------------------------------------

class ZeroGradients(L.Callback):
    """With zero gradients (and fresh Adam moments) AdamW's step is its weight decay alone."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        for p in pl_module.parameters():
            p.grad.zero_()
        self.lr = optimizer.param_groups[0]["lr"]


def test_the_query_key_bias_row_is_not_weight_decayed(tiny_cli_args):
    cli = main(["--config", MQAR, *tiny_cli_args, *SMALL_MQAR, "--model.init_args.bias=true",
                "--trainer.max_steps=1", "--trainer.limit_val_batches=0"], run=False)
    probe = ZeroGradients()
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)
    shrink = 1 - probe.lr * 0.1  # the config's weight_decay
    params = dict(cli.model.named_parameters())
    for name in ("model.blocks.0.attn.qk.w_q", "model.blocks.1.attn.qk.w_k"):
        before, after = probe.before[name], params[name].detach()
        torch.testing.assert_close(after[:, -1], before[:, -1], rtol=0, atol=0)  # the bias row
        torch.testing.assert_close(after[:, :-1], before[:, :-1] * shrink)
    torch.testing.assert_close(params["model.blocks.0.mlp.fc.weight"].detach(),
                               probe.before["model.blocks.0.mlp.fc.weight"] * shrink)
    torch.testing.assert_close(params["model.blocks.0.mlp.fc.bias"].detach(), probe.before["model.blocks.0.mlp.fc.bias"])


def test_shrink_a_cli_checkpoint_then_fine_tune_it(tmp_path, tiny_cli_args):
    main(["fit", "--config", MQAR, *tiny_cli_args, *SMALL_MQAR])
    (last,) = tmp_path.rglob("last.ckpt")
    out = tmp_path / "small.ckpt"
    assert command_line(["convert", "--ckpt", str(last), "--to", "mha", "--d_head", "3", "--out", str(out)]) == 0
    fine_tune = ["--config", MQAR, "--model", str(out.with_suffix(".yaml")), *tiny_cli_args, *SMALL_MQAR,
                 f"--trainer.logger.init_args.save_dir={tmp_path / 'fine_tune'}"]
    main(["fit", *fine_tune])
    (tuned,) = (tmp_path / "fine_tune").rglob("last.ckpt")
    assert GrowAttentionLM.load_from_checkpoint(tuned).model.head_sizes() == [3] * len(
        yaml.safe_load(out.with_suffix(".yaml").read_text())["init_args"]["d_head"])
