"""One source for each set of allowed values, and the small public pieces built on it."""

from typing import get_args

import pytest

from lit_growattn import growth
from lit_growattn.cli import main
from lit_growattn.config import GPTConfig
from lit_growattn.growth.choices import Direction
from lit_growattn.model import GPT

from conftest import REPO


def test_every_direction_name_has_its_solver_and_methods_add_the_baselines():
    assert tuple(growth.DIRECTIONS) == get_args(Direction)
    assert growth.METHODS == (*get_args(Direction), *growth.BASELINES)


def test_the_command_line_lists_the_allowed_methods(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs/recall_grow.yaml"), "--trainer.callbacks.init_args.growth.method=svd",
              f"--trainer.logger.init_args.save_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert all(method in err for method in growth.METHODS), err[-2000:]


def test_named_qk_forms_gives_layer_name_and_form():
    gpt = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, d_head=2, attention="diff"))
    named = gpt.named_qk_forms()
    assert [(layer, name) for layer, name, _ in named] == [
        (0, "blocks.0.attn.qk"), (0, "blocks.0.attn.qk2"), (1, "blocks.1.attn.qk"), (1, "blocks.1.attn.qk2")]
    assert [form for _, _, form in named] == [f for forms in gpt.qk_forms() for f in forms]
