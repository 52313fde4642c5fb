"""AutoSchedule: spends its K-cache budget over its checks and never more, takes no statistics once done, grows
nothing without gain, resumes with the same decisions from checkpoints written by the CLI, refuses bad settings and
the old rule's settings; the shipped auto configs grow."""

from types import SimpleNamespace

import pytest
import torch
import yaml

from lit_growattn import AutoSchedule, GrowAttentionCallback, GrowthSettings, StepSearch
from lit_growattn.commands.cli import main
from lit_growattn.growing.event import GrowthEvent
from lit_growattn.growing.window import StatsWindow
from lit_growattn.growth import FormStats
from lit_growattn.settings import StatisticsSettings

from conftest import REPO, SHAKESPEARE, needs_shakespeare, scalar_tags
from test_growth import Problem
from test_growth_schedule import assert_same_run, cli_fit, growth_history

S = "--trainer.callbacks.init_args.schedule.init_args"
# Fused recall, 5 batches an epoch when run by cli_fit: 30 steps, checks at steps 5, 10 and 15 (spend_until ½), each
# from 3 statistics batches; a budget of mean head size 4 from 1 leaves 3 columns, one a check.
AUTO = ["--trainer.max_epochs=6", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
        f"{S}.check_every=5", f"{S}.budget=4", f"{S}.spend_until=0.5", "--trainer.callbacks.init_args.statistics.batches=3"]


def fit(config: str, tmp_path, *overrides: str) -> GrowAttentionCallback:
    cli = main(["--config", str(REPO / "configs" / config), "--trainer.enable_progress_bar=false",
                f"--trainer.logger.init_args.save_dir={tmp_path}", *overrides], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    return next(c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback))


def bound(budget=4.0, check_every=10, spend_until=0.5, steps=100, costs=None, start=None, max_d_head=16):
    """An AutoSchedule bound to two growing layers (4 key heads each, d_head 1) of a run of `steps` steps."""
    schedule = AutoSchedule(budget, check_every, spend_until)
    costs = costs or {0: 4, 1: 4}
    schedule.bind(GrowthSettings(max_d_head=max_d_head), StatisticsSettings(), sorted(costs),
                  start or [1] * len(costs), costs)
    schedule.check_run(SimpleNamespace(max_steps=steps, accumulate_grad_batches=1), stats_batches=8)
    return schedule


def check(before, after):
    return {"d_head_before": before, "d_head": after}


def test_the_budget_is_spread_evenly_over_the_checks_and_unspent_allowance_carries_over():
    schedule = bound()  # 5 checks (steps 10 … 50); 4 × 8 − 8 = 24 values per token to spend
    assert schedule.checks == 5 and schedule.total([]) == 24
    assert schedule.allowance([]) == pytest.approx(24 / 5)
    one = [check([1, 1], [2, 1])]  # spent 4 at the first check
    assert schedule.allowance(one) == pytest.approx(2 * 24 / 5 - 4)
    idle = [check([1, 1], [1, 1])] * 4  # nothing spent in four checks: the last has the whole budget
    assert schedule.allowance(idle) == pytest.approx(24)
    assert [schedule.pending([check([1, 1], [1, 1])] * n).at for n in range(5)] == [10, 20, 30, 40, 50]
    assert schedule.pending(idle + [check([1, 1], [1, 1])]) is None  # spend_until reached: no sixth check
    assert schedule.pending([check([1, 1], [4, 4])]) is None  # the budget is spent
    # A resumed run's model starts at its grown sizes: the budget still counts from where the run started.
    schedule.start_sizes = [2, 1]
    assert schedule.total(one) == 24 and schedule.allowance(one) == pytest.approx(2 * 24 / 5 - 4)
    assert "4 of 4, 32 of 32 values per token; 0 unspent" in schedule.summary([check([1, 1], [4, 4])])
    assert "mean query/key head size 2.5 of 4" in schedule.summary([check([1, 1], [3, 2])])
    assert "; 12 unspent" in schedule.summary([check([1, 1], [3, 2])])


def test_a_budget_is_counted_in_key_heads_so_a_gqa_layer_costs_its_kv_heads():
    # Layer 0: 8 key heads (mha); layer 1: 2 (GQA). Budget mean 3 over 10 key heads: 30 values, 10 at the start.
    schedule = bound(budget=3, costs={0: 8, 1: 2}, max_d_head=4)
    assert schedule.total([]) == 20
    assert schedule.cache([3, 3]) == 30 and schedule.pending([check([1, 1], [3, 3])]) is None  # spent
    assert schedule.pending([check([1, 1], [3, 2])]) is not None  # 28 of 30: a GQA column (2 values) still fits
    assert schedule.pending([check([1, 1], [2, 3])]) is not None  # 22 of 30: an mha column (8) fits exactly
    assert schedule.pending([check([1, 1], [2, 4])]) is None  # 24 of 30: it does not, and layer 1 is at max_d_head


def test_no_budget_buys_until_spend_until_and_max_d_head():
    schedule = bound(budget=None, max_d_head=4)
    assert schedule.allowance([]) == float("inf")
    assert schedule.pending([check([1, 1], [4, 3])]).at == 20
    assert schedule.pending([check([1, 1], [4, 4])]) is None  # every layer at max_d_head
    assert "(no budget)" in schedule.summary([check([1, 1], [4, 3])])


@pytest.mark.parametrize("build, message", [
    (lambda: AutoSchedule(budget=0), "budget is a mean query/key head size"),
    (lambda: AutoSchedule(check_every=0), "check_every must be a positive number of optimizer steps"),
    (lambda: AutoSchedule(spend_until=0), r"spend_until is a share of the run's optimizer steps in \(0, 1\]"),
    (lambda: AutoSchedule(spend_until=1.5), r"spend_until is a share of the run's optimizer steps in \(0, 1\]"),
    (lambda: bound(budget=0.5), r"budget=0.5\) is below the mean query/key head size the growing layers start at \(1\)"),
    (lambda: bound(budget=17), "exceeds growth.max_d_head=16, so it could never be spent"),
    (lambda: GrowAttentionCallback(AutoSchedule(), GrowthSettings(rank_threshold=0.5)),
     "leave growth.rank_threshold out"),
    (lambda: GrowAttentionCallback(AutoSchedule(), GrowthSettings(columns=2)), "leave growth.columns out"),
    (lambda: GrowAttentionCallback(AutoSchedule(), GrowthSettings(max_columns=2)), "leave growth.max_columns out"),
    (lambda: GrowAttentionCallback(AutoSchedule(), GrowthSettings(mode="replace")), "use growth.mode='append'"),
])
def test_bad_auto_settings_fail_with_message(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_run_too_short_for_a_check_warns_that_nothing_will_grow():
    with pytest.warns(UserWarning, match="until spend_until=0.5 of the run's 100: no check fits, so nothing will grow"):
        schedule = bound(check_every=60)
    assert schedule.pending([]) is None


def test_the_old_rules_settings_are_refused_with_the_new_spelling(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "text_auto.yaml").read_text())
    config["trainer"]["callbacks"][-1]["init_args"]["schedule"]["init_args"] = {"check_every": 20, "patience": 3,
                                                                                "threshold": 0.5}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="AutoSchedule no longer takes patience, threshold: it now spends a K-cache "
                                         "budget") as refused:
        main(["fit", "--config", str(path)], run=False)
    assert "{budget: null, check_every: 20, spend_until: 0.5}" in str(refused.value)
    with pytest.raises(ValueError, match="no longer takes first_check"):
        main(["fit", "--config", str(REPO / "configs" / "recall_auto.yaml"), f"{S}.first_check=16"], run=False)


def test_no_gain_no_growth_zero_gradient():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    still = FormStats.from_state_dict({**stats.state_dict(), "n_sum": torch.zeros_like(stats.n_sum)})
    half = FormStats.from_state_dict({k: v / 2 for k, v in still.state_dict().items()})
    installed = []
    event = GrowthEvent(GrowthSettings(max_d_head=8), StepSearch(), loss_of=lambda c: pytest.fail("rated a growth"),
                        install=installed.append, broadcast=lambda obj: obj, allowance=float("inf"))
    record, spectra = event.run([(0, "form", p.form)], [still], seed=0, half=[half])
    [decision] = record["decisions"]
    assert (decision["columns"], decision["above_floor"], decision["cost"]) == (0, 0, 2)
    assert installed == [] and spectra == {} and p.form.d_head == 2 and record["allowance"] == float("inf")


def test_a_model_that_starts_at_its_budget_takes_no_statistics(tmp_path, tiny_cli_args, monkeypatch):
    monkeypatch.setattr(StatsWindow, "begin_step", lambda *a, **k: pytest.fail("a statistics step with nothing to spend"))
    cb = fit("recall_auto.yaml", tmp_path, *tiny_cli_args, "--model.init_args.d_head=8", f"{S}.budget=8",
             f"{S}.check_every=2", "--trainer.callbacks.init_args.statistics.batches=2",
             "--data.init_args.num_train_examples=320")
    assert cb.history == [] and cb.schedule.pending([]) is None


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto")
    return out, cli_fit(out, AUTO, config="configs/recall_auto.yaml")


def test_auto_spends_within_its_allowance_at_every_check_and_never_beyond_its_budget(auto_run):
    out, full = auto_run
    history = growth_history(full)
    assert [e["step"] for e in history] == [5, 10, 15]
    budget = 4 * 1  # mean 4 over the one layer of one key head
    for n, event in enumerate(history):
        spent_before = event["d_head_before"][0] - 1
        assert event["allowance"] == pytest.approx(3 * (n + 1) / 3 - spent_before)
        [decision] = event["decisions"]
        assert event["d_head"][0] - event["d_head_before"][0] == decision["columns"] <= event["allowance"]
        assert decision["columns"] <= decision["above_floor"]
    assert full["hyper_parameters"]["d_head"][0] <= budget
    assert history[-1]["d_head"][0] > 1  # recall needs width: the statistics say so
    tags = scalar_tags(out)
    assert {"growth/auto/columns/layer_0", "growth/auto/above_floor/layer_0", "growth/auto/first_gain/layer_0",
            "growth/auto/first_noise/layer_0", "growth/auto/allowance"} <= tags


@pytest.mark.parametrize("checkpoint", [
    "step=3.ckpt",  # inside the first check's window
    "step=5.ckpt",  # between the window and the first check
    "step=8.ckpt",  # inside the second window, with grown shapes
    "step=16.ckpt",  # after the last check
])
def test_auto_resumes_from_any_step_with_the_same_decisions(auto_run, tmp_path, checkpoint):
    out, full = auto_run
    assert_same_run(cli_fit(tmp_path, AUTO, ckpt_path=out / "ckpt" / checkpoint, config="configs/recall_auto.yaml"), full)


def test_auto_shows_its_decisions_and_takes_no_statistics_after_its_last_check(tmp_path, monkeypatch, capsys):
    windows = []
    begin = StatsWindow.begin_step
    monkeypatch.setattr(StatsWindow, "begin_step", lambda self, event, *a, **k: (windows.append(event), begin(self, event, *a, **k)))
    cb = fit("recall_auto.yaml", tmp_path, *AUTO, "--data.init_args.num_train_examples=320",
             "--data.init_args.num_val_examples=64")
    assert [e["event"] for e in cb.history] == ["step 5", "step 10", "step 15"] and cb.schedule.pending(cb.history) is None
    assert windows == [e["event"] for e in cb.history for _ in range(3)]  # 3 batches a check, none after
    printed = capsys.readouterr().out
    assert "allowance 1 values per token; layer 0 +" in printed and "above the floor (held-out gains " in printed
    assert "K-cache budget: mean query/key head size" in printed and "unspent" in printed


@pytest.mark.parametrize("config", ["recall_auto.yaml", pytest.param("text_auto.yaml", marks=needs_shakespeare)])
def test_auto_configs_start_at_one_and_grow(tmp_path, tiny_cli_args, config):
    data = ["--data.init_args.num_train_examples=640"] if config == "recall_auto.yaml" else [
        f"--data.init_args.path={SHAKESPEARE}", "--data.init_args.samples_per_epoch=1280"]
    cb = fit(config, tmp_path, *tiny_cli_args, "--trainer.limit_train_batches=null", "--trainer.max_epochs=2",
             f"{S}.check_every=4", "--trainer.callbacks.init_args.statistics.batches=2", *data)
    assert cb.history[0]["d_head_before"][0] == 1
    assert any(d > 1 for e in cb.history for d in e["d_head"]), cb.history
