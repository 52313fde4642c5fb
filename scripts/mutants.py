"""Mutation testing of the core (`make mutants`, docs/testing.md): runs mutmut, then prints each module's score.

    python scripts/mutants.py                                   # every configured module ([tool.mutmut])
    python scripts/mutants.py 'lit_growattn.training.optimization.*'     # some mutants only (mutmut's names, globs allowed)
    python scripts/mutants.py --scores                          # the table of the last runs, running nothing
    python scripts/mutants.py --sample 40                       # 40 mutants drawn at random from each module

mutmut keeps its results in mutants/, so a run continues where the last one stopped and retests only what changed.
The score counts a mutant as killed when a test failed or timed out; "no tests" (no selected test calls the
function) counts against it. Mutants not checked yet are left out of the score and shown in their own column.

With --sample N, each module's score is estimated from N of its mutants drawn uniformly at random (with a fixed
seed, so a rerun draws the same ones): the table gives the kills among those drawn and a 95 % Wilson interval for
the module's score; the drawn mutants not killed yet are (re)tested. A module with at most N mutants, or whose every
mutant is checked, is scored whole from the results so far. A survivor of a function that every
training run reaches costs minutes, so the whole product takes about ten CPU-hours; a sample of 40 per module
bounds each score to about ±12 points in about two.

"""

from __future__ import annotations

import argparse
import math
import random
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

MUTMUT = [sys.executable, "-m", "mutmut"]
KILLED = {"killed", "timeout"}


def module_of(mutant: str) -> str:
    """`lit_growattn.growth.step_size.x_choose_step__mutmut_3` → `lit_growattn.growth.step_size`."""
    return mutant.rsplit(".", 1)[0]


def statuses(results: str) -> dict[str, str]:
    """Each mutant's status, from `mutmut results --all true` (lines `name: status`)."""
    found = {}
    for line in results.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            found[name] = status
    return found


def scores(status: dict[str, str]) -> dict[str, Counter]:
    """Per module, the count of each status."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for name, s in status.items():
        counts[module_of(name)][s] += 1
    return counts


def draw(status: dict[str, str], n: int, seed: int) -> list[str]:
    """Up to `n` mutants of each module, uniformly at random; the same ones for the same seed and mutants."""
    by_module: dict[str, list[str]] = defaultdict(list)
    for name in sorted(status):
        by_module[module_of(name)].append(name)
    drawn = []
    for module, names in sorted(by_module.items()):
        drawn += random.Random(f"{seed}:{module}").sample(names, min(n, len(names)))
    return drawn


def sampled(status: dict[str, str], drawn: list[str]) -> dict[str, str]:
    """The drawn mutants' statuses, and every mutant of a module checked whole (its exact score beats a sample's)."""
    complete = {module for module, c in scores(status).items() if not c["not checked"]}
    drawn_set = set(drawn)
    return {name: s for name, s in status.items() if name in drawn_set or module_of(name) in complete}


def wilson(killed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion `killed / n` (sound near 0 and 1, unlike p ± z·se)."""
    p = killed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def table(counts: dict[str, Counter], totals: dict[str, Counter] | None = None) -> str:
    """The per-module table; with `totals` (every mutant's counts), `counts` are a sample's and get an interval."""
    sampled = totals is not None
    head = "| module | killed | checked | score | survived | no tests | not checked |"
    if sampled:
        head = "| module | mutants | drawn | killed | checked | score | 95 % interval | survived | no tests | not checked |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for module, c in sorted(counts.items()):
        checked = sum(c.values()) - c["not checked"]
        killed = sum(c[s] for s in KILLED)
        score = f"{100 * killed / checked:.0f} %" if checked else "–"
        rest = f"{c['survived']} | {c['no tests']} | {c['not checked']} |"
        if not sampled:
            rows.append(f"| {module} | {killed} | {checked} | {score} | {rest}")
            continue
        total = sum(totals[module].values())
        if not checked:
            interval = "–"
        elif checked == total:
            interval = "whole module"
        else:
            low, high = wilson(killed, checked)
            interval = f"{100 * low:.0f}–{100 * high:.0f} %"
        rows.append(f"| {module} | {total} | {sum(c.values())} | {killed} | {checked} | {score} | {interval} | {rest}")
    return "\n".join(rows)


def mutmut_statuses() -> dict[str, str]:
    results = subprocess.run([*MUTMUT, "results", "--all", "true"], capture_output=True, text=True, check=True)
    return statuses(results.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutants", nargs="*", help="mutmut mutant names or globs (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--scores", action="store_true", help="only print the scores of the runs so far")
    parser.add_argument("--sample", type=int, metavar="N", help="score each module from N mutants drawn at random")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed with --sample (default 0)")
    args = parser.parse_args(argv)
    if not Path("pyproject.toml").is_file():
        parser.error("run from the repository root (mutmut reads [tool.mutmut] in ./pyproject.toml)")
    if args.sample is not None and (args.sample < 1 or args.mutants):
        parser.error("--sample N takes N ≥ 1 and draws from every module: leave the mutant names out")
    chosen = args.mutants
    if args.sample is not None:
        status = mutmut_statuses()
        if not status:
            parser.error(
                "--sample draws from the mutants mutmut has generated, and there are none yet: "
                "run `make mutants MUTANTS='lit_growattn.growth.registry.*'` once (it generates every module's "
                "mutants and tests that small module's), then sample"
            )
        chosen = draw(status, args.sample, args.seed)
    if not args.scores:
        # mutmut retests a function whose code changed, not a survivor that a test added since may kill: a sample
        # reruns its survivors (a kill stands, since the tests only grow)
        rerun = [name for name in chosen if args.sample is None or status[name] not in KILLED]
        if args.sample is None or rerun:
            run = subprocess.run([*MUTMUT, "run", "--max-children", str(args.workers), *rerun])
            if run.returncode != 0:
                return run.returncode
    status = mutmut_statuses()
    if args.sample is None:
        print(table(scores(status)))
    else:
        print(table(scores(sampled(status, chosen)), totals=scores(status)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
