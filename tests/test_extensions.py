"""A growth direction and an attention variant registered from a module outside the package grow through the CLI."""

import os
import subprocess
import sys

import pytest
import torch

from lit_growattn import growth
from lit_growattn.__main__ import main as command_line
from lit_growattn.attention import ATTENTIONS, register_attention
from lit_growattn.attention.mha import MultiHeadAttention
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT

from conftest import REPO

TESTS = REPO / "tests"


def fit(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m lit_growattn fit` on tiny MQAR, run from tests/ as a user runs it from the folder of their module."""
    command = [sys.executable, "-m", "lit_growattn", "fit", "--config", str(REPO / "configs/mqar_grow.yaml"),
               "--trainer.max_epochs=2", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
               "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
               "--data.init_args.num_train_examples=512", "--data.init_args.num_val_examples=128",
               "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]", "--trainer.callbacks.init_args.statistics.batches=2",
               *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=TESTS, env=env, capture_output=True, text=True, timeout=300)


def test_a_toy_direction_and_variant_from_outside_the_package_grow_through_the_cli(tmp_path):
    proc = fit(tmp_path, "--extensions=[toy_extension]", "--model.init_args.attention=toy_mha",
               "--trainer.callbacks.init_args.growth.method=toy_sign")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Read without loading: this process keeps the registries as shipped (loading would need `import toy_extension`).
    checkpoint = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=False)
    assert checkpoint["hyper_parameters"]["attention"] == "toy_mha"
    (state,) = [s for name, s in checkpoint["callbacks"].items() if "GrowAttention" in name]
    (event,) = state["history"]
    assert event["d_head"] == [4, 4]  # d_head 2, grown by 2 at epoch 1
    assert event["sign_fallbacks"] == 0  # the toy direction itself was installed, not the gradient's fallback
    assert "toy_extension" not in sys.modules


def test_without_the_extension_the_names_are_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown attention 'toy_unregistered'; registered attentions: .*mha.*extensions"):
        GPT(GPTConfig(attention="toy_unregistered"))
    with pytest.raises(ValueError, match=r"method must be one of natural, gradient, pinv, random, zero; got 'toy_s"):
        growth.check_choice("method", "toy_sign", growth.METHODS)


def test_a_missing_extension_module_is_named(tmp_path, capsys):
    assert command_line(["fit", "--config", str(REPO / "configs/mqar_grow.yaml"), "--extensions=[no_such_module]",
                         f"--trainer.logger.init_args.save_dir={tmp_path}"]) == 1
    assert "extensions: cannot import 'no_such_module'" in capsys.readouterr().err


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="attention 'mha' is already registered"):
        register_attention("mha")(type("Other", (torch.nn.Module,), {}))
    assert ATTENTIONS["mha"] is MultiHeadAttention
    with pytest.raises(ValueError, match="growth direction 'natural' is already registered"):
        growth.register_direction("natural")(lambda mo, rcond: -mo.n)
