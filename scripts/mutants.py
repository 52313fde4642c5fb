"""Mutation testing of the core (`make mutants`, docs/testing.md): runs mutmut, then prints each module's score.

    python scripts/mutants.py                                   # every configured module ([tool.mutmut])
    python scripts/mutants.py 'lit_growattn.training.optimization.*'     # some mutants only (mutmut's names, globs allowed)
    python scripts/mutants.py --scores                          # the table of the last runs, running nothing

mutmut keeps its results in mutants/, so a run continues where the last one stopped and retests only what changed.
The score counts a mutant as killed when a test failed or timed out; "no tests" (no selected test calls the
function) counts against it. Mutants not checked yet are left out of the score and shown in their own column.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

MUTMUT = [sys.executable, "-m", "mutmut"]
KILLED = {"killed", "timeout"}


def module_of(mutant: str) -> str:
    """`lit_growattn.growth.step_size.x_choose_step__mutmut_3` → `lit_growattn.growth.step_size`."""
    return mutant.rsplit(".", 1)[0]


def scores(results: str) -> dict[str, Counter]:
    """Per module, the count of each status in `mutmut results --all true` (lines `name: status`)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for line in results.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            counts[module_of(name)][status] += 1
    return counts


def table(counts: dict[str, Counter]) -> str:
    rows = ["| module | killed | checked | score | survived | no tests | not checked |", "|---|---|---|---|---|---|---|"]
    for module, c in sorted(counts.items()):
        checked = sum(c.values()) - c["not checked"]
        killed = sum(c[s] for s in KILLED)
        score = f"{100 * killed / checked:.0f} %" if checked else "–"
        rows.append(f"| {module} | {killed} | {checked} | {score} | {c['survived']} | {c['no tests']} | {c['not checked']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutants", nargs="*", help="mutmut mutant names or globs (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--scores", action="store_true", help="only print the scores of the runs so far")
    args = parser.parse_args(argv)
    if not Path("pyproject.toml").is_file():
        parser.error("run from the repository root (mutmut reads [tool.mutmut] in ./pyproject.toml)")
    if not args.scores:
        run = subprocess.run([*MUTMUT, "run", "--max-children", str(args.workers), *args.mutants])
        if run.returncode != 0:
            return run.returncode
    results = subprocess.run([*MUTMUT, "results", "--all", "true"], capture_output=True, text=True, check=True)
    print(table(scores(results.stdout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
