"""Statistics memory: the estimate printed at setup, its bound, and layers growing in turn from their own windows."""

import re

import pytest
import torch

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings
from lit_growattn.growth import FormShape, SketchSize
from lit_growattn.growth.value import ValueShape
from lit_growattn.contract import NamedForm
from lit_growattn.callback.memory import check_statistics_memory, layers_of_event

from callback_helpers import recall_data, tiny_module, trainer


class _Form(FormShape):
    def __init__(self, h, e_in, kv=None):
        self.w_q, self.w_k = torch.zeros(h, e_in, 1), torch.zeros(h if kv is None else kv, e_in, 1)


class _Values(ValueShape):
    def __init__(self, h, e_in, e_out=None, kv=None):
        self.w_v = torch.zeros(h if kv is None else kv, e_in, 1)
        self.w_o = torch.zeros(h, 1, e_in if e_out is None else e_out)


def test_llama_1b_estimate_and_the_fix_it_names():
    # Llama-3.2-1B: 16 layers, 32 heads, e = 2048 (docs/hf.md, "Statistics memory": 8.6 GB of N in float32, plus C̄).
    forms = [NamedForm(i, f"l{i}", _Form(32, 2048)) for i in range(16)]
    line = check_statistics_memory(forms, list(range(16)), None, "natural", None)
    assert line.startswith("growth statistics: 8.86 GB per rank (16 of 16 layers per window; query/key 32 heads × "
                           "e′² = 2048²; 4 B each)")
    with pytest.raises(ValueError, match="exceed statistics.max_memory_gb=2.0: set statistics.layers_per_event: 3"):
        check_statistics_memory(forms, list(range(16)), None, "natural", 2.0)
    assert "1.66 GB" in check_statistics_memory(forms, list(range(16)), 3, "natural", 2.0)


def test_value_maps_count_c_per_head_and_n_to_the_output():
    """A value map holds C (h·e′²) and N (h·e′·e): twice a query/key form's N when e′ = e."""
    forms = [NamedForm(i, f"l{i}", _Form(32, 2048)) for i in range(16)]
    both = forms + [NamedForm(i, f"v{i}", _Values(32, 2048)) for i in range(16)]
    line = check_statistics_memory(both, list(range(16)), None, "natural", None)
    value_bytes = 16 * 4 * 32 * 2048 * 4096
    assert line.startswith(f"growth statistics: {(8.86e9 + value_bytes) / 1e9:.3g} GB per rank")
    assert "query/key 32 heads × e′² = 2048²; values 32 heads × e′ × (e′ + e) = 2048 × 4096; 4 B each" in line
    biased = [NamedForm(0, "v", _Values(4, 65, 64))]  # e′ = e + 1 with a bias: C is e′², N is e′ × e
    assert check_statistics_memory(biased, [0], None, "natural", None).startswith(
        f"growth statistics: {4 * 4 * 65 * (65 + 64) / 1e6:.3g} MB per rank")


def test_the_automatic_schedule_holds_twice_the_sums_and_is_told_to_grow_fewer_layers():
    """AutoSchedule keeps the sums of half the window beside the whole window's; it offers every growing layer at
    each check, so fewer growing layers (growth.layers), not layers_per_event, bound its memory."""
    forms = [NamedForm(i, f"l{i}", _Form(32, 2048)) for i in range(16)]
    line = check_statistics_memory(forms, list(range(16)), None, "natural", None, halves=True)
    assert line.startswith("growth statistics: 17.7 GB per rank (16 of 16 layers per window; query/key 32 heads × "
                           "e′² = 2048²; twice: the automatic schedule keeps each half of the window; 4 B each)")
    with pytest.raises(ValueError, match=r"exceed statistics.max_memory_gb=2.0: grow at most 1 layer with "
                                         r"growth.layers \(the automatic schedule offers every growing layer"):
        check_statistics_memory(forms, list(range(16)), None, "natural", 2.0, halves=True)


@pytest.mark.parametrize("method, limit_gb, fix", [
    ("pinv", 0.9, r"one layer alone needs 1.09 GB with pinv's second sum: use method natural or gradient \(0.554 GB"),
    ("pinv", 0.3, r"one layer alone needs 1.09 GB: raise statistics.max_memory_gb above that$"),
    ("natural", 0.3, r"one layer alone needs 0.554 GB: raise statistics.max_memory_gb above that$"),
])
def test_a_window_one_layer_of_which_does_not_fit_names_only_a_fix_that_helps(method, limit_gb, fix):
    # Llama-3.2-1B's layers (32 heads, e = 2048): 0.554 GB each, twice that with pinv.
    forms = [NamedForm(i, f"l{i}", _Form(32, 2048)) for i in range(4)]
    with pytest.raises(ValueError, match=fix):
        check_statistics_memory(forms, list(range(4)), None, method, limit_gb)


def test_layers_of_event_take_turns():
    assert [layers_of_event([0, 1, 2], 2, n) for n in range(3)] == [[0, 1], [2, 0], [1, 2]]
    assert layers_of_event([0, 1, 2], None, 5) == [0, 1, 2]


def test_each_event_grows_its_own_layers(tmp_path, capsys):
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1, 2]), GrowthSettings(columns=1),
                                 StatisticsSettings(batches=2, layers_per_event=1, max_memory_gb=1.0))
    module = tiny_module(data)
    trainer(tmp_path, [grow], max_epochs=3).fit(module, data)
    assert [e["d_head"] for e in grow.history] == [[3, 2], [3, 3]]
    assert "growth statistics: " in capsys.readouterr().out


def test_the_automatic_schedule_is_told_how_many_layers_fit_in_the_plural():
    forms = [NamedForm(i, f"l{i}", _Form(32, 2048)) for i in range(16)]  # 1.11 GB per layer, both halves
    with pytest.raises(ValueError) as refused:
        check_statistics_memory(forms, list(range(16)), None, "natural", 2.5, halves=True)
    assert str(refused.value).endswith(": grow at most 2 layers with growth.layers (the automatic schedule offers every "
                                       "growing layer at each check), or raise statistics.max_memory_gb")


@pytest.mark.parametrize("halves, limit_gb, fix", [
    # Both halves: 2.18 GB a layer with pinv, 1.11 GB without its second sum.
    (True, 1.5, "one layer alone needs 2.18 GB with pinv's second sum: use method natural or gradient (1.11 GB per "
                "layer), or raise statistics.max_memory_gb"),
    # Exactly the bytes of one layer without pinv's second sum (553,648,128 B): that fits.
    (False, 0.553648128, "one layer alone needs 1.09 GB with pinv's second sum: use method natural or gradient "
                         "(0.554 GB per layer), or raise statistics.max_memory_gb"),
])
def test_pinv_is_told_what_the_other_methods_need_with_the_same_halves(halves, limit_gb, fix):
    forms = [NamedForm(i, f"l{i}", _Form(32, 2048)) for i in range(4)]
    with pytest.raises(ValueError) as refused:
        check_statistics_memory(forms, list(range(4)), None, "pinv", limit_gb, halves=halves)
    assert str(refused.value).endswith(f": {fix}")


def llama_1b_units():
    """Llama-3.2-1B's attention without building it: 16 layers, 32 heads, 8 KV heads, hidden 2048 (head 64)."""
    return ([NamedForm(i, f"q{i}", _Form(32, 2048, kv=8)) for i in range(16)]
            + [NamedForm(i, f"v{i}", _Values(32, 2048, kv=8)) for i in range(16)])


def test_memory_line_counts_sketch():
    # Float32, k 24, l 36, k_c 24, per layer:
    #   full:   query/key 2048²·(1 + 32) = 138,412,032, values 32·2048·(2048 + 2048) = 268,435,456 numbers;
    #   sketch: query/key 2048·(2048 + 32·24 + 8·36) = 6,356,992, values 8·2048·24 + 32·2048·36 + 32·2048·24 =
    #           4,325,376 numbers;
    #   its test matrices: query/key Ω 2048·24 + Ψ 32·2048·36 = 2,408,448, values Ω 32·2048·24 + Ψ 2048·36 +
    #           Ω_c 2048·24 = 1,695,744 numbers (38 % more than the sketch's sums).
    # Over 16 layers: full 8.86 GB + 17.2 GB = 26 GB, sketch 0.561 GB + 0.385 GB = 0.946 GB: 1/16, 1/45, both 1/28.
    forms, sketch = llama_1b_units(), SketchSize.of(24)
    full_qk, full_v, sketch_qk, sketch_v = (16 * 4 * n for n in (138_412_032, 268_435_456, 6_356_992 + 2_408_448,
                                                                 4_325_376 + 1_695_744))
    assert [round(b / 1e9, 3) for b in (full_qk, full_v, sketch_qk, sketch_v)] == [8.858, 17.18, 0.561, 0.385]
    assert round((full_qk + full_v) / (sketch_qk + sketch_v)) == 28
    assert [unit.tests_numel(sketch) for unit in (forms[0].form, forms[16].form)] == [2_408_448, 1_695_744]
    line = check_statistics_memory(forms, list(range(16)), None, "natural", None, sketch=sketch)
    assert line == ("growth statistics: 0.946 GB per rank (16 of 16 layers per window; query/key e′ × (e′ + 32k + 8l) "
                    "= 2048 × 3104, test matrices e′ × (k + 32l) = 2048 × 1176; values e′ × (8k + 32k_c) + e × 32l = "
                    "2048 × 960 + 2048 × 1152, test matrices e × 32k + e′ × (l + k_c) = 2048 × 768 + 2048 × 60; "
                    "sketch k = 24, l = 36, k_c = 24: 1/28 of the full statistics' 26 GB; 4 B each)")
    query_key = check_statistics_memory(forms[:16], list(range(16)), None, "natural", None, sketch=sketch)
    assert "; sketch k = 24, l = 36, k_c = 24: 1/16 of the full statistics' 8.86 GB; " in query_key
    values = check_statistics_memory(forms[16:], list(range(16)), None, "natural", None, sketch=sketch)
    assert "; sketch k = 24, l = 36, k_c = 24: 1/45 of the full statistics' 17.2 GB; " in values
    # AutoSchedule's half of the window keeps its own sums but shares the whole's test matrices: 16 layers ×
    # 4 B × (2·(6,356,992 + 4,325,376) + 2,408,448 + 1,695,744) = 1,630,011,392 B.
    halves = check_statistics_memory(forms, list(range(16)), None, "natural", None, halves=True, sketch=sketch)
    assert halves.startswith("growth statistics: 1.63 GB per rank ")
    assert halves.endswith("; twice: the automatic schedule keeps each half of the window (the sums; their test "
                           "matrices once); 4 B each)")
    small = check_statistics_memory([NamedForm(0, "q", _Form(2, 16))], [0], None, "natural", None, sketch=sketch)
    assert "sketch k = 24, l = 36, k_c = 24: no less than the full statistics' 0.00307 MB" in small


def test_memory_fix_proposes_sketch():
    # The full statistics of both sides, 26 GB, over 4 GB; the sketch with its test matrices, 0.946 GB, fits; so would
    # 2 layers per event (1.63 GB a layer).
    forms, sketch = llama_1b_units(), SketchSize.of(24)
    with pytest.raises(ValueError) as refused:
        check_statistics_memory(forms, list(range(16)), None, "natural", 4.0, offer=sketch)
    assert str(refused.value).endswith(
        "exceed statistics.max_memory_gb=4.0: set statistics.sketch: on (with k = 24 the window needs 0.946 GB per "
        "rank; docs/design.md, sketched statistics), or without the sketch: set statistics.layers_per_event: 2 (each "
        "event then grows 2 layers in turn, each from its own window)")
    # A sketch that does not fit either is not proposed.
    with pytest.raises(ValueError) as refused:
        check_statistics_memory(forms, list(range(16)), None, "natural", 0.5, offer=sketch)
    assert str(refused.value).endswith("exceed statistics.max_memory_gb=0.5: one layer alone needs 1.63 GB: raise "
                                       "statistics.max_memory_gb above that")
    # Under the sketch, the fix is counted in the sketch's bytes, test matrices included: 59.1 MB a layer.
    with pytest.raises(ValueError) as refused:
        check_statistics_memory(forms, list(range(16)), None, "natural", 0.5, sketch=sketch)
    assert str(refused.value).endswith("exceed statistics.max_memory_gb=0.5: set statistics.layers_per_event: 8 (each "
                                       "event then grows 8 layers in turn, each from its own window)")


def test_auto_prints_its_choice_and_the_events_record_the_statistics_they_grew_from(tmp_path, capsys):
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), GrowthSettings(columns=1), StatisticsSettings(batches=2, sketch="auto"))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)
    # Kept in full by the width rule (QKForm captures a sketch, so that is not the reason).
    assert re.search(r"^growth statistics kept in full \(auto: e′ = 16 < 2·\(k \+ l\) = 120 on cpu\)$",
                     capsys.readouterr().out, re.MULTILINE)
    assert grow.window.sketch is None and "sketch" not in grow.history[0] and not grow.history[0]["skipped"]


def test_sketch_on_prints_its_sizes_the_ridge_it_takes_and_the_memory_it_holds(tmp_path, capsys):
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), GrowthSettings(grow="both", columns=1, value_columns=1),
                                 StatisticsSettings(batches=2, sketch="on", sketch_size=4))
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)
    lines = capsys.readouterr().out.splitlines()
    # Two layers of 2 heads, e′ = e = 16, k 4, l 6, k_c 4, per layer: query/key sums 16·36 and test matrices 16·16,
    # values 16·16 + 16·12 and 16·8 + 16·10, 1568 numbers; the full statistics 16²·3 + 2·16·32 = 1792.
    assert lines[:2] == [
        "growth statistics sketched: k = 4, l = 6, k_c = 4 per head (statistics.sketch: on); method natural means "
        "ridge 1.0 under the sketch (growth.ridge null; docs/design.md, sketched statistics)",
        f"growth statistics: {2 * 4 * 1568 / 1e6:.3g} MB per rank (2 of 2 layers per window; query/key e′ × (e′ + 2k "
        "+ 2l) = 16 × 36, test matrices e′ × (k + 2l) = 16 × 16; values e′ × (2k + 2k_c) + e × 2l = 16 × 16 + 16 × "
        "12, test matrices e × 2k + e′ × (l + k_c) = 16 × 8 + 16 × 10; sketch k = 4, l = 6, k_c = 4: 1/1.1 of the "
        f"full statistics' {2 * 4 * 1792 / 1e6:.3g} MB; 4 B each)"]
    (event,) = grow.history
    assert event["sketch"] == {"k": 4, "l": 6, "k_c": 4} and not event["skipped"]
    assert grow.settings.ridge == 1.0  # what the growth maths were handed


def test_a_later_setup_resolves_the_ridge_from_the_users_setting_again(tmp_path):
    # The ridge 1.0 that natural takes under the sketch belongs to that run: the same callback fitting again with the
    # full statistics hands the growth maths the user's null (the pseudo-inverse), not the last run's 1.0.
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), GrowthSettings(columns=1), StatisticsSettings(batches=2, sketch="on",
                                                                                               sketch_size=4))
    trainer(tmp_path / "sketched", [grow], max_epochs=2).fit(tiny_module(data), data)
    assert grow.settings.ridge == 1.0
    grow.statistics = StatisticsSettings(batches=2)
    grow.history, grow.window.sketch = [], None
    trainer(tmp_path / "full", [grow], max_epochs=2).fit(tiny_module(data), data)
    assert grow.settings.ridge is None and "sketch" not in grow.history[0]
