"""The optimizer and the built-in schedule (lit_growattn.training.optimization), unit by unit: the learning-rate factor at
chosen steps, the parameter groups, the bias row's decoupled weight decay, and the optimizer and scheduler a
module configures."""

import copy
import functools
import math

import pytest
import torch

from lit_growattn.module import GrowAttentionLM
from lit_growattn.training.optimization import default_optimizer, lr_factor


@pytest.mark.parametrize("step, expected", [(0, 0.25), (1, 0.5), (3, 1.0)])
def test_warmup_is_linear_up_to_the_peak(step, expected):
    assert lr_factor(step, warmup=4, total=100, floor=0.1, shape="cosine") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "step, expected",
    [
        (4, 1.0),  # the first step after the warmup is at the peak
        (9, 0.1 + 0.9 * 0.5),  # half way: cos(π/2) = 0
        (6, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2))),
        (14, 0.1),  # the floor at `total`
        (40, 0.1),  # and after it
    ],
)
def test_cosine_decays_to_the_floor(step, expected):
    assert lr_factor(step, warmup=4, total=14, floor=0.1, shape="cosine") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("step", [2, 9, 500])
def test_constant_schedule_stays_at_the_peak(step):
    assert lr_factor(step, warmup=2, total=10, floor=0.1, shape="constant") == 1.0


def test_no_warmup_starts_at_the_peak():
    assert lr_factor(0, warmup=0, total=10, floor=0.0, shape="cosine") == 1.0
    assert lr_factor(5, warmup=0, total=10, floor=0.0, shape="cosine") == pytest.approx(0.5, rel=1e-12)


def test_total_within_the_warmup_decays_in_one_step():
    """A run shorter than its warmup (total ≤ warmup) still has a schedule: one step of cosine after the warmup."""
    assert lr_factor(4, warmup=4, total=2, floor=0.2, shape="cosine") == 1.0
    assert lr_factor(5, warmup=4, total=2, floor=0.2, shape="cosine") == pytest.approx(0.2, rel=1e-12)
    assert lr_factor(6, warmup=4, total=2, floor=0.2, shape="cosine") == pytest.approx(0.2, rel=1e-12)


def tiny(**kwargs) -> GrowAttentionLM:
    torch.manual_seed(0)
    args = dict(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, d_head=4, bias=True)
    return GrowAttentionLM(**{**args, **kwargs})


def test_default_optimizer_is_adamw_with_the_documented_settings():
    optimizer = default_optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-3, (0.9, 0.95), 0.1)


def test_weight_decay_only_on_matrices_without_a_bias_row():
    module = tiny()
    decay, no_decay = module.parameter_groups()
    bias_rows = {id(p) for p in module._bias_row_parameters()}
    assert bias_rows  # bias=True: W_Q and W_K end in a bias row
    assert "weight_decay" not in decay and no_decay["weight_decay"] == 0.0
    trainable = [p for p in module.parameters() if p.requires_grad]
    matrices = [id(p) for p in trainable if p.ndim >= 2 and id(p) not in bias_rows]
    assert any(p.ndim == 2 and id(p) in matrices for p in trainable)  # the embedding, the MLP: 2-D weights decay
    assert [id(p) for p in decay["params"]] == matrices
    assert [id(p) for p in no_decay["params"]] == [id(p) for p in trainable if id(p) not in matrices]
    assert any(p.ndim == 1 for p in no_decay["params"])  # norms' gains, temperatures


def test_frozen_parameters_are_in_no_group():
    module = tiny()
    frozen = module._bias_row_parameters()[0]
    frozen.requires_grad_(False)
    assert all(p is not frozen for group in module.parameter_groups() for p in group["params"])


def test_bias_row_decay_spares_the_last_row():
    module = tiny()
    optimizer = torch.optim.AdamW(module.parameter_groups(), lr=0.5, weight_decay=0.1)
    with_grad, without_grad = module._bias_row_parameters()[:2]
    with_grad.grad = torch.ones_like(with_grad)
    before = with_grad.detach().clone(), without_grad.detach().clone()
    module.on_before_optimizer_step(optimizer)
    shrink = 1.0 - 0.5 * 0.1  # the no-decay group's lr times the decay group's weight decay
    torch.testing.assert_close(with_grad[:, :-1], shrink * before[0][:, :-1])
    assert torch.equal(with_grad[:, -1], before[0][:, -1])
    assert torch.equal(without_grad, before[1])  # no gradient: AdamW skips it, and so does the decay


def test_bias_row_decay_is_nothing_without_bias_rows():
    module = tiny(bias=False)
    optimizer = torch.optim.AdamW(module.parameter_groups(), lr=0.5)
    before = [p.detach().clone() for p in module.parameters()]
    module.on_before_optimizer_step(optimizer)  # no bias rows: it neither fails nor changes anything
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))


def test_built_in_schedule_follows_the_hparams():
    module = tiny(warmup_steps=3, min_lr_ratio=0.25, lr_schedule="cosine")
    module._total_steps = 13
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    assert isinstance(optimizer, torch.optim.AdamW) and len(optimizer.param_groups) == 2
    for step in (0, 2, 3, 8, 13):
        assert module._lr_factor(step) == lr_factor(step, 3, 13, 0.25, "cosine")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * lr_factor(0, 3, 13, 0.25, "cosine"))
    optimizer.step()  # no gradients yet: nothing moves, but the scheduler's step now follows an optimizer step
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * lr_factor(1, 3, 13, 0.25, "cosine"))


def test_given_optimizer_and_scheduler_are_used():
    built = {}

    def optimizer(params):
        built["optimizer"] = torch.optim.SGD(params, lr=0.1)
        return built["optimizer"]

    def scheduler(opt):
        built["scheduler"] = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        return built["scheduler"]

    configured = tiny(optimizer=optimizer, scheduler=scheduler).configure_optimizers()
    assert configured["optimizer"] is built["optimizer"]
    assert configured["lr_scheduler"] == {"scheduler": built["scheduler"], "interval": "step"}


def test_deep_copy_shares_the_factories():
    """Lightning's weight averaging deep-copies the module: the factories (objects the CLI builds, which may hold
    what cannot be copied) are shared, everything else is copied, and references to the module lead to the copy."""
    module = tiny(optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                  scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1))
    module.loop_back = [module]  # a reference to the module from inside its own state
    copied = copy.deepcopy(module)
    assert copied is not module and type(copied) is type(module)
    assert copied.optimizer_factory is module.optimizer_factory
    assert copied.scheduler_factory is module.scheduler_factory
    assert copied.loop_back[0] is copied
    for original, twin in zip(module.parameters(), copied.parameters(), strict=True):
        assert twin is not original and torch.equal(twin, original)
