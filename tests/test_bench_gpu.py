"""The GPU kit on CPU: scripts/gpu/check.py --dry-run runs every step at tiny sizes (scripts/bench_gpu.py among
them) and writes its JSON with every key; `make gpu-wheels` pins versions within the project's requirements."""

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO, launch

CHECK = REPO / "scripts" / "gpu" / "check.py"

STEP_KEYS = {
    "gpu_tests": {"passed", "failed", "skipped", "pytest_exit_code", "tests", "checks"},
    "bench_gpu": {"device", "torch", "lightning", "precision", "compile", "setup", "throughput", "statistics_step",
                  "sdpa_backends", "targets", "bench_seconds", "checks"},
    "sketch_1b": {"device", "shape", "auto_capture", "step_s", "step_cost_ratio", "sketch_vs_full",
                  "per_repeat_sketch_vs_full", "stats_sums_bytes", "stats_extra_peak_bytes", "stats_memory_bytes",
                  "plain_step_peak_bytes", "sketch_sums_ratio", "sketch_memory_ratio", "target", "checks"},
    "sketch_crossover": {"device", "shape", "sketch_size", "widths", "e_in_crossing", "kappa", "checks"},
    "mfu": {"setup", "matmul_peak_tflops", "flops_per_token", "tokens_per_s", "mfu", "statistics_step", "checks"},
    "text_growth": {"corpus", "batch_size", "block_size", "steps", "growth_lines", "d_head", "step_s_per_epoch",
                    "step_s_before_after_growth", "val_loss", "checks"},
    "fsdp2_growth": {"growth_lines", "d_head", "d_v", "parameters_sharded", "val_loss", "resumed_from",
                     "resumed_d_head", "resumed_d_v", "resumed_val_loss", "checks"},
    "seed001": {"model", "steps", "fit_seconds", "mean_abs_lambda_per_layer", "attention_entropy", "losses", "checks"},
}


def test_dry_run_runs_every_step_and_writes_every_key(tmp_path):
    # One test for the one dry run: spread over several, the test workers of `make test` would each run it.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = launch([sys.executable, CHECK, "--dry-run", "--out", tmp_path], cwd=REPO, env=env, timeout=900)
    log = (tmp_path / "gpu_check.log").read_text()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:] + log[-4000:]
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert set(result) == {"dry_run", "seconds", "environment", "steps", "checks"} and result["dry_run"]
    assert result["environment"]["result"]["device"] == "cpu"
    assert result["environment"]["result"]["unmet_requirements"] == []
    assert list(result["steps"]) == list(STEP_KEYS)
    for name, keys in STEP_KEYS.items():
        step = result["steps"][name]
        assert step["status"] == "ok" and step["error"] is None, (name, step["error"])
        assert set(step["result"]) == keys, name
    assert "growth at step 12 (epoch 2): d_head 9→16 per layer" in log
    # Where a CPU can answer, it does; figures only a GPU gives are not judged here.
    assert result["checks"] == {
        "gpu_tests: gpu tests pass": None,
        "bench_gpu: grown_vs_static_throughput >= 0.95": None,
        "bench_gpu: stats_step_cost_ratio <= 1.5": None,
        "bench_gpu: both_sides_step_cost_ratio <= 1.5": None,
        "bench_gpu: no math fallback at any d_head": None,
        "sketch_1b: sketch_memory_ratio <= 1/16": None,
        "text_growth: text run grows at every event": True,
        "fsdp2_growth: FSDP2 run grows at every event, sharded": True,
        "fsdp2_growth: FSDP2 run resumes from its folder at the grown sizes": True,
        "seed001: lambda moves": True,
        "seed001: entropy callback logs": True,
    }
    steps = {name: step["result"] for name, step in result["steps"].items()}

    # The GPU tests are collected, and skipped without CUDA.
    tests = steps["gpu_tests"]
    assert tests["skipped"] == len(tests["tests"]) >= 9 and tests["passed"] == tests["failed"] == 0
    assert {t["message"] for t in tests["tests"].values()} == {"Skipped: needs a CUDA GPU"}

    # bench_gpu.py: CPU has a flash kernel too, with one rule: q, k and v of the same width. Padded, every head size
    # reaches it (a fallback would have raised under the fused-only restriction); unpadded, d_head 1 ≠ d_v falls back.
    bench = steps["bench_gpu"]
    assert bench["throughput"]["grown_d_head"] == [bench["setup"]["d_head_grown"]] * bench["setup"]["n_layer"]
    for key in ("grown_vs_static_throughput", "lightning_vs_plain_throughput"):
        assert bench["throughput"][key] > 0
    assert bench["statistics_step"]["stats_step_cost_ratio"] > 0
    backends = bench["sdpa_backends"]
    assert backends["math_fallbacks"] == [] and len(backends["per_d_head"]) == len(bench["setup"]["d_heads"])
    for row in backends["per_d_head"].values():
        assert "flash" in row["padded_train"] and "flash" in row["padded_extend"], row
    assert "math" in backends["per_d_head"]["1"]["unpadded_train"]

    # The 1B measurement at a tiny size (where e′ is too small for the sketch to be smaller): every step was timed.
    sketch = steps["sketch_1b"]
    assert sketch["device"] == "cpu" and sketch["sketch_sums_ratio"] > 0 and sketch["stats_memory_bytes"]["full"] > 0
    assert all(t > 0 for t in sketch["step_s"].values()) and set(sketch["step_s"]) == {"normal", "both", "sketch_both"}

    # MFU: 6 FLOPs per weight and token (tied embedding counted once, no position table), plus the causal score
    # and value products, 3 × (s + 1) × n_head · (d_head + d_v) per layer; against the measured matmul peak.
    mfu, s = steps["mfu"], steps["mfu"]["setup"]
    weights = s["vocab"] * s["n_embd"] + s["n_layer"] * (12 * s["n_embd"] ** 2 + 4 * s["n_embd"])
    attention = s["n_layer"] * 3 * (s["block_size"] + 1) * s["n_head"] * (s["d_head"] + s["d_v"])
    assert mfu["flops_per_token"] == pytest.approx(6 * weights + attention, rel=0.05)
    for kind in ("normal", "statistics"):
        assert mfu["tokens_per_s"][kind] > 0
        assert mfu["mfu"][kind] == pytest.approx(
            mfu["flops_per_token"] * mfu["tokens_per_s"][kind] / (mfu["matmul_peak_tflops"] * 1e12))

    # The text run grows twice (2 → 9 → 16) and times every epoch.
    assert steps["text_growth"]["d_head"] == [16, 16] and len(steps["text_growth"]["step_s_per_epoch"]) == 3


def test_the_check_refuses_to_overwrite_results(tmp_path):
    (tmp_path / "bench_gpu.json").write_text("{}")
    done = subprocess.run([sys.executable, str(CHECK), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "bench_gpu.json exists already: give another --out folder" in done.stderr
    assert (tmp_path / "bench_gpu.json").read_text() == "{}"


def test_gpu_wheels_meet_the_projects_requirements():
    # The pins are the versions tested when they were set (docs/gpu.md); a fresh install may resolve newer ones, but
    # a pin outside pyproject.toml's range would put an untested version on the GPU machine.
    pins = re.search(r"^GPU_WHEELS := (.*?)(?<!\\)$", (REPO / "Makefile").read_text(), re.M | re.S).group(1)
    pinned = dict(pin.split("==") for pin in pins.replace("\\\n", " ").split())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["hf"]]]
    by_name = {canonicalize_name(r.name): r for r in requirements}
    assert {"jsonargparse", "ruamel-yaml", "datasets", "transformers"} <= {canonicalize_name(n) for n in pinned}
    for name, version in pinned.items():
        required = by_name.get(canonicalize_name(name))
        assert required is None or required.specifier.contains(version), (name, version, str(required))
