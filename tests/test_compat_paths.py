"""Old import paths that users' code, configs and checkpoints hold keep working: a module moved whole is the same
module object under its old name (an alias, so a monkeypatch through either name reaches the one module), a module
that was split re-exports the identical objects, and the class paths that configs and checkpoints record are
unchanged."""

import importlib
import pickle

import pytest
from conftest import needs_transformers
from jsonargparse import ArgumentParser
from jsonargparse._util import get_import_path

import lit_growattn
import lit_growattn.contract
import lit_growattn.model.contract
from lit_growattn.callback import budget, event, schedule

MOVED = {
    "lit_growattn.model.contract": "lit_growattn.contract",
    "lit_growattn.callbacks": "lit_growattn.callback.callback",
    "lit_growattn.settings": "lit_growattn.callback.settings",
    **{f"lit_growattn.growing.{name}": f"lit_growattn.callback.{name}"
       for name in ("window", "memory", "report", "trainer_ops", "averaging")},
}


@pytest.mark.parametrize("old, new", MOVED.items())
def test_a_moved_module_is_the_same_module_under_its_old_path(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_old_modules_are_attributes_after_a_plain_import():
    """`import lit_growattn` made them attributes before they moved, as a side effect some code relies on."""
    assert lit_growattn.settings.GrowthSettings is lit_growattn.GrowthSettings
    assert lit_growattn.callbacks.GrowAttentionCallback is lit_growattn.GrowAttentionCallback
    assert lit_growattn.growing.window is importlib.import_module("lit_growattn.callback.window")
    assert lit_growattn.growing.schedule.AutoSchedule is lit_growattn.AutoSchedule
    with pytest.raises(AttributeError, match="module 'lit_growattn' has no attribute 'nothing'"):
        lit_growattn.nothing  # noqa: B018
    with pytest.raises(AttributeError, match="module 'lit_growattn.growing' has no attribute 'nothing'"):
        lit_growattn.growing.nothing  # noqa: B018


def test_the_contract_keeps_its_old_path():
    assert lit_growattn.model.contract is lit_growattn.contract
    assert importlib.import_module("lit_growattn.model.contract") is lit_growattn.contract
    from lit_growattn.model.contract import GrowableModule, check_module

    assert (GrowableModule, check_module) == (lit_growattn.contract.GrowableModule, lit_growattn.contract.check_module)


def test_a_monkeypatch_through_the_old_path_reaches_the_module(monkeypatch):
    monkeypatch.setattr("lit_growattn.model.contract.growable_units", "patched")
    assert lit_growattn.contract.growable_units == "patched"


def test_the_hugging_face_dint_names_keep_their_old_paths():
    needs_transformers()
    import lit_growattn.dint.attention
    import lit_growattn.dint.models as models
    from lit_growattn.hf import dint

    assert lit_growattn.dint.attention is dint
    from lit_growattn.dint.attention import DintAttention, DintSettings, d2_ratio_for_init, document_running_mean

    assert (DintAttention, DintSettings, d2_ratio_for_init, document_running_mean) == (
        dint.DintAttention, dint.DintSettings, dint.d2_ratio_for_init, dint.document_running_mean)
    for name in ("FAMILIES", "DINT_MODEL_TYPES", "dint_classes", "register_all", "DintLlamaConfig",
                 "DintQwen3ForCausalLM"):
        assert getattr(models, name) is getattr(dint, name), name
    assert pickle.loads(pickle.dumps(models.DintLlamaForCausalLM)) is dint.DintLlamaForCausalLM
    with pytest.raises(AttributeError):
        models.NoSuchName  # noqa: B018 - the attribute lookup is what is tested


def test_the_lightning_modules_keep_their_defining_modules():
    """Checkpoints record `<module>.<class>` (`convert` writes lit_growattn.module.GrowAttentionLM), and Lightning
    looks that module up in sys.modules."""
    from lit_growattn.module import GrowAttentionLM

    assert GrowAttentionLM is lit_growattn.GrowAttentionLM
    assert GrowAttentionLM.__module__ == "lit_growattn.module"


@pytest.mark.parametrize("path, recorded", [
    ("lit_growattn.module.GrowAttentionLM", "lit_growattn.GrowAttentionLM"),
    ("lit_growattn.hf.module.HFCausalLM", "lit_growattn.hf.HFCausalLM"),
    ("lit_growattn.data.instruct.InstructDataModule", "lit_growattn.data.InstructDataModule"),
    ("lit_growattn.data.text.TextDataModule", "lit_growattn.data.TextDataModule"),
    ("lit_growattn.analysis.AttentionAnalysisCallback", "lit_growattn.analysis.AttentionAnalysisCallback"),
    ("lit_growattn.dint.entropy.AttentionEntropyCallback", "lit_growattn.dint.entropy.AttentionEntropyCallback"),
])
def test_configs_and_checkpoints_record_the_same_class_paths(path, recorded):
    if path.startswith("lit_growattn.hf"):
        needs_transformers()
    module, _, name = path.rpartition(".")
    assert get_import_path(getattr(importlib.import_module(module), name)) == recorded


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
