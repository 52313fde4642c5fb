"""scripts/bench_hf.py --quick runs and prints every figure (a smoke test: the figures themselves are in docs/hf.md)."""

import json
import os
import subprocess
import sys

from conftest import REPO, needs_transformers

needs_transformers()


def test_bench_hf_quick_prints_every_figure():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_hf.py"), "--quick", "--repeats", "3"],
                         env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out)
    assert result["converted_vs_native_throughput"] > 0
    assert set(result["stats_step_cost_ratio"]) == {"explicit", "extend"}
    assert all(t > 0 for t in result["median_step_seconds"].values())
