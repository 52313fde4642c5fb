"""GrowAttentionCallback under 16-mixed (the GradScaler's factor is taken out, overflowed steps dropped) and on
another device than the one a checkpoint restores statistics on."""

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lit_growattn.attention import QKForm
from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings
from lit_growattn.callback.window import StatsWindow

from callback_helpers import WindowRecorder, recall_data, tiny_module, trainer


def _window_run(tmp_path, init_scale=None, batches=4):
    L.seed_everything(0)
    data = recall_data(batch_size=16, examples=16 * batches)
    recorder = WindowRecorder(AtEpochs([1]), growth=GrowthSettings(columns=2, method="gradient"),
                              statistics=StatisticsSettings(batches=batches))
    plugins = [] if init_scale is None else [
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]
    module = tiny_module(data, dropout=0.0)
    trainer(tmp_path, [recorder], max_epochs=2, plugins=plugins).fit(module, data)
    return recorder, module


def test_16_mixed_statistics_are_unscaled(tmp_path):
    reference, _ = _window_run(tmp_path / "fp32")
    scaled, module = _window_run(tmp_path / "fp16", init_scale=2.0**12)
    assert len(reference.seen) == len(scaled.seen) > 0
    for (ref, _, _), (got, instances, weight) in zip(reference.seen, scaled.seen):
        assert (instances, weight) == (64, 4.0)  # no step overflowed at this scale
        # fp16 rounding moves single entries; a scale left in would be off by the factor 4096.
        assert (got.n - ref.n).norm() < 0.01 * ref.n.norm()
    assert module.model.head_sizes() == [4, 4]


# The scaler skips the first optimizer steps (they overflow), so Lightning sees the scheduler step before any.
SCHEDULER_FIRST = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


def test_16_mixed_overflowed_steps_are_dropped_not_poisoning(tmp_path):
    # Starting at 2^30 the scaler overflows and halves its scale for several steps before the gradients fit.
    with pytest.warns(UserWarning, match=SCHEDULER_FIRST):
        recorder, module = _window_run(tmp_path / "partial", init_scale=2.0**30, batches=24)
    assert recorder.seen
    for means, instances, weight in recorder.seen:
        assert 0 < weight < 24 and instances == 16 * weight
        assert all(torch.isfinite(m).all() for m in means if m is not None)
    assert module.model.head_sizes() == [4, 4]
    # A window made only of overflowed steps leaves nothing to grow from: the growth is skipped, training goes on.
    with pytest.warns(UserWarning, match="growth at epoch 1 skipped: no finite statistics"), \
            pytest.warns(UserWarning, match=SCHEDULER_FIRST):
        recorder, module = _window_run(tmp_path / "all", init_scale=2.0**60, batches=2)
    assert [(e["event"], e["skipped"]) for e in recorder.history] == [("epoch 1", True)]
    assert module.model.head_sizes() == [2, 2]


def test_16_mixed_layer_without_finite_statistics_keeps_its_size_and_the_others_grow(tmp_path, monkeypatch):
    L.seed_everything(0)
    data = recall_data(batch_size=16, examples=64)
    module = tiny_module(data, dropout=0.0)
    overflowing = module.model.blocks[0].attn.qk
    record = QKForm._record
    monkeypatch.setattr(QKForm, "_record", lambda self, xa, gx: record(self, xa, gx * float("inf") if self is overflowing else gx))
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=2),
                                 statistics=StatisticsSettings(batches=2))
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))]
    with pytest.warns(UserWarning, match=r"layers \[0\] have no finite statistics"):
        trainer(tmp_path, [grow], max_epochs=2, plugins=plugins).fit(module, data)
    assert module.model.head_sizes() == [2, 4] and not grow.history[0]["skipped"]




class SketchSumsRecorder(GrowAttentionCallback):
    """The window's sums as the growth receives them."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        self.sums = [{name: getattr(s, name).clone() for name in s.names} for s in self.window.stats]
        super()._grow(trainer, pl_module, point, batch_idx)


def _sketch_window_run(tmp_path, init_scale=None):
    L.seed_everything(0)
    data = recall_data(batch_size=16, examples=64)
    recorder = SketchSumsRecorder(AtEpochs([1]), growth=GrowthSettings(grow="both", columns=2, value_columns=2,
                                                                       method="gradient"),
                                  statistics=StatisticsSettings(batches=4, sketch="on", sketch_size=4))
    plugins = [] if init_scale is None else [
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]
    trainer(tmp_path, [recorder], max_epochs=2, plugins=plugins).fit(tiny_module(data, dropout=0.0), data)
    return recorder


def test_sketch_16_mixed_divides_gradient_parts_only(tmp_path):
    """Under a GradScaler the sketch's gradient-borne sums (query/key G X′Ω and GᵀX′Ψ, the value side's E_V gradient
    and G_Y) come out of the scale, the others (C̄; the value side's Nyström part F = C_VΩ_c, from a cotangent injected
    in backward, which no loss scale multiplies) as they are."""
    reference = _sketch_window_run(tmp_path / "fp32")
    scaled = _sketch_window_run(tmp_path / "fp16", init_scale=2.0**12)
    assert [sorted(s) for s in scaled.sums] == [sorted(s) for s in reference.sums]
    assert {"c_sum", "y_sum", "w_sum", "f_sum"} == {name for s in scaled.sums for name in s} - {"instances", "weight"}
    for ref, got in zip(reference.sums, scaled.sums, strict=True):
        assert float(got["weight"]) == float(ref["weight"]) == 4.0  # no step overflowed at this scale
        for name in ref.keys() - {"instances", "weight"}:
            # fp16 rounding moves single entries; a scale left in a sum, or taken out of one that carries none, puts
            # it off by the factor 4096.
            assert (got[name] - ref[name]).norm() < 0.01 * ref[name].norm(), name
    assert [e["d_v"] for e in scaled.history] == [[10, 10]] and not scaled.history[0]["skipped"]


# -- device: statistics follow the model, wherever a checkpoint restored them ----------------------------
class RecordingStrategy:
    """Single-rank collectives that note the device of what they are given."""

    def __init__(self):
        self.devices = []

    def reduce(self, t, reduce_op):
        self.devices.append(t.device)
        return t


def test_restored_statistics_follow_the_model_device():
    form = QKForm(8, 2, 2)
    window = StatsWindow("natural")
    forms = [(0, "model.blocks.0.attn.qk", form)]
    window.begin_step("epoch 1", forms, active={0}, mode="explicit", gathered_with={})
    window.end_step(forms)
    saved = window.state_dict(strategy=None, world=1)  # inside the window: partial sums, on the CPU
    restored = StatsWindow("natural")
    restored.load_state_dict(saved, rank=0, world=1)
    strategy = RecordingStrategy()
    # A model on another device (meta stands for CUDA here): the window closes there, with one collective.
    restored.close(strategy, world=1, device=torch.device("meta"))
    assert strategy.devices == [torch.device("meta")]
    assert all(t.device.type == "meta" for st in restored.stats for t in st.tensors())
