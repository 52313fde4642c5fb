"""The callback side's old import paths keep working (issue 53): a module moved whole into lit_growattn.callback is
the same module object under its old name (so a test or user that patches a name there patches the real one), a
module that was split re-exports the identical objects, and the class paths that configs and checkpoints record
are unchanged."""

import importlib

import pytest
from jsonargparse import ArgumentParser
from jsonargparse._util import get_import_path

import lit_growattn
from lit_growattn import growth
from lit_growattn.callback import budget, event, schedule
from lit_growattn.growth import sides

MOVED = {
    "lit_growattn.callbacks": "lit_growattn.callback.callback",
    "lit_growattn.settings": "lit_growattn.callback.settings",
    **{f"lit_growattn.growing.{name}": f"lit_growattn.callback.{name}"
       for name in ("window", "memory", "report", "trainer_ops", "averaging")},
}


@pytest.mark.parametrize("old, new", MOVED.items())
def test_a_moved_module_is_the_same_module_under_its_old_path(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_split_modules_re_export_the_identical_objects():
    old_schedule = importlib.import_module("lit_growattn.growing.schedule")
    for name in ("Clock", "GrowthPoint", "GrowthSchedule", "AtEpochs", "AtSteps", "check_same_schedule",
                 "warn_past_the_end"):
        assert getattr(old_schedule, name) is getattr(schedule, name)
    assert old_schedule.AutoSchedule is budget.AutoSchedule
    old_event = importlib.import_module("lit_growattn.growing.event")
    for name in ("GrowthEvent", "LossOf", "StepChoice", "Stopwatch", "choose_step_size", "plan_growth"):
        assert getattr(old_event, name) is getattr(event, name)
    assert old_event.offers is budget.offers


def test_patching_a_name_under_the_old_path_patches_the_callback(monkeypatch):
    from lit_growattn import callbacks

    monkeypatch.setattr(callbacks, "GrowthEvent", None)
    assert importlib.import_module("lit_growattn.callback.callback").GrowthEvent is None


def test_the_sides_functions_keep_their_names_in_growth():
    for name in ("HeadSize", "column_costs", "growth_for", "head_size_of", "is_value", "leading_tensor", "restore",
                 "stats_from_state_dict", "stats_like", "tensor_names", "weights_of"):
        assert getattr(growth, name) is getattr(sides, name)


@pytest.mark.parametrize("name", ["GrowAttentionCallback", "AtEpochs", "AtSteps", "AutoSchedule", "GrowthSchedule",
                                  "GrowthSettings", "StatisticsSettings", "StepSearch"])
def test_the_recorded_class_paths_are_unchanged(name):
    cls = getattr(lit_growattn, name)
    assert get_import_path(cls) == f"lit_growattn.{name}"
    assert cls is getattr(importlib.import_module("lit_growattn.callback"), name)


def test_a_config_naming_the_old_callback_path_still_builds_it():
    parser = ArgumentParser()
    parser.add_argument("--callback", type=lit_growattn.GrowAttentionCallback)
    config = parser.parse_object({"callback": {
        "class_path": "lit_growattn.callbacks.GrowAttentionCallback",
        "init_args": {"schedule": {"class_path": "lit_growattn.growing.schedule.AutoSchedule",
                                   "init_args": {"budget": 8}}}}})
    callback = parser.instantiate(config).callback
    assert isinstance(callback, lit_growattn.GrowAttentionCallback)
    assert isinstance(callback.schedule, lit_growattn.AutoSchedule) and callback.schedule.check_every == 50
