"""Value growth (growth.grow: value | both) through GrowAttentionCallback on the project's GPT: the function kept at
α = 0, what is logged, resume, DDP, 16-mixed and compile, the optimizer's state, bad settings (docs/value.md)."""

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_growattn import AtEpochs, AutoSchedule, GrowAttentionCallback, GrowthSettings, StatisticsSettings, StepSearch
from lit_growattn.module import GrowAttentionLM

from callback_helpers import params, recall_data, tiny_module, trainer
from conftest import required_args
from test_growth_schedule import assert_same_run, cli_fit

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}\n" for i in range(400))


class PreservationProbe(GrowAttentionCallback):
    """The model's outputs on a kept batch just before and just after the growth."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        inputs = self.window.kept[0][0]
        pl_module.eval()
        with torch.no_grad():
            self.out_before = pl_module(inputs)
            super()._grow(trainer, pl_module, point, batch_idx)
            self.out_after = pl_module(inputs)
        pl_module.train()


@pytest.mark.parametrize("attention", ["mha", "dint", "lowrank_dint"])
@pytest.mark.parametrize("grow", ["value", "both"])
def test_growth_at_step_zero_keeps_the_function(tmp_path, attention, grow):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data, attention=attention, attention_args=required_args(attention), bias=True)
    columns = dict(columns=2) if grow == "both" else {}
    probe = PreservationProbe(AtEpochs([1]), growth=GrowthSettings(grow=grow, value_columns=3, **columns),
                              statistics=StatisticsSettings(batches=2), step_search=StepSearch(alphas=[0.0]))
    trainer(tmp_path, [probe], max_epochs=2, precision="64-true").fit(module, data)
    assert module.value_sizes() == [11, 11] and module.hparams["d_v"] == [11, 11]
    assert module.head_sizes() == ([4, 4] if grow == "both" else [2, 2])
    torch.testing.assert_close(probe.out_after, probe.out_before, atol=1e-10, rtol=0)
    (event,) = probe.history
    assert (event["d_v_before"], event["d_v"]) == ([8, 8], [11, 11])


def test_a_searched_value_growth_never_raises_the_loss_and_is_logged(tmp_path, capsys):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(AtEpochs([1, 2]), growth=GrowthSettings(grow="value", value_columns=[2, 1]),
                                 statistics=StatisticsSettings(batches=4))
    trainer(tmp_path, [grow], max_epochs=3).fit(module, data)
    assert module.value_sizes() == [12, 10]
    for event in grow.history:
        assert event["loss_after"] <= event["loss_before"]
    out = capsys.readouterr().out
    assert "growth at step 8 (epoch 1): d_v [8, 8]→[10, 9]" in out
    assert "growth summary" in out and "d_v" in out.split("growth summary")[1]
    (events,) = (tmp_path / "run").rglob("events.out.tfevents.*")
    tags = set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    assert {"growth/d_v/layer_0", "growth/d_v/layer_1", "growth/discarded_energy_v/layer_0"} <= tags


def test_adam_moments_of_the_old_value_columns_are_carried(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)

    class Snapshot(GrowAttentionCallback):
        def _grow(self, trainer, pl_module, point, batch_idx):
            (opt,) = trainer.optimizers
            names = {p: n for n, p in pl_module.named_parameters()}
            self.before = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
            super()._grow(trainer, pl_module, point, batch_idx)
            (opt,) = trainer.optimizers
            names = {p: n for n, p in pl_module.named_parameters()}
            self.after = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}

    grow = Snapshot(AtEpochs([1]), growth=GrowthSettings(grow="value", value_columns=2),
                    statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2).fit(module, data)
    for name, old in [("model.blocks.0.attn.value.w_v", (slice(None), slice(None), slice(0, 8))),
                      ("model.blocks.0.attn.value.w_o", (slice(None), slice(0, 8), slice(None)))]:
        before, after = grow.before[name], grow.after[name]
        assert torch.equal(after["exp_avg"][old], before["exp_avg"]) and after["step"] == before["step"]
        new = torch.ones_like(after["exp_avg"], dtype=torch.bool)
        new[old] = False
        assert not after["exp_avg"][new].any()  # new columns start with empty first moments


@pytest.mark.parametrize("growth, message", [
    (dict(value_columns=2), "growth.value_columns sizes the value side, which does not grow"),
    (dict(grow="value", columns=2), "growth.columns sizes the query/key side"),
    (dict(grow="both", method="pinv"), "the value side grows by natural, gradient, random, zero, not method 'pinv'"),
    (dict(grow="both", mode="replace"), "the value side only appends columns"),
    (dict(grow="value", truncation="whitened"), "truncation='whitened' applies to query/key forms only"),
])
def test_settings_the_value_side_cannot_apply_are_refused(growth, message):
    with pytest.raises(ValueError, match=message):
        GrowthSettings(**growth)


def test_the_automatic_schedule_refuses_value_growth_for_now():
    with pytest.raises(ValueError, match="AutoSchedule buys query/key columns only"):
        GrowAttentionCallback(AutoSchedule(budget=4), growth=GrowthSettings(grow="both"))


def test_diff_attention_cannot_grow_its_value_side(tmp_path):
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="value"))
    with pytest.raises(ValueError, match=r"has no growable value map in layers \[0, 1\]"):
        trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data, attention="diff"), data)


def test_max_d_v_beyond_the_rank_of_w_m_is_refused(tmp_path):
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="value", max_d_v=17))
    with pytest.raises(ValueError, match=r"max_d_v=17 must lie between the current value head size \(8\) and"):
        trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)


def test_a_grown_checkpoint_loads_with_its_value_sizes(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="both", columns=1, value_columns=2),
                                 statistics=StatisticsSettings(batches=2))
    fit = trainer(tmp_path, [grow], max_epochs=2)
    fit.fit(module, data)
    fit.save_checkpoint(tmp_path / "grown.ckpt")
    loaded = GrowAttentionLM.load_from_checkpoint(tmp_path / "grown.ckpt")
    assert loaded.value_sizes() == [10, 10] and loaded.head_sizes() == [3, 3]
    inputs = next(iter(data.val_dataloader()))[0]
    module.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs), module(inputs))


# -- the command line: a shipped config that grows both sides ------------------------------------------
BOTH = [
    "--trainer.max_epochs=3", "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=1",
    "--trainer.callbacks.init_args.statistics.batches=3", "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=16", "--data.init_args.batch_size=4", "--data.init_args.block_size=16",
    "--data.init_args.samples_per_epoch=40",
]


@pytest.fixture(scope="module")
def both_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("both")
    corpus = out / "corpus.txt"
    corpus.write_text(CORPUS)
    args = [*BOTH, f"--data.init_args.path={corpus}"]
    return out, args, cli_fit(out, args, config="configs/text_grow_both.yaml", data_args=False)


def test_the_shipped_config_grows_both_sides(both_run):
    _, _, full = both_run
    assert full["hyper_parameters"]["d_head"] == [16] and full["hyper_parameters"]["d_v"] == [16]


@pytest.mark.parametrize("checkpoint", ["step=3.ckpt", "step=8.ckpt"])  # inside the first and second windows
def test_resume_inside_a_window_is_bit_equal(both_run, tmp_path, checkpoint):
    out, args, full = both_run
    resumed = cli_fit(tmp_path, args, ckpt_path=out / "ckpt" / checkpoint, config="configs/text_grow_both.yaml",
                      data_args=False)
    assert_same_run(resumed, full)
    assert resumed["hyper_parameters"]["d_v"] == full["hyper_parameters"]["d_v"]


def test_bf16_mixed_value_growth_grows_and_stays_finite(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="both", columns=2, value_columns=2),
                                 statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2, precision="bf16-mixed").fit(module, data)
    (event,) = grow.history
    assert not event["skipped"] and module.value_sizes() == [10, 10]
    assert all(torch.isfinite(p).all() for p in params(module).values())
