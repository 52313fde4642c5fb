"""One source for each set of allowed values, and the small public pieces built on it."""

import pytest

from lit_growattn import growth
from lit_growattn.__main__ import main as command_line
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT

from conftest import REPO


def test_the_methods_are_the_registered_directions_and_the_baselines():
    assert tuple(growth.METHODS) == (*growth.DIRECTIONS, *growth.BASELINES) == ("natural", "gradient", "pinv", "random", "zero")
    assert "natural" in growth.METHODS and "random" in growth.METHODS and "svd" not in growth.METHODS


def test_the_command_line_lists_the_allowed_methods(tmp_path, capsys):
    assert command_line(["fit", "--config", str(REPO / "configs/recall_grow.yaml"),
                         "--trainer.callbacks.init_args.growth.method=svd", f"--trainer.logger.init_args.save_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "'svd'" in err and all(method in err for method in growth.METHODS), err[-2000:]


def test_named_qk_forms_gives_layer_name_and_form():
    gpt = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, d_head=2, attention="diff"))
    named = gpt.named_qk_forms()
    assert [(layer, name) for layer, name, _ in named] == [
        (0, "blocks.0.attn.qk"), (0, "blocks.0.attn.qk2"), (1, "blocks.1.attn.qk"), (1, "blocks.1.attn.qk2")]
    assert [form for _, _, form in named] == [f for forms in gpt.qk_forms() for f in forms]


def test_registered_names_read_their_registries_as_they_are_now():
    registry = {"a": 1}
    names = growth.choices.RegisteredNames(registry, ("b",))
    registry["c"] = 2
    assert list(names) == ["a", "c", "b"] and len(names) == 3 and "c" in names and "d" not in names
    with pytest.raises(ValueError, match="^x must be one of a, c, b; got 'd'$"):  # no hint unless one is given
        growth.check_choice("x", "d", names)
    hinted = growth.choices.RegisteredNames(registry, hint="register more with f")
    with pytest.raises(ValueError, match="^x must be one of a, c; got 'd' \\(register more with f\\)$"):
        growth.check_choice("x", "d", hinted)
