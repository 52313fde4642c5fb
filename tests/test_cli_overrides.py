"""The command line as users write it: every callback setting set and unset (null) by its dotted name, options of
one callback after `--trainer.callbacks+=` another, Lightning's Timer, and where a run's files go."""

import pytest
import yaml
from jsonargparse import ArgumentError, ArgumentParser, _typehints

from lit_growattn import AutoSchedule, GrowAttentionCallback
from lit_growattn.__main__ import main as command_line
from lit_growattn.commands.cli import main
from lit_growattn.callback.settings import StatisticsSettings

from conftest import REPO, needs_transformers

CB = "--trainer.callbacks.init_args"
SMALL_RECALL = ["--data.init_args.num_train_examples=256", "--data.init_args.num_val_examples=64"]


def growth_callback(cli) -> GrowAttentionCallback:
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback)]
    return callback


def test_recall_grow_switched_to_the_automatic_schedule_by_overrides(tmp_path, tiny_cli_args):
    # The shipped config's fixed `columns: 7` must go for AutoSchedule, which chooses the count itself.
    cli = main(["fit", "--config", str(REPO / "configs/recall_grow.yaml"), *tiny_cli_args, *SMALL_RECALL,
                f"{CB}.growth.columns=null", f"{CB}.schedule=lit_growattn.AutoSchedule",
                f"{CB}.schedule.init_args.budget=4", f"{CB}.schedule.init_args.check_every=2",
                f"{CB}.statistics.batches=2"])
    grow = growth_callback(cli)
    assert grow.settings.columns is None and grow.settings.method == "pinv"  # the config's other fields are kept
    assert isinstance(grow.schedule, AutoSchedule) and grow.schedule.check_every == 2
    assert cli.trainer.global_step == 4 and len(grow.history) >= 1  # it ran, and checked at step 2


# A config in which every group has settings that are not null, so that unsetting each one is seen.
SET_CONFIG = """
trainer:
  callbacks:
    - class_path: lit_growattn.GrowAttentionCallback
      init_args:
        schedule:
          class_path: lit_growattn.AutoSchedule
          init_args: {budget: 4, check_every: 8, spend_until: 0.75}
        growth: {method: random, size_by: natural, max_d_head: 6}
        statistics: {batches: 4, layers_per_step: 1, max_memory_gb: 10.0}
        step_search: {alphas: [0, 1], batches: 1}
"""


@pytest.mark.parametrize("option, read, expected", [
    ("schedule.init_args.spend_until=1.0", lambda g: g.schedule.spend_until, 1.0),
    ("growth.max_d_head=null", lambda g: g.settings.max_d_head, None),
    ("growth.size_by=null", lambda g: g.settings.size_by, None),
    ("statistics.batches=6", lambda g: g.statistics.batches, 6),
    ("statistics.max_memory_gb=null", lambda g: g.statistics.max_memory_gb, None),
    ("step_search.batches=2", lambda g: g.search.batches, 2),
    ("step_search.alphas=null", lambda g: g.search.alphas, None),
], ids=lambda v: v if isinstance(v, str) else "")
def test_each_setting_is_set_and_unset_by_its_dotted_name(tmp_path, tiny_cli_args, option, read, expected):
    overlay = tmp_path / "set.yaml"
    overlay.write_text(SET_CONFIG)
    cli = main(["--config", str(REPO / "configs/recall_auto.yaml"), "--config", str(overlay), *tiny_cli_args,
                *SMALL_RECALL, f"{CB}.{option}"], run=False)
    grow = growth_callback(cli)
    assert read(grow) == expected
    assert grow.settings.method == "random" and grow.statistics.layers_per_step == 1  # the rest of the config stays


def test_a_budget_unset_on_the_command_line_is_refused_with_what_to_use_instead(tmp_path, tiny_cli_args, capsys,
                                                                                monkeypatch):
    # AutoSchedule has no budget: null any more; the refusal names a budget to give, or the schedules without one.
    monkeypatch.delenv("LIT_GROWATTN_DEBUG", raising=False)
    overlay = tmp_path / "set.yaml"
    overlay.write_text(SET_CONFIG)
    assert command_line(["fit", "--config", str(REPO / "configs/recall_auto.yaml"), "--config", str(overlay),
                         *tiny_cli_args, *SMALL_RECALL, f"{CB}.schedule.init_args.budget=null"]) == 1
    err = capsys.readouterr().err
    report = err[err.index("error:"):].splitlines()[0]
    assert report.startswith("error: ValueError: AutoSchedule needs a budget: the mean head size the grown model may "
                             "reach (e.g. budget: 4, ")
    assert report.endswith("To grow without a cache bound use AtSteps or AtEpochs with growth.rank_threshold; to "
                           "train at a fixed width drop the callback and set the model's d_head.")


def test_options_after_the_callback_is_added_on_the_command_line(tmp_path, tiny_cli_args):
    cli = main(["--config", str(REPO / "configs/mqar.yaml"), *tiny_cli_args,
                "--trainer.callbacks+=lit_growattn.GrowAttentionCallback", f"{CB}.schedule=lit_growattn.AtSteps",
                f"{CB}.schedule.init_args.steps=[4]", f"{CB}.growth.max_d_head=null", f"{CB}.step_search.alphas=null",
                f"{CB}.growth.columns=2"], run=False)
    grow = growth_callback(cli)
    assert [p.at for p in grow.schedule.points] == [4]
    assert (grow.settings.max_d_head, grow.search.alphas, grow.settings.columns) == (None, None, 2)


def test_an_option_that_went_to_another_callback_is_refused_in_one_line(tmp_path, tiny_cli_args, capsys):
    with pytest.raises(SystemExit):
        main(["--config", str(REPO / "configs/recall_grow.yaml"), *tiny_cli_args, *SMALL_RECALL,
              "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor", f"{CB}.growth.columns=null"],
             run=False)
    error = capsys.readouterr().err.split("error: ", 1)[1]
    assert error.startswith(f"{CB}.growth.columns went to LearningRateMonitor, the callback listed last")
    assert "before any --trainer.callbacks+=" in error and len(error.strip().splitlines()) == 1
    # The order it names works.
    cli = main(["--config", str(REPO / "configs/recall_grow.yaml"), *tiny_cli_args, *SMALL_RECALL,
                f"{CB}.growth.columns=null", "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor",
                f"{CB}.logging_interval=step"], run=False)
    assert growth_callback(cli).settings.columns is None


class Holder:
    def __init__(self, statistics: StatisticsSettings = StatisticsSettings()):
        self.statistics = statistics


def test_jsonargparse_itself_still_turns_a_nested_null_into_text(monkeypatch):
    """lit_growattn.commands.cli passes nested values to jsonargparse as JSON. Once this fails, jsonargparse does it itself,
    and `_pass_nested_values_as_json` can go."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--holder", type=Holder)
    args = [f"--holder={__name__}.Holder", "--holder.init_args.statistics.max_memory_gb=null"]
    assert parser.parse_args(args).holder.init_args.statistics.max_memory_gb is None
    monkeypatch.setattr(_typehints, "adapt_class_type", _typehints.adapt_class_type.__wrapped__)
    with pytest.raises(ArgumentError, match="max_memory_gb"):
        parser.parse_args(args)


def test_timer_runs_through_a_growth_and_its_config_is_saved(tmp_path, tiny_cli_args):
    cli = main(["fit", "--config", str(REPO / "configs/recall_grow.yaml"), *tiny_cli_args, *SMALL_RECALL,
                "--trainer.max_epochs=2", f"{CB}.schedule.init_args.epochs=[1]", f"{CB}.statistics.batches=2",
                "--trainer.callbacks+=lightning.pytorch.callbacks.Timer",
                "--trainer.callbacks.init_args.duration=00:00:10:00"])
    assert len(growth_callback(cli).history) == 1
    (saved,) = tmp_path.rglob("config.yaml")
    timer = yaml.safe_load(saved.read_text())["trainer"]["callbacks"][-1]
    assert timer == {"class_path": "lightning.pytorch.callbacks.Timer",
                     "init_args": {"duration": "00:00:10:00", "interval": "step", "verbose": True}}


NO_LOGGER = ["fit", "--config", str(REPO / "configs/mqar.yaml"), "--trainer.logger=false", "--trainer.max_steps=2",
             "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
             "--data.init_args.num_train_examples=256", "--data.init_args.num_val_examples=64"]


def test_a_run_without_logger_writes_into_a_run_folder_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("mine: true\n")  # a user's file where Lightning would write its own
    main(NO_LOGGER)
    main(NO_LOGGER)
    runs = tmp_path / "logs" / "lit_growattn"
    for run in (runs / "version_0", runs / "version_1"):
        assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "logs"]
    assert (tmp_path / "config.yaml").read_text() == "mine: true\n"
    assert not list(tmp_path.rglob("last-v1.ckpt"))


@pytest.mark.parametrize("logger", [[], ["--trainer.logger=false"]], ids=["tensorboard", "no logger"])
def test_a_failed_start_leaves_no_folder_it_created(tmp_path, monkeypatch, logger):
    monkeypatch.chdir(tmp_path)
    too_long_window = ["fit", "--config", str(REPO / "configs/recall_grow.yaml"), *logger, *SMALL_RECALL,
                       "--trainer.enable_progress_bar=false"]  # 16 statistics batches, 4 batches an epoch
    with pytest.raises(ValueError, match="statistics.batches=16 is more than an epoch"):
        main(too_long_window)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match="statistics.batches=16 is more than an epoch"):
        main(too_long_window)
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["notes.txt"]


def test_rotary_dim_on_qwen3_says_it_is_refused_for_the_model_type():
    needs_transformers()
    from hf_helpers import tiny_config
    from lit_growattn.hf import HFCausalLM

    with pytest.raises(ValueError, match=r"rotary_dim is refused for qwen3 models \(its q_norm/k_norm normalise all 8 "
                                         r"rotary columns of a head together.*\): set it to null "
                                         r"\(--model.init_args.rotary_dim=null\)"):
        HFCausalLM(config=tiny_config("qwen3").to_dict(), rotary_dim=4)
