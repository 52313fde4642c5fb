"""configs/hf_llama_fsdp.yaml as a user runs it, on 2 CPU processes: `python -m lit_growattn fit --config` with a tiny
Llama folder saved by save_pretrained (random weights, its own BPE tokenizer) and only the settings a CPU and a tiny
model need changed. Both sides grow under FSDP2 with its bf16 mixed precision (gloo all-gathers and reduces bf16 on
CPU), the output holds no warning, and a resume from the last checkpoint folder trains on at the grown sizes."""

from __future__ import annotations

import re

import pytest
import yaml

from conftest import REPO, needs_transformers, run_command

needs_transformers()

from lit_growattn.training.checkpoint import read_checkpoint  # noqa: E402

from hf_helpers import saved_tokenizer, tiny_config  # noqa: E402

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n"


@pytest.fixture
def cpu_args(tmp_path) -> list[str]:
    """The config's command with a tiny folder and corpus, and what a CPU and a 2-layer model of 64 positions need:
    2 processes, blocks of 32 tokens, an epoch of 2 optimizer steps (32 windows / 2 ranks / 8 accumulated), growth
    at steps 1 and 2 from 2 micro-batches, one layer per event (the config's 8 exceed the 2 layers)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "Llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab=320)).save_pretrained(folder)
    saved_tokenizer(folder, [TEXT] * 20, vocab_size=300)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 150)
    return ["fit", "--config", REPO / "configs/hf_llama_fsdp.yaml", f"--model.init_args.pretrained={folder}",
            f"--data.init_args.path={corpus}", f"--data.init_args.cache_dir={tmp_path / 'cache'}",
            "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy.init_args.data_parallel_size=2",
            "--data.init_args.block_size=32", "--data.init_args.samples_per_epoch=32",
            "--trainer.callbacks.init_args.schedule.init_args.steps=[1, 2]",
            "--trainer.callbacks.init_args.statistics.batches=2",
            "--trainer.callbacks.init_args.statistics.layers_per_event=1",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}"]


def fit(args, cwd):
    done = run_command(*args, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    # A warning prints where it was raised, `FILE.py:LINE: `, in Python's format ("UserWarning: …") and in
    # Lightning's, which names no category.
    warned = [line for line in output.splitlines() if re.search(r"\.py:\d+: |warn", line, re.I)]
    assert not warned, "\n".join(warned)
    return done


def last_checkpoint(tmp_path, version: int) -> dict:
    folder = tmp_path / "logs" / "hf_llama_fsdp" / f"version_{version}" / "checkpoints" / "last.ckpt"
    assert (folder / ".metadata").is_file()  # a distributed checkpoint folder, as ModelParallelStrategy writes
    return read_checkpoint(folder)


def history(checkpoint: dict) -> list[tuple]:
    (state,) = (s for name, s in checkpoint["callbacks"].items() if name.startswith("GrowAttentionCallback"))
    return [(e["event"], e["d_head"], e["d_v"]) for e in state["history"]]


def test_the_shipped_fsdp_config_grows_both_sides_on_two_processes_and_resumes(cpu_args, tmp_path):
    done = fit([*cpu_args, "--trainer.max_steps=4"], tmp_path)
    assert "growth at step 1 (epoch 0): d_head [8, 8]→[16, 8], d_v [8, 8]→[16, 8]" in done.stdout
    assert "growth at step 2 (epoch 1): d_head [16, 8]→[16, 16], d_v [16, 8]→[16, 16]" in done.stdout
    grown = last_checkpoint(tmp_path, 0)
    hparams = grown["hyper_parameters"]
    assert grown["global_step"] == 4
    # How the run computed is the run's (the config it saved), not the checkpoint's: another run may choose anew.
    saved = yaml.safe_load((tmp_path / "logs" / "hf_llama_fsdp" / "version_0" / "config.yaml").read_text())
    assert saved["model"]["init_args"]["fsdp_param_dtype"] == "bfloat16" and "fsdp_param_dtype" not in hparams
    assert (hparams["head_sizes"], hparams["v_head_sizes"]) == ([16, 16], [16, 16])
    events = [("step 1", [16, 8], [16, 8]), ("step 2", [16, 16], [16, 16])]
    assert history(grown) == events

    last = tmp_path / "logs" / "hf_llama_fsdp" / "version_0" / "checkpoints" / "last.ckpt"
    done = fit([*cpu_args, "--trainer.max_steps=6", f"--ckpt_path={last}"], tmp_path)
    assert "growth at" not in done.stdout  # both events are in the resumed history
    resumed = last_checkpoint(tmp_path, 1)
    assert resumed["global_step"] == 6 and history(resumed) == events
    hparams = resumed["hyper_parameters"]
    assert (hparams["head_sizes"], hparams["v_head_sizes"]) == ([16, 16], [16, 16])
    attention = "model.model.layers.1.self_attn"
    weights = resumed["state_dict"]
    assert weights[f"{attention}.w_q"].shape[-1] == weights[f"{attention}.value.w_v"].shape[-1] == 16
