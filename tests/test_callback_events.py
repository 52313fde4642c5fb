"""GrowAttentionCallback's growth events on one process: what grows, what is logged and printed, optimizer
carry-over, every attention variant, bad input."""

import math

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_growattn.callback import callback as callback_module
from lit_growattn.attention import ATTENTIONS, Attention, QKForm
from lit_growattn import (AtEpochs, AtSteps, AutoSchedule, GrowAttentionCallback, GrowthSettings, StatisticsSettings,
                          StepSearch)
from lit_growattn.commands.cli import main
from lit_growattn.callback.event import GrowthEvent
from lit_growattn.growth import loss_rounding
from lit_growattn.module import GrowAttentionLM

from callback_helpers import (HeldOutProbe, PreservationProbe, SketchEventProbe, WindowRecorder,
                              assert_never_raises_the_held_out_loss, params, recall_data, sketch_tolerance, tiny_module,
                              trainer)
from conftest import REPO, required_args, scalar_tags
from test_growth import Problem

GROWTH_TAGS = {
    "growth/d_head/layer_0", "growth/d_head/layer_1", "growth/alpha", "growth/sign_fallbacks",
    "growth/predicted_decrease", "growth/realised_decrease", "growth/seconds",
    "growth/discarded_energy/layer_0", "growth/discarded_energy/layer_1",
    "compute/loss_vs_tokens", "compute/loss_vs_flops",
}


# -- a growth run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["natural", "pinv", "gradient", "zero"])
def test_growth_run_grows_logs_and_never_raises_the_eval_loss(tmp_path, method):
    # Batches of 32 and 4 kept batches (128 sequences) to rate the steps on: with 2 kept batches of 16, natural's
    # α = 1 lowers their loss by 0.0018 and raises the held-out one by 0.0013 (6 standard errors) at seed 0.
    L.seed_everything(1)
    data = recall_data(batch_size=32, examples=256, val_examples=512)
    module = tiny_module(data)
    grow = HeldOutProbe(AtEpochs([1, 2]), growth=GrowthSettings(columns=[2, 1], method=method),
                        statistics=StatisticsSettings(batches=4), step_search=StepSearch(batches=4))
    trainer(tmp_path, [grow]).fit(module, data)
    assert module.model.head_sizes() == [6, 4] and module.hparams.d_head == [6, 4]
    assert [e["epoch"] for e in grow.history] == [1, 2] and not any(e["skipped"] for e in grow.history)
    # A step α > 0 is taken only when it beats α = 0 by more than the evaluation's round-off.
    assert all(not e["alpha"] or e["realised_decrease"] > loss_rounding(e["loss_before"], torch.float32)
               for e in grow.history)
    # A baseline's growth does not depend on α: none is chosen, and none is logged.
    assert all((e["alpha"] is None) == (method == "zero") for e in grow.history)
    assert_never_raises_the_held_out_loss(grow, steps_taken=method != "zero")
    assert GROWTH_TAGS - ({"growth/alpha"} if method == "zero" else set()) <= scalar_tags(tmp_path)
    acc = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*"))), size_guidance={"images": 0})
    acc.Reload()
    assert {"growth/spectrum/epoch_1", "growth/spectrum/epoch_2"} <= set(acc.Tags()["images"])
    assert all(math.isfinite(trainer_metric) for trainer_metric in [e["predicted_decrease"] for e in grow.history])


@pytest.mark.parametrize("method", ["random", "zero"])
def test_baselines_rate_one_candidate(tmp_path, monkeypatch, method):
    rated = []
    losses = callback_module.kept_batch_losses
    monkeypatch.setattr(callback_module, "kept_batch_losses", lambda *args: rated.append(len(args[-1])) or losses(*args))
    L.seed_everything(0)
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=2, method=method),
                                 statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)
    assert rated == [2]  # the current forms and the baseline's growth, once (not once per α)
    assert grow.history[0]["alpha"] is None and grow.history[0]["d_head"] == [4, 4]


def test_a_step_must_beat_the_round_off_of_every_token_it_was_rated_on():
    """A step that beats α = 0 by 8× the round-off of one value, but by less than that of a mean of 4096 tokens
    (64× one value's), is taken when the loss averages one value and not when it averages 4096."""
    p = Problem(e=8, h=2, d=2)
    loss = 2.0
    gap = 8 * loss_rounding(loss, torch.float32)
    rated = lambda candidates: torch.tensor([loss if c is None else loss - gap for c in candidates])  # noqa: E731

    def chosen(terms: int) -> float:
        event = GrowthEvent(GrowthSettings(columns=1), StepSearch(), loss_of=rated, install=lambda grown: None,
                            broadcast=lambda obj: obj, terms=terms)
        return event.run([(0, "form", p.form)], [p.stats("natural")], seed=0)[0]["alpha"]

    assert chosen(1) > 0 and chosen(4096) == 0.0


def test_the_step_choice_counts_the_tokens_of_every_kept_batch(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(callback_module, "GrowthEvent", lambda *a, **k: made.append(k["terms"]) or GrowthEvent(*a, **k))
    L.seed_everything(0)
    data = recall_data()  # 8 full batches an epoch
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=2),
                                 statistics=StatisticsSettings(batches=4), step_search=StepSearch(batches=3))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)
    _, labels = next(iter(data.train_dataloader()))
    assert made == [3 * labels.numel()]


def test_console_line_per_event_and_summary_at_the_end(tmp_path, capsys):
    L.seed_everything(0)
    data = recall_data()  # 8 batches an epoch
    grow = GrowAttentionCallback(AtEpochs([1, 2]), growth=GrowthSettings(columns=[2, 1]),
                                 statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=3).fit(tiny_module(data), data)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("growth at step")]
    assert len(lines) == 2
    assert lines[0].startswith("growth at step 8 (epoch 1): d_head [2, 2]→[4, 3], α=")
    assert "on the kept batches" in lines[0] and lines[1].startswith("growth at step 16 (epoch 2): d_head [4, 3]→[6, 4]")
    summary = out[out.index("growth summary"):].splitlines()
    assert summary[1].split() == ["event", "step", "epoch", "d_head", "α", "loss", "before", "loss", "after", "seconds"]
    assert [row.split()[:5] for row in summary[3:5]] == [["epoch", "1", "8", "1", "4,3"], ["epoch", "2", "16", "2", "6,4"]]


def test_head_sizes_are_logged_at_the_logging_cadence(tmp_path):
    L.seed_everything(0)
    data = recall_data()  # 8 batches an epoch, growth at the start of epoch 1 (step 8)
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=2),
                                 statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2, log_every_n_steps=4).fit(tiny_module(data), data)
    (event_file,) = tmp_path.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
    events.Reload()
    sizes = {e.step: e.value for e in events.Scalars("growth/d_head/layer_0")}
    # At the start, at every 4th step (Lightning logs step k-1 of a cadence k), and at the growth itself.
    assert sizes == {0: 2.0, 3: 2.0, 7: 2.0, 8: 4.0, 11: 4.0, 15: 4.0}


def test_growth_checkpoint_loads_for_validate_and_test(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=3),
                                 statistics=StatisticsSettings(batches=2))
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, [grow, checkpoint], max_epochs=2).fit(tiny_module(data), data)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    loaded = GrowAttentionLM.load_from_checkpoint(ckpt)
    assert loaded.model.head_sizes() == [5, 5]
    t = trainer(tmp_path / "eval", [])
    # Evaluating needs no growth callback: Lightning's note that the checkpoint's callbacks are absent is expected.
    with pytest.warns(UserWarning, match=r"callbacks used to create the checkpoint .* \['GrowAttentionCallback'\]"):
        assert "val/loss" in t.validate(tiny_module(data), data, ckpt_path=ckpt)[0]
    assert "test/loss" in t.test(loaded, data)[0]


# -- optimizer and scheduler carry-over ---------------------------------------------------------------
class CarryProbe:
    """Wraps the callback's install step: the optimizer state just before and just after the rebuild."""

    def __init__(self, monkeypatch):
        install = callback_module.install_growth
        monkeypatch.setattr(callback_module, "install_growth", lambda *args: self(install, *args))

    def __call__(self, install, trainer, pl_module, *args):
        opt = trainer.optimizers[0]
        self.before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in pl_module.named_parameters()}
        self.sched_before = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        self.lrs_before = [g["lr"] for g in opt.param_groups]
        install(trainer, pl_module, *args)
        new = trainer.optimizers[0]
        self.after = {n: {k: v.clone() for k, v in new.state[p].items()} if p in new.state else None
                      for n, p in pl_module.named_parameters()}
        self.param_groups = new.param_groups
        self.names = {id(p): n for n, p in pl_module.named_parameters()}
        self.sched_after = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        self.lrs_after = [g["lr"] for g in new.param_groups]


@pytest.mark.parametrize("temperature", ["keep", "rescale"])
def test_append_carries_adam_moments_step_and_schedule(tmp_path, monkeypatch, temperature):
    L.seed_everything(0)
    data = recall_data()
    probe = CarryProbe(monkeypatch)
    grow = GrowAttentionCallback(AtEpochs([1]),
                                 growth=GrowthSettings(columns=2, mode="append", temperature=temperature),
                                 statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)
    c = (4 / 2) ** 0.25 if temperature == "rescale" else 1.0  # τ′ = τ√(d/d′) → old columns × (τ/τ′)^½
    for name in ("model.blocks.0.attn.qk.w_q", "model.blocks.1.attn.qk.w_k"):
        old, new = probe.before[name], probe.after[name]
        torch.testing.assert_close(new["exp_avg"][..., :2], old["exp_avg"] / c)
        torch.testing.assert_close(new["exp_avg_sq"][..., :2], old["exp_avg_sq"] / c**2)
        assert torch.equal(new["step"], old["step"])
        assert (new["exp_avg"][..., 2:] == 0).all()
    assert probe.sched_after["last_epoch"] == probe.sched_before["last_epoch"]
    assert probe.lrs_after == probe.lrs_before
    no_decay = {probe.names[id(p)] for g in probe.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert {"model.blocks.0.attn.qk.log_tau", "model.blocks.1.attn.qk.log_tau"} <= no_decay


def test_replace_resets_the_rotated_tensors(tmp_path, monkeypatch):
    L.seed_everything(0)
    data = recall_data()
    probe = CarryProbe(monkeypatch)
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=2, mode="replace"),
                                 statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)
    assert probe.after["model.blocks.0.attn.qk.w_q"] is None  # Adam starts these afresh, step included
    assert probe.after["model.blocks.0.attn.value.w_v"] is not None


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: GrowthSettings(columns=0), "growth.columns must be positive"),
        (lambda: GrowthSettings(columns=[1, -1]), "growth.columns must be positive"),
        (lambda: GrowthSettings(method="svd"), "growth.method must be one of"),
        (lambda: GrowthSettings(method="random", mode="replace"), "needs mode='append'"),
        (lambda: GrowthSettings(method="random", size_by="zero"), "growth.size_by must be one of"),
        (lambda: GrowthSettings(method="natural", size_by="gradient"),
         "growth.size_by='gradient' only applies to the baselines .* set growth.size_by to null"),
        (lambda: StepSearch(alphas=[-1.0]), "non-empty list of finite values ≥ 0"),
        (lambda: StepSearch(alphas=[]), "non-empty list of finite values ≥ 0"),
        (lambda: StepSearch(alphas=[0.0, float("nan")]), "non-empty list of finite values ≥ 0"),
        (lambda: StatisticsSettings(batches=0), "statistics.batches must be positive"),
        (lambda: GrowAttentionCallback(AtEpochs([1]), statistics=StatisticsSettings(batches=2),
                                       step_search=StepSearch(batches=3)), "step_search.batches ≤ statistics.batches"),
        (lambda: GrowthSettings(rank_threshold=1.5), "rank_threshold is a fraction"),
        (lambda: GrowthSettings(layers=[]), "layers must list each layer to grow once"),
        (lambda: GrowthSettings(layers=[0, 0]), "layers must list each layer to grow once"),
        (lambda: StatisticsSettings(layers_per_step=0), "layers_per_step must be positive"),
        (lambda: GrowthSettings(columns=2, rank_threshold=0.1), "growth.columns is a fixed count"),
        (lambda: GrowthSettings(columns=2, max_columns=3), "growth.max_columns caps the count growth.rank_threshold chooses"),
        (lambda: GrowAttentionCallback(AtEpochs([1]), GrowthSettings(max_columns=3)),
         "growth.max_columns caps a count chosen from the statistics, and AtEpochs grows by growth.columns"),
        (lambda: GrowAttentionCallback(AtEpochs([1]), GrowthSettings(method="random"),
                                       step_search=StepSearch(line_search="full_rank")),
         "method 'random' adds random columns without one: use line_search='low_rank'"),
    ],
)
def test_bad_callback_arguments_fail_with_message(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(growth=GrowthSettings(max_d_head=1)), r"max_d_head=1 must lie between the current query/key head size \(2\)"),
        (dict(growth=GrowthSettings(max_d_head=17)), r"max_d_head=17 must lie between .* input size \(16"),
        (dict(growth=GrowthSettings(layers=[5])), r"layers \[5\] do not exist"),
        (dict(growth=GrowthSettings(columns=[1, 1, 1])), "growth.columns has 3 entries but the model has 2 layers"),
        (dict(statistics=StatisticsSettings(batches=100)), "statistics.batches=100 is more than an epoch"),
        (dict(growth=GrowthSettings(rank_threshold=None, max_columns=2)), "growth.max_columns caps a count chosen"),
    ],
)
def test_impossible_schedules_fail_before_training(tmp_path, kwargs, message):
    data = recall_data()
    module = tiny_module(data)
    before = params(module)
    with pytest.raises(ValueError, match=message):
        trainer(tmp_path, [GrowAttentionCallback(AtEpochs([1]), **kwargs)]).fit(module, data)
    assert all(torch.equal(before[k], v) for k, v in params(module).items())


def test_step_sizes_without_zero_warn():
    with pytest.warns(UserWarning, match="has no 0: a growth may then raise the loss"):
        GrowAttentionCallback(AtEpochs([1]), step_search=StepSearch(alphas=[0.5, 1.0]))


def test_rank_threshold_chooses_the_growth_from_the_spectrum(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(rank_threshold=0.05, max_d_head=10),
                                 statistics=StatisticsSettings(batches=3))
    trainer(tmp_path, [grow], max_epochs=2).fit(module, data)
    sizes = module.model.head_sizes()
    assert all(3 <= d <= 10 for d in sizes), sizes  # at least one new column, at most max_d_head
    assert max(sizes) > 3, sizes  # more than one column somewhere: no fixed count caps a growth chosen from the spectrum


def test_epoch_past_max_epochs_warns(tmp_path):
    data = recall_data()
    with pytest.warns(UserWarning, match="AtEpochs has epoch 5 but max_epochs=2"):
        trainer(tmp_path, [GrowAttentionCallback(AtEpochs([1, 5]), statistics=StatisticsSettings(batches=2))], max_epochs=2).fit(
            tiny_module(data), data)


class NoQK(torch.nn.Module):
    """An attention variant without a growable query/key pair."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.proj = torch.nn.Linear(cfg.n_embd, cfg.n_embd)

    def qk_forms(self):
        return []

    def forward(self, x):
        return self.proj(x)


def test_growth_on_attention_without_qk_pair_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(ATTENTIONS, "noqk", NoQK)
    data = recall_data()
    with pytest.raises(ValueError, match=r"growable_forms\(\) is empty: no attention layer has a growable query/key form"):
        trainer(tmp_path, [GrowAttentionCallback(AtEpochs([1]))]).fit(tiny_module(data, attention="noqk"), data)


def test_nonfinite_statistics_skip_the_growth_and_training_goes_on(tmp_path, monkeypatch):
    record = QKForm._record
    monkeypatch.setattr(QKForm, "_record", lambda self, xa, gx: record(self, xa, gx * float("nan")))
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(AtEpochs([1]), statistics=StatisticsSettings(batches=2))
    with pytest.warns(UserWarning, match="growth at epoch 1 skipped"):
        trainer(tmp_path, [grow], max_epochs=2).fit(module, data)
    assert [(e["event"], e["skipped"]) for e in grow.history] == [("epoch 1", True)]
    assert module.model.head_sizes() == [2, 2]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert "growth/skipped" in scalar_tags(tmp_path)


# -- round-robin layers: each statistics step captures only some layers ---------------------------------
def _round_robin_run(tmp_path, stats_batches, layers_per_step):
    L.seed_everything(0)
    data = recall_data(batch_size=16, examples=64)
    recorder = WindowRecorder(AtEpochs([1]), growth=GrowthSettings(columns=2, method="natural"),
                              statistics=StatisticsSettings(batches=stats_batches, layers_per_step=layers_per_step))
    module = tiny_module(data, dropout=0.0)
    trainer(tmp_path, [recorder], max_epochs=2, precision="64-true").fit(module, data)
    return recorder, module


def test_round_robin_captures_each_layer_on_its_own_steps(tmp_path):
    # Window of 2 steps, one layer per step: layer 0 from the second-to-last batch, layer 1 from the last.
    turns, module = _round_robin_run(tmp_path / "turns", stats_batches=2, layers_per_step=1)
    every, _ = _round_robin_run(tmp_path / "every", stats_batches=1, layers_per_step=None)
    assert [(instances, weight) for _, instances, weight in turns.seen] == [(16, 1.0), (16, 1.0)]
    layer_1_turn, layer_1_last = turns.seen[1][0], every.seen[1][0]
    torch.testing.assert_close(layer_1_turn.n, layer_1_last.n, rtol=1e-9, atol=0)
    torch.testing.assert_close(layer_1_turn.c, layer_1_last.c, rtol=1e-9, atol=0)
    assert not torch.allclose(turns.seen[0][0].n, every.seen[0][0].n)  # layer 0 saw the batch before
    assert module.model.head_sizes() == [4, 4]


def test_round_robin_window_too_short_for_every_layer_fails_at_setup(tmp_path):
    with pytest.raises(ValueError, match="2 growing layers need at least 2 statistics batches"):
        _round_robin_run(tmp_path, stats_batches=1, layers_per_step=1)


# -- every attention variant grows ---------------------------------------------------------------------
@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
@pytest.mark.parametrize("mode, temperature", [("append", "keep"), ("replace", "rescale")])
def test_growth_at_step_zero_preserves_every_variant(tmp_path, attention, mode, temperature):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data, attention=attention, attention_args=required_args(attention), bias=True)
    assert all(isinstance(block.attn, Attention) for block in module.model.blocks)
    n_forms = len(module.model.qk_forms()[0])
    probe = PreservationProbe(AtEpochs([1]), growth=GrowthSettings(columns=2, mode=mode, temperature=temperature),
                              statistics=StatisticsSettings(batches=2), step_search=StepSearch(alphas=[0.0]))
    trainer(tmp_path, [probe], max_epochs=2, precision="64-true").fit(module, data)
    assert module.model.head_sizes() == [4, 4]
    assert all(f.d_head == 4 for forms in module.model.qk_forms() for f in forms) and n_forms >= 1
    torch.testing.assert_close(probe.out_after, probe.out_before, atol=1e-10, rtol=0)


@pytest.mark.parametrize("attention", ["diff", "dint"])
def test_searched_growth_of_two_map_variants_never_raises_the_eval_loss(tmp_path, attention):
    L.seed_everything(1)
    data = recall_data(batch_size=32, examples=256, val_examples=512)
    grow = HeldOutProbe(AtEpochs([1]), growth=GrowthSettings(columns=2),
                        statistics=StatisticsSettings(batches=4), step_search=StepSearch(batches=4))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data, attention=attention), data)
    (event,) = grow.history
    assert event["d_head"] == [4, 4]
    assert not event["alpha"] or event["realised_decrease"] > loss_rounding(event["loss_before"], torch.float32)
    assert_never_raises_the_held_out_loss(grow)


def test_full_rank_line_search_never_installs_a_growth_that_raises_the_eval_loss(tmp_path):
    L.seed_everything(1)
    data = recall_data(batch_size=32, examples=256, val_examples=512)
    grow = HeldOutProbe(AtEpochs([1, 2]), growth=GrowthSettings(columns=2, method="gradient"),
                        statistics=StatisticsSettings(batches=4),
                        step_search=StepSearch(line_search="full_rank", batches=4))
    trainer(tmp_path, [grow], max_epochs=3).fit(tiny_module(data), data)
    assert [e["d_head"] for e in grow.history] == [[4, 4], [6, 6]]
    assert all(e["realised_decrease"] >= 0 for e in grow.history)  # the truncated growth is measured against α = 0
    assert_never_raises_the_held_out_loss(grow)




def test_the_demo_config_prints_its_growth_lines_between_progress_bars(tmp_path, capsys):
    main(["fit", "--config", str(REPO / "configs/recall_grow.yaml"), "--trainer.max_epochs=2",
          "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
          "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]", "--trainer.callbacks.init_args.statistics.batches=2",
          "--data.init_args.num_train_examples=256", "--data.init_args.num_val_examples=64",
          f"--trainer.logger.init_args.save_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "growth at step 3 (epoch 1): d_head 1→8 per layer, α=" in out
    assert "growth summary" in out and "epoch 1  3" in out


# -- sketched statistics: the event the full statistics give ---------------------------------------------------------
def _sketch_or_full_run(tmp_path, schedule, growth_settings, sketch, max_steps, **module_args):
    """A float64 run of the tiny GPT growing both sides, its statistics sketched with k = e′ = 16 (exact for any
    statistics) or kept in full."""
    L.seed_everything(0)
    data = recall_data(batch_size=8, examples=64)
    statistics = StatisticsSettings(batches=4, **({"sketch": "on", "sketch_size": 16} if sketch else {}))
    recorder = SketchEventProbe(schedule, growth=growth_settings, statistics=statistics)
    trainer(tmp_path, [recorder], max_epochs=2, max_steps=max_steps, precision="64-true",
            enable_checkpointing=False).fit(tiny_module(data, dropout=0.0, **module_args), data)
    return recorder


def _close_lists(got, want, rtol, what):
    """Lists of gains, each within rtol of the list's largest magnitude."""
    want_t, got_t = torch.tensor(want, dtype=torch.float64), torch.tensor(got, dtype=torch.float64)
    torch.testing.assert_close(got_t, want_t, rtol=0, atol=rtol * float(want_t.abs().max()),
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.filterwarnings("ignore:statistics.sketch_size=16 keeps k \\+ l = 40 columns per head")
@pytest.mark.parametrize("method, full_ridge", [("gradient", None), ("natural", 1.0)])
def test_sketch_event_equals_full(tmp_path, method, full_ridge):
    """With k ≥ e′ the sketch reconstructs the window's statistics exactly (docs/design.md §12), so a sketched run
    grows as a full run at the sketch's ridge does (natural under the sketch is ridge 1.0 when growth.ridge is null):
    the same grown function (pair signs may differ: the sketch makes them canonical), the same event record, and under
    AutoSchedule the same columns bought from the same offers. Fails on any error of the capture, the sums, the
    reconstruction or their plumbing through the callback (test matrices, seeds, ridge, halves)."""
    cases = {
        "AtSteps": (AtSteps([4]), dict(columns=2, value_columns=2), 5, {}),
        "AutoSchedule": (AutoSchedule(budget=4, check_every=4, spend_until=1.0), {}, 9, dict(d_v=2)),
    }
    for name, (schedule, columns, steps, module_args) in cases.items():
        full, sketched = (
            _sketch_or_full_run(tmp_path / f"{name}-{kind}", schedule,
                                GrowthSettings(grow="both", method=method, ridge=ridge, **columns), kind == "sketch",
                                steps, **module_args)
            for kind, ridge in [("full", full_ridge), ("sketch", None)])
        assert len(full.history) == len(sketched.history) == len(sketched.events) >= 1
        for n, (want, got, (want_products, _), (got_products, cond)) in enumerate(
                zip(full.history, sketched.history, full.events, sketched.events)):
            tol = sketch_tolerance(16, cond)
            for a, b in zip(got_products, want_products, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=tol * float(b.abs().max()))
            assert (want.get("sketch"), got["sketch"]) == (None, {"k": 16, "l": 24, "k_c": 16})
            assert got.keys() - {"sketch"} == want.keys() and got["alpha"] == want["alpha"]
            for key in got.keys() - {"sketch", "timings", "seconds", "decisions", "discarded_energy"}:
                expected = pytest.approx(want[key], rel=tol) if isinstance(want[key], float) else want[key]
                assert got[key] == expected, key
            for unit, energy in want.get("discarded_energy", {}).items():
                assert got["discarded_energy"][unit] == pytest.approx(energy, rel=tol), unit
            for a, b in zip(got.get("decisions", []), want.get("decisions", []), strict=True):
                assert {k: v for k, v in a.items() if k not in ("held_out", "in_sample")} == {
                    k: v for k, v in b.items() if k not in ("held_out", "in_sample")}
                for part in ("held_out", "in_sample"):
                    _close_lists(a[part], b[part], tol, f"{name} event {n} layer {b['layer']} {b['side']} {part}")
        if name == "AutoSchedule":
            assert any(d["columns"] for event in sketched.history for d in event["decisions"])
