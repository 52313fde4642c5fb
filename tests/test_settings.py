"""The callback's settings as a person reads and writes them: the package's top level, `--print_config=comments`,
old flat configs refused with the grouped spelling, and the sketch's settings: their refusals, its size, and what
`auto` resolves to."""

import math
import re
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch
import yaml
from lightning_utilities.core.rank_zero import rank_zero_only

from conftest import REPO, run_command
from lit_growattn import (AtEpochs, AtSteps, AutoSchedule, GrowAttentionCallback, GrowAttentionLM, GrowthSettings,
                          StatisticsSettings, StepSearch)
from lit_growattn.callback.checks import SKETCH_CROSSOVER, resolve_sketch, sketch_ridge, sketch_size
from lit_growattn.callback.report import sketch_line
from lit_growattn.commands.cli import main
from lit_growattn.contract import NamedForm
from lit_growattn.growth import DIRECTIONS, FormShape, SketchSize
from lit_growattn.growth.value import ValueShape

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
                assert cb["init_args"]["schedule"]["class_path"] in ("lit_growattn.AtEpochs", "lit_growattn.AtSteps",
                                                                     "lit_growattn.AutoSchedule")
    assert growing == 8  # six nanoGPT configs, configs/hf_llama_grow.yaml and configs/hf_llama_fsdp.yaml


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


# -- statistics.sketch, statistics.sketch_size, growth.ridge ------------------------------------------------------------

PINV_REFUSED = (
    "{setting}='pinv' cannot use statistics.sketch: on: pinv sums each sequence's C_i⁺N_iC_i⁺ with that sequence's own "
    "pseudo-inverse, which is not a function of the summed N a sketch keeps; sketching it directly would need an e′×e′ "
    "eigendecomposition per sequence inside every statistics step. Use {option} natural or gradient with the sketch, "
    "or statistics.sketch: off (auto resolves to off for pinv)")
UNSET = "(--trainer.callbacks.init_args.{}=null)"


@pytest.mark.parametrize("build, message", [
    (lambda: StatisticsSettings(sketch="yes"), "statistics.sketch must be one of off, on, auto; got 'yes'"),
    (lambda: StatisticsSettings(sketch="on", sketch_size=0),
     "statistics.sketch_size must be positive (or null for max(24, 2·p + 8)), got 0"),
    (lambda: StatisticsSettings(sketch="off", sketch_size=24),
     "statistics.sketch_size sizes the sketch, and statistics.sketch is off: set statistics.sketch to on or auto, or "
     f"set statistics.sketch_size to null {UNSET.format('statistics.sketch_size')}"),
    (lambda: GrowthSettings(ridge=-1), "growth.ridge must be ≥ 0 (a multiple of the input covariance's mean "
                                       "eigenvalue), got -1"),
    (lambda: GrowthSettings(method="gradient", ridge=1.0),
     "growth.ridge regularises the natural direction's C̄, which growth.method='gradient' does not use: set "
     f"growth.ridge to null {UNSET.format('growth.ridge')}"),
    (lambda: GrowthSettings(method="random", ridge=1.0),
     "growth.ridge regularises the natural direction's C̄, which growth.method='random' (sized by 'gradient', "
     f"growth.size_by) does not use: set growth.ridge to null {UNSET.format('growth.ridge')}"),
    (lambda: GrowAttentionCallback(AtSteps([8]), GrowthSettings(method="pinv"), StatisticsSettings(sketch="on")),
     PINV_REFUSED.format(setting="growth.method", option="method")),
    (lambda: GrowAttentionCallback(AtSteps([8]), GrowthSettings(method="zero", size_by="pinv"),
                                   StatisticsSettings(sketch="on")),
     PINV_REFUSED.format(setting="growth.size_by", option="size_by")),
    (lambda: GrowAttentionCallback(AtSteps([8]), GrowthSettings(columns=40), StatisticsSettings(sketch="on",
                                                                                               sketch_size=24)),
     "growth.columns=40 needs 40 bottleneck pairs per head, and a sketch of statistics.sketch_size=24 yields at most "
     "24: raise statistics.sketch_size to at least 40 (88 = 2·40 + 8 recommended), or grow fewer columns"),
    (lambda: GrowAttentionCallback(AtSteps([8]), GrowthSettings(grow="both", columns=[2, 3], value_columns=[5, 30]),
                                   StatisticsSettings(sketch="auto", sketch_size=16)),
     "growth.value_columns=[5, 30] needs 30 bottleneck pairs per head, and a sketch of statistics.sketch_size=16 "
     "yields at most 16: raise statistics.sketch_size to at least 30 (68 = 2·30 + 8 recommended), or grow fewer "
     "columns"),
    (lambda: GrowAttentionCallback(AtSteps([8]), statistics=StatisticsSettings(sketch="on"),
                                   step_search=StepSearch(line_search="full_rank")),
     "step_search.line_search='full_rank' installs M + αΔM at full rank (e′ columns per head), which the sketch does "
     "not keep: use line_search='low_rank', or statistics.sketch: off"),
])
def test_bad_sketch_and_ridge_settings_are_refused_naming_the_fix(build, message):
    with pytest.raises(ValueError) as refused:
        build()
    assert str(refused.value) == message


def test_a_registered_direction_cannot_use_the_sketch(monkeypatch):
    monkeypatch.setitem(DIRECTIONS, "sign", lambda mo, rcond: -mo.n.sign())
    with pytest.raises(ValueError) as refused:
        GrowAttentionCallback(AtSteps([8]), GrowthSettings(method="sign"), StatisticsSettings(sketch="on"))
    assert str(refused.value) == (
        "growth.method='sign' cannot use statistics.sketch: on: a registered direction reads N̄ itself, of which the "
        "sketch keeps only thin factors. Use method natural or gradient with the sketch, or statistics.sketch: off "
        "(auto resolves to off for it)")
    assert resolve(StatisticsSettings(sketch="auto"), units(2048), GrowthSettings(method="sign")) == (
        None, "auto: growth.method='sign' reads N̄ itself")


def test_a_sketch_the_settings_allow_is_built():
    # pinv under auto (resolved off at setup), natural with a ridge and no sketch, a baseline sized by natural.
    GrowAttentionCallback(AtSteps([8]), GrowthSettings(method="pinv"), StatisticsSettings(sketch="auto"))
    GrowAttentionCallback(AtSteps([8]), GrowthSettings(ridge=0.5))
    GrowAttentionCallback(AtSteps([8]), GrowthSettings(method="random", size_by="natural", ridge=0.0),
                          StatisticsSettings(sketch="on", sketch_size=1))


def test_yaml_reads_on_and_off_as_booleans_and_the_settings_take_them():
    # YAML 1.1 (jsonargparse's loader) reads `sketch: on` unquoted as true.
    assert [StatisticsSettings(sketch=v).sketch for v in (True, False, "auto")] == ["on", "off", "auto"]
    done = run_command("fit", "--config", "configs/mqar_grow.yaml",
                       "--trainer.callbacks.init_args.statistics={batches: 4, sketch: on}", "--print_config")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("growth_settings, schedule, k", [
    (GrowthSettings(), AtSteps([8]), 24),  # p = 1: max(24, 10)
    (GrowthSettings(columns=[3, 12]), AtSteps([8]), 32),  # the most columns one event appends
    (GrowthSettings(grow="both", value_columns=13), AtSteps([8]), 34),
    (GrowthSettings(rank_threshold=0.1), AtSteps([8]), 24),  # chosen by the spectrum: p = 8
    (GrowthSettings(rank_threshold=0.1, max_columns=20), AtSteps([8]), 48),
    (GrowthSettings(), AutoSchedule(4), 24),  # chosen by the schedule: p = 8
])
def test_the_default_sketch_size_leaves_room_for_twice_the_columns_an_event_appends(growth_settings, schedule, k):
    expected = SketchSize(k, math.ceil(3 * k / 2), k)
    assert sketch_size(StatisticsSettings(sketch="on"), growth_settings, schedule.kind) == expected
    assert sketch_size(StatisticsSettings(sketch="on", sketch_size=5), growth_settings, "fixed") == SketchSize.of(5)


class _Form(FormShape):
    """A query/key form's shape; `sketch`: whether it captures a sketch (has the attribute)."""

    def __init__(self, h, kv, e_in, sketch=True):
        self.w_q, self.w_k = torch.zeros(h, e_in, 1), torch.zeros(kv, e_in, 1)
        if sketch:
            self.sketch = None


class _Values(ValueShape):
    def __init__(self, h, kv, e_in):
        self.w_v, self.w_o = torch.zeros(kv, e_in, 1), torch.zeros(h, 1, e_in)


def _no_attribute(self):
    raise AttributeError("tests_numel")


def units(e_in, layers=2, h=4, kv=2, sketch=True):
    return [NamedForm(i, f"l{i}", _Form(h, kv, e_in, sketch)) for i in range(layers)]


def resolve(statistics, forms, growth_settings=GrowthSettings(), search=StepSearch(), device="cpu", kind="fixed",
            halves=False):
    layers = sorted({f.layer for f in forms})
    return resolve_sketch(statistics, growth_settings, search, kind, forms, layers, halves, torch.device(device))


K24 = SketchSize.of(24)  # k + l = 60


def test_auto_keeps_the_full_statistics_for_pinv_full_rank_and_units_that_capture_no_sketch():
    auto = StatisticsSettings(sketch="auto")
    assert resolve(auto, units(2048), GrowthSettings(method="pinv")) == (
        None, "auto: growth.method='pinv' sums each sequence's own C_i⁺N_iC_i⁺, which no sketch keeps")
    assert resolve(auto, units(2048), GrowthSettings(method="random", size_by="pinv")) == (
        None, "auto: growth.size_by='pinv' sums each sequence's own C_i⁺N_iC_i⁺, which no sketch keeps")
    assert resolve(auto, units(2048), search=StepSearch(line_search="full_rank")) == (
        None, "auto: step_search.line_search='full_rank' installs M + αΔM at full rank")
    assert resolve(auto, units(2048, sketch=False)) == (None, "auto: _Form of layer 0 captures no sketch")
    assert resolve(StatisticsSettings(sketch="off"), units(2048)) == (None, "statistics.sketch: off")
    assert resolve(StatisticsSettings(), units(2048)) == (K24, "auto: e′ = 2048 ≥ 2·(k + l) = 120 on cpu")


def test_auto_sketches_when_the_full_statistics_exceed_max_memory_and_the_sketch_fits():
    # 16 layers, 32 heads, 8 KV heads, e′ 100 (< κ·(k + l) = 120, so that the width rule alone keeps the full path):
    # full 16·4·100²·33 = 21.1 MB, sketch 16·4·100·(100 + 32·24 + 8·36) = 7.4 MB and its test matrices
    # 16·4·100·(24 + 32·36) = 7.5 MB, 14.9 MB together.
    forms = units(100, layers=16, h=32, kv=8)
    assert resolve(StatisticsSettings(sketch="auto"), forms) == (None, "auto: e′ = 100 < 2·(k + l) = 120 on cpu")
    assert resolve(StatisticsSettings(sketch="auto", max_memory_gb=0.015), forms) == (
        K24, "auto: the full statistics' 21.1 MB per rank exceed statistics.max_memory_gb=0.015, the sketch's 14.9 MB "
             "fit")
    # The sums alone would fit 10 MB; with the test matrices beside them the sketch does not.
    assert resolve(StatisticsSettings(sketch="auto", max_memory_gb=0.01), forms)[0] is None
    # Nor when the sketch does not fit either: the memory check then refuses, naming the fixes.
    assert resolve(StatisticsSettings(sketch="auto", max_memory_gb=0.005), forms)[0] is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_rule_width(device):
    kappa = SKETCH_CROSSOVER[device]
    threshold = kappa * (K24.k + K24.l)
    at = math.ceil(threshold)
    assert resolve(StatisticsSettings(sketch="auto"), units(at), device=device) == (
        K24, f"auto: e′ = {at} ≥ {kappa:g}·(k + l) = {threshold:g} on {device}")
    assert resolve(StatisticsSettings(sketch="auto"), units(at - 1), device=device) == (
        None, f"auto: e′ = {at - 1} < {kappa:g}·(k + l) = {threshold:g} on {device}")


def test_on_refuses_units_that_capture_no_sketch_and_warns_when_it_saves_nothing():
    with pytest.raises(ValueError) as refused:
        resolve(StatisticsSettings(sketch="on"), units(64, sketch=False))
    assert str(refused.value) == (
        "statistics.sketch: on needs forms that capture a sketch (lit_growattn.contract.SketchCapture); _Form of "
        "layer 0 lacks sketch: set statistics.sketch to off, or to auto (which then keeps the full statistics)")
    with pytest.raises(ValueError, match=r"^statistics.sketch: on needs value maps that capture a sketch "
                                         r"\(lit_growattn.contract.SketchCapture\); _Values of layer 1 lacks sketch:"):
        resolve(StatisticsSettings(sketch="on"), units(64, layers=1) + [NamedForm(1, "v", _Values(4, 2, 64))])
    old_protocol = units(64, layers=1)
    # A form with `sketch` but without the sketch's memory member:
    old_protocol[0].form.__class__ = type("_OldForm", (_Form,), {"tests_numel": property(_no_attribute)})
    with pytest.raises(ValueError, match=r"_OldForm of layer 0 lacks tests_numel: set statistics.sketch to off"):
        resolve(StatisticsSettings(sketch="on"), old_protocol)
    assert resolve(StatisticsSettings(sketch="auto"), old_protocol) == (
        None, "auto: _OldForm of layer 0 captures no sketch")
    with pytest.warns(UserWarning) as warned:
        assert resolve(StatisticsSettings(sketch="on", sketch_size=24), units(60)) == (K24, "statistics.sketch: on")
        assert resolve(StatisticsSettings(sketch="on"), units(60)) == (K24, "statistics.sketch: on")
    assert [str(w.message) for w in warned] == [
        "statistics.sketch_size=24 keeps k + l = 60 columns per head, not fewer than the input size e′ = 60: the "
        "sketch saves nothing here",
        "the default sketch size 24 keeps k + l = 60 columns per head, not fewer than the input size e′ = 60: the "
        "sketch saves nothing here"]
    with mock.patch.object(rank_zero_only, "rank", 1), warnings.catch_warnings():  # other ranks stay quiet
        warnings.simplefilter("error")
        assert resolve(StatisticsSettings(sketch="on"), units(60)) == (K24, "statistics.sketch: on")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(StatisticsSettings(sketch="on"), units(61)) == (K24, "statistics.sketch: on")


def test_natural_takes_ridge_one_under_the_sketch_unless_the_ridge_is_set():
    assert sketch_ridge(GrowthSettings(), K24) == 1.0 and sketch_ridge(GrowthSettings(), None) is None
    assert sketch_ridge(GrowthSettings(ridge=0.25), K24) == 0.25
    assert sketch_ridge(GrowthSettings(method="random", size_by="natural"), K24) == 1.0
    assert sketch_ridge(GrowthSettings(method="gradient"), K24) is None
    line = sketch_line(K24, "statistics.sketch: on", 1.0)
    assert line == ("growth statistics sketched: k = 24, l = 36, k_c = 24 per head (statistics.sketch: on); method "
                    "natural means ridge 1.0 under the sketch (growth.ridge null; docs/design.md, sketched statistics)")
    assert sketch_line(None, "auto: e′ = 16 < 2·(k + l) = 120 on cpu", None) == (
        "growth statistics kept in full (auto: e′ = 16 < 2·(k + l) = 120 on cpu)")
