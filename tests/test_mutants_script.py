"""scripts/mutants.py's sampled scores (`make mutants`, docs/testing.md): the draw, the interval and the table."""

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import mutants  # noqa: E402  (scripts/ is not a package)


def _status(counts: dict[str, int], checked: int) -> dict[str, str]:
    """`counts[module]` mutants per module; the first `checked` of each killed, the rest not checked."""
    return {
        f"lit_growattn.{module}.f__mutmut_{i}": "killed" if i < checked else "not checked"
        for module, n in counts.items()
        for i in range(n)
    }


def test_draw_takes_n_per_module_and_the_same_ones_for_a_seed():
    status = _status({"a": 100, "b": 7}, checked=0)
    drawn = mutants.draw(status, 40, seed=0)
    per_module = Counter(mutants.module_of(name) for name in drawn)
    assert per_module == {"lit_growattn.a": 40, "lit_growattn.b": 7}
    assert len(set(drawn)) == len(drawn)
    assert mutants.draw(dict(reversed(status.items())), 40, seed=0) == drawn  # order of mutmut's listing is irrelevant
    assert mutants.draw(status, 40, seed=1) != drawn


def test_draw_is_uniform_over_a_module():
    status = _status({"a": 10}, checked=0)
    hits = Counter(name for seed in range(2000) for name in mutants.draw(status, 3, seed))
    # each of 10 mutants drawn with probability 3/10: 600 of 2000 draws, binomial sd ≈ 20.5; 5 sd apart
    assert all(abs(hits[name] - 600) < 5 * 20.5 for name in status), hits


@pytest.mark.parametrize(
    ("killed", "n", "low", "high"),
    # reference values of the 95 % Wilson score interval (z = 1.96), to 4 digits
    [(40, 40, 0.9124, 1.0), (0, 10, 0.0, 0.2775), (30, 40, 0.5981, 0.8581), (1, 2, 0.0945, 0.9055)],
)
def test_wilson_interval(killed, n, low, high):
    assert mutants.wilson(killed, n) == pytest.approx((low, high), abs=1e-4)


def test_sampled_table_scores_complete_modules_whole_and_others_from_the_draw():
    status = _status({"whole": 50, "part": 100}, checked=60)
    status["lit_growattn.whole.f__mutmut_0"] = "survived"
    status["lit_growattn.part.f__mutmut_10"] = "survived"
    drawn = [f"lit_growattn.part.f__mutmut_{i}" for i in range(0, 100, 10)]  # 6 checked (1 survived), 4 not
    rows = mutants.table(mutants.scores(mutants.sampled(status, drawn)), totals=mutants.scores(status)).splitlines()
    assert rows[2] == "| lit_growattn.part | 100 | 10 | 5 | 6 | 83 % | 44–97 % | 1 | 0 | 4 |"
    assert rows[3] == "| lit_growattn.whole | 50 | 50 | 49 | 50 | 98 % | whole module | 1 | 0 | 0 |"
