"""The callback's settings as a person reads and writes them: the package's top level, `--print_config=comments`,
and old flat configs refused with the grouped spelling."""

import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, run_command
from lit_growattn import (AtEpochs, AtSteps, AutoSchedule, GrowAttentionCallback, GrowAttentionLM, GrowthSettings,
                          StatisticsSettings, StepSearch)
from lit_growattn.commands.cli import main

GROUPS = {"growth": GrowthSettings, "statistics": StatisticsSettings, "step_search": StepSearch}


def test_the_product_is_importable_from_the_top_level():
    callback = GrowAttentionCallback(AtSteps([100]), GrowthSettings(columns=2))
    assert callback.schedule.points[0].name == "step 100" and GrowAttentionLM.__module__ == "lit_growattn.module"
    assert AutoSchedule(4).splits_window and not AtEpochs([1]).splits_window


def test_print_config_describes_every_growth_setting():
    out = subprocess.run([sys.executable, "-m", "lit_growattn", "fit", "--config", "configs/mqar_grow.yaml",
                          "--print_config=comments"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    for group, cls in GROUPS.items():
        start = next(i for i, line in enumerate(lines) if line.strip() == f"{group}:")
        for field in cls.__dataclass_fields__:
            at = next(i for i in range(start, len(lines)) if re.match(rf"\s*{field}:", lines[i]))
            comment = lines[at - 1].strip()
            assert comment.startswith("#") and "type:" in comment, (group, field, comment)
            assert len(comment.split("(type:")[0]) > 20, (group, field, comment)  # a description, not just the type
    assert "epochs (0-based" in out  # the schedule's own settings too


def test_a_growth_field_is_unset_from_the_command_line_by_a_mapping_that_keeps_the_others():
    # docs/configuration.md: the dotted form with null is refused by jsonargparse, the mapping form merges.
    done = run_command("fit", "--config", "configs/text_auto.yaml",
                       "--trainer.callbacks.init_args.growth={max_columns: null}", "--print_config")
    assert done.returncode == 0, done.stderr
    callbacks = yaml.safe_load(done.stdout)["trainer"]["callbacks"]
    growth = next(cb for cb in callbacks if cb["class_path"].endswith("GrowAttentionCallback"))["init_args"]["growth"]
    assert growth["max_columns"] is None
    assert (growth["method"], growth["size_by"], growth["mode"]) == ("random", "natural", "append")


def test_every_shipped_config_uses_the_grouped_settings():
    growing = 0
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        callbacks = (yaml.safe_load(path.read_text()).get("trainer") or {}).get("callbacks") or []
        for cb in callbacks:
            if cb["class_path"].endswith("GrowAttentionCallback"):
                growing += 1
                assert cb["class_path"] == "lit_growattn.GrowAttentionCallback"
                assert set(cb["init_args"]) <= {"schedule", *GROUPS}, path
                assert cb["init_args"]["schedule"]["class_path"] in ("lit_growattn.AtEpochs", "lit_growattn.AutoSchedule")
    assert growing == 7  # six nanoGPT configs and configs/hf_llama_grow.yaml


OLD = """
trainer:
  callbacks:
    - class_path: lit_growattn.callbacks.GrowAttentionCallback
      init_args: {grow_at_epochs: [2, 4], grow_by: 2, dynamic_rank: null, stats_batches: 16, alphas: [0, 1]}
"""


def test_an_old_flat_config_fails_with_the_new_spelling(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(OLD)
    with pytest.raises(ValueError, match="old flat form") as error:
        main(["fit", "--config", str(old)], run=False)
    spelled = yaml.safe_load(str(error.value).split("Write its init_args as:\n", 1)[1])
    assert spelled == {"schedule": {"class_path": "lit_growattn.AtEpochs", "init_args": {"epochs": [2, 4]}},
                       "growth": {"columns": 2, "rank_threshold": None}, "statistics": {"batches": 16},
                       "step_search": {"alphas": [0, 1]}}
    GrowAttentionCallback(AtEpochs([2, 4]), GrowthSettings(columns=2), StatisticsSettings(16), StepSearch([0, 1]))


def test_an_old_flat_automatic_config_is_spelled_with_the_budget(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(OLD.replace("grow_at_epochs: [2, 4], grow_by: 2, dynamic_rank: null",
                               "schedule: auto, check_every: 10, patience: 2, grow_by: 4"))
    with pytest.raises(ValueError, match="old flat form") as error:
        main(["fit", "--config", str(old)], run=False)
    spelled = yaml.safe_load(str(error.value).split("Write its init_args as:\n", 1)[1])
    assert spelled["schedule"] == {"class_path": "lit_growattn.AutoSchedule",
                                   "init_args": {"budget": 4, "check_every": 10, "spend_until": 0.5}}
    assert "(budget 4 is an example: give the mean query/key head size you can afford)" in str(error.value)
    assert "growth" not in spelled  # grow_by was the old rule's cap, which the budget replaces


@pytest.mark.parametrize("option, message", [
    ("check_every=10", r"write --trainer.callbacks.init_args.schedule.init_args.check_every=…"),
    ("auto_threshold=1e-5", r"AutoSchedule no longer takes auto_threshold: it now spends a K-cache budget"),
])
def test_an_old_flat_option_on_the_command_line_fails_with_the_new_one(option, message):
    with pytest.raises(ValueError, match=message):
        main(["fit", "--config", str(REPO / "configs/recall_auto.yaml"), f"--trainer.callbacks.init_args.{option}"],
             run=False)


def test_a_setting_of_one_side_is_asked_for_by_the_sides_name():
    settings = GrowthSettings(grow="both", columns=[2, 3], value_columns=5, max_d_head=12, max_d_v=6)
    assert [settings.count(1, "d_head"), settings.count(1, "d_v")] == [3, 5]
    assert [settings.max_width("d_head"), settings.max_width("d_v")] == [12, 6]
    for ask in (lambda side: settings.count(0, side), settings.max_width):  # a bool was the side before the names
        with pytest.raises(ValueError) as refused:
            ask(True)
        assert str(refused.value) == "side is 'd_head' (the query/key side) or 'd_v' (the value side), not True"
