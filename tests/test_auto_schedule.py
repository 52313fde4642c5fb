"""schedule='auto': grows where width pays and stops by itself, grows nothing without gain, resumes with the same
decisions from checkpoints written by the CLI, refuses bad settings; the shipped auto configs grow."""

import itertools
import operator

import pytest
import torch

from lit_growattn import AutoSchedule, GrowAttentionCallback, GrowthSettings, StepSearch
from lit_growattn.commands.cli import main
from lit_growattn.growing.event import GrowthEvent
from lit_growattn.growing.window import StatsWindow
from lit_growattn.growing.report import decision_text
from lit_growattn.growth import FormStats, installed
from lit_growattn.growth.capacity import CapacityRule

from conftest import REPO, SHAKESPEARE, needs_shakespeare, scalar_tags
from test_growth import F64, Problem
from test_growth_schedule import assert_same_run, cli_fit, growth_history

# Fused recall, 5 batches an epoch when run by cli_fit: a check every 5 optimizer steps from 3 statistics batches.
AUTO = [
    "--trainer.max_epochs=6", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", "--trainer.callbacks.init_args.schedule.init_args.check_every=5",
    "--trainer.callbacks.init_args.statistics.batches=3", "--trainer.callbacks.init_args.schedule.init_args.patience=2",
    # A tiny run's few statistics batches are noisy: a low bar, so that growth happens at all.
    "--trainer.callbacks.init_args.schedule.init_args.threshold=1e-3", "--trainer.callbacks.init_args.schedule.init_args.agreement=0.1",
    # Its loss still falls fast when growth stops: any fall ends it after `patience` idle checks (the loss-fall
    # condition has its own test, tests/test_capacity.py).
    "--trainer.callbacks.init_args.schedule.init_args.min_fall=1.0",
    # The rule itself, not the shipped config's cap: room for every column.
    "--trainer.callbacks.init_args.growth.max_columns=63",
]


def fit(config: str, tmp_path, *overrides: str) -> GrowAttentionCallback:
    cli = main(["--config", str(REPO / "configs" / config), "--trainer.enable_progress_bar=false",
                f"--trainer.logger.init_args.save_dir={tmp_path}", *overrides], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    return next(c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback))


def test_auto_grows_on_fused_recall_then_stops_and_takes_no_more_statistics(tmp_path, monkeypatch, capsys):
    windows = []
    begin = StatsWindow.begin_step
    monkeypatch.setattr(StatsWindow, "begin_step", lambda self, event, *a, **k: (windows.append(event), begin(self, event, *a, **k)))
    cb = fit("recall_auto.yaml", tmp_path, *AUTO[1:], "--trainer.max_epochs=4",
             "--data.init_args.num_train_examples=640", "--data.init_args.num_val_examples=64")
    history = cb.history
    assert history[0]["d_head_before"] == [1] and history[0]["d_head"][0] > 1  # d_head 1 cannot solve recall
    decision = history[0]["decisions"][0]
    assert decision["columns"] == history[0]["d_head"][0] - 1 and decision["candidates"] == 63
    assert decision["pooled"] == 1  # the first check has nothing to pool
    # Each column taken clears the ratio bar, together they clear the agreement bar; no larger block does.
    assert decision["agreement_bar"] == 0.1  # the bar this test sets on the command line
    leading = list(itertools.accumulate((ratio >= decision["bar"] for ratio in decision["ratios"]), operator.and_))
    clears = [lead and agreement >= decision["agreement_bar"] for lead, agreement in zip(leading, decision["agreement"])]
    assert clears[decision["columns"] - 1] and not any(clears[decision["columns"]:])
    # Stopped by itself, well before the 40 steps of the run: the last two checks grew nothing.
    assert cb.schedule.finished(history) and cb.schedule.pending(history) is None
    # Statistics were taken for the checks only (3 batches each), none after the schedule finished.
    assert windows == [e["event"] for e in history for _ in range(3)]
    # Each decision is shown: console line per check, TensorBoard scalars per layer.
    printed = capsys.readouterr().out
    assert f"growth at step 5 (epoch 0): d_head 1→{history[0]['d_head'][0]} per layer" in printed
    assert f"layer 0 +{decision['columns']} of 63 (1 check: ratios " in printed and "growth check at step" in printed
    assert {"growth/auto/columns/layer_0", "growth/auto/first_ratio/layer_0", "growth/auto/first_share/layer_0",
            "growth/auto/first_agreement/layer_0",
            "growth/auto/bottleneck/layer_0", "growth/auto/bar/layer_0", "growth/auto/pooled_checks/layer_0"} <= scalar_tags(tmp_path)


def test_no_gain_no_growth_zero_gradient():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    still = FormStats.from_state_dict({**stats.state_dict(), "n_sum": torch.zeros_like(stats.n_sum)})
    installed = []
    event = GrowthEvent(GrowthSettings(max_d_head=8), StepSearch(),
                        loss_of=lambda candidates: torch.ones(len(candidates)), install=installed.append,
                        broadcast=lambda obj: obj, capacity=CapacityRule(ratio=1e-9))
    half = FormStats.from_state_dict({**still.state_dict(), "c_sum": still.c_sum / 2, "weight": still.weight / 2,
                                      "instances": still.instances / 2})
    record, spectra = event.run([(0, "form", p.form)], [still], seed=0, half=[half])
    assert [d["columns"] for d in record["decisions"]] == [0] and max(record["decisions"][0]["ratios"]) == 0
    assert installed == [] and spectra == {} and p.form.d_head == 2


def test_a_layer_with_an_unused_component_does_not_grow_and_says_why():
    """Its third query/key component is zero: removing it costs nothing, so the columns the bars want are refused
    unless the gate is off (spare_below 0); the costs are measured on the loss the event rates candidates by."""
    p = Problem(e=8, h=2, d=3)
    with torch.no_grad():
        p.form.w_q[:, :, 2] = 0
    stats = p.stats("natural")
    half = FormStats.from_state_dict({k: v / 2 for k, v in stats.state_dict().items()})

    def loss_of(candidates):
        losses = []
        for candidate in candidates:
            with installed({"form": p.form}, candidate), torch.no_grad():
                losses.append(p.loss())
        return torch.stack(losses)

    def check(spare_below: float) -> dict:
        event = GrowthEvent(GrowthSettings(max_d_head=8), StepSearch(), loss_of=loss_of, install=lambda grown: None,
                            broadcast=lambda obj: obj, capacity=CapacityRule(ratio=1e-9, agreement=1e-9,
                                                                             spare_below=spare_below))
        record, _ = event.run([(0, "form", p.form)], [stats], seed=0, half=[half])
        return record["decisions"][0]

    gated, open_gate = check(0.03), check(0.0)
    assert open_gate["wanted"] == open_gate["columns"] > 0 and open_gate["least_used"] is None
    assert gated["wanted"] == open_gate["wanted"] and gated["columns"] == 0
    costs = gated["component_costs"]
    assert len(costs) == 3 and abs(costs[2]) <= 1e3 * torch.finfo(F64).eps * float(p.loss().detach())
    assert "width to spare" in decision_text([gated]) and "least-used component" in decision_text([gated])
    assert p.form.d_head == 3 and torch.all(p.form.w_q[:, :, 2] == 0)  # rated, restored, nothing installed


def test_no_gain_no_growth_at_ample_width_takes_no_statistics(tmp_path, tiny_cli_args, monkeypatch):
    monkeypatch.setattr(StatsWindow, "begin_step", lambda *a, **k: pytest.fail("a statistics step at full width"))
    cb = fit("recall_auto.yaml", tmp_path, *tiny_cli_args, "--model.init_args.d_head=8",
             "--trainer.callbacks.init_args.growth.max_d_head=8", "--trainer.callbacks.init_args.schedule.init_args.check_every=2",
             "--trainer.callbacks.init_args.statistics.batches=2", "--data.init_args.num_train_examples=320")
    assert cb.history == [] and cb.schedule.pending([]) is None


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto")
    return out, cli_fit(out, AUTO, config="configs/recall_auto.yaml")


def test_auto_run_decides_at_every_check(auto_run):
    _, full = auto_run
    history = growth_history(full)
    assert [e["step"] for e in history] == list(range(5, 5 * len(history) + 1, 5))
    assert history[0]["d_head"][0] > 1 and all("decisions" in e for e in history)


@pytest.mark.parametrize("checkpoint", [
    "step=3.ckpt",  # inside the first check's window
    "step=5.ckpt",  # between the window and the first check
    "step=8.ckpt",  # inside the second window, with grown shapes
    "step=11.ckpt",  # just after the second check
])
def test_auto_resumes_from_any_step_with_the_same_decisions(auto_run, tmp_path, checkpoint):
    out, full = auto_run
    assert_same_run(cli_fit(tmp_path, AUTO, ckpt_path=out / "ckpt" / checkpoint, config="configs/recall_auto.yaml"), full)


@pytest.mark.parametrize("build, message", [
    (lambda: AutoSchedule(check_every=0), "check_every must be a positive number of optimizer steps"),
    (lambda: AutoSchedule(patience=0), "patience must be a positive number of checks"),
    (lambda: AutoSchedule(first_check=0), "first_check is the optimizer step of the first check"),
    (lambda: AutoSchedule(threshold=-1.0), "threshold is a positive ratio"),
    (lambda: AutoSchedule(agreement=1.5), "agreement is a share"),
    (lambda: GrowAttentionCallback(AutoSchedule(), GrowthSettings(rank_threshold=0.5)),
     "leave growth.rank_threshold out"),
    (lambda: GrowAttentionCallback(AutoSchedule(), GrowthSettings(columns=2)), "leave growth.columns out"),
    (lambda: GrowAttentionCallback(AutoSchedule(), GrowthSettings(mode="replace")), "use growth.mode='append'"),
])
def test_bad_auto_settings_fail_with_message(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("setting", ["check_every", "first_check"])
def test_checks_closer_than_the_window_fail_before_training(tmp_path, tiny_cli_args, setting):
    with pytest.raises(ValueError, match=f"{setting}=2 optimizer steps hold fewer than statistics.batches=3"):
        fit("recall_auto.yaml", tmp_path, *tiny_cli_args, f"--trainer.callbacks.init_args.schedule.init_args.{setting}=2",
            "--trainer.callbacks.init_args.statistics.batches=3")


@pytest.mark.parametrize("config", ["recall_auto.yaml", pytest.param("text_auto.yaml", marks=needs_shakespeare)])
def test_auto_configs_start_at_one_and_grow(tmp_path, tiny_cli_args, config):
    data = ["--data.init_args.num_train_examples=320"] if config == "recall_auto.yaml" else [
        f"--data.init_args.path={SHAKESPEARE}", "--data.init_args.samples_per_epoch=640"]
    cb = fit(config, tmp_path, *tiny_cli_args, "--trainer.limit_train_batches=null", "--trainer.max_epochs=2",
             "--trainer.callbacks.init_args.schedule.init_args.check_every=4", "--trainer.callbacks.init_args.statistics.batches=2",
             "--trainer.callbacks.init_args.schedule.init_args.threshold=1e-3", "--trainer.callbacks.init_args.schedule.init_args.agreement=0.01", *data)
    assert cb.history[0]["d_head_before"][0] == 1
    assert any(d > 1 for d in cb.history[0]["d_head"]), cb.history[0]
