"""Statistics memory: the estimate printed at setup, its bound, and layers growing in turn from their own windows."""

import pytest
import torch

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings
from lit_growattn.growth import FormShape
from lit_growattn.growth.value import ValueShape
from lit_growattn.contract import NamedForm
from lit_growattn.callback.memory import check_statistics_memory, layers_of_event

from callback_helpers import recall_data, tiny_module, trainer


class _Form(FormShape):
    def __init__(self, h, e_in):
        self.w_q = torch.zeros(h, e_in, 1)


class _Values(ValueShape):
    def __init__(self, h, e_in, e_out=None):
        self.w_v, self.w_o = torch.zeros(h, e_in, 1), torch.zeros(h, 1, e_in if e_out is None else e_out)


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
