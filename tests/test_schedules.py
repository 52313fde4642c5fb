"""The schedules, unit by unit (fast: in the mutation selection): the clock that replays Lightning's loop, the
window's position, the fixed schedules' checks, resuming with another kind, and AutoSchedule's K-cache budget (the
allowance spread over the checks, the checks' steps, the cost of a column per key head, the end, the summary, and
the settings it refuses). Training runs with the schedules: tests/test_growth_schedule.py, test_auto_schedule.py."""

import warnings
from types import SimpleNamespace

import pytest

from lit_growattn import AtEpochs, AtSteps, AutoSchedule, GrowAttentionCallback, GrowthSettings
from lit_growattn.callback.schedule import Clock, GrowthPoint, GrowthSchedule, check_same_schedule
from lit_growattn.callback.settings import StatisticsSettings


def bound(budget=4.0, check_every=10, spend_until=0.5, steps=100, costs=None, start=None, max_d_head=16,
          value_costs=None, value_start=None, max_d_v=16, statistics=StatisticsSettings(), accumulate=1,
          stats_batches=8):
    """An AutoSchedule bound to two growing layers (4 key heads each, d_head 1; `costs`: key heads by layer) of a run
    of `steps` steps; `value_costs` (value heads by layer; d_v 1) grows the value side too, `costs={}` only it."""
    schedule = AutoSchedule(budget, check_every, spend_until)
    costs = {0: 4, 1: 4} if costs is None else costs
    value_costs = value_costs or {}
    keyed = {(layer, "d_head"): c for layer, c in costs.items()} | {(layer, "d_v"): c for layer, c in value_costs.items()}
    layers = sorted({layer for layer, _ in keyed})
    start = {"d_head": start or [1] * len(layers), "d_v": value_start or [1] * len(layers)}
    grow = "both" if costs and value_costs else "value" if value_costs else "query_key"
    settings = GrowthSettings(grow=grow, max_d_head=max_d_head if costs else None,
                              max_d_v=max_d_v if value_costs else None)
    schedule.bind(settings, statistics, layers, start, keyed)
    trainer = SimpleNamespace(max_steps=steps, estimated_stepping_batches=1000, accumulate_grad_batches=accumulate)
    schedule.check_run(trainer, stats_batches=stats_batches)
    return schedule


def check(before, after, v_before=None, v_after=None):
    """An event record: d_head before and after, and d_v when the value side grows."""
    return {"d_head_before": before, "d_head": after} | (
        {"d_v_before": v_before, "d_v": v_after} if v_before is not None else {})


def test_the_budget_is_spread_evenly_over_the_checks_and_unspent_allowance_carries_over():
    schedule = bound()  # 5 checks (steps 10 … 50); 4 × 8 − 8 = 24 values per token to spend
    assert schedule.checks == 5 and schedule.total([]) == 24
    assert schedule.allowance([]) == pytest.approx(24 / 5)
    one = [check([1, 1], [2, 1])]  # spent 4 at the first check
    assert schedule.allowance(one) == pytest.approx(2 * 24 / 5 - 4)
    idle = [check([1, 1], [1, 1])] * 4  # nothing spent in four checks: the last has the whole budget
    assert schedule.allowance(idle) == pytest.approx(24)
    assert [schedule.pending([check([1, 1], [1, 1])] * n).at for n in range(5)] == [10, 20, 30, 40, 50]
    assert schedule.pending(idle + [check([1, 1], [1, 1])]) is None  # spend_until reached: no sixth check
    assert schedule.pending([check([1, 1], [4, 4])]) is None  # the budget is spent
    # A resumed run's model starts at its grown sizes: the budget still counts from where the run started.
    schedule.start_sizes = {"d_head": [2, 1]}
    assert schedule.total(one) == 24 and schedule.allowance(one) == pytest.approx(2 * 24 / 5 - 4)
    # The summary counts what was bought beyond the start, not the start itself.
    assert schedule.summary([check([1, 1], [4, 4])]) == ("K-cache budget: mean query/key head size 4 of 4; bought 24 of "
                                                         "the 24 values per token the budget adds to the start (100 %), "
                                                         "0 unspent")
    assert "mean query/key head size 2.5 of 4; bought 12 of the 24" in schedule.summary([check([1, 1], [3, 2])])
    assert schedule.summary([check([1, 1], [3, 2])]).endswith(
        "(50 %), 12 unspent: the run ended before its check at step 20")


def test_a_budget_is_counted_in_key_heads_so_a_gqa_layer_costs_its_kv_heads():
    # Layer 0: 8 key heads (mha); layer 1: 2 (GQA). Budget mean 3 over 10 key heads: 30 values, 10 at the start.
    schedule = bound(budget=3, costs={0: 8, 1: 2}, max_d_head=4)
    assert schedule.total([]) == 20
    assert schedule.cache({"d_head": [3, 3]}) == 30 and schedule.pending([check([1, 1], [3, 3])]) is None  # spent
    assert schedule.pending([check([1, 1], [3, 2])]) is not None  # 28 of 30: a GQA column (2 values) still fits
    assert schedule.pending([check([1, 1], [2, 3])]) is not None  # 22 of 30: an mha column (8) fits exactly
    assert schedule.pending([check([1, 1], [2, 4])]) is None  # 24 of 30: it does not, and layer 1 is at max_d_head


def test_a_kv_budget_counts_both_sides_in_their_cache_heads():
    # d_head on 4 key heads per layer, d_v on 4 value heads in layer 0 and 2 (GQA) in layer 1: 14 heads, all at 1.
    schedule = bound(budget=3, value_costs={0: 4, 1: 2}, max_d_head=4, max_d_v=4)
    assert schedule.total([]) == 3 * 14 - 14
    both = check([1, 1], [3, 3], [1, 1], [3, 2])  # 24 + 12 + 4 = 40 of 42: a GQA value column (2 values) still fits
    assert schedule.cache({"d_head": [3, 3], "d_v": [3, 2]}) == 40 and schedule.pending([both]) is not None
    spent = check([1, 1], [3, 3], [1, 1], [3, 3])
    assert schedule.pending([spent]) is None
    assert schedule.summary([both]) == ("KV-cache budget: mean head size of the query/key and value sides 2.857 (d_head "
                                        "3, d_v 2.667) of 3; bought 26 of the 28 values per token the budget adds to "
                                        "the start (93 %), 2 unspent: the run ended before its check at step 20")
    # A resumed run: its history says where both sides started.
    schedule.start_sizes = {"d_head": [3, 3], "d_v": [3, 2]}
    assert schedule.spent([both]) == 26 and schedule.total([both]) == 28


def test_a_value_budget_counts_the_v_cache_alone():
    schedule = bound(budget=2, costs={}, value_costs={0: 4, 1: 4}, max_d_v=4)
    assert schedule.limits == {"d_v": 4} and schedule.total([]) == 8
    # The query/key sizes are in the record but not in the budget.
    grown = check([1, 1], [9, 9], [1, 1], [2, 2])
    assert schedule.spent([grown]) == 8 and schedule.pending([grown]) is None
    assert schedule.summary([grown]).startswith("V-cache budget: mean value head size 2 of 2; bought 8 of the 8 values "
                                                "per token")


def test_only_the_last_check_fills_toward_the_budget():
    schedule = bound()  # 5 checks
    assert [schedule.fill_to([check([1, 1], [1, 1])] * n) for n in range(5)] == [None] * 4 + [4.0]
    # Read from the history alone: a run resumed before its last check fills at it, as the run it continues would.
    resumed = bound(start=[2, 1])
    assert resumed.fill_to([check([1, 1], [2, 1])] * 4) == 4.0 and resumed.fill_to([check([1, 1], [2, 1])]) is None


def test_the_last_checks_allowance_is_all_that_is_left():
    schedule = bound()
    history = [check([1, 1], [2, 1]), check([2, 1], [3, 1]), check([3, 1], [3, 1]), check([3, 1], [3, 2])]
    assert schedule.allowance(history) == schedule.total(history) - schedule.spent(history) == 24 - 12


def test_a_skipped_last_check_is_named_in_the_summary():
    schedule = bound()
    skipped = {**check([1, 1], [2, 1]), "event": "step 50", "skipped": True, "reason": "no statistics were gathered"}
    assert schedule.summary([check([1, 1], [2, 1])] * 4 + [skipped]).endswith(
        "(17 %), 20 unspent: the last check (step 50) was skipped: no statistics were gathered")
    # A run that stopped (max_steps, an interrupt) before its last check: the summary says so, not "skipped".
    assert schedule.summary([check([1, 1], [2, 1])] * 4).endswith(
        "20 unspent: the run ended before its check at step 50")


@pytest.mark.parametrize("build, message", [
    (lambda: AutoSchedule(budget=0), "budget is a mean head size"),
    (lambda: AutoSchedule(), r"^AutoSchedule needs a budget: the mean head size the grown model may reach \(e.g. "
                             r"budget: 4, .*To grow without a cache bound use AtSteps or AtEpochs with "
                             r"growth.rank_threshold; to train at a fixed width drop the callback and set the model's "
                             r"d_head.$"),
    (lambda: AutoSchedule(4, check_every=0), "check_every must be a positive number of optimizer steps"),
    (lambda: AutoSchedule(4, spend_until=0), r"spend_until is a share of the run's optimizer steps in \(0, 1\]"),
    (lambda: AutoSchedule(4, spend_until=1.5), r"spend_until is a share of the run's optimizer steps in \(0, 1\]"),
    (lambda: bound(budget=0.5), r"budget=0.5\) is below the mean query/key head size the growing layers are at \(1\)"),
    (lambda: bound(budget=17), r"exceeds the mean query/key head size that growth.max_d_head=16 allows \(16\), so it "
                               "could never be spent"),
    (lambda: bound(budget=13, value_costs={0: 4, 1: 4}, max_d_v=8),
     r"exceeds the mean head size of the query/key and value sides that growth.max_d_head=16 and growth.max_d_v=8 "
     r"allow \(12\)"),
    (lambda: bound(budget=0.5, costs={}, value_costs={0: 4, 1: 4}),
     r"below the mean value head size the growing layers are at \(1\)"),
    (lambda: GrowAttentionCallback(AutoSchedule(4), GrowthSettings(grow="value", value_columns=2)),
     "set growth.value_columns to null"),
    (lambda: GrowAttentionCallback(AutoSchedule(4), GrowthSettings(rank_threshold=0.5)),
     "set growth.rank_threshold to null"),
    (lambda: GrowAttentionCallback(AutoSchedule(4), GrowthSettings(columns=2)), "set growth.columns to null"),
    (lambda: GrowAttentionCallback(AutoSchedule(4), GrowthSettings(max_columns=2)), "set growth.max_columns to null"),
    (lambda: GrowAttentionCallback(AutoSchedule(4), GrowthSettings(mode="replace")), "use growth.mode='append'"),
])
def test_bad_auto_settings_fail_with_message(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_run_too_short_for_a_check_warns_that_nothing_will_grow():
    with pytest.warns(UserWarning, match="until spend_until=0.5 of the run's 100: no check fits, so nothing will grow"):
        schedule = bound(check_every=60)
    assert schedule.pending([]) is None




def test_the_documented_defaults():
    schedule = AutoSchedule(budget=4)  # the budget has no default: AutoSchedule() is refused
    assert (schedule.budget, schedule.check_every, schedule.spend_until) == (4, 50, 0.5)


def test_checks_come_every_check_every_steps_and_the_last_leaves_a_batch_after_it():
    schedule = bound()
    point = schedule.pending([])
    assert (point.unit, point.at, point.name) == ("step", 10, "step 10")
    assert bound(check_every=50, spend_until=1.0).checks == 1  # a check at step 100 of 100 would never run
    assert bound(check_every=99, spend_until=1.0).checks == 1  # step 99 does
    assert bound(steps=-1).checks == 50  # no max_steps: the estimate from the epochs (1000 steps here)
    with pytest.warns(UserWarning, match=r"^AutoSchedule checks every 10 optimizer steps until spend_until=0.5 of the "
                                         r"run's 1: no check fits, so nothing will grow; lower check_every or raise "
                                         r"spend_until$"):
        assert bound(steps=1).checks == 0
    assert bound(steps=0).checks == 50  # max_steps 0 is Lightning's "not set" too
    assert bound(check_every=1, spend_until=1.0, stats_batches=1).checks == 99


def test_the_whole_budget_is_the_limit_once_the_checks_are_over():
    schedule = bound()
    idle = [check([1, 1], [1, 1])] * 5
    assert schedule.allowance(idle) == pytest.approx(24)  # a sixth check (there is none) would get no more


def test_a_resumed_run_counts_its_budget_from_where_it_started():
    schedule = bound(start=[2, 2])  # the resumed model is built at its grown sizes
    grown = [check([1, 1], [4, 3])]  # 28 of 32 values: 4 left, exactly one more column
    assert schedule.total(grown) == 24 and schedule.spent(grown) == 20
    assert schedule.pending(grown).at == 20


@pytest.mark.parametrize("kwargs", [
    dict(budget=1.0),  # exactly the width the layers start at
    dict(budget=16.0),  # exactly max_d_head
    dict(check_every=1, spend_until=1.0, stats_batches=1),
    dict(statistics=StatisticsSettings(layers_per_event=2)),  # every growing layer at each event
    dict(check_every=4, accumulate=2, stats_batches=8),  # 4 steps of 2 micro-batches hold the window exactly
])
def test_settings_at_their_bounds_are_accepted(kwargs):
    assert bound(**kwargs).checks >= 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(statistics=StatisticsSettings(layers_per_event=1)),
     r"^AutoSchedule offers every growing layer's columns at each check, but statistics.layers_per_event=1 covers 1 "
     r"of 2: set statistics.layers_per_event to null "
     r"\(--trainer.callbacks.init_args.statistics.layers_per_event=null\) with AutoSchedule \(or bound memory with "
     r"growth.layers\), or use AtSteps$"),
    (dict(check_every=3, accumulate=2, stats_batches=8),
     r"^check_every=3 optimizer steps hold fewer than statistics.batches=8 micro-batches \(accumulate_grad_batches=2\): "
     r"raise check_every or lower statistics.batches$"),
])
def test_what_the_run_cannot_apply_is_refused_before_training(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bound(**kwargs)


# -- the schedule's arithmetic -------------------------------------------------------------------------
def test_clock_replays_lightning_steps_with_accumulation_and_epoch_end_flush():
    clock = Clock(epoch=0, batch=0, step=0, epoch_batches=5, accumulate=2)
    seen = []
    for _ in range(6):
        seen.append((clock.epoch, clock.batch, clock.step, clock.between_windows))
        clock = clock.advance()
    assert seen == [(0, 0, 0, True), (0, 1, 0, False), (0, 2, 1, True), (0, 3, 1, False), (0, 4, 2, True),
                    (1, 0, 3, True)]
    clock = Clock(epoch=0, batch=0, step=0, epoch_batches=7, accumulate=3)
    steps = []
    for _ in range(8):
        steps.append(clock.step)
        clock = clock.advance()
    assert steps == [0, 0, 0, 1, 1, 1, 2, 3]  # a step after every 3rd micro-batch, and after the epoch's last


def test_window_position_from_any_clock():
    at_step_4 = GrowthPoint("step", 4)
    before = GrowthSchedule.batches_before
    assert before(at_step_4, Clock(1, 2, 4, 5, 2), horizon=3) == 0  # the growth happens at this batch start
    assert before(at_step_4, Clock(1, 1, 3, 5, 2), horizon=3) == 1  # the window's last micro-batch
    assert before(at_step_4, Clock(0, 4, 2, 5, 2), horizon=3) == 3  # the window opens at the end of epoch 0
    assert before(at_step_4, Clock(0, 3, 1, 5, 2), horizon=3) is None
    assert before(GrowthPoint("epoch", 1), Clock(0, 4, 3, 5, 1), horizon=3) == 1
    assert before(GrowthPoint("epoch", 1), Clock(1, 0, 5, 5, 1), horizon=3) == 0


@pytest.mark.parametrize("build, message", [
    (lambda: AtEpochs([0, 2]), r"^AtEpochs\(epochs=\[0, 2\]\): growth at epoch 0 \(or earlier\) has no statistics"),
    (lambda: AtEpochs([2, 2]), r"^AtEpochs\(epochs=\[2, 2\]\) must list each growth epoch once"),
    (lambda: AtSteps([0]), r"^AtSteps\(steps=\[0\]\): growth at step 0"),
    (lambda: AtSteps([]), r"^AtSteps\(steps=\[\]\) must list each growth step once"),
])
def test_bad_schedules_fail_with_message(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def run_of(max_steps=-1, max_epochs=None, batches=5, accumulate=1, estimated=float("inf")):
    return SimpleNamespace(max_steps=max_steps, max_epochs=max_epochs, num_training_batches=batches,
                           accumulate_grad_batches=accumulate, estimated_stepping_batches=estimated)


def test_fixed_schedules_warn_of_points_the_run_never_reaches():
    with pytest.warns(UserWarning, match="^AtEpochs has epoch 3 but max_epochs=3: it will never happen$"):
        AtEpochs([1, 3]).check_run(run_of(max_epochs=3), stats_batches=2)
    with pytest.warns(UserWarning, match="^AtSteps has step 10 but max_steps=10: it will never happen$"):
        AtSteps([4, 10]).check_run(run_of(max_steps=10), stats_batches=2)
    with pytest.warns(UserWarning, match=r"^AtSteps has step 12 but the run ends after about 12 optimizer steps \(max_epochs"):
        AtSteps([4, 12]).check_run(run_of(estimated=12.0), stats_batches=2)
    AtEpochs([1, 2]).check_run(run_of(max_epochs=3), stats_batches=5)  # in range, a window of one epoch: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AtSteps([4, 11]).check_run(run_of(max_steps=12, estimated=11.0), stats_batches=4)  # max_steps decides
    with pytest.warns(UserWarning, match="^AtEpochs has epoch 1 but max_epochs=0"):
        AtEpochs([1]).check_run(run_of(max_epochs=0), stats_batches=2)


@pytest.mark.parametrize("schedule, run, message", [
    (AtEpochs([1]), run_of(batches=5), r"^statistics.batches=6 is more than an epoch \(5 batches\); lower it$"),
    (AtSteps([3, 5]), run_of(accumulate=2),
     r"^AtSteps \[5\] leave less than statistics.batches=6 micro-batches after the previous growth \(or the start\) "
     r"with accumulate_grad_batches=2: space the steps further apart or lower statistics.batches$"),
    (AtSteps([2]), run_of(accumulate=2), r"^AtSteps \[2\] leave less than statistics.batches=6"),
])
def test_fixed_schedules_refuse_windows_that_do_not_fit(schedule, run, message):
    with pytest.raises(ValueError, match=message):
        schedule.check_run(run, stats_batches=6)
    schedule.check_run(run, stats_batches=4 if isinstance(schedule, AtSteps) else 5)  # windows that fit


def test_a_fixed_schedule_takes_its_points_in_order_once_each():
    schedule = AtSteps([8, 4])
    assert [p.name for p in schedule.points] == ["step 4", "step 8"]
    assert schedule.pending([]).name == "step 4" and schedule.pending([{"event": "step 4"}]).name == "step 8"
    assert schedule.pending([{"event": "step 4"}, {"event": "step 8"}]) is None
    assert AtEpochs([1]).pending([{"event": "step 1"}]).name == "epoch 1"  # another unit's record is not its own


@pytest.mark.parametrize("state, kind, message", [
    ({"history": [], "schedule": "auto"}, "fixed", r"^the checkpoint was written by a run with the automatic schedule "
     r"\(AutoSchedule\), this one has a fixed schedule \(AtEpochs or AtSteps\): resume with the automatic schedule, "
     r"or start a new run from its weights with --model.init_args.init_from=CHECKPOINT$"),
    ({"history": [{"event": "step 5", "decisions": []}]}, "fixed", "written by a run with the automatic schedule"),
    ({"history": [{"event": "epoch 1"}]}, "auto", r"written by a run with a fixed schedule \(AtEpochs or AtSteps\), "
     r"this one has the automatic schedule \(AutoSchedule\): resume with a fixed schedule, or start a new run"),
    ({"history": [{"event": "step 5", "decisions": [{"ratios": [1.0]}]}], "schedule": "auto"}, "auto",
     r"^the checkpoint was written by the automatic schedule before its K-cache budget, whose checks this one cannot "
     r"continue: start a new run from its weights with --model.init_args.init_from=CHECKPOINT$"),
])
def test_resuming_with_another_kind_of_schedule_is_refused(state, kind, message):
    with pytest.raises(ValueError, match=message):
        check_same_schedule(state, kind)


@pytest.mark.parametrize("state, kind", [
    ({"history": [], "schedule": "fixed"}, "fixed"),
    ({"history": []}, "auto"),  # a run that had not grown yet
    ({"history": [{"event": "step 5", "decisions": [{"columns": 1}]}], "schedule": "auto"}, "auto"),
])
def test_resuming_with_the_same_kind_is_accepted(state, kind):
    check_same_schedule(state, kind)


def test_an_automatic_checks_line_names_what_it_bought_and_the_gains_against_the_noise():
    from lit_growattn.callback.report import decision_text, event_line

    check = {"step": 40, "epoch": 1, "skipped": False, "allowance": 16.0, "decisions": [
        {"layer": 0, "side": "d_head", "columns": 1, "above_floor": 2, "cost": 4,
         "held_out": [0.031, 0.012, 0.004, 0.001], "in_sample": [0.041, 0.023, 0.013, 0.009]},
        {"layer": 1, "columns": 0, "above_floor": 0, "cost": 2, "held_out": [], "in_sample": []}]}  # no side: d_head
    decided = ("allowance 16 values per token; layer 0 d_head +1 of 2 above the floor (held-out gains 0.031 0.012 "
               "0.004 vs fitted noise 0.01 0.011 0.009, 4 values per column); layer 1 d_head +0 of 0 above the floor "
               "(held-out gains – vs fitted noise –, 2 values per column)")
    assert event_line({**check, "d_head": [5, 4], "alpha": 0.25, "loss_before": 2.5, "loss_after": 2.25,
                       "seconds": 0.4, "d_head_before": [4, 4]}).endswith(f"0.4 s; {decided}")
    nothing = {**check, "decisions": [{**check["decisions"][0], "columns": 0, "side": "d_v"}]}
    assert event_line({**nothing, "d_head": [4, 4]}) == (
        "growth check at step 40 (epoch 1): no layer grows, d_head stays [4, 4]; allowance 16 values per token; layer 0 "
        "d_v +0 of 2 above the floor (held-out gains 0.031 0.012 vs fitted noise 0.01 0.011, 4 values per column)")
    # The last check buys beyond the floor, toward the budget: the line says how many of each.
    last = {**check, "fill_to": 4.0, "decisions": [{**check["decisions"][0], "columns": 3, "above_floor": 2,
                                                    "filled": 1}]}
    assert decision_text(last) == ("allowance 16 values per token; layer 0 d_head +3 (2 of 2 above the floor, 1 toward "
                                   "the budget of 4) (held-out gains 0.031 0.012 0.004 0.001 vs fitted noise 0.01 "
                                   "0.011 0.009 0.008, 4 values per column)")
    # An allowance short of what cleared the floor: the line keeps how many cleared it.
    short = {**last, "decisions": [{**last["decisions"][0], "columns": 2, "above_floor": 4, "filled": 0}]}
    assert "d_head +2 (2 of 4 above the floor, 0 toward the budget of 4)" in decision_text(short)
