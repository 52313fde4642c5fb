"""AutoSchedule in training runs: spends its K-cache budget (or, growing the value side too, its KV-cache budget) over
its checks and never more, takes no statistics once done, grows nothing without gain, resumes with the same decisions
from checkpoints written by the CLI, refuses the old rule's settings; the shipped auto configs grow (its unit tests:
tests/test_schedules.py)."""


import pytest
import yaml

from lit_growattn import GrowAttentionCallback
from lit_growattn.commands.cli import main
from lit_growattn.callback.window import StatsWindow

from conftest import REPO, SHAKESPEARE, needs_shakespeare, scalar_tags
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


def test_the_old_rules_settings_are_refused_with_the_new_spelling(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "text_auto.yaml").read_text())
    config["trainer"]["callbacks"][-1]["init_args"]["schedule"]["init_args"] = {"check_every": 20, "patience": 3,
                                                                                "threshold": 0.5}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="AutoSchedule no longer takes patience, threshold: it now spends a K-cache "
                                         "budget") as refused:
        main(["fit", "--config", str(path)], run=False)
    # The budget has no default: the rewrite gives an example, and says so.
    assert "{budget: 4, check_every: 20, spend_until: 0.5}" in str(refused.value)
    assert "budget 4 is an example: give the mean query/key head size you can afford" in str(refused.value)
    with pytest.raises(ValueError, match="no longer takes first_check"):
        main(["fit", "--config", str(REPO / "configs" / "recall_auto.yaml"), f"{S}.first_check=16"], run=False)


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
        if n < len(history) - 1:  # before the last check only columns above the floor are bought
            assert decision["columns"] <= decision["above_floor"] and "fill_to" not in event
    # The last check spends all that is left (a column costs 1 value here), toward the budget.
    assert history[-1]["fill_to"] == budget
    assert full["hyper_parameters"]["d_head"][0] == history[-1]["d_head"][0] == budget
    assert history[-1]["d_head"][0] > 1  # recall needs width: the statistics say so
    tags = scalar_tags(out)
    assert {"growth/auto/columns/layer_0", "growth/auto/above_floor/layer_0", "growth/auto/first_gain/layer_0",
            "growth/auto/first_noise/layer_0", "growth/auto/allowance"} <= tags


# The same run growing both sides from d_head 1 and d_v 1: a mean head size of 4 over the key head and the value head
# leaves 6 values per token, 2 a check.
AUTO_KV = [*AUTO, "--trainer.callbacks.init_args.growth.grow=both", "--model.init_args.d_v=1"]


@pytest.fixture(scope="module")
def auto_kv_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_kv")
    return out, cli_fit(out, AUTO_KV, config="configs/recall_auto.yaml")


def test_auto_buys_query_key_and_value_columns_within_one_kv_cache_budget(auto_kv_run):
    out, full = auto_kv_run
    history = growth_history(full)
    assert [e["step"] for e in history] == [5, 10, 15]
    cache = lambda e, when="": e[f"d_head{when}"][0] + e[f"d_v{when}"][0]  # noqa: E731  one key head, one value head
    for n, event in enumerate(history):
        assert event["allowance"] == pytest.approx(6 * (n + 1) / 3 - (cache(event, "_before") - 2))
        bought = {d["side"]: d for d in event["decisions"]}
        assert set(bought) == {"d_head", "d_v"} and all(d["cost"] == 1 for d in bought.values())
        for side, d in bought.items():
            assert event[side][0] - event[f"{side}_before"][0] == d["columns"]
            assert d["columns"] <= d["above_floor"] or n == len(history) - 1  # the last check buys beyond the floor
        assert cache(event) - cache(event, "_before") <= event["allowance"]
    # At the end the KV cache is the budget: a column costs 1 value, so less than one unspent is none.
    assert cache(history[-1]) == 8
    assert history[-1]["d_v"][0] > 1  # recall reads its answer through W_V·W_O: one value column is not enough
    assert full["hyper_parameters"]["d_v"] == history[-1]["d_v"]
    assert {"growth/auto/columns_v/layer_0", "growth/auto/above_floor_v/layer_0", "growth/auto/first_gain_v/layer_0",
            "growth/d_v/layer_0"} <= scalar_tags(out)


def test_auto_with_both_sides_resumes_from_inside_a_window_with_the_same_decisions(auto_kv_run, tmp_path):
    out, full = auto_kv_run
    assert_same_run(cli_fit(tmp_path, AUTO_KV, ckpt_path=out / "ckpt" / "step=8.ckpt", config="configs/recall_auto.yaml"),
                    full)


def test_a_checkpoint_written_before_the_callback_had_its_package_resumes_bit_equal(auto_kv_run, tmp_path):
    """Step 8 of this run (inside a statistics window, after a growth of both sides), written under this suite by the
    code of commit 5432392, when the callback lived in callbacks.py, settings.py and growing/: resumed by today's code,
    it ends at the uninterrupted run's weights and history."""
    out, full = auto_kv_run
    old = REPO / "tests" / "data" / "recall_auto_kv_step8_before_callback_package.ckpt"
    assert_same_run(cli_fit(tmp_path, AUTO_KV, ckpt_path=old, config="configs/recall_auto.yaml"), full)


def test_resuming_with_other_growing_sides_is_refused_before_any_step(auto_kv_run, tmp_path):
    """A run's KV-cache budget and window count the sides it grew: resuming a run of both sides with query/key alone
    would drop its value columns from the budget."""
    out, _ = auto_kv_run
    with pytest.raises(ValueError, match=r"written by a run with growth.grow='both', this one has 'query_key': resume "
                                         r"with growth.grow=both, or start a new run from its weights"):
        cli_fit(tmp_path, AUTO, ckpt_path=out / "ckpt" / "step=8.ckpt", config="configs/recall_auto.yaml")


@pytest.mark.parametrize("checkpoint", [
    "step=3.ckpt",  # inside the first check's window
    "step=5.ckpt",  # between the window and the first check
    "step=8.ckpt",  # inside the second window, with grown shapes
    "step=13.ckpt",  # inside the last check's window: it still fills toward the budget
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
    assert "allowance 1 values per token; layer 0 d_head +" in printed and "above the floor (held-out gains " in printed
    assert "K-cache budget: mean query/key head size 4 of 4; bought 3 of the 3 values per token the budget adds to the " \
           "start (100 %), 0 unspent" in printed


@pytest.mark.parametrize("config", ["recall_auto.yaml", pytest.param("text_auto.yaml", marks=needs_shakespeare)])
def test_auto_configs_start_at_one_and_grow(tmp_path, tiny_cli_args, config):
    data = ["--data.init_args.num_train_examples=640"] if config == "recall_auto.yaml" else [
        f"--data.init_args.path={SHAKESPEARE}", "--data.init_args.samples_per_epoch=1280"]
    cb = fit(config, tmp_path, *tiny_cli_args, "--trainer.limit_train_batches=null", "--trainer.max_epochs=2",
             f"{S}.check_every=4", "--trainer.callbacks.init_args.statistics.batches=2", *data)
    assert cb.history[0]["d_head_before"][0] == 1
    assert any(d > 1 for e in cb.history for d in e["d_head"]), cb.history
