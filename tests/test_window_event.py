"""StatsWindow (the statistics window) and GrowthEvent.run (one growth) on hand-built forms, float64, no Lightning:
the sums a window folds against FormStats fed directly, a resumed window against an uninterrupted one, and the
growth an event installs against the plan it was chosen from."""

import dataclasses
import time
import zlib
from types import SimpleNamespace
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from lit_growattn import growth
from lit_growattn.growth import allocation
from lit_growattn.attention.qk import QKForm
from lit_growattn.callback.budget import offers
from lit_growattn.callback.event import GrowthEvent, StepChoice, Stopwatch, choose_step_size, plan_growth
from lit_growattn.callback.window import StatsWindow, capture_mode, fold_captured, layers_in_turn, sketch_seed
from lit_growattn.growth import FormStats, installed
from lit_growattn.callback.settings import GrowthSettings, StatisticsSettings, StepSearch
from lit_growattn import AtSteps, GrowAttentionCallback
from test_growth import F64, Problem

E, H, D, DV, S = 6, 2, 2, 3, 9
WITH = {"batches": 4, "accumulate_grad_batches": 1}  # the settings a window is gathered with


def make_forms(dtype=F64):
    torch.manual_seed(0)
    return [(layer, f"layer{layer}", QKForm(E, H, D).to(dtype)) for layer in range(2)]


def micro_batch(k, dtype=F64):
    g = torch.Generator().manual_seed(100 + k)
    return (F.layer_norm(torch.randn(2, S, E, generator=g, dtype=dtype), (E,)),
            torch.randn(2, H, S, DV, generator=g, dtype=dtype))


def backward(forms, k):
    x, v = micro_batch(k, forms[0][2].w_q.dtype)
    sum(form.attend(x, v).sin().mean() for _, _, form in forms).backward()


def captured_reference(k, layer, weight):
    """The pairs of micro-batch `k` for form `layer`, captured on a fresh copy outside any window."""
    form = make_forms()[layer][2]
    form.capture = "explicit"
    backward([(layer, "", form)], k)
    return [(xa, gx, weight) for xa, gx in form.take_captured()]


def reference_stats(pairs, method="gradient"):
    st = FormStats.empty_like(make_forms()[0][2], method, dtype=F64)
    for xa, gx, w in pairs:
        st.update(xa, gx, w)
    return st


def window_step(window, forms, k, active, weight=0.5, event="e1", keep=None, grad_scale=None):
    window.begin_step(event, forms, active, "explicit", WITH, keep=keep)
    backward(forms, k)
    fold_captured(forms, window.stats, weight, grad_scale, window.half)
    window.end_step(forms)


def assert_stats_equal(a, b):
    for key in ("c_sum", "n_sum", "instances", "weight"):
        torch.testing.assert_close(getattr(a, key), getattr(b, key), rtol=1e-12, atol=1e-14)


class Ranks:
    """Two ranks: the other one holds `other` times this rank's values (so sums are (1 + other)×) and its kept
    batches are this rank's + 100."""

    def __init__(self, other=2.0):
        self.other, self.reduced = other, 0

    def reduce(self, t, reduce_op):
        assert reduce_op == "sum"
        self.reduced += 1
        return t * (1 + self.other)

    def all_gather(self, t):
        return torch.stack([t, t * self.other if t.is_floating_point() else t + 100])


def test_capture_mode_and_round_robin():
    assert capture_mode("auto", torch.device("cpu")) == "explicit"
    assert capture_mode("auto", torch.device("cuda")) == "extend"
    assert capture_mode("extend", torch.device("cpu")) == "extend"
    assert [layers_in_turn([3, 5, 7], 2, step) for step in range(3)] == [{3, 5}, {7, 3}, {5, 7}]
    assert layers_in_turn([3, 5, 7], 1, 4) == {5}


def test_window_sums_the_active_layers_weighted_and_turns_capture_off():
    forms, window = make_forms(), StatsWindow("gradient")
    window.begin_step("e1", forms, {1}, "explicit", WITH)
    assert [f.capture for _, _, f in forms] == [None, "explicit"]
    assert window.event == "e1" and window.gathered_with == WITH and window.stats[0].n_sum.dtype == F64
    backward(forms, 0)
    fold_captured(forms, window.stats, 0.25, None)
    window.end_step(forms)
    assert [f.capture for _, _, f in forms] == [None, None]
    window_step(window, forms, 1, {0, 1}, weight=0.75)
    assert_stats_equal(window.stats[0], reference_stats(captured_reference(1, 0, 0.75)))
    assert_stats_equal(window.stats[1], reference_stats(captured_reference(0, 1, 0.25) + captured_reference(1, 1, 0.75)))
    assert float(window.stats[1].weight) == pytest.approx(0.25 + 0.75)  # each micro-batch's share, once
    assert window.half is None and window.kept == [] and not window.reduced


def test_end_step_drops_what_a_skipped_backward_left():
    forms, window = make_forms(), StatsWindow("gradient")
    window.begin_step("e1", forms, {0}, "explicit", WITH)
    backward(forms, 0)  # no fold_captured: the optimizer step was skipped
    window.end_step(forms)
    assert forms[0][2].take_captured() == [] and float(window.stats[0].weight) == 0


def test_float32_forms_get_float32_sums_and_pinv_keeps_its_sum():
    window = StatsWindow("pinv")
    window.begin_step("e1", make_forms(torch.float32), {0}, "explicit", WITH)
    assert window.stats[0].n_sum.dtype == torch.float32 and window.stats[0].pinv_sum is not None


def test_halves_take_every_other_micro_batch_of_each_form():
    forms, window = make_forms(), StatsWindow("gradient", halves=True)
    for k in range(4):
        window_step(window, forms, k, {0, 1}, weight=0.25)
    half, every = window.half, window.stats
    for layer in range(2):
        assert_stats_equal(half[layer], reference_stats(captured_reference(0, layer, 0.25) + captured_reference(2, layer, 0.25)))
        assert_stats_equal(every[layer], reference_stats([p for k in range(4) for p in captured_reference(k, layer, 0.25)]))
    # Round-robin: layer 1 captured on steps 0, 1 and 3 only; its half takes steps 0 and 3 (while at most half).
    window = StatsWindow("gradient", halves=True)
    for k, active in enumerate([{0, 1}, {0, 1}, {0}, {1}]):
        window_step(window, forms, k, active, weight=0.25)
    assert_stats_equal(window.half[1], reference_stats(captured_reference(0, 1, 0.25) + captured_reference(3, 1, 0.25)))
    assert_stats_equal(window.half[0], reference_stats(captured_reference(0, 0, 0.25) + captured_reference(2, 0, 0.25)))


def test_fold_divides_out_the_grad_scale_and_handles_non_finite_pairs():
    forms = make_forms()
    window = StatsWindow("gradient")
    window.begin_step("e1", forms, {0}, "explicit", WITH)
    x, v = micro_batch(0)
    (1024.0 * forms[0][2].attend(x, v).sin().mean()).backward()
    fold_captured(forms, window.stats, 1.0, 1024.0)  # layer 1 captured nothing: its sums stay empty
    assert_stats_equal(window.stats[0], reference_stats(captured_reference(0, 0, 1.0)))

    def fold_nan(grad_scale, halves):
        window = StatsWindow("gradient", halves=halves)
        window.begin_step("e1", forms, {0}, "explicit", WITH)
        forms[0][2].attend(x, v).mean().backward()
        pairs = forms[0][2].take_captured()
        forms[0][2].captured = [(xa, gx * float("nan")) for xa, gx in pairs]
        fold_captured(forms, window.stats, 1.0, grad_scale, window.half)
        return window

    poisoned = fold_nan(None, True)
    assert poisoned.stats[0].weight.isnan().all() and poisoned.half[0].weight.isnan().all()
    dropped = fold_nan(1024.0, False)
    assert float(dropped.stats[0].weight) == 0 and float(dropped.stats[0].n_sum.abs().sum()) == 0


class Captured:
    """A unit whose backward captured `tuples` (what `take_captured` hands the window)."""

    def __init__(self, tuples):
        self.tuples = tuples

    def take_captured(self):
        taken, self.tuples = self.tuples, []
        return taken


SKETCH = growth.SketchSize.of(3)
# Each sums' kind with the shapes of its captured tuple (b 2, s 5, H 4, KV 2, e′ 7, e 6): update's arguments.
SUMS_AND_CAPTURES = {
    "full": (lambda: FormStats.empty_like(QKForm(E, H, D).to(F64), "gradient", dtype=F64),
             [(2, 5, E), (2, H, 5, E)]),
    "query/key sketch": (lambda: growth.SketchFormStats(4, 2, 7, SKETCH, seed=3, dtype=F64),
                         [(2, 5, 7), (2, 4, 5, SKETCH.k), (2, 2, 5, SKETCH.l)]),
    "value sketch": (lambda: growth.SketchValueStats(4, 2, 7, 6, SKETCH, seed=3, dtype=F64),
                     [(2, 5, 7), (2, 2, 5, SKETCH.k), (2, 4, 5, SKETCH.l), (2, 5, 6), (2, 4, 5, SKETCH.k_c)]),
}


@pytest.mark.parametrize("kind", SUMS_AND_CAPTURES)
def test_fold_divides_exactly_the_gradient_parts_by_the_scale(kind):
    # A scale of 2¹⁰ multiplies the parts that carry the loss's gradient, and dividing it out is exact in floating
    # point: the folded sums equal, bit for bit, those of the unscaled tuple. Dividing any other part (the value
    # sketch's A_jX′Ψ or its Nyström E_C gradient), or only the second (as for the full pairs), would not.
    make, shapes = SUMS_AND_CAPTURES[kind]
    g = torch.Generator().manual_seed(7)
    captured = tuple(torch.randn(shape, generator=g, dtype=F64) for shape in shapes)
    folded, direct = make(), make()
    scaled = tuple(t * 2.0**10 if i in folded.gradient_parts else t for i, t in enumerate(captured))
    fold_captured([(0, "unit", Captured([scaled]))], [folded], 0.5, 2.0**10)
    direct.update(*captured, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(folded.tensors(), direct.tensors(), strict=True))
    assert float(folded.weight) == 0.5


def test_a_sketched_window_hands_each_capturing_unit_its_test_matrices_for_the_step_only():
    forms, size = make_forms(), growth.SketchSize.of(2)
    window = StatsWindow("gradient", halves=True, sketch=size)
    window.begin_step("step 8", forms, {1}, "explicit", WITH)
    for (_, name, _), whole, half in zip(forms, window.stats, window.half):
        assert isinstance(whole, growth.SketchFormStats) and whole.size == size and whole.y_sum.dtype == F64
        # The half's test matrices are the whole's (drawn once, held once), so that they subtract; the seed is
        # stable across processes.
        assert half.tests is whole.tests and whole.tests.seed == zlib.crc32(f"step 8/{name}".encode())
    assert window.stats[0].tests.seed != window.stats[1].tests.seed != sketch_seed("step 16", "layer1")
    assert forms[0][2].sketch is None and forms[1][2].sketch is window.stats[1].tests
    window.end_step(forms)
    assert [form.sketch for _, _, form in forms] == [None, None]


def test_a_sketched_window_resumes_with_its_test_matrices():
    forms, size = make_forms(), growth.SketchSize.of(2)
    window = StatsWindow("gradient", halves=True, sketch=size)
    window.begin_step("step 8", forms, {0, 1}, "explicit", WITH)
    g = torch.Generator().manual_seed(1)
    for st in window._sums():  # noqa: SLF001
        e = st.c_sum.shape[0]
        st.update(torch.randn(2, 5, e, generator=g, dtype=F64), torch.randn(2, H, 5, size.k, generator=g, dtype=F64),
                  torch.randn(2, H, 5, size.l, generator=g, dtype=F64))
    window.end_step(forms)
    resumed = StatsWindow("gradient", halves=True, sketch=size)
    resumed.load_state_dict(window.state_dict(Ranks(), 1), rank=0, world=1)
    for got, want in zip(resumed._sums(), window._sums(), strict=True):  # noqa: SLF001
        assert isinstance(got, growth.SketchFormStats) and got.tests.checksum == want.tests.checksum
        assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors(), strict=True))
    # Restored, and moved to a device, the half still holds the whole's test matrices, not a copy of its own.
    resumed.to(torch.device("cpu"))
    assert all(half.tests is whole.tests for whole, half in zip(resumed.stats, resumed.half, strict=True))


def test_a_window_resumed_with_another_sketch_is_refused():
    # The resolved setting is saved: a window begun under auto (which chose k 24) resumes under on with k 24.
    trainer = SimpleNamespace(accumulate_grad_batches=1)

    def gathered(statistics, sketch):
        callback = GrowAttentionCallback(AtSteps([8]), statistics=statistics)
        callback.window.sketch = sketch  # as `setup` resolves it
        return callback._window_settings(trainer)  # noqa: SLF001

    began = gathered(StatisticsSettings(sketch="auto"), growth.SketchSize.of(24))
    assert (began["statistics.sketch"], began["statistics.sketch_size"]) == ("on", 24)
    window = StatsWindow("gradient", sketch=growth.SketchSize.of(24))
    window.begin_step("step 8", make_forms(), {0}, "explicit", began)
    window.check_resumed(gathered(StatisticsSettings(sketch="on", sketch_size=24), growth.SketchSize.of(24)))
    with pytest.raises(ValueError) as refused:
        window.check_resumed(gathered(StatisticsSettings(), None))
    assert str(refused.value) == (
        "this checkpoint was taken inside the statistics window of growth 'step 8', which began with other settings: "
        "statistics.sketch=on in the checkpoint but off now, statistics.sketch_size=24 in the checkpoint but None now. "
        "Going on would mix two windows' statistics and choose another step size than the uninterrupted run: resume "
        "with statistics.sketch=on and statistics.sketch_size=24, or from a checkpoint taken outside the window "
        "(before it began, or after the growth)")
    with pytest.raises(ValueError, match=r"other settings: statistics.sketch_size=24 in the checkpoint but 32 now\. "):
        window.check_resumed(gathered(StatisticsSettings(sketch="on", sketch_size=32), growth.SketchSize.of(32)))


def test_a_window_saved_before_the_sketch_settings_counts_as_full_statistics():
    # Checkpoints of a version without statistics.sketch kept the statistics in full: they resume under off (what the
    # callback passes then: off, None) and are refused under on.
    window = StatsWindow("gradient")
    window.begin_step("step 8", make_forms(), {0}, "explicit", dict(WITH))
    window.check_resumed({**WITH, "statistics.sketch": "off", "statistics.sketch_size": None})
    with pytest.raises(ValueError, match=r"other settings: statistics.sketch=off in the checkpoint but on now, "
                                         r"statistics.sketch_size=None in the checkpoint but 24 now\. "):
        window.check_resumed({**WITH, "statistics.sketch": "on", "statistics.sketch_size": 24})
    window.check_resumed(dict(WITH))  # settings that do not name them: nothing to compare


def test_kept_batches_are_clones_and_another_event_starts_afresh():
    forms, window = make_forms(), StatsWindow("gradient")
    batch = {"ids": torch.arange(6).view(2, 3), "note": "x"}
    window_step(window, forms, 0, {0}, keep=batch)
    batch["ids"].add_(1)
    assert torch.equal(window.kept[0]["ids"], torch.arange(6).view(2, 3)) and window.kept[0]["note"] == "x"
    window_step(window, forms, 1, {0}, keep=batch)  # the same event: kept batches and sums go on
    assert len(window.kept) == 2 and float(window.stats[0].weight) == pytest.approx(1.0)
    window.begin_step("e2", forms, {1}, "explicit", {"batches": 9})
    assert window.event == "e2" and window.kept == [] and window.gathered_with == {"batches": 9}
    assert float(window.stats[0].weight) == 0 and float(window.stats[1].weight) == 0
    window.end_step(forms)
    window.clear()
    assert (window.event, window.stats, window.half, window.kept, window.reduced, window.gathered_with) == (
        None, None, None, [], False, None)


def test_close_sums_over_ranks_once_and_gathers_kept_batches_batch_major():
    forms, window = make_forms(), StatsWindow("gradient", halves=True)
    for k in range(2):
        window_step(window, forms, k, {0, 1}, keep={"ids": torch.tensor([k])})
    before = [FormStats.from_state_dict(s.state_dict()) for s in window.stats + window.half]
    ranks = Ranks(other=2.0)
    window.close(ranks, 2, torch.device("cpu"))
    assert ranks.reduced == 1 and window.reduced
    assert len(window.stats) == len(window.half) == 2
    for got, want in zip(window.stats + window.half, before):
        torch.testing.assert_close(got.n_sum, 3 * want.n_sum, rtol=1e-12, atol=0)
        torch.testing.assert_close(got.weight, 3 * want.weight, rtol=1e-12, atol=0)
    assert [int(b["ids"]) for b in window.kept] == [0, 100, 1, 101]
    one = StatsWindow("gradient")
    window_step(one, forms, 0, {0}, keep={"ids": torch.tensor([7])})
    one.close(Ranks(other=0.0), 1, torch.device("cpu"))
    assert [int(b["ids"]) for b in one.kept] == [7] and one.half is None and len(one.stats) == 2


@pytest.mark.parametrize("halves", [False, True])
def test_a_resumed_window_equals_an_uninterrupted_one(halves):
    forms = make_forms()
    whole, first = StatsWindow("gradient", halves), StatsWindow("gradient", halves)
    for k in range(4):
        window_step(whole, forms, k, {k % 2}, keep={"ids": torch.tensor([k])})
    for k in range(2):
        window_step(first, forms, k, {k % 2}, keep={"ids": torch.tensor([k])})
    state = first.state_dict(Ranks(), 1)
    assert state["event"] == "e1" and not state["per_rank"] and state["halves"] == halves
    assert state["gathered_with"] == WITH and state["stats"]["flat"].device.type == "cpu"
    resumed = StatsWindow("gradient", halves)
    resumed.load_state_dict(state, rank=0, world=1)
    resumed.check_resumed(WITH)
    for k in range(2, 4):
        window_step(resumed, forms, k, {k % 2}, keep={"ids": torch.tensor([k])})
    for a, b in zip(resumed._sums(), whole._sums()):  # noqa: SLF001
        assert_stats_equal(a, b)
    assert (resumed.half is None) == (not halves) and resumed.gathered_with == WITH
    assert [int(b["ids"]) for b in resumed.kept] == [0, 1, 2, 3]
    resumed.close(Ranks(), 1, torch.device("cpu"))
    again = StatsWindow("gradient", halves)
    again.load_state_dict(resumed.state_dict(Ranks(), 1), rank=0, world=1)
    assert again.reduced and len(again.stats) == 2
    again.check_resumed({"batches": 1})  # a closed window holds no partial sums: nothing to refuse


def test_a_window_saved_by_two_ranks_resumes_each_rank_with_its_own_sums():
    forms, window = make_forms(), StatsWindow("gradient")
    for k in range(2):
        window_step(window, forms, k, {0, 1}, keep={"ids": torch.tensor([k])})
    state = window.state_dict(Ranks(other=2.0), 2)
    assert state["per_rank"] and state["world_size"] == 2 and state["stats"]["flat"].shape[0] == 2
    for rank, factor in [(0, 1.0), (1, 2.0)]:
        resumed = StatsWindow("gradient")
        resumed.load_state_dict(state, rank=rank, world=2)
        for got, want in zip(resumed.stats, window.stats):
            torch.testing.assert_close(got.n_sum, factor * want.n_sum, rtol=1e-12, atol=0)
        assert [int(b["ids"]) for b in resumed.kept] == [k + 100 * rank for k in range(2)]
    with pytest.raises(RuntimeError, match=r"^this checkpoint was taken inside the statistics window of growth "
                                           r"'e1' by 2 ranks, each holding its own partial sums, and cannot be split over 3: resume it with 2 ranks "
                                           r"\(devices × num_nodes\), or from a checkpoint taken outside the window$"):
        StatsWindow("gradient").load_state_dict(state, rank=0, world=3)


def test_a_window_of_the_other_schedule_kind_is_dropped():
    forms, window = make_forms(), StatsWindow("gradient", halves=True)
    window_step(window, forms, 0, {0})
    other = StatsWindow("gradient")
    other.kept = ["stale"]
    other.load_state_dict(window.state_dict(Ranks(), 1), rank=0, world=1)
    assert other.stats is None and other.event is None and other.kept == []
    empty = StatsWindow("gradient")
    empty.load_state_dict(StatsWindow("gradient").state_dict(Ranks(), 2), rank=0, world=2)
    assert empty.stats is None and empty.event is None


def test_a_window_saved_by_an_earlier_version_resumes_a_fixed_schedule():
    forms, window = make_forms(), StatsWindow("gradient")
    window_step(window, forms, 0, {0, 1}, keep={"ids": torch.tensor([3])})
    state = window.state_dict(Ranks(), 1)
    del state["halves"], state["gathered_with"]  # neither was saved before the automatic schedule
    resumed = StatsWindow("gradient")
    resumed.load_state_dict(state, rank=0, world=1)
    for got, want in zip(resumed.stats, window.stats):
        assert_stats_equal(got, want)
    assert resumed.event == "e1" and resumed.half is None and resumed.gathered_with is None
    assert [int(b["ids"]) for b in resumed.kept] == [3]
    automatic = StatsWindow("gradient", halves=True)  # its sums hold no halves: that event is skipped
    automatic.load_state_dict(state, rank=0, world=1)
    assert automatic.stats is None and automatic.event is None


def test_a_one_form_window_keeps_pinv_sums_in_both_halves():
    forms, window = make_forms()[:1], StatsWindow("pinv", halves=True)
    for k in range(2):
        window_step(window, forms, k, {0}, weight=0.5)
    pairs = [captured_reference(k, 0, 0.5) for k in range(2)]
    for got, want in [(window.stats[0], reference_stats(pairs[0] + pairs[1], "pinv")),
                      (window.half[0], reference_stats(pairs[0], "pinv"))]:
        assert_stats_equal(got, want)
        torch.testing.assert_close(got.pinv_sum, want.pinv_sum, rtol=1e-12, atol=1e-14)


def test_a_window_resumed_under_other_settings_is_refused():
    forms, window = make_forms(), StatsWindow("gradient")
    window.check_resumed({"batches": 1})  # no window open
    window_step(window, forms, 0, {0})
    window.check_resumed(dict(WITH))
    with pytest.raises(ValueError, match=r"^this checkpoint was taken inside the statistics window of growth 'e1', "
                                         r"which began with other settings: batches=4 in the checkpoint but 2 now\. "
                                         r"Going on would mix two windows' statistics and choose another step size "
                                         r"than the uninterrupted run: resume with batches=4, or from a checkpoint "
                                         r"taken outside the window \(before it began, or after the growth\)$"):
        window.check_resumed({**WITH, "batches": 2})
    with pytest.raises(ValueError, match="batches=4 in the checkpoint but 2 now, accumulate_grad_batches=1 in the "
                                         "checkpoint but None now.*resume with batches=4 and accumulate_grad_batches=1"):
        window.check_resumed({"batches": 2})
    window.gathered_with = None  # a checkpoint of an earlier version: nothing to compare
    window.check_resumed({"batches": 2})


# -- GrowthEvent.run ---------------------------------------------------------------------------------------------

def rated_by(p, calls=None):
    def loss_of(candidates):
        if calls is not None:
            calls.append(candidates)
        losses = []
        for candidate in candidates:
            with installed({"form": p.form}, candidate), torch.no_grad():
                losses.append(p.loss())
        return torch.stack(losses)
    return loss_of


def test_the_event_installs_the_chosen_growth_and_records_what_it_did():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    settings, search = GrowthSettings(columns=2, method="natural"), StepSearch(alphas=[0.0, 0.25, 1.0])
    loss_before = p.loss().item()
    plan = plan_growth([(0, "form", p.form)], [stats], settings, search.line_search, False, seed=3)
    expected = {a: plan.grow("form", a) for a in (0.25, 1.0)}
    rated = {a: float(rated_by(p)([{"form": g}])[0]) for a, g in expected.items()}
    best = min(rated, key=rated.get)
    assert rated[best] < loss_before  # the test needs a step that wins
    installs, broadcasts = [], []

    def broadcast(obj):
        broadcasts.append(obj)
        return obj

    event = GrowthEvent(settings, search, loss_of=rated_by(p), install=installs.append, broadcast=broadcast, terms=1)
    record, spectra = event.run([(0, "form", p.form)], [stats], seed=3)
    assert record["alpha"] == best
    assert record["loss_before"] == pytest.approx(loss_before, rel=1e-12)
    assert record["loss_after"] == pytest.approx(rated[best], rel=1e-12)
    assert record["realised_decrease"] == pytest.approx(loss_before - rated[best], rel=1e-9)
    [grown] = installs
    assert broadcasts == [grown] and list(grown) == ["form"]
    torch.testing.assert_close(grown["form"].w_q, expected[best].w_q, rtol=0, atol=0)
    torch.testing.assert_close(grown["form"].w_k, expected[best].w_k, rtol=0, atol=0)
    assert grown["form"].w_q.shape[-1] == 4 and grown["form"].w_q.device.type == "cpu"
    assert record["predicted_decrease"] == pytest.approx(float(expected[best].predicted_decrease), rel=1e-12)
    assert record["sign_fallbacks"] == int(expected[best].fell_back)
    assert record["discarded_energy"] == {"form": pytest.approx(expected[best].discarded_energy.sum().item())}
    torch.testing.assert_close(spectra["form"], expected[best].spectrum)
    assert set(record["timings"]) == {"plan_s", "rating_s", "apply_s"} and "decisions" not in record
    assert record["seconds"] >= sum(record["timings"].values()) >= 0
    # The installed growth, re-measured on a fresh form, has the loss the event reported.
    fresh = p.installed(grown["form"])
    assert p.loss(fresh).item() == pytest.approx(record["loss_after"], rel=1e-12)


def test_when_no_step_wins_the_event_installs_alpha_zero_and_keeps_the_function():
    p = Problem(e=8, h=2, d=2)
    loss_before, installs = p.loss().item(), []

    def every_step_loses(candidates):
        return torch.tensor([loss_before if c is None else loss_before + 1 for c in candidates], dtype=F64)

    event = GrowthEvent(GrowthSettings(columns=2), StepSearch(alphas=[0.0, 0.5, 1.0]), loss_of=every_step_loses,
                        install=installs.append, broadcast=lambda obj: obj)
    record, _ = event.run([(0, "form", p.form)], [p.stats("natural")], seed=0)
    assert (record["alpha"], record["loss_before"], record["loss_after"]) == (0.0, loss_before, loss_before)
    grown = installs[0]["form"]
    assert grown.w_q.shape[-1] == 4 and float(record["predicted_decrease"]) == 0.0
    assert p.loss(p.installed(grown)).item() == pytest.approx(loss_before, rel=1e-12)


def test_the_event_installs_what_the_broadcast_hands_every_rank():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    rank0 = {"form": Problem(seed=1, e=8, h=2, d=2).form}
    installs = []

    def broadcast(obj):  # rank 0's tensors replace this rank's
        if isinstance(obj, dict):
            plan = plan_growth([(0, "form", rank0["form"])], [stats], GrowthSettings(columns=1), "low_rank", False, 0)
            return {"form": plan.grow("form", 0.0)}
        return obj

    event = GrowthEvent(GrowthSettings(columns=1), StepSearch(alphas=[0.0, 1.0]), loss_of=rated_by(p),
                        install=installs.append, broadcast=broadcast)
    record, _ = event.run([(0, "form", p.form)], [stats], seed=0)
    assert torch.equal(installs[0]["form"].w_q[..., :2], rank0["form"].w_q.detach())


def test_the_event_takes_a_custom_step_size_rule_and_the_seed_draws_baseline_columns():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    seen = []

    def always_half(plan, names, loss_of, search, method, terms):
        seen.append((names, method, terms))
        return StepChoice(0.5, 1.0, 0.25)

    installs = []
    event = GrowthEvent(GrowthSettings(columns=1), StepSearch(), loss_of=rated_by(p), install=installs.append,
                        broadcast=lambda obj: obj, choose_step_size=always_half, terms=7)
    record, _ = event.run([(0, "form", p.form)], [stats], seed=0)
    assert seen == [(["form"], "natural", 7)]
    assert (record["alpha"], record["loss_before"], record["loss_after"], record["realised_decrease"]) == (0.5, 1.0, 0.25, 0.75)
    plan = plan_growth([(0, "form", p.form)], [stats], GrowthSettings(columns=1), "low_rank", False, 0)
    torch.testing.assert_close(installs[0]["form"].w_q, plan.grow("form", 0.5).w_q, rtol=0, atol=0)

    def random_growth(seed):
        installs, calls = [], []
        event = GrowthEvent(GrowthSettings(columns=1, method="random"), StepSearch(), loss_of=rated_by(p, calls),
                            install=installs.append, broadcast=lambda obj: obj)
        record, _ = event.run([(0, "form", p.form)], [stats], seed=seed)
        assert record["alpha"] is None and [len(c) for c in calls] == [2] and calls[0][0] is None
        return installs[0]["form"]

    assert torch.equal(random_growth(5).w_k, random_growth(5).w_k)
    assert not torch.equal(random_growth(5).w_k, random_growth(6).w_k)


def test_plan_growth_sizes_by_columns_rank_threshold_or_later():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    forms = [(0, "form", p.form)]
    assert plan_growth(forms, [stats], GrowthSettings(columns=3), "low_rank", False, 0).grow("form", 0.0).w_q.shape[-1] == 5
    assert plan_growth(forms, [stats], GrowthSettings(columns=[2]), "low_rank", False, 0).grow("form", 0.0).w_q.shape[-1] == 4
    capped = plan_growth(forms, [stats], GrowthSettings(rank_threshold=1e-9, max_columns=1), "low_rank", False, 0)
    assert capped.grow("form", 0.0).w_q.shape[-1] == 3


THREE = [(0, "a", 0), (0, "b", 1), (1, "c", 2)]  # (layer, name, Problem seed): "a" and "b" share layer 0
LAYER_OF = {name: layer for layer, name, _ in THREE}


def plans_equal(x, y):
    """The same head sizes, and the same growth and full-rank trial of every form at α = 1/2."""
    if x.d_new != y.d_new:
        return False
    grown = [(p.grow(n, 0.5), p.trial(n, 0.5)) for p in (x, y) for n in x.d_new]
    half = len(grown) // 2
    return all(torch.equal(getattr(g, k), getattr(h, k)) for a, b in zip(grown[:half], grown[half:])
               for g, h in zip(a, b) for k in ("w_q", "w_k", "log_tau"))


@pytest.mark.parametrize("settings, line_search, matters, also", [
    # rank_threshold sizes each form from its spectrum (natural ranks at 0.3: a 3, b 4, c 3), max_columns caps it
    # per layer, and the forms of a layer take the largest.
    (GrowthSettings(rank_threshold=0.3, max_columns=[5, 2]), "low_rank",
     {"dynamic_rank": 0.3, "grow_by": {"a": 5, "b": 5, "c": 2}, "group_of": LAYER_OF.get}, {}),
    (GrowthSettings(columns=3, max_d_head=4), "low_rank", {"max_width": 4}, {"grow_by": 3}),
    (GrowthSettings(columns=2, ridge=0.5), "low_rank", {"ridge": 0.5}, {"grow_by": 2}),
    (GrowthSettings(columns=2, mode="replace", temperature="rescale", truncation="whitened"), "full_rank",
     {"mode": "replace", "temperature": "rescale", "truncation": "whitened", "line_search": "full_rank"},
     {"grow_by": 2}),
    # A baseline sized by another direction's spectrum (pinv ranks at 0.3: a 3, b 3, c 2; gradient's: 4, 2, 3).
    (GrowthSettings(method="random", size_by="pinv", rank_threshold=0.3), "low_rank", {"size_by": "pinv"},
     {"method": "random", "dynamic_rank": 0.3, "grow_by": None, "group_of": LAYER_OF.get}),
])
def test_plan_growth_hands_every_setting_to_the_plan(settings, line_search, matters, also):
    problems = {name: Problem(seed=seed, e=8, h=2, d=2) for _, name, seed in THREE}
    forms = [(layer, name, problems[name].form) for layer, name, _ in THREE]
    stats = [problems[name].stats("pinv") for _, name, _ in THREE]

    def build(**kwargs):
        return growth.GrowthPlan.build({name: form for _, name, form in forms}, stats,
                                       generator=torch.Generator().manual_seed(4), **kwargs)

    planned = plan_growth(forms, stats, settings, line_search, sized_later=False, seed=4)
    assert plans_equal(planned, build(**matters, **also))
    for setting in matters:  # each of them changes the plan: the comparison above can fail
        assert not plans_equal(planned, build(**{k: v for k, v in matters.items() if k != setting}, **also)), setting


def test_the_automatic_schedule_needs_the_halves():
    p = Problem(e=8, h=2, d=2)
    event = GrowthEvent(GrowthSettings(max_d_head=8), StepSearch(), loss_of=rated_by(p), install=lambda g: None,
                        broadcast=lambda obj: obj, allowance=4.0)
    with pytest.raises(ValueError, match="^the automatic schedule decides from the two halves of the window: pass `half`$"):
        event.run([(0, "form", p.form)], [p.stats("natural")], seed=0)


def test_non_finite_statistics_change_nothing():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    stats.n_sum[0, 0, 0] = float("nan")
    installs = []
    event = GrowthEvent(GrowthSettings(columns=1), StepSearch(), loss_of=rated_by(p), install=installs.append,
                        broadcast=lambda obj: obj)
    with pytest.raises(growth.NonFiniteStatistics):
        event.run([(0, "form", p.form)], [stats], seed=0)
    assert installs == [] and p.form.d_head == 2


def test_the_automatic_schedule_buys_from_the_halves_within_its_allowance():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    half = FormStats.from_state_dict({k: v / 2 for k, v in stats.state_dict().items()})
    for allowance, most in [(5.0, 2), (float("inf"), 6)]:  # a column costs the form's 2 heads; room for 6 below e = 8
        calls, installs = [], []
        event = GrowthEvent(GrowthSettings(max_d_head=8), StepSearch(alphas=[0.0, 1.0]), loss_of=rated_by(p, calls),
                            install=installs.append, broadcast=lambda obj: obj, allowance=allowance)
        record, _ = event.run([(0, "form", p.form)], [stats], seed=0, half=[half])
        [decision] = record["decisions"]
        assert record["allowance"] == allowance and decision["cost"] == 2
        # Equal halves fit no noise: every column that gains clears the floor, as many as the allowance pays for.
        assert decision["columns"] == min(most, decision["above_floor"]) > 0
        assert installs[0]["form"].w_q.shape[-1] == 2 + decision["columns"]
        assert calls[0][0] is None and record["loss_before"] == pytest.approx(p.loss().item(), rel=1e-12)


# -- choose_step_size and Stopwatch ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """What a CurvePlan hands out: how it is rated (`grow`: the truncated growth; `trial`: the full-rank
    candidate of line_search='full_rank'), for which form and step, and the first-order prediction."""
    kind: str
    name: str
    alpha: float
    predicted_decrease: float


class CurvePlan:
    """Stands in for a GrowthPlan of forms "a" and "b": `loss_of` rates a candidate growth at α on a known curve
    (float64), so that every step-size choice has an exact answer. `current`: the loss of the forms as they are
    (None); `predicted(α)`: the first-order predicted decrease, shared 1 : 3 between the two forms."""

    names = ["a", "b"]

    def __init__(self, grown, trial=None, current=None, predicted=lambda a: a):
        self.curves = {"grow": grown, "trial": trial or grown}
        self.current = grown(0.0) if current is None else current
        self.predicted, self.calls = predicted, []

    def grow(self, name, alpha):
        return self._candidate("grow", name, alpha)

    def trial(self, name, alpha):
        return self._candidate("trial", name, alpha)

    def _candidate(self, kind, name, alpha):
        return Candidate(kind, name, alpha, self.predicted(alpha) * {"a": 0.25, "b": 0.75}[name])

    def at(self, kind, alpha):
        """The candidate `loss_of` receives: every form at step α."""
        return {n: self._candidate(kind, n, alpha) for n in self.names}

    def loss_of(self, candidates):
        self.calls.append(candidates)
        losses = []
        for grown in candidates:
            if grown is None:
                losses.append(self.current)
                continue
            assert sorted(grown) == self.names and all(g.name == n for n, g in grown.items())
            [(kind, alpha)] = {(g.kind, g.alpha) for g in grown.values()}  # every form at the same step
            losses.append(self.curves[kind](alpha))
        return torch.tensor(losses, dtype=F64)

    def choose(self, search, method="natural", terms=1):
        return choose_step_size(self, self.names, self.loss_of, search, method, terms)


def test_the_grid_rates_each_positive_candidate_once_and_takes_the_best():
    plan = CurvePlan(lambda a: 1 - a + a**2)  # lowest at α = 1/2
    with pytest.warns(UserWarning, match=r"^alphas \[0\.25, 0\.5, 1\.0\] has no 0"):
        assert plan.choose(StepSearch(alphas=[1.0, 0.5, 0.25, 0.5])) == StepChoice(0.5, 1.0, 0.75)
    assert plan.calls == [[None, plan.at("trial", 0.25), plan.at("trial", 0.5), plan.at("trial", 1.0)]]
    # α = 0 keeps the function: its loss is the current one, measured once, never a forward pass of its own.
    plan = CurvePlan(lambda a: 1 + a, current=1.0)
    assert plan.choose(StepSearch(alphas=[0.0, 0.5, 1.0])) == StepChoice(0.0, 1.0, 1.0)
    assert plan.calls == [[None, plan.at("trial", 0.5), plan.at("trial", 1.0)]]


@pytest.mark.parametrize("line_search", ["low_rank", "full_rank"])
def test_a_step_must_beat_alpha_zero_by_more_than_the_round_off_of_its_terms(line_search):
    # The grown loss is lower by 1e-9 (relative): more than the round-off of one float64 value (2.2e-16), less
    # than that of a mean of 1e16 values (1e8 · 2.2e-16). full_rank: the full-rank trial wins clearly, and the
    # round-off decides between the truncated growth and α = 0.
    grown = lambda a: 1 - 1e-9 * a  # noqa: E731
    trial = (lambda a: 1 - a / 2) if line_search == "full_rank" else None
    search = StepSearch(alphas=[0.0, 1.0], line_search=line_search)
    assert CurvePlan(grown, trial).choose(search, terms=1).alpha == 1.0
    assert CurvePlan(grown, trial).choose(search, terms=10**16) == StepChoice(0.0, 1.0, 1.0)


def test_full_rank_rates_the_grid_before_truncation_then_checks_the_truncated_growth_against_alpha_zero():
    trial = lambda a: 1 - a + a**2  # noqa: E731  (the full-rank candidates: lowest at α = 1/2)
    search = StepSearch(alphas=[0.0, 0.25, 0.5, 1.0], line_search="full_rank")
    kept = CurvePlan(lambda a: 1 - a / 4, trial)  # truncated, α = 1/2 still lowers the loss: taken
    assert kept.choose(search) == StepChoice(0.5, 1.0, 0.875)
    assert kept.calls == [[None, *(kept.at("trial", a) for a in (0.25, 0.5, 1.0))],
                          [kept.at("grow", 0.0), kept.at("grow", 0.5)]]
    dropped = CurvePlan(lambda a: 1 + a, trial)  # truncated, α = 1/2 raises it: α = 0 instead
    assert dropped.choose(search) == StepChoice(0.0, 1.0, 1.0)


def test_the_quadratic_rule_adds_the_fitted_minimiser_and_takes_it_when_it_wins():
    # L(α) = 1 − α + 4α²: the slope 1 comes from the first-order prediction at the smallest positive candidate
    # (1/16: 1/16 per unit α; further out the prediction bends, so another probe would give another slope), the
    # curvature from the candidates up to the best measured one (1/16 alone), so α* = 1/(2·4) = 1/8.
    plan = CurvePlan(lambda a: 1 - a + 4 * a**2, predicted=lambda a: a * (1 + (a - 1 / 16)))
    search = StepSearch(alphas=[0.0, 1 / 16, 1 / 4, 1.0], rule="quadratic")
    choice = plan.choose(search)
    assert choice.alpha == pytest.approx(1 / 8, rel=1e-12)
    assert (choice.loss_before, choice.loss_after) == (1.0, pytest.approx(1 - 1 / 8 + 4 / 64, rel=1e-12))
    assert plan.calls[0] == [None, *(plan.at("trial", a) for a in (1 / 16, 1 / 4, 1.0))]
    [[star]] = plan.calls[1:]
    assert star == plan.at("grow", choice.alpha)
    # The grid's best is kept when the fitted minimiser loses to it: with 20α³ more past α = 0.1, L(1/8) is above
    # L(1/16).
    plan = CurvePlan(lambda a: 1 - a + 4 * a**2 + 20 * a**3 * (a > 0.1))
    assert plan.choose(search).alpha == 1 / 16 and len(plan.calls) == 2


def test_the_quadratic_step_stays_within_the_grid_and_is_not_rated_twice():
    # L(α) = 1 − α + α²/10: α* = 5 is past the largest candidate, 1/4, which is taken without another forward.
    plan = CurvePlan(lambda a: 1 - a + a**2 / 10)
    choice = plan.choose(StepSearch(alphas=[0.0, 1 / 16, 1 / 4], rule="quadratic"))
    assert choice == StepChoice(0.25, 1.0, pytest.approx(1 - 0.25 + 0.0625 / 10, rel=1e-12))
    assert len(plan.calls) == 1
    # No descent predicted (slope ≤ 0): α* = 0, already a candidate.
    plan = CurvePlan(lambda a: 1 + a, predicted=lambda a: -a)
    assert plan.choose(StepSearch(alphas=[0.0, 0.5], rule="quadratic")) == StepChoice(0.0, 1.0, 1.0)
    assert len(plan.calls) == 1


@pytest.mark.parametrize("method", ["random", "zero"])
def test_a_baseline_is_rated_once_beside_the_current_loss(method):
    plan = CurvePlan(lambda a: 0.5 + a, current=2.0)  # α does not enter a baseline: grown at 0
    assert plan.choose(StepSearch(alphas=[0.0, 0.5, 1.0]), method=method) == StepChoice(None, 2.0, 0.5)
    assert plan.calls == [[None, plan.at("grow", 0.0)]]


def test_the_stopwatch_times_each_piece_from_the_last_lap(monkeypatch):
    clock_readings = iter([10.0, 12.5, 13.0, 20.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock_readings))
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    watch = Stopwatch(torch.device("cpu"))
    watch.lap("plan")
    watch.lap("rating")
    assert watch.seconds == {"plan_s": 2.5, "rating_s": 0.5}
    assert watch.total() == 10.0 and synced == []  # nothing to wait for on the CPU
    # On CUDA every reading waits for the queued kernels first (here only recorded: no GPU needed).
    clock_readings = iter([1.0, 4.0, 6.0])
    gpu = torch.device("cuda", 1)
    watch = Stopwatch(gpu)
    watch.lap("apply")
    assert watch.seconds == {"apply_s": 3.0} and watch.total() == 5.0 and synced == [gpu] * 3


def test_offers_fit_each_half_with_the_growth_settings_and_measure_it_on_the_other():
    p = Problem(e=8, h=2, d=2)
    # Halves with different statistics: those of another batch in one half, p's in the other.
    half = Problem(e=8, h=2, d=2, seed=1).stats("natural")
    stats = p.stats("natural") + half
    settings = GrowthSettings(method="gradient", size_by=None, truncation="whitened", max_d_head=6)
    [found] = offers([(0, "form", p.form)], [stats], [half], settings)
    a = [growth.growth_for(p.form, half.means(), "gradient", truncation="whitened")]
    b = [growth.growth_for(p.form, p.stats("natural").means(), "gradient", truncation="whitened")]
    expected = allocation.offer(0, "d_head", a, b, cost=2, room=4)
    assert (found.layer, found.side, found.width, found.cost) == (0, "d_head", 2, 2)
    assert found.held_out == pytest.approx(expected.held_out, rel=1e-12)
    assert found.in_sample == pytest.approx(expected.in_sample, rel=1e-12)
    # Other settings fit other columns: the offer follows them.
    other = offers([(0, "form", p.form)], [stats], [half], GrowthSettings(max_d_head=6))[0]
    assert other.held_out != pytest.approx(found.held_out, rel=1e-6)
    # A baseline's columns are rated by the direction that sizes them (size_by), not by the default one.
    baseline = GrowthSettings(method="random", size_by="natural", max_d_head=6)
    [sized] = offers([(0, "form", p.form)], [stats], [half], baseline)
    a = [growth.growth_for(p.form, half.means(), "random", size_by="natural")]
    b = [growth.growth_for(p.form, p.stats("natural").means(), "random", size_by="natural")]
    assert sized.held_out == pytest.approx(allocation.offer(0, "d_head", a, b, cost=2, room=4).held_out, rel=1e-12)
    assert sized.held_out != pytest.approx(offers([(0, "form", p.form)], [stats], [half], GrowthSettings(
        method="random", max_d_head=6))[0].held_out, rel=1e-6)
    # A layer at max_d_head offers nothing.
    assert offers([(0, "form", p.form)], [stats], [half], GrowthSettings(max_d_head=2))[0].held_out == []


def sketched_sums(unit, seeds, size):
    """Sketched sums of `unit` holding one random captured micro-batch per seed."""
    sums = unit.empty_sums("gradient", F64, sketch=size, seed=11)
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        shapes = ([(2, 9, unit.e_in), (2, unit.n_head, 9, size.k), (2, unit.n_kv_head, 9, size.l)]
                  if unit.side == "d_head" else
                  [(2, 9, unit.e_in), (2, unit.n_kv_head, 9, size.k), (2, unit.n_head, 9, size.l), (2, 9, unit.e_out),
                   (2, unit.n_head, 9, size.k_c)])
        sums.update(*(torch.randn(shape, generator=g, dtype=F64) for shape in shapes))
    return sums


@pytest.mark.parametrize("side, group, method", [("d_head", 2, "natural"), ("d_v", 1, "natural"),
                                                 ("d_v", 2, "gradient"), ("d_v", 2, "natural")])
def test_a_sketched_offer_lists_no_more_columns_than_the_sketch_prices(side, group, method):
    # e′ 24 leaves room for 22 columns; a sketch of k 4 prices 4 pairs per group on the query/key side, and on the
    # value side under natural the bottleneck's, min(e′, g·k): the heads of a group share the range of N̄_V but each
    # has its own input covariance, so the natural direction has up to g·k pairs there. The gradient's heads share
    # their left factor too: its pairs beyond k would be round-off, and are not offered.
    gen, size = torch.Generator().manual_seed(0), growth.SketchSize.of(4)
    if side == "d_head":
        unit = growth.FormWeights(torch.randn(4, 24, 2, generator=gen, dtype=F64),
                                  torch.randn(4 // group, 24, 2, generator=gen, dtype=F64), torch.zeros(4, dtype=F64))
        unit.rotary = 0  # what a grouped form has beside its weights (grouped.growth_for reads it)
        settings = GrowthSettings(method=method, max_d_head=24)
    else:
        unit = growth.ValueWeights(torch.randn(4 // group, 24, 2, generator=gen, dtype=F64),
                                   torch.randn(4, 2, 24, generator=gen, dtype=F64))
        settings = GrowthSettings(grow="value", method=method, max_d_v=24)
    stats, half = sketched_sums(unit, [1, 2], size), sketched_sums(unit, [1], size)
    [found] = offers([(0, "unit", unit)], [stats], [half], settings)
    pairs = growth.growth_for(unit, half.means(), method).pairs
    assert len(found.held_out) == pairs == (group * size.k if side == "d_v" and method == "natural" else size.k)
    if method == "natural":  # growth.ridge reaches the offers
        ridged = offers([(0, "unit", unit)], [stats], [half], dataclasses.replace(settings, ridge=1.0))[0]
        assert ridged.held_out != pytest.approx(found.held_out, rel=1e-6)


def test_a_check_that_buys_nothing_records_its_decision_and_installs_nothing():
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    still = FormStats.from_state_dict({**stats.state_dict(), "n_sum": torch.zeros_like(stats.n_sum)})
    half = FormStats.from_state_dict({k: v / 2 for k, v in still.state_dict().items()})
    installed = []
    event = GrowthEvent(GrowthSettings(max_d_head=8), StepSearch(), loss_of=lambda c: pytest.fail("rated a growth"),
                        install=installed.append, broadcast=lambda obj: obj, allowance=float("inf"))
    record, spectra = event.run([(0, "form", p.form)], [still], seed=0, half=[half])
    assert set(record) == {"alpha", "allowance", "decisions", "timings", "seconds"} and record["alpha"] is None
    assert set(record["timings"]) == {"plan_s"} and record["seconds"] >= record["timings"]["plan_s"] >= 0
    [decision] = record["decisions"]
    assert (decision["columns"], decision["above_floor"], decision["cost"]) == (0, 0, 2)
    assert installed == [] and spectra == {} and p.form.d_head == 2 and record["allowance"] == float("inf")


@pytest.mark.parametrize("halves", ["still", "noisy"])
def test_the_last_check_buys_what_its_allowance_pays_for_even_with_nothing_above_the_floor(halves):
    # The twin of the check above at the last check (fill_to: the budget). No column clears the floor, because the
    # gradient is zero (still) or the halves' noise outweighs the signal (noisy), and the allowance of 5 still buys
    # 2 columns of 2 heads each, toward the budget, and installs them.
    p = Problem(e=8, h=2, d=2)
    stats = p.stats("natural")
    if halves == "still":
        stats = FormStats.from_state_dict({**stats.state_dict(), "n_sum": torch.zeros_like(stats.n_sum)})
        half = FormStats.from_state_dict({k: v / 2 for k, v in stats.state_dict().items()})
    else:
        noise = torch.randn(stats.n_sum.shape, dtype=stats.n_sum.dtype, generator=torch.Generator().manual_seed(0))
        half = FormStats.from_state_dict({**{k: v / 2 for k, v in stats.state_dict().items()},
                                          "n_sum": stats.n_sum / 2 + 10 * noise * stats.n_sum.abs().mean()})
    installs = []
    event = GrowthEvent(GrowthSettings(max_d_head=8), StepSearch(alphas=[0.0, 1.0]), loss_of=rated_by(p),
                        install=installs.append, broadcast=lambda obj: obj, allowance=5.0, fill_to=4.0)
    record, _ = event.run([(0, "form", p.form)], [stats], seed=0, half=[half])
    [decision] = record["decisions"]
    assert (decision["columns"], decision["above_floor"], decision["filled"]) == (2, 0, 2)
    assert record["fill_to"] == 4.0 and installs[0]["form"].w_q.shape[-1] == 2 + 2


def test_a_layer_growing_both_sides_offers_each_side_and_the_event_installs_the_columns_bought():
    from test_growth_value import ValueProblem

    p, v = Problem(e=8, h=2, d=2), ValueProblem(e=6, h=4, kv=2, d=2)
    values = growth.ValueWeights(v.w_v, v.w_o)  # 4 query heads sharing 2 value heads: a value column costs 2
    forms = [(0, "form", p.form), (0, "values", values)]
    value_half = ValueProblem(e=6, h=4, kv=2, d=2, seed=1).stats()
    stats, half = [p.stats("natural") + p.stats("natural"), v.stats() + value_half], [p.stats("natural"), value_half]
    settings = GrowthSettings(grow="both", max_d_head=6, max_d_v=5)
    keys, found = offers(forms, stats, half, settings)
    assert (keys.side, found.side, found.layer, found.width, found.cost) == ("d_head", "d_v", 0, 2, 2)
    a = [growth.growth_for(values, value_half.means())]
    b = [growth.growth_for(values, v.stats().means())]
    expected = allocation.offer(0, "d_v", a, b, cost=2, room=3)  # max_d_v 5 leaves 3 columns
    assert len(found.held_out) == 3 and found.held_out == pytest.approx(expected.held_out, rel=1e-12)
    assert found.in_sample == pytest.approx(expected.in_sample, rel=1e-12)
    installs = []
    event = GrowthEvent(settings, StepSearch(alphas=[0.0, 1.0]),
                        loss_of=lambda candidates: torch.linspace(1.0, 0.5, len(candidates), dtype=F64),
                        install=installs.append, broadcast=lambda obj: obj, allowance=float("inf"))
    # Equal halves fit no noise: every column that gains clears the floor.
    record, _ = event.run(forms, [p.stats("natural") + p.stats("natural"), v.stats() + v.stats()], seed=0,
                          half=[p.stats("natural"), v.stats()])
    bought = {d["side"]: d["columns"] for d in record["decisions"]}
    assert bought["d_v"] > 0, record["decisions"]
    [grown] = installs
    assert grown["form"].w_q.shape[-1] == 2 + bought["d_head"]
    assert grown["values"].w_v.shape == (2, 6, 2 + bought["d_v"]) and grown["values"].w_o.shape == (4, 2 + bought["d_v"], 6)


def test_kept_batch_losses_are_each_candidates_mean_over_every_kept_batch_with_the_forms_restored():
    """Rated forward only, in eval mode, with each candidate installed in turn: the loss of candidate c on batch b is
    c + b here (the query weights' mean is the candidate's offset), so each mean is c + the mean of the batches."""
    from types import SimpleNamespace

    from lit_growattn.callback.trainer_ops import kept_batch_losses
    from lit_growattn.contract import NamedForm
    from lit_growattn.growth import FormWeights

    form = QKForm(4, 1, 2, bias=False)
    with torch.no_grad():
        form.w_q.zero_()
    weights = form.held_weights()

    class Module(torch.nn.Module):
        device = torch.device("cpu")

        def batch_loss(self, batch):
            assert not self.training  # rated in eval mode
            return form.w_q.mean() + batch

    module = Module().train()
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(forward_context=torch.no_grad), global_rank=0,
                              world_size=1, strategy=SimpleNamespace(reduce=lambda t, reduce_op: t))
    candidates = [None, *({"qk": FormWeights(torch.full_like(weights.w_q, c), weights.w_k, weights.log_tau)}
                          for c in (1.0, 10.0))]
    means = kept_batch_losses(trainer, module, [NamedForm(0, "qk", form)], [torch.tensor(1.0), torch.tensor(4.0)],
                              candidates)
    assert means.tolist() == [2.5, 3.5, 12.5]
    assert module.training and form.w_q is weights.w_q  # the mode and the forms as they were


@pytest.mark.parametrize("sharded", [True, False])
def test_under_fsdp2_a_rank_with_a_smaller_share_of_kept_batches_runs_as_many_forwards(monkeypatch, sharded):
    """Under FSDP2 a forward is a collective: rank 1 of 2 holding one of 3 kept batches runs a second, uncounted
    forward per candidate, so that rank 0's second forward is not left waiting; its count and sum are its share's
    alone (the reduce adds the other rank's). Under DDP it runs its share only."""
    from types import SimpleNamespace

    from lit_growattn.callback import trainer_ops
    from lit_growattn.contract import NamedForm

    form = QKForm(4, 1, 2, bias=False)
    seen = []

    class Module(torch.nn.Module):
        device = torch.device("cpu")

        def batch_loss(self, batch):
            seen.append(batch.item())
            return batch

    monkeypatch.setattr(trainer_ops, "is_sharded", lambda module: sharded)
    reduced = []
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(forward_context=torch.no_grad), global_rank=1,
                              world_size=2, strategy=SimpleNamespace(reduce=lambda t, reduce_op: reduced.append(t) or t))
    kept = [torch.tensor(1.0), torch.tensor(4.0), torch.tensor(16.0)]
    trainer_ops.kept_batch_losses(trainer, Module(), [NamedForm(0, "qk", form)], kept, [None, None])
    assert seen == ([4.0, 1.0] * 2 if sharded else [4.0] * 2)  # its share (batch 1), then batch 0 uncounted
    assert reduced[0].tolist() == [4.0, 4.0, 1.0]  # each candidate's sum over its share, and the share's count


def test_a_rated_loss_averages_one_value_per_token_of_each_kept_batch():
    from lit_growattn.callback.trainer_ops import loss_terms

    ids = torch.zeros(4, 16, dtype=torch.long)
    # (ids, labels): the largest integer tensor counts; a float input does not; a batch without one counts 1.
    assert loss_terms([(ids, ids), (ids[:2], ids[:2])]) == 64 + 32
    assert loss_terms([{"input": torch.randn(4, 16, 8), "labels": ids[:, :3]}]) == 12
    assert loss_terms([torch.randn(4, 16)]) == 1 and loss_terms([]) == 0


def test_every_automatic_schedule_chart_of_the_tensorboard_layout_shows_a_scalar_a_check_logs(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_growattn.callback.report import add_layout, event_metrics, summary_table

    logger, layouts = TensorBoardLogger(str(tmp_path)), []
    logger.experiment.add_custom_scalars = layouts.append
    add_layout(SimpleNamespace(is_global_zero=True, logger=logger), n_layer=2)
    charted = {tag for charts in layouts[0].values() for _, tags in charts.values() for tag in tags
               if tag.startswith("growth/auto/")}
    decision = {"columns": 0, "above_floor": 0, "filled": 0, "held_out": [0.1], "in_sample": [0.2], "cost": 4}
    last_check = {"skipped": False, "allowance": 8.0, "fill_to": 4.0, "decisions": [
        {**decision, "layer": layer, "side": side} for layer in range(2) for side in ("d_head", "d_v")]}
    assert charted == set(event_metrics(last_check, {})) - {"growth/skipped"}
    # The summary table's lines carry no trailing blanks (its cells are padded to their column's width).
    table = summary_table([{**last_check, "event": "step 50", "step": 50, "epoch": 0}])
    assert all(line == line.rstrip() for line in table.splitlines()) and "no growth" in table
