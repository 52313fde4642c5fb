"""Smoke test of scripts/bench_data.py: `--quick` runs end to end and prints one JSON object with every figure.

No figure is asserted beyond being there and positive: the machine is shared, and the figures only mean something
from a full run (recorded in docs/data.md).
"""

import json
import subprocess
import sys

from conftest import REPO


def test_bench_data_quick_prints_every_figure():
    out = subprocess.run([sys.executable, str(REPO / "scripts/bench_data.py"), "--quick", "--sizes-mb", "2"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    result = json.loads(out)
    assert set(result["memory"]) == {"2mb", "growth_mb"}
    assert all(result["memory"][k]["peak_rss_mb"] > 0 for k in ("2mb",))
    assert result["speed"]["loader_vs_step_ratio"] > 0
    for num_proc in (1, 2):
        assert result["bpe"][f"num_proc_{num_proc}"]["token_file_mb_per_s"] > 0
    assert result["bpe"]["bytes_per_token"] > 1
