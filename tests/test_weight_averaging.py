"""Lightning's own callbacks combined with growth (lit_growattn/growing/averaging.py): EMA and SWA run through both
growths of configs/recall_grow.yaml, their averaged copy grows as the model does (new entries from the live model,
old ones keep their average), an EMA run resumed after a growth equals the uninterrupted one, and the callbacks
that cannot follow a growth (or `statistics.layers_per_event` above the growing layers) are refused at setup."""

import math
import re

import pytest
import torch
from lightning.pytorch.callbacks import (BackboneFinetuning, Callback, EMAWeightAveraging, LearningRateFinder,
                                         ModelCheckpoint, ModelPruning, StochasticWeightAveraging)
from torch.optim.swa_utils import SWALR

from lit_growattn import AtSteps, GrowAttentionCallback
from lit_growattn.commands.cli import main
from lit_growattn.training.lightning_private import averaged_model
from lit_growattn.callback.settings import GrowthSettings, StatisticsSettings

from callback_helpers import params, recall_data, tiny_module, trainer
from conftest import REPO, needs_transformers

# recall_grow.yaml, small: 5 batches an epoch, growths at the starts of epochs 1 and 2 (steps 5 and 10).
RECALL = [
    "--config", str(REPO / "configs/recall_grow.yaml"), "--trainer.max_epochs=3", "--trainer.limit_train_batches=5",
    "--trainer.limit_val_batches=1", "--trainer.callbacks.init_args.statistics.batches=3",
    "--data.init_args.num_train_examples=320", "--data.init_args.num_val_examples=64",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]
EMA = ["--trainer.callbacks+=lightning.pytorch.callbacks.EMAWeightAveraging", "--trainer.callbacks.init_args.decay=0.5"]
# device as a string: SWA's default, torch.device("cpu"), is a value jsonargparse cannot write into config.yaml.
SWA = ["--trainer.callbacks+=lightning.pytorch.callbacks.StochasticWeightAveraging",
       "--trainer.callbacks.init_args.swa_lrs=0.01", "--trainer.callbacks.init_args.device=cpu"]
# SWA swaps the module's per-step schedule for its per-epoch SWALR, and Lightning says so; that is what SWA does.
SWA_SWAPS_SCHEDULE = pytest.mark.filterwarnings("ignore:SWA is currently only supported every epoch:UserWarning")


def fit(out, *args):
    """`python -m lit_growattn fit` on the small recall_grow.yaml, with a checkpoint after every optimizer step."""
    return main([
        "fit", *RECALL, f"--trainer.logger.init_args.save_dir={out}", *args,
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.init_args.dirpath={out}/ckpt", "--trainer.callbacks.init_args.filename={step}",
        "--trainer.callbacks.init_args.every_n_train_steps=1", "--trainer.callbacks.init_args.save_top_k=-1",
    ])


def only(trainer, kind):
    (callback,) = [c for c in trainer.callbacks if isinstance(c, kind)]
    return callback


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ema")
    return out, fit(out, *EMA)


def test_ema_runs_through_both_growths_and_its_average_grows_with_the_model(ema_run):
    _, cli = ema_run
    growths = only(cli.trainer, GrowAttentionCallback).history
    assert [(e["step"], e["skipped"]) for e in growths] == [(5, False), (10, False)]
    average = averaged_model(only(cli.trainer, EMAWeightAveraging))
    assert average.head_sizes() == cli.model.head_sizes() == [15]
    assert {k: v.shape for k, v in average.named_parameters()} == {k: v.shape for k, v in cli.model.named_parameters()}


@SWA_SWAPS_SCHEDULE
@pytest.mark.parametrize("start", [1, 3], ids=["averaging-from-epoch-0", "first-growth-before-averaging"])
def test_swa_runs_through_both_growths_and_its_scheduler_steps_the_rebuilt_optimizer(tmp_path, start):
    cli = fit(tmp_path, *SWA, f"--trainer.callbacks.init_args.swa_epoch_start={start}")  # 1-based: epoch start - 1
    assert cli.model.head_sizes() == [15]
    assert averaged_model(only(cli.trainer, StochasticWeightAveraging)).head_sizes() == [15]
    (config,) = cli.trainer.lr_scheduler_configs
    (optimizer,) = cli.trainer.optimizers
    assert isinstance(config.scheduler, SWALR) and config.scheduler.optimizer is optimizer
    # SWALR anneals at every epoch end: the last one, after both growths, set the rebuilt optimizer's lrs.
    assert [group["lr"] for group in optimizer.param_groups] == config.scheduler.get_last_lr()
    assert config.scheduler.get_last_lr() != [0.01] * len(optimizer.param_groups)  # still annealing


def test_ema_resumed_after_a_growth_equals_the_uninterrupted_run(ema_run, tmp_path):
    out, _ = ema_run
    fit(tmp_path, *EMA, f"--ckpt_path={out / 'ckpt' / 'step=6.ckpt'}")  # the step after the first growth
    full, resumed = (torch.load(d / "ckpt" / "step=15.ckpt", map_location="cpu", weights_only=False)
                     for d in (out, tmp_path))
    # WeightAveraging writes the averaged model as state_dict, the live one as current_model_state.
    for key in ("state_dict", "current_model_state", "averaging_state"):
        assert resumed[key].keys() == full[key].keys(), key
        assert all(torch.equal(resumed[key][k], full[key][k]) for k in full[key]), key
    assert not torch.equal(full["state_dict"]["model.blocks.0.attn.qk.w_q"],
                           full["current_model_state"]["model.blocks.0.attn.qk.w_q"])


@SWA_SWAPS_SCHEDULE
@pytest.mark.parametrize("averaging, kept", [
    (lambda: EMAWeightAveraging(decay=0.5), lambda ckpt: [ckpt["current_model_state"], ckpt["averaging_state"]]),
    (lambda: StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1),
     lambda ckpt: [ckpt["callbacks"]["StochasticWeightAveraging"]["average_model_state"]]),
], ids=["ema", "swa"])
def test_resumed_after_a_growth_with_a_model_built_small_equals_the_uninterrupted_run(tmp_path, averaging, kept):
    """Through the Python API the model is built with its first head sizes (the CLI builds it with the checkpoint's),
    so the averaged copy must take the checkpoint's sizes before the average is loaded into it."""
    def run(out, ckpt_path=None):
        data = recall_data()
        grow = GrowAttentionCallback(AtSteps([3]), growth=GrowthSettings(columns=2),
                                     statistics=StatisticsSettings(batches=2))
        every_step = ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
        trainer(out, [grow, averaging(), every_step], max_epochs=2, limit_train_batches=4).fit(
            tiny_module(data), data, ckpt_path=ckpt_path)
        ckpt = torch.load(out / "ckpt" / "step=8.ckpt", map_location="cpu", weights_only=False)
        return [ckpt["state_dict"], *kept(ckpt)]

    full = run(tmp_path / "full")
    after_growth = tmp_path / "full" / "ckpt" / "step=5.ckpt"
    for resumed, uninterrupted in zip(run(tmp_path / "resumed", after_growth), full, strict=True):
        assert resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    assert full[0]["model.blocks.0.attn.qk.w_q"].shape[-1] == 4


class AtGrowth(Callback):
    """The averaged copy and the live model at the end of each batch, and at the start of the batch where the
    model grew (this callback comes after GrowAttentionCallback, which grows at batch start, and after the
    averaging callback, which averages at batch end)."""

    def __init__(self, averaging: Callback):
        self.averaging, self.before, self.growth = averaging, None, None

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.before = params(averaged_model(self.averaging)), params(pl_module)

    def on_train_batch_start(self, trainer, pl_module, *args):
        live = params(pl_module)
        if self.before is not None and any(v.shape != self.before[1][k].shape for k, v in live.items()):
            self.growth = *self.before, params(averaged_model(self.averaging)), live


@SWA_SWAPS_SCHEDULE
@pytest.mark.parametrize("averaging, temperature", [
    (lambda: EMAWeightAveraging(decay=0.5), "keep"),
    (lambda: StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1), "keep"),
    (lambda: EMAWeightAveraging(decay=0.5), "rescale"),
], ids=["ema", "swa", "ema-rescale"])
def test_the_averaged_copy_grows_the_same_columns_and_takes_the_live_values_of_the_new_ones(
        tmp_path, averaging, temperature):
    data = recall_data()
    averaging = averaging()
    grow = GrowAttentionCallback(AtSteps([3]), growth=GrowthSettings(columns=2, temperature=temperature),
                                 statistics=StatisticsSettings(batches=2))
    probe = AtGrowth(averaging)
    trainer(tmp_path, [grow, averaging, probe], max_epochs=1, limit_train_batches=5).fit(tiny_module(data), data)
    average_before, live_before, average, live = probe.growth
    d, d_new = 2, 4
    c = (d_new / d) ** 0.25 if temperature == "rescale" else 1.0  # the growth's factor on the old columns
    grown = [k for k in live if k.endswith((".w_q", ".w_k"))]
    assert grown and all(live[k].shape[-1] == average[k].shape[-1] == d_new for k in grown)
    for k in grown:
        assert torch.equal(average[k][..., d:], live[k][..., d:]), k  # new columns: the live model's
        assert not torch.equal(average_before[k], live_before[k]), k  # an average, not a copy of the model
        assert torch.allclose(average[k][..., :d], c * average_before[k], rtol=1e-6, atol=1e-7), k
        if temperature == "keep":
            assert torch.equal(average[k][..., :d], average_before[k]), k  # unchanged, bit for bit
    for k in live:
        if k.endswith(".log_tau"):
            shift = 0.5 * math.log(d / d_new) if temperature == "rescale" else 0.0
            assert torch.allclose(average[k], average_before[k] + shift, atol=1e-6), k
        elif k not in grown:
            assert torch.equal(average[k], average_before[k]), k


def test_model_pruning_of_other_tensors_runs_through_a_growth(tmp_path):
    data = recall_data()
    grow = GrowAttentionCallback(AtSteps([3]), growth=GrowthSettings(columns=2),
                                 statistics=StatisticsSettings(batches=2))
    module = tiny_module(data)
    trainer(tmp_path, [grow, ModelPruning("l1_unstructured", amount=0.5)], max_epochs=2, limit_train_batches=3).fit(
        module, data)
    assert [e["skipped"] for e in grow.history] == [False] and module.head_sizes() == [4, 4]


@pytest.mark.parametrize("others, match", [
    (lambda grow, _: [grow, BackboneFinetuning()], "BackboneFinetuning cannot be combined .* new parameter groups"),
    (lambda grow, _: [grow, LearningRateFinder()], "LearningRateFinder cannot be combined .* restores"),
    (lambda grow, module: [grow, ModelPruning("l1_unstructured", parameters_to_prune=[
        (module.model.blocks[1].attn.qk, "w_k"), (module.model.blocks[1].mlp.fc, "weight")])],
     re.escape("ModelPruning prunes ['model.blocks.1.attn.qk.w_k'], which grow: pruning re-parametrises a tensor (a "
               "mask beside `<name>_orig`) and keeps a copy of its first values (lottery ticket), and neither follows "
               "a growth. Leave the growing tensors (query/key: w_q, w_k, log_tau; values: w_v, w_o) out of "
               "parameters_to_prune") + "$"),
    (lambda grow, _: [EMAWeightAveraging(), grow],
     "EMAWeightAveraging comes before GrowAttentionCallback .* put it after"),
], ids=["finetuning", "lr-finder", "pruning", "ema-first"])
def test_callbacks_that_cannot_follow_a_growth_are_refused_at_setup(tmp_path, others, match):
    data = recall_data()
    grow = GrowAttentionCallback(AtSteps([3]), statistics=StatisticsSettings(batches=2))
    module = tiny_module(data)
    before = params(module)
    with pytest.raises(ValueError, match=match):
        trainer(tmp_path, others(grow, module), max_epochs=1, limit_train_batches=3).fit(module, data)
    assert all(torch.equal(v, before[k]) for k, v in params(module).items())  # refused before any step


def test_layers_per_event_above_the_growing_layers_is_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"statistics.layers_per_event=2 exceeds the 1 growing layers \[0\]: set it "
                                         "to at most 1"):
        main(["fit", *RECALL, f"--trainer.logger.init_args.save_dir={tmp_path}",
              "--trainer.callbacks.init_args.statistics.layers_per_event=2"])
    assert not list(tmp_path.rglob("*.ckpt"))


def test_ema_follows_the_growth_of_a_hugging_face_model(tmp_path):
    needs_transformers()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n" * 150)
    cli = main([
        "fit", "--config", str(REPO / "configs/hf_llama_grow.yaml"), f"--data.init_args.path={corpus}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--data.init_args.batch_size=8",
        "--data.init_args.block_size=32", "--data.init_args.samples_per_epoch=64", "--trainer.max_epochs=2",
        "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.init_args.warmup_steps=2",
        "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
        "--trainer.callbacks.init_args.statistics.batches=2",
        *EMA,
    ])
    average = averaged_model(only(cli.trainer, EMAWeightAveraging))
    assert average.head_sizes() == cli.model.head_sizes() == [16, 16]
    assert {k: v.shape for k, v in average.named_parameters()} == {k: v.shape for k, v in cli.model.named_parameters()}


def test_the_averaged_copy_grows_the_value_side_alike(tmp_path):
    data = recall_data()
    averaging = EMAWeightAveraging(decay=0.5)
    grow = GrowAttentionCallback(AtSteps([3]), growth=GrowthSettings(grow="value", value_columns=2),
                                 statistics=StatisticsSettings(batches=2))
    probe = AtGrowth(averaging)
    trainer(tmp_path, [grow, averaging, probe], max_epochs=1, limit_train_batches=5).fit(tiny_module(data), data)
    average_before, live_before, average, live = probe.growth
    old = {".w_v": (..., slice(0, 8)), ".w_o": (slice(None), slice(0, 8))}
    new = {".w_v": (..., slice(8, None)), ".w_o": (slice(None), slice(8, None))}
    grown = [k for k in live if k.endswith(tuple(old))]
    assert len(grown) == 4 and all(average[k].shape == live[k].shape for k in grown)
    for k in grown:
        end = k[k.rindex("."):]
        assert torch.equal(average[k][new[end]], live[k][new[end]]), k  # new columns: the live model's
        assert torch.equal(average[k][old[end]], average_before[k]), k  # the old ones keep their average
        assert not torch.equal(average_before[k], live_before[k]), k
