"""The user's path with Hugging Face models: `python -m lit_growattn fit` on configs/hf_llama_grow.yaml and on a
pretrained folder, under DDP, bf16-mixed and a resume inside a statistics window, growing one side or both."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, launch, needs_transformers

needs_transformers()

import torch  # noqa: E402
import yaml  # noqa: E402

from hf_helpers import load, same_model, saved_tiny_model, saved_tokenizer  # noqa: E402

CONFIG = REPO / "configs" / "hf_llama_grow.yaml"
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n"


def _fit(tmp_path, *args: str, config=CONFIG, expect_ok: bool = True) -> subprocess.CompletedProcess:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 150)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lit_growattn", "fit", "--config", str(config),
           f"--data.init_args.path={corpus}", f"--data.init_args.cache_dir={tmp_path / 'cache'}",
           "--data.init_args.batch_size=8", "--data.init_args.block_size=32", "--data.init_args.samples_per_epoch=64",
           "--trainer.max_epochs=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
           f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.init_args.warmup_steps=2", *args]
    done = launch(cmd, cwd=tmp_path, env=env)
    if expect_ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _callbacks(tmp_path, steps: list[int], batches: int = 2, extra: list[dict] = ()) -> str:
    """A second config replacing the callbacks: `extra`, then growth by 4 columns at `steps` from `batches`."""
    path = tmp_path / "callbacks.yaml"
    grow = {"class_path": "lit_growattn.GrowAttentionCallback",
            "init_args": {"schedule": {"class_path": "lit_growattn.AtSteps", "init_args": {"steps": steps}},
                          "growth": {"columns": 4}, "statistics": {"batches": batches}}}
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [*extra, grow]}}))
    return f"--config={path}"


def _last_head_sizes(tmp_path) -> list[int]:
    (ckpt,) = tmp_path.rglob("last.ckpt")
    return torch.load(ckpt, weights_only=False)["hyper_parameters"]["head_sizes"]


def test_hf_llama_config_grows(tmp_path):
    done = _fit(tmp_path, "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                "--trainer.callbacks.init_args.statistics.batches=2")
    assert "d_head 8→16 per layer" in done.stdout + done.stderr
    assert _last_head_sizes(tmp_path) == [16, 16]


def test_hf_grows_under_ddp_with_identical_replicas(tmp_path):
    dump = {"class_path": "hf_helpers.ParamsDump", "init_args": {"out": str(tmp_path)}}
    _fit(tmp_path, _callbacks(tmp_path, [4], extra=[dump]), "--trainer.devices=2",
         "--trainer.strategy=ddp", "--trainer.max_steps=6")
    p0, p1 = (torch.load(tmp_path / f"params_{rank}.pt") for rank in (0, 1))
    assert p0["model.model.layers.0.self_attn.w_q"].shape == (4, 64, 12)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


def test_hf_resume_inside_statistics_window_is_bit_equal(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    dump = lambda out: {"class_path": "hf_helpers.ParamsDump", "init_args": {"out": str(out)}}  # noqa: E731
    every_step = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(full / "ckpts"), "every_n_train_steps": 1, "save_top_k": -1,
                                "filename": "{step}", "save_last": True}}
    # Growth at step 5 from the 4 micro-batches of steps 1–4: step 3's checkpoint falls inside the window.
    full.mkdir(), resumed.mkdir()
    _fit(full, _callbacks(full, [5], 4, [every_step, dump(full)]), "--trainer.max_steps=7")
    _fit(resumed, _callbacks(resumed, [5], 4, [dump(resumed)]), "--trainer.max_steps=7",
         f"--ckpt_path={full / 'ckpts' / 'step=3.ckpt'}")
    a, b = torch.load(full / "params_0.pt"), torch.load(resumed / "params_0.pt")
    assert a["model.model.layers.1.self_attn.w_k"].shape[-1] == 12
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hf_grows_in_bf16_mixed(tmp_path):
    _fit(tmp_path, _callbacks(tmp_path, [4]), "--trainer.precision=bf16-mixed", "--trainer.max_steps=6")
    assert _last_head_sizes(tmp_path) == [12, 12]


def test_pretrained_folder_fine_tunes_and_grows(tmp_path):
    model_dir = tmp_path / "model"
    saved_tiny_model("qwen3", model_dir, vocab=320)
    saved_tokenizer(model_dir, [TEXT] * 20, vocab_size=300)  # byte-level BPE: 256 bytes, <eos> and merges
    _fit(tmp_path, _callbacks(tmp_path, [4]), "--model.init_args.config=null",
         f"--model.init_args.pretrained={model_dir}", f"--data.init_args.tokenizer={model_dir}", "--trainer.max_steps=6")
    assert _last_head_sizes(tmp_path) == [12, 12]
    # ... and exports (`python -m lit_growattn export`, in process) to a folder from_pretrained loads, tokenizer beside.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_growattn.commands.export import main as export

    (ckpt,) = tmp_path.rglob("last.ckpt")
    export(["--ckpt", str(ckpt), "--out", str(tmp_path / "grown")])
    grown = AutoModelForCausalLM.from_pretrained(tmp_path / "grown")
    assert grown.config.model_type == "growattn_qwen3" and grown.config.qk_head_sizes == [12, 12]
    assert AutoTokenizer.from_pretrained(tmp_path / "grown").vocab_size <= 320


def test_bad_models_fail_before_training(tmp_path):
    from lit_growattn.hf import HFCausalLM

    model_dir = tmp_path / "model"
    saved_tiny_model("llama", model_dir)  # 96 tokens; the byte tokenizer has 256
    with pytest.raises(ValueError, match="the tokenizer has 256 tokens but the model's vocabulary has 96"):
        HFCausalLM(pretrained=str(model_dir), vocab_size=256)
    with pytest.raises(FileNotFoundError, match="is not a model folder"):
        HFCausalLM(pretrained=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported; supported model types: gpt2, llama"):
        HFCausalLM(config={"model_type": "bert"})


@pytest.mark.parametrize("grow", ["query_key", "both"])
def test_auto_schedule_grows_a_rotary_gqa_model_within_its_budget(tmp_path, grow):
    """A tiny Llama (4 query heads sharing 2 key/value heads per layer, rotary d_head 8, d_v 8): each column costs its
    layer's 2 KV heads, and the K cache (the KV cache when both sides grow) never exceeds the budget's mean head size
    12 (2 layers × 2 KV heads × 12 values per side)."""
    path = tmp_path / "auto.yaml"
    rule = {"budget": 12, "check_every": 4, "spend_until": 1.0}  # checks at steps 4, 8 and 12 of 16
    grow_settings = {"columns": None, "grow": grow}
    grow_callback = {"class_path": "lit_growattn.GrowAttentionCallback",
                     "init_args": {"schedule": {"class_path": "lit_growattn.AutoSchedule", "init_args": rule},
                                   "growth": grow_settings, "statistics": {"batches": 4}}}
    watch = {"class_path": "hf_helpers.RotaryWatch", "init_args": {"out": str(tmp_path)}}
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [grow_callback, watch]}}))
    done = _fit(tmp_path, f"--config={path}")
    out = done.stdout + done.stderr
    assert "at step 4 (epoch 0)" in out and "at step 12 (epoch 1)" in out and "at step 16" not in out
    sides = 2 if grow == "both" else 1
    assert out.count("2 values per column") == 6 * sides  # both layers (and sides) at each of the 3 checks
    sizes = _last_head_sizes(tmp_path)
    assert min(sizes) >= 8
    if grow == "both":
        checkpoint = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=False)
        v_sizes = checkpoint["hyper_parameters"]["v_head_sizes"]
        assert min(v_sizes) >= 8 and 2 * (sum(sizes) + sum(v_sizes)) <= 2 * 2 * 2 * 12
        assert f"KV-cache budget: mean head size of the query/key and value sides {(sum(sizes) + sum(v_sizes)) / 4:.4g}" in out
    else:
        assert 2 * sum(sizes) <= 2 * 2 * 12
        assert f"mean query/key head size {sum(sizes) / 2:.4g} of 12" in out
    growths = torch.load(tmp_path / "rotary_watch.pt")
    assert growths and all(same for event in growths for _, _, same in event)  # rotary columns bit-identical
    assert [d for _, d, _ in growths[-1]] == sizes


# -- both sides grown through the command line (the value side: tests/test_hf_value.py) ---------------------------

@pytest.mark.parametrize("schedule", [{"class_path": "lit_growattn.AtSteps", "init_args": {"steps": [4]}},
                                      {"class_path": "lit_growattn.AtEpochs", "init_args": {"epochs": [1]}}])
def test_fit_grows_both_sides_of_a_tiny_llama_and_exports_it(tmp_path, schedule):
    from lit_growattn.commands.export import main as export_command
    from lit_growattn.hf import HFCausalLM

    path = tmp_path / "callbacks.yaml"
    grow = {"class_path": "lit_growattn.GrowAttentionCallback",
            "init_args": {"schedule": schedule, "statistics": {"batches": 2},
                          "growth": {"grow": "both", "columns": 1, "value_columns": 2}}}
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [grow]}}))
    done = _fit(tmp_path, f"--config={path}", "--trainer.max_steps=10")
    assert "d_head 8→9 per layer, d_v 8→10 per layer" in done.stdout + done.stderr
    (ckpt,) = tmp_path.rglob("last.ckpt")
    checkpoint = torch.load(ckpt, weights_only=False)
    assert checkpoint["hyper_parameters"]["head_sizes"] == [9, 9]
    assert checkpoint["hyper_parameters"]["v_head_sizes"] == [10, 10]
    assert checkpoint["state_dict"]["model.model.layers.0.self_attn.value.w_v"].shape == (2, 64, 10)
    trained = HFCausalLM.load_from_checkpoint(ckpt).model.eval()
    export_command(["--ckpt", str(ckpt), "--out", str(tmp_path / "grown")])
    loaded = load(tmp_path / "grown")
    assert loaded.config.v_head_sizes == [10, 10] and loaded.config.qk_head_sizes == [9, 9]
    same_model(trained, loaded)


def test_a_resume_inside_the_statistics_window_of_a_growth_of_both_sides_ends_bit_equal(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    full.mkdir(), resumed.mkdir()

    def callbacks(out, extra):
        grow = {"class_path": "lit_growattn.GrowAttentionCallback",
                "init_args": {"schedule": {"class_path": "lit_growattn.AtSteps", "init_args": {"steps": [5]}},
                              "statistics": {"batches": 4}, "growth": {"grow": "both", "columns": 2, "value_columns": 3}}}
        dump = {"class_path": "hf_helpers.ParamsDump", "init_args": {"out": str(out)}}
        (out / "callbacks.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": [*extra, grow, dump]}}))
        return f"--config={out / 'callbacks.yaml'}"

    every_step = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(full / "ckpts"), "every_n_train_steps": 1, "save_top_k": -1,
                                "filename": "{step}", "save_last": True}}
    # Growth at step 5 from the 4 micro-batches of steps 1–4: step 3's checkpoint falls inside the window.
    _fit(full, callbacks(full, [every_step]), "--trainer.max_steps=7")
    _fit(resumed, callbacks(resumed, []), "--trainer.max_steps=7", f"--ckpt_path={full / 'ckpts' / 'step=3.ckpt'}")
    a, b = torch.load(full / "params_0.pt"), torch.load(resumed / "params_0.pt")
    assert a["model.model.layers.1.self_attn.value.w_v"].shape[-1] == 11
    assert a["model.model.layers.1.self_attn.w_k"].shape[-1] == 10
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_both_sides_grow_under_ddp_with_identical_replicas(tmp_path):
    grow = {"class_path": "lit_growattn.GrowAttentionCallback",
            "init_args": {"schedule": {"class_path": "lit_growattn.AtSteps", "init_args": {"steps": [4]}},
                          "statistics": {"batches": 2}, "growth": {"grow": "both", "columns": 1, "value_columns": 2}}}
    dump = {"class_path": "hf_helpers.ParamsDump", "init_args": {"out": str(tmp_path)}}
    (tmp_path / "callbacks.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": [grow, dump]}}))
    _fit(tmp_path, f"--config={tmp_path / 'callbacks.yaml'}", "--trainer.devices=2", "--trainer.strategy=ddp",
         "--trainer.max_steps=6")
    p0, p1 = (torch.load(tmp_path / f"params_{rank}.pt") for rank in (0, 1))
    assert p0["model.model.layers.0.self_attn.value.w_v"].shape == (2, 64, 10)
    assert p0["model.model.layers.0.self_attn.value.w_o"].shape == (4, 10, 64)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
