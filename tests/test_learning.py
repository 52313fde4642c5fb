"""Training learns: accuracy and loss reached in short real runs, the learning rate the optimizer steps with, the
optimizer state of grown columns, and what a growth event installs, each against values computed here.

Every bar below is set from a measured value with the seeds fixed; each comment gives the measured value beside
the bar, so that a test fails when the model stops learning, not when round-off or a seed moves it a little.
"""

import functools
import math
from collections import Counter
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings, StepSearch
from lit_growattn.commands.cli import main
from lit_growattn.callback.event import choose_step_size
from lit_growattn.growth import loss_rounding

from callback_helpers import recall_data, tiny_module, trainer
from conftest import REPO
from test_text_data import write_corpus

# The demo (configs/recall_grow.yaml) scaled down: 16 keys instead of 32, 3 epochs of 100 steps instead of 6 of 200.
SMALL_DEMO = ["--data.init_args.num_keys=16", "--data.init_args.num_values=8", "--data.init_args.num_kv_pairs=8",
              "--data.init_args.num_train_examples=3200", "--data.init_args.num_val_examples=256",
              "--data.init_args.batch_size=32", "--trainer.max_epochs=3", "--model.init_args.warmup_steps=25"]


def _cli(config, log_dir, *overrides):
    """`python -m lit_growattn fit --config <config> <overrides>`, built but not run yet."""
    return main(["--config", str(REPO / config), "--trainer.enable_progress_bar=false",
                 f"--trainer.logger.init_args.save_dir={log_dir}", *overrides], run=False)


def _val_acc_after_fit(cli) -> float:
    cli.trainer.fit(cli.model, cli.datamodule)
    return float(cli.trainer.callback_metrics["val/acc"])


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """The small demo, grown (d_head 1 → 8 → 15 at epochs 1 and 2) and kept at d_head 1 (no callback)."""
    demo = "configs/recall_grow.yaml"
    grown = _cli(demo, tmp_path_factory.mktemp("grown"), *SMALL_DEMO)
    static = _cli(demo, tmp_path_factory.mktemp("static"), *SMALL_DEMO, "--trainer.callbacks=null")
    acc = {"grown": _val_acc_after_fit(grown), "static": _val_acc_after_fit(static)}
    return SimpleNamespace(acc=acc, head_sizes={"grown": grown.model.head_sizes(), "static": static.model.head_sizes()})


def test_the_demo_task_is_solved_after_its_growths(demo_runs):
    assert demo_runs.head_sizes["grown"] == [15]
    # Measured 1.000 (chance: 1/8).
    assert demo_runs.acc["grown"] >= 0.95


def test_grown_beats_static_narrow_on_the_demo_task(demo_runs):
    """The headline in small: the model grown from d_head 1 gets where d_head 1 kept does not."""
    assert demo_runs.head_sizes["static"] == [1]
    # Measured 1.000 against 0.682 (with seeds 1 and 2 of the model: 1.000 against 0.586 and 0.627).
    assert demo_runs.acc["grown"] - demo_runs.acc["static"] >= 0.2


def test_text_loss_falls_below_the_bytes_unigram_entropy(tmp_path):
    """A byte-level model on generated text: from the untrained loss to below the loss of the best context-free
    guess (the held-out bytes' own unigram entropy, computed here), so it learned to use the context."""
    path = tmp_path / "corpus.txt"
    write_corpus(path)
    cli = _cli("configs/text.yaml", tmp_path, "--trainer.max_epochs=1", f"--data.init_args.path={path}",
               "--data.init_args.block_size=32", "--data.init_args.batch_size=16",
               "--data.init_args.samples_per_epoch=1280", "--model.init_args.warmup_steps=10")  # 80 steps
    untrained = cli.trainer.validate(cli.model, cli.datamodule, verbose=False)[0]["val/loss"]
    cli.trainer.fit(cli.model, cli.datamodule)
    trained = float(cli.trainer.callback_metrics["val/loss"])
    held_out = path.read_bytes()[-int(path.stat().st_size * 0.1) :]  # val_fraction 0.1: the file's last tenth
    shares = [n / len(held_out) for n in Counter(held_out).values()]
    unigram = -sum(p * math.log(p) for p in shares)
    # Measured: 5.62 untrained, 2.51 after 80 steps (a fall of 3.11 nats), 0.95 below a unigram entropy of 3.46.
    assert untrained - trained >= 2.5
    assert trained <= unigram - 0.5


class LearningRates(L.Callback):
    """The learning rate of each parameter group at every optimizer step, as the optimizer steps with it."""

    def __init__(self):
        self.at_step: dict[int, list[float]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.at_step[trainer.global_step] = [group["lr"] for group in optimizer.param_groups]


def test_learning_rate_follows_warmup_then_cosine_to_the_floor(tmp_path):
    """The built-in schedule as the module documents it, read off the optimizer during a run that grows midway
    (the rebuilt optimizer and scheduler must go on where they were)."""
    peak, warmup, floor, epochs = 0.01, 8, 0.1, 4
    L.seed_everything(0)
    data = recall_data()  # 8 batches an epoch: 32 steps
    rates = LearningRates()
    grow = GrowAttentionCallback(AtEpochs([2]), growth=GrowthSettings(columns=2),
                                 statistics=StatisticsSettings(batches=2))
    module = tiny_module(data, warmup_steps=warmup, min_lr_ratio=floor,
                         optimizer=functools.partial(torch.optim.AdamW, lr=peak))
    trainer(tmp_path, [grow, rates], max_epochs=epochs).fit(module, data)
    total = 8 * epochs
    assert grow.history[0]["step"] == 16 and sorted(rates.at_step) == list(range(total))

    def documented(step):
        if step < warmup:
            return peak * (step + 1) / warmup
        return peak * (floor + (1 - floor) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) / 2)

    for step, lrs in rates.at_step.items():
        assert lrs == pytest.approx([documented(step)] * len(lrs), rel=1e-12, abs=0), step
    # The shape in numbers: linear warmup, the peak, half-way down the cosine, near the floor at the end.
    assert rates.at_step[0][0] == pytest.approx(peak / 8)
    assert rates.at_step[7][0] == rates.at_step[8][0] == pytest.approx(peak)
    assert rates.at_step[20][0] == pytest.approx(peak * (floor + 1) / 2)
    assert rates.at_step[31][0] == pytest.approx(peak * floor, rel=0.05)


class AdamStateAtGrowth(GrowAttentionCallback):
    """Adam's state of the growing query/key tensors just before and just after each event."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        self.before = self._grown_state(trainer, pl_module)
        super()._grow(trainer, pl_module, point, batch_idx)
        self.after = self._grown_state(trainer, pl_module)

    @staticmethod
    def _grown_state(trainer, pl_module):
        (optimizer,) = trainer.optimizers
        return {name: {key: value.clone() for key, value in optimizer.state[p].items()}
                for name, p in pl_module.named_parameters() if name.endswith(("w_q", "w_k"))}


@pytest.mark.parametrize("new_second_moment, temperature", [("mean", "keep"), ("zero", "keep"), ("mean", "rescale")])
def test_new_columns_optimizer_state_is_what_new_second_moment_says(tmp_path, new_second_moment, temperature):
    """Old columns keep their moments (scaled as their weights were: by c = (d′/d)^¼ under `rescale`, so their
    gradients by 1/c); new columns start with zero first moments and, as second moments, the old (scaled) ones'
    mean or zero."""
    L.seed_everything(0)
    data = recall_data()
    grow = AdamStateAtGrowth(AtEpochs([1]), growth=GrowthSettings(columns=2, temperature=temperature,
                                                                  new_second_moment=new_second_moment),
                             statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)
    d, d_new = 2, 4
    c = (d_new / d) ** 0.25 if temperature == "rescale" else 1.0
    assert grow.before.keys() == grow.after.keys() and len(grow.after) == 4  # w_q and w_k of 2 layers
    # Second moments are ~1e-7 here: relative tolerances only (a float32 default atol of 1e-5 would pass zeros).
    close = functools.partial(torch.testing.assert_close, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    for name, old in grow.before.items():
        new = grow.after[name]
        assert new["exp_avg"].shape[-1] == d_new, name
        assert torch.equal(new["step"], old["step"]), name
        old_sq = old["exp_avg_sq"] / c**2
        close(new["exp_avg"][..., :d], old["exp_avg"] / c, msg=name)
        close(new["exp_avg_sq"][..., :d], old_sq, msg=name)
        assert torch.equal(new["exp_avg"][..., d:], torch.zeros_like(new["exp_avg"][..., d:])), name
        assert old_sq.mean() > 0, name  # so that the two policies differ
        fill = old_sq.mean() if new_second_moment == "mean" else torch.zeros(())
        close(new["exp_avg_sq"][..., d:], fill.expand_as(new["exp_avg_sq"][..., d:]), msg=name)


def test_the_quadratic_step_is_taken_when_it_wins():
    """On a loss that is exactly L(0) − sα + cα² with the slope s predicted to first order, the quadratic rule's
    α* = s/2c lies between the grid's points and beats them all: it must be the step taken."""
    slope, curvature, loss_0 = 1.6, 2.0, 2.0
    loss = lambda alpha: loss_0 - slope * alpha + curvature * alpha**2  # noqa: E731
    grown = lambda name, alpha: SimpleNamespace(alpha=alpha, predicted_decrease=slope * alpha)  # noqa: E731
    plan = SimpleNamespace(grow=grown, trial=grown)

    def loss_of(candidates):
        return torch.tensor([loss_0 if c is None else loss(c["form"].alpha) for c in candidates], dtype=torch.float64)

    grid = [0.0, 0.25, 1.0]  # losses 2, 1.725, 2.4
    on_grid = choose_step_size(plan, ["form"], loss_of, StepSearch(alphas=grid), "natural", terms=1)
    quadratic = choose_step_size(plan, ["form"], loss_of, StepSearch(alphas=grid, rule="quadratic"), "natural", terms=1)
    assert on_grid.alpha == 0.25
    assert quadratic.alpha == pytest.approx(slope / (2 * curvature))  # 0.4, loss 1.68
    assert quadratic.loss_after == pytest.approx(loss(0.4)) and quadratic.loss_after < on_grid.loss_after - 0.04


class KeptBatchLosses(GrowAttentionCallback):
    """The kept batches' mean loss just before and just after each event, measured here by a plain forward pass."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        batches = list(self.window.kept)
        self.measured_before = _mean_loss(pl_module, batches)
        super()._grow(trainer, pl_module, point, batch_idx)
        self.measured_after = _mean_loss(pl_module, batches)


@torch.no_grad()
def _mean_loss(pl_module, batches) -> float:
    was_training = pl_module.training
    pl_module.eval()
    losses = [F.cross_entropy(pl_module(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100)
              for inputs, labels in batches]
    pl_module.train(was_training)
    return float(torch.stack(losses).mean())


def test_the_installed_growth_has_the_loss_the_event_reported(tmp_path):
    """A growth with α > 0 changes the function: the model it leaves behind, re-measured on the kept batches,
    has the loss the event chose it for, and the model before it the loss reported as `loss_before`."""
    L.seed_everything(0)
    data = recall_data()
    grow = KeptBatchLosses(AtEpochs([1]), growth=GrowthSettings(columns=2), statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)
    (event,) = grow.history
    assert event["alpha"] > 0
    # Means in float32 of the 2 kept batches' 2 × 16 × 4 labelled tokens.
    tolerance = loss_rounding(event["loss_before"], torch.float32, terms=128)
    assert grow.measured_before == pytest.approx(event["loss_before"], abs=tolerance, rel=0)
    assert grow.measured_after == pytest.approx(event["loss_after"], abs=tolerance, rel=0)
    # The growth moved the loss far beyond that: measured 2.9e-3 against a tolerance of 4.5e-6.
    assert grow.measured_before - grow.measured_after > 100 * tolerance
