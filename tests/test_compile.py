"""`compile: true`: compiled training with a growth event equals eager training, with a bounded number of graphs."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from lit_growattn.commands.cli import main
from lit_growattn.model.compiled import CompiledBlocks
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT

from conftest import REPO


def _fit(tmp_path, tiny_cli_args, *extra):
    """8 steps at the full learning rate (no warmup, so that every parameter moves well beyond the tolerance);
    returns the parameters before training and the trained module."""
    cli = main(["--config", str(REPO / "configs/mqar_grow.yaml"), *tiny_cli_args, "--trainer.max_epochs=2",
                "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                "--trainer.callbacks.init_args.statistics.batches=1", "--model.init_args.warmup_steps=0",
                "--model.init_args.n_layer=1", "--model.init_args.n_embd=32", "--data.init_args.num_train_examples=128",
                "--data.init_args.num_val_examples=32", "--data.init_args.batch_size=32", *extra], run=False)
    initial = {name: p.detach().clone() for name, p in cli.model.named_parameters()}
    cli.trainer.fit(cli.model, cli.datamodule)
    return initial, cli.model


# The value side grows too (both sides' statistics are captured eagerly, and the resized W_V, W_O recompile).
BOTH = ["--trainer.callbacks.init_args.growth.grow=both", "--trainer.callbacks.init_args.growth.value_columns=3",
        "--model.init_args.d_v=8"]


@pytest.mark.parametrize("sides", [[], BOTH], ids=["query_key", "both"])
def test_compiled_growth_run_equals_eager_with_bounded_recompiles(tmp_path, tiny_cli_args, sides):
    initial, eager = _fit(tmp_path / "eager", tiny_cli_args, *sides)
    torch.compiler.reset()
    graphs = counters["stats"]["unique_graphs"]
    _, compiled = _fit(tmp_path / "compiled", tiny_cli_args, "--model.init_args.compile=true", *sides)
    graphs = counters["stats"]["unique_graphs"] - graphs
    assert compiled.model.head_sizes() == eager.model.head_sizes() == [4]
    assert compiled.model.value_sizes() == eager.model.value_sizes() == [11 if sides else 32]
    # One graph before the growth, one after it; the documented bound is 2 · n_layer per growth epoch.
    assert compiled.model.compiled.resets == 1
    assert graphs == 2, graphs
    # Compiled kernels sum in other orders than eager ones: float32 round-off, carried through 8 Adam steps (which
    # move a parameter by up to lr whatever its gradient's size). Measured ≤ 1.3e-6 against this 1.2e-5.
    tolerance = 100 * torch.finfo(torch.float32).eps
    for (name, got), want in zip(compiled.named_parameters(), eager.parameters()):
        old = tuple(slice(0, size) for size in initial[name].shape)  # a grown tensor's columns from before the growth
        # Every parameter moved far beyond the tolerance (measured ≥ 1.2e-2), so equal ones are equal training.
        assert (want[old] - initial[name]).abs().max() > 100 * tolerance, name
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=lambda m: f"{name}: {m}")


def test_more_graphs_than_the_bound_fail_loudly(monkeypatch):
    # Dynamo's default would warn once and run eagerly from then on; here a third batch shape is an error.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.compiler.reset()
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, d_head=2, d_v=8))
    model.compile_blocks()
    for batch in (4, 3):
        idx = torch.randint(0, 16, (batch, 8))
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    with pytest.raises(RuntimeError, match="more than 2 compiled graphs"):
        model(torch.randint(0, 16, (2, 8)))
    torch.compiler.reset()


def test_moving_the_blocks_before_their_first_step_does_not_drop_compiled_code(monkeypatch):
    # Lightning moves the model to its device (and dtype) after it was built: only a change between compiled
    # steps, a growth, may reset dynamo, or a GPU run would count one reset more than a CPU run.
    monkeypatch.setattr(torch, "compile", lambda block, **kwargs: block)
    resets = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(True))
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    compiled = CompiledBlocks(blocks)
    blocks.double()
    compiled(torch.zeros(2, 4, dtype=torch.float64))
    compiled(torch.zeros(2, 4, dtype=torch.float64))
    assert compiled.resets == 0 and not resets
    blocks[0] = torch.nn.Linear(4, 4, bias=False, dtype=torch.float64)  # the parameters change, as in a growth
    compiled(torch.zeros(2, 4, dtype=torch.float64))
    assert compiled.resets == 1 and resets == [True]
