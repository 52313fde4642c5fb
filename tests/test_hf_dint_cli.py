"""The user's path for seed 001 on a Hugging Face model, as subprocesses: convert a tiny pretrained Llama folder to
low-rank DINT, fine-tune it on instruction data with the tiny twin of configs/hf_llama_dint_sft.yaml, export,
reload and generate; the entropy reference and the cross-domain validation sets (a text file, and a dataset folder
passed where a hub name goes) reach TensorBoard."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, needs_transformers, scalar_tags

needs_transformers()

import torch  # noqa: E402
import yaml  # noqa: E402

from lit_growattn.data.arithmetic import make_rows, write_jsonl  # noqa: E402

from hf_helpers import instruct_tokenizer, saved_tiny_model  # noqa: E402

TINY = REPO / "configs" / "hf_llama_dint_sft_tiny.yaml"


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "lit_growattn", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_shipped_gpu_config_names_the_seed_setup():
    config = yaml.safe_load((REPO / "configs" / "hf_llama_dint_sft.yaml").read_text())
    twin = yaml.safe_load(TINY.read_text())
    assert config["trainer"]["precision"] == "bf16-mixed" and config["trainer"]["accelerator"] == "gpu"
    assert config["data"]["init_args"]["hf_dataset"] == "nvidia/OpenMathInstruct-2"
    for key in ("model", "data"):
        assert config[key]["class_path"] == twin[key]["class_path"]
    assert [c["class_path"] for c in config["trainer"]["callbacks"]] == [c["class_path"] for c in twin["trainer"]["callbacks"]]


def test_convert_fit_export_generate(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    import lit_growattn.hf  # noqa: F401 - registers the DINT classes

    folder = tmp_path / "llama"
    tokenizer = instruct_tokenizer(folder, chat_template=False)
    saved_tiny_model("llama", folder, vocab=len(tokenizer))
    done = run(tmp_path, "convert", "--pretrained", str(folder), "--to", "lowrank_dint", "--rank", "2",
               "--out", str(tmp_path / "dint"))
    assert "fine-tune with" in done.stdout
    assert AutoConfig.from_pretrained(tmp_path / "dint").dint == {"kind": "lowrank", "rank": 2, "d2_ratio": None}

    rows = write_jsonl(tmp_path / "rows.jsonl", make_rows(40, seed=0))
    (tmp_path / "other.txt").write_text("Problem user assistant Solution. " * 200)
    (tmp_path / "hub").mkdir()  # a folder `datasets.load_dataset` reads, where a hub name would go
    write_jsonl(tmp_path / "hub" / "test.jsonl", [{"body": "user Solution Problem. " * 20} for _ in range(10)])
    run(tmp_path, "fit", "--config", str(TINY), f"--model.init_args.pretrained={tmp_path / 'dint'}",
        f"--data.init_args.tokenizer={tmp_path / 'dint'}", f"--data.init_args.path={rows}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--data.init_args.val_texts={other: other.txt, "
        "hub: {hf_dataset: hub, hf_split: test, hf_text_field: body}}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}")
    tags = scalar_tags(tmp_path / "logs")
    assert {"val/loss", "val/other/loss", "val/hub/loss", "train/loss"} <= tags
    assert {f"attention/{kind}/layer_{i}" for kind in ("entropy", "entropy_original") for i in (0, 1)} <= tags

    (ckpt,) = (tmp_path / "logs").rglob("last.ckpt")
    run(tmp_path, "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "export"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    lam = torch.stack([layer.self_attn.lam for layer in model.model.layers])
    assert lam.abs().max() > 0  # λ left zero during fine-tuning
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert torch.equal(state["model.model.layers.0.self_attn.lam"], model.model.layers[0].self_attn.lam.detach())
    prompt = torch.tensor([tokenizer("Problem:\nWhat is 1 + 2?\n\nSolution:\n")["input_ids"]])
    cached = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    uncached = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
                              use_cache=False)
    assert cached.shape == (1, prompt.shape[1] + 20) and torch.equal(cached, uncached)
