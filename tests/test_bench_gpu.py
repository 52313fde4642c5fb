"""scripts/bench_gpu.py --dry-run: the GPU benchmark's command works on CPU (tiny shapes; no figure is asserted)."""

import json
import subprocess
import sys

from conftest import REPO


def test_gpu_bench_dry_run_prints_every_measurement_and_padding_reaches_flash():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["throughput"]["grown_d_head"] == [result["setup"]["d_head_grown"]] * result["setup"]["n_layer"]
    for key in ("grown_vs_static_throughput", "lightning_vs_plain_throughput"):
        assert result["throughput"][key] > 0
    assert result["statistics_step"]["stats_step_cost_ratio"] > 0
    assert all(isinstance(met, bool) for met in result["targets"].values())
    # CPU has a flash kernel too, with one rule: q, k and v of the same width. Padded, every head size reaches it
    # (a fallback would have raised under the fused-only restriction); unpadded, d_head 1 ≠ d_v falls back.
    backends = result["sdpa_backends"]
    assert backends["math_fallbacks"] == [] and len(backends["per_d_head"]) == 64
    for row in backends["per_d_head"].values():
        assert "flash" in row["padded_train"] and "flash" in row["padded_extend"], row
    assert "math" in backends["per_d_head"]["1"]["unpadded_train"]
