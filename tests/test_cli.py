import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_growattn.commands.cli import main
from lit_growattn.module import GrowAttentionLM

from conftest import REPO, SHAKESPEARE, needs_shakespeare, scalar_tags


def test_mqar_fit_writes_checkpoint_and_tensorboard_tags(tmp_path, tiny_cli_args):
    main(
        ["fit", "--config", str(REPO / "configs/mqar.yaml"), *tiny_cli_args,
         "--data.init_args.num_train_examples=512", "--data.init_args.num_val_examples=128"]
    )
    ckpts = sorted(tmp_path.rglob("*.ckpt"))
    assert any(p.name == "last.ckpt" for p in ckpts)
    tags = scalar_tags(tmp_path)
    expected = {"train/loss", "val/loss", "val/acc", "val/ppl", "attention/temperature/layer_0", "attention/temperature/layer_1"}
    assert expected <= tags, expected - tags
    module = GrowAttentionLM.load_from_checkpoint(ckpts[-1])
    assert module.cfg.vocab_size == 128 and module.cfg.block_size == 64


def test_step_scalars_follow_the_logging_cadence(tmp_path, tiny_cli_args, monkeypatch):
    calls = []
    log_step_scalars = GrowAttentionLM._log_step_scalars
    monkeypatch.setattr(GrowAttentionLM, "_log_step_scalars", lambda self, *a: calls.append(1) or log_step_scalars(self, *a))
    main(["fit", "--config", str(REPO / "configs/mqar.yaml"), *tiny_cli_args, "--trainer.log_every_n_steps=2",
          "--data.init_args.num_train_examples=512", "--data.init_args.num_val_examples=128"])
    (event_file,) = tmp_path.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("train/loss", "train/acc", "train/flops_seen", "attention/temperature/layer_1"):
        assert [e.step for e in events.Scalars(tag)] == [1, 3], tag  # 4 steps, every second one
    assert len(events.Scalars("compute/loss_vs_flops")) == 2
    assert len(calls) == 2  # the work is skipped on the other steps, not only their values


def _text_fit(tmp_path, tiny_cli_args, path):
    main(["fit", "--config", str(REPO / "configs/text.yaml"), *tiny_cli_args, f"--data.init_args.path={path}",
          "--data.init_args.block_size=32", "--data.init_args.batch_size=8", "--data.init_args.samples_per_epoch=64"])
    tags = scalar_tags(tmp_path)
    assert {"train/loss", "val/loss", "val/ppl"} <= tags


def test_text_fit_on_a_small_file_with_a_second_domain(tmp_path, tiny_cli_args):
    path, other = tmp_path / "corpus.txt", tmp_path / "other.txt"
    path.write_bytes(("To be, or not to be, that is the question.\n" * 80).encode() + b"\xff\xfe raw bytes")
    other.write_bytes(b"def f(x):\n    return x * 2\n" * 40)
    _text_fit(tmp_path, [*tiny_cli_args, f"--data.init_args.val_paths={{code: {other}}}"], path)
    tags = scalar_tags(tmp_path)
    assert {"val/code/loss", "val/code/ppl", "val/code/acc"} <= tags  # cross-domain set, no dataloader suffix
    assert not any("dataloader_idx" in t for t in tags)


@needs_shakespeare
def test_text_fit_on_tiny_shakespeare(tmp_path, tiny_cli_args):
    _text_fit(tmp_path, tiny_cli_args, SHAKESPEARE)


@pytest.mark.parametrize("config, d_head", [("recall_grow.yaml", 1), ("mqar_grow.yaml", 2), ("text_grow.yaml", 2)])
def test_growth_configs_grow_at_their_first_event(tmp_path, tiny_cli_args, config, d_head):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"To be, or not to be, that is the question.\n" * 200)
    data = {"mqar_grow.yaml": ["--data.init_args.num_train_examples=512", "--data.init_args.num_val_examples=128"],
            "text_grow.yaml": [f"--data.init_args.path={corpus}"]}.get(config, [])
    cli = main(["--config", str(REPO / "configs" / config), *tiny_cli_args, "--trainer.max_epochs=2",
                "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]", "--trainer.callbacks.init_args.statistics.batches=2",
                *data], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    grown = cli.model.model.head_sizes()
    assert len(set(grown)) == 1 and grown[0] > d_head, grown


def test_unknown_attention_fails_before_training(tmp_path, tiny_cli_args):
    with pytest.raises(ValueError, match="unknown attention 'flash9'; registered attentions: .*mha"):
        main(["fit", "--config", str(REPO / "configs/mqar.yaml"), *tiny_cli_args, "--model.init_args.attention=flash9"])
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_fit_through_python_m_prints_no_library_deprecation_and_no_advertising(tmp_path, tiny_cli_args):
    """Lightning's LeafSpec FutureWarning (torch 2.13) and its "💡 Tip" for litlogger/litmodels are hidden at the
    command line (lit_growattn/__main__.py); Lightning's other lines and our own warnings still show."""
    done = subprocess.run(
        [sys.executable, "-m", "lit_growattn", "fit", "--config", str(REPO / "configs/mqar.yaml"), *tiny_cli_args],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "GPU available" in output  # Lightning's lines at the same level as the tip are kept
    assert "LeafSpec" not in output and "FutureWarning" not in output
    assert "Tip" not in output and "litlogger" not in output and "litmodels" not in output


def test_print_config_through_python_m():
    out = subprocess.run(
        [sys.executable, "-m", "lit_growattn", "fit", "--config", str(REPO / "configs/mqar.yaml"), "--print_config"],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout
    assert "lit_growattn.GrowAttentionLM" in out and "MQARDataModule" in out
