"""The declared contract between GrowAttentionCallback and the module it grows: what is refused at setup, what the
forms carry themselves, and that the callback reaches the model only through the contract."""

import re

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from callback_helpers import params, recall_data, tiny_module, trainer
from conftest import REPO
from lit_growattn import AtEpochs, GrowAttentionCallback, GrowAttentionLM, GrowthSettings, StatisticsSettings
from lit_growattn.attention import QKForm
from lit_growattn.attention.lowrank_dint import LowRankQK
from lit_growattn.training.checkpoint import resize_to_checkpoint
from lit_growattn.contract import GrowableForm, GrowableModule, NamedForm, ScoreMap, check_module, missing


def grow_once(**settings) -> GrowAttentionCallback:
    return GrowAttentionCallback(AtEpochs([1]), GrowthSettings(columns=2), StatisticsSettings(batches=2), **settings)


class Plain(L.LightningModule):
    """A LightningModule that knows nothing of growth."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_without_the_contract_is_refused_at_setup_naming_what_it_lacks(tmp_path):
    loader = DataLoader([(torch.ones(4),)] * 4, batch_size=2)
    with pytest.raises(TypeError, match="lacks batch_loss, growable_forms, head_sizes, record_head_sizes. A module to "
                                        "grow implements lit_growattn.contract.GrowableModule"):
        trainer(tmp_path, [grow_once()]).fit(Plain(), loader)


class TwoOptimizers(GrowAttentionLM):
    """Lightning takes two optimizers only under manual optimization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def configure_optimizers(self):
        groups = self.parameter_groups()
        return [torch.optim.AdamW(groups[:1]), torch.optim.SGD(groups[1:], lr=0.1)]


def test_two_optimizers_are_refused_before_the_first_step(tmp_path):
    data = recall_data()
    module = TwoOptimizers(**{k: v for k, v in tiny_module(data).hparams.items()})
    before = params(module)
    with pytest.raises(ValueError, match="configures 2: return a single optimizer"):
        trainer(tmp_path, [grow_once()]).fit(module, data)
    assert all(torch.equal(before[k], v) for k, v in params(module).items())


def test_the_project_types_meet_the_contract():
    data = recall_data()
    module = tiny_module(data)
    assert isinstance(module, GrowableModule) and not missing(module, GrowableModule)
    form = QKForm(8, 2, 3, bias=True)
    assert isinstance(form, GrowableForm) and form.n_kv_head == form.n_head == 2
    low_rank = LowRankQK(8, 2, 3, rank=2, bias=True, d2_ratio=1 / 9)
    assert isinstance(low_rank, ScoreMap) and not isinstance(low_rank, GrowableForm)
    assert [p is q for p, q in zip(form.bias_row_parameters(), [form.w_q, form.w_k])] == [True, True]
    assert QKForm(8, 2, 3, bias=False).bias_row_parameters() == []


UNIT_MEMBERS = ("column_cost", "e_in", "empty_sums", "held_weights", "leading_tensor", "max_width", "side",
                "sums_numel", "tensor_names", "width")


class BareForm(torch.nn.Module):
    """A form of one's own with everything of a query/key form but the members every growable unit has."""

    def __init__(self, form: QKForm):
        super().__init__()
        self.inner = form

    def __getattr__(self, name):
        if name == "inner":
            return super().__getattr__(name)
        if name in UNIT_MEMBERS:
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_a_form_without_the_members_of_a_growable_unit_is_refused_naming_them():
    class OwnModel:  # a module of one's own whose form is not built on lit_growattn.growth.FormShape
        def growable_forms(self):
            return [NamedForm(0, "model.layers.0.qk", BareForm(QKForm(8, 2, 3, bias=True)))]

        head_sizes = batch_loss = record_head_sizes = growable_forms

    with pytest.raises(TypeError) as refused:
        check_module(OwnModel())
    assert str(refused.value) == (
        f"form 'model.layers.0.qk' (BareForm) lacks {', '.join(UNIT_MEMBERS)} of lit_growattn.contract.GrowableForm")


class ScaledQK(QKForm):
    """A subclass of a form: the resize and bias-row knowledge comes with it (no table keyed by exact type)."""


def test_subclassed_forms_resize_to_a_checkpoint_and_keep_their_bias_rows():
    model = torch.nn.ModuleDict({"a": ScaledQK(8, 2, 3, bias=True), "b": LowRankQK(8, 2, 3, 2, True, 1 / 9)})
    grown = {"a.w_q": torch.zeros(2, 9, 5), "a.w_k": torch.zeros(2, 9, 5), "b.up_q": torch.zeros(2, 2, 7)}
    resize_to_checkpoint(model, grown)
    assert model["a"].d_head == 5 and model["b"].d_head == 7
    assert len(model["a"].bias_row_parameters()) == 2


class DictBatches(GrowAttentionLM):
    """Batches as dicts: the callback rates candidate growths through `batch_loss`, whatever the batch is."""

    def training_step(self, batch, batch_idx):
        return super().training_step((batch["inputs"], batch["labels"]), batch_idx)

    def validation_step(self, batch, batch_idx):
        return super().validation_step((batch["inputs"], batch["labels"]), batch_idx)

    def batch_loss(self, batch):
        return super().batch_loss((batch["inputs"], batch["labels"]))


def test_batches_need_not_be_pairs(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    data.setup("fit")
    pairs = [pair for batch in data.train_dataloader() for pair in zip(*batch)]
    loader = DataLoader([{"inputs": x, "labels": y} for x, y in pairs], batch_size=16)
    module = DictBatches(**{k: v for k, v in tiny_module(data).hparams.items()})
    grow = grow_once()
    trainer(tmp_path, [grow], max_epochs=2, limit_val_batches=1).fit(module, loader, loader)
    assert module.head_sizes() == [4, 4] and not grow.history[0]["skipped"]


def test_the_callback_package_reaches_the_model_only_through_the_contract():
    sources = sorted((REPO / "lit_growattn" / "callback").glob("*.py"))
    assert len(sources) > 3
    for path in sources:
        text = path.read_text()
        assert "pl_module.model" not in text and not re.search(r"\bid\(", text) and '"model.' not in text, path


class OldProtocolForm:
    """A form of one's own written to the protocol before sketched statistics, not built on FormShape: the members of
    `GrowableForm` only, `empty_sums(method, dtype)` and `sums_numel(method)` taking nothing more, no `sketch` and no
    `tests_numel`; everything else is the wrapped QKForm's."""

    def __init__(self, inner: QKForm):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "calls", [])

    def __getattr__(self, name):
        if name in ("sketch", "tests_numel"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def empty_sums(self, method, dtype=torch.float32):
        self.calls.append("empty_sums")
        return self.inner.empty_sums(method, dtype)

    def sums_numel(self, method):
        self.calls.append("sums_numel")
        return self.inner.sums_numel(method)


class OldProtocolModule(GrowAttentionLM):
    """GrowAttentionLM whose growable forms are `OldProtocolForm`s around its own."""

    def growable_forms(self):
        wrapped = self.__dict__.setdefault("_wrapped", {})
        return [NamedForm(n.layer, n.name, wrapped.setdefault(id(n.form), OldProtocolForm(n.form)))
                for n in super().growable_forms()]


@pytest.mark.parametrize("sketch", ["off", "auto"])
def test_a_form_of_the_protocol_before_the_sketch_grows_with_the_sketch_off(tmp_path, sketch):
    data = recall_data()
    module = OldProtocolModule(vocab_size=data.vocab_size, block_size=data.max_seq_len, n_layer=2, n_head=2,
                               n_embd=16, d_head=2, d_v=8, warmup_steps=0, lr_schedule="cosine")
    callback = GrowAttentionCallback(AtEpochs([1]), GrowthSettings(columns=2),
                                     StatisticsSettings(batches=2, sketch=sketch, max_memory_gb=1.0))
    trainer(tmp_path, [callback], max_epochs=2).fit(module, data)
    assert module.head_sizes() == [4, 4]
    forms = [n.form for n in module.growable_forms()]
    assert all(isinstance(f, OldProtocolForm) and "empty_sums" in f.calls and "sums_numel" in f.calls for f in forms)
    with pytest.raises(ValueError, match="OldProtocolForm of layer 0 lacks sketch, tests_numel"):
        GrowAttentionCallback(AtEpochs([1]), GrowthSettings(columns=2), StatisticsSettings(batches=2, sketch="on"))\
            .setup(trainer(tmp_path, []), module, "fit")
