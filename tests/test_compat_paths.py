"""Old import paths that users' code, configs and checkpoints hold keep working after the moves of issue 53: each
old module is the new one (an alias, so a monkeypatch through either name reaches the one module), each moved name is
the same object, and the class paths that jsonargparse records are unchanged."""

import importlib
import pickle

import pytest
from conftest import needs_transformers
from jsonargparse._util import get_import_path

import lit_growattn
import lit_growattn.contract
import lit_growattn.model.contract


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
