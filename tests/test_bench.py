"""Smoke test of scripts/bench.py: `--quick` runs end to end and prints one JSON object with the headline keys.

No timing is asserted: the machine is shared, and the figures only mean something from a full run.
"""

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO

HEADLINE = (
    "lightning_vs_plain_throughput",
    "budget_spent_vs_lightning_step_ratio",
    "stats_step_cost_ratio",
    "explicit_step_cost_ratio",
    "stats_vs_naive_cost_ratio",
    "stats_step_cost_ratio_pinv",
    "explicit_step_cost_ratio_pinv",
    "stats_vs_naive_cost_ratio_pinv",
    "auto_step_cost_ratio",
    "round_robin_step_cost_ratio",
    "value_step_cost_ratio",
    "both_sides_step_cost_ratio",
    "growth_event_seconds",
    "growth_event_full_seconds",
    "growth_event_epoch_share",
    "stats_peak_memory_ratio",
    "explicit_peak_memory_ratio",
)
SKETCH_KEYS = ("sketch_qk_step_cost_ratio", "sketch_value_step_cost_ratio", "sketch_both_sides_step_cost_ratio",
               "sketch_vs_full_qk_ratio", "sketch_vs_full_value_ratio", "sketch_vs_full_both_sides_ratio",
               "sketch_memory_ratio")


def finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_bench_quick_prints_one_json_object_with_finite_positive_keys():
    # The timeout only guards against a hang; --quick takes about 20 s on 2 loaded cores.
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # nothing but the JSON object on stdout
    bad = {key: result.get(key) for key in HEADLINE + SKETCH_KEYS if not finite_positive(result.get(key))}
    assert not bad, f"missing or not finite positive: {bad}"
    assert result["auto_capture"] in ("extend", "explicit")
    assert len(result["shapes"]) == 2
    for name, shape in result["shapes"].items():
        for key in ("stats_step_cost_ratio", "explicit_step_cost_ratio", "stats_vs_naive_cost_ratio",
                    "stats_step_cost_ratio_pinv", "stats_peak_memory_ratio", "explicit_peak_memory_ratio"):
            assert finite_positive(shape[key]), (name, key, shape[key])
        for key in SKETCH_KEYS:  # smoke, not targets: their medians and the per-repeat ratios they come from
            assert finite_positive(shape[key]), (name, key, shape[key])
            if key != "sketch_memory_ratio":
                repeats = shape["sketch_per_repeat_ratios"][key]
                assert len(repeats) >= 5 and all(finite_positive(x) for x in repeats), (name, key, repeats)
        for key in ("stats_sums_bytes", "stats_extra_peak_bytes", "stats_memory_bytes"):
            assert set(shape[key]) == {"full", "sketch"}, (name, key)
        assert all(finite_positive(shape["stats_sums_bytes"][k]) for k in ("full", "sketch"))
        assert f"sketch_both_sides_step_cost_ratio <= 1.5 ({name})" in result["targets"]
    crossover = result["sketch_crossover"]
    assert crossover["widths"] and all(finite_positive(w["sketch_vs_full"]) for w in crossover["widths"].values())
    assert crossover["kappa"] == "none in range" or finite_positive(crossover["kappa"])
    assert all(finite_positive(s) for s in result["growth_event"]["growth_event_seconds_per_method"].values())
    assert result["growth_event"]["growth_event_full_pieces"]["d_head_after"] == [
        result["growth_event"]["growth_shape"]["d_head_after"]
    ] * result["growth_event"]["growth_shape"]["n_layer"]
    # The event's pieces come from its own stopwatch (the history record's "timings").
    pieces = result["growth_event"]["growth_event_full_pieces"]
    assert all(finite_positive(pieces[k]) for k in ("plan_s", "rating_s", "apply_s")), pieces
    assert all(isinstance(met, bool) for met in result["targets"].values())


def test_bench_uses_only_public_names_of_the_package():
    """No private name of lit_growattn (a `_name` imported or reached as an attribute) in the CPU benchmark."""
    import ast

    modules = ["bench.py", "bench_setup.py", "bench_steps.py", "bench_memory.py", "bench_sketch.py", "bench_common.py"]
    tree = ast.Module([node for m in modules for node in ast.parse((REPO / "scripts" / m).read_text()).body], [])
    ours = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("lit_growattn") for alias in node.names}
    assert not [name for name in ours if name.startswith("_")]
    private = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.startswith("_")
               and not node.attr.startswith("__")]
    assert not private, private
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                and any(getattr(base, "id", "") == "GrowAttentionCallback" for base in node.bases)]


def test_the_gpu_options_go_to_the_gpu_benchmark_and_are_refused_on_cpu(monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    import bench
    import bench_gpu

    calls = []
    monkeypatch.setattr(bench_gpu, "main", calls.append)
    bench.main(["--accelerator", "gpu", "--bf16"])
    bench.main(["--accelerator", "gpu", "--quick"])
    assert calls == [[], ["--dry-run"]]  # bench_gpu.py always runs bf16-mixed; --quick is its tiny dry run
    for argv, refusal in ((["--bf16"], "--bf16 is the GPU benchmark's precision"),
                          (["--accelerator", "gpu", "--threads", "2"], "--threads: options of the CPU benchmark")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert refusal in capsys.readouterr().err


def test_sketch_crossover_interpolates_where_sketch_over_full_falls_through_one():
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_sketch import crossing

    assert crossing([100, 400], [2.0, 0.5]) == pytest.approx(200.0)  # log-midway: ratios 2 and 1/2
    assert crossing([100, 400], [2.0, 1.5]) is None
    assert crossing([100, 400], [0.9, 0.5]) is None


def test_llama1b_measurement_smoke_at_a_reduced_size():
    """--llama1b's measurement (two Llama-3.2-1B-shaped layers) at a few hundredths of its size: its keys and the
    memory check (the units' sums_numel + tests_numel against the allocated sums, inside statistics_memory)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_sketch
    from bench_setup import Env

    r = bench_sketch.measure_llama1b(2, Env("none"), layers=2, hidden=128, heads=4, kv_heads=2, seq_len=64)
    assert all(finite_positive(r["step_cost_ratio"][k]) for k in ("full", "sketch"))
    assert finite_positive(r["sketch_vs_full"]) and finite_positive(r["sketch_memory_ratio"])
    assert all(finite_positive(r["stats_sums_bytes"][k]) for k in ("full", "sketch"))
    assert list(r["target"]) == ["sketch_memory_ratio <= 1/16"]


def test_llama1b_is_refused_with_quick(capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    import bench

    with pytest.raises(SystemExit):
        bench.main(["--quick", "--llama1b"])
    assert "--llama1b is a full-size measurement" in capsys.readouterr().err
