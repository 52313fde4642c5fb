"""The K-cache budget study's tables and plot, from its results.json (kcache_study.py's runs):

    python studies/kcache_budget/summary.py     # prints the tables; writes summary.md and loss_vs_kcache.png beside it
    python studies/kcache_budget/summary.py --results A.json B.json --out DIR   # invocations run in parallel, merged

Differences are paired by seed, in % of the second row's loss (100 (a/b − 1)), as mean ± standard error over the
seeds. Static d_head 16 (the ceiling) is taken from these runs where they hold it, else from the capacity study's
results.json (same static path, same seeds), which also holds today's rule ("auto from d_head 1") for the
no-step-back comparison. The verdicts are the criteria stated in README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
CAPACITY = HERE.parent / "capacity" / "results.json"
FULL = 16
BYTES_PER_VALUE = 4


def paired(a: dict[str, float], b: dict[str, float]) -> tuple[float, float | None, int] | None:
    """Mean and standard error over the seeds both hold of 100 (a/b − 1); None without a common seed."""
    diffs = [100 * (a[s] / b[s] - 1) for s in a if s in b]
    if not diffs:
        return None
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return statistics.mean(diffs), se, len(diffs)


def shown(diff) -> str:
    if diff is None:
        return "–"
    mean, se, n = diff
    return f"{mean:+.2f} %" + (f" ± {se:.2f}" if se is not None else " (1 seed)")


def verdict(diff) -> str:
    """At or below ("≤"): the mean difference is within one standard error of zero or under it; above (">"): more
    than two standard errors over it; between: "> (1–2 s.e.)". No verdict from one seed."""
    if diff is None or diff[1] is None:
        return "–"
    mean, se, _ = diff
    return "≤" if mean - se <= 0 else ">" if mean - 2 * se > 0 else "> (1–2 s.e.)"


class Cell:
    """One model size and corpus: each row's runs by seed, and the ceiling and today's rule by seed."""

    def __init__(self, rows: dict[str, dict[str, dict]], capacity: dict):
        self.rows = rows
        self.static16 = {s: r["loss"] for s, r in rows.get("static 16", {}).items()}
        for seed, old in capacity.items():
            self.static16.setdefault(seed, old["static d_head 16"])
        self.today = {s: old["auto from d_head 1"]["loss"] for s, old in capacity.items()}

    def loss(self, row: str) -> dict[str, float]:
        return {s: r["loss"] for s, r in self.rows.get(row, {}).items()}

    def mean(self, row: str, key) -> float | None:
        values = [key(r) for r in self.rows.get(row, {}).values()]
        return statistics.mean(values) if values else None


def cells(results: dict, capacity: dict) -> dict[tuple[str, str], Cell]:
    return {(model, corpus): Cell(rows, capacity.get(model, {}).get(corpus, {}))
            for model, corpora in results["runs"].items() for corpus, rows in corpora.items()}


def budgets(found: dict[tuple[str, str], Cell]) -> list[str]:
    """The budgets any row was run at (its name ends in the budget; the ceiling's in 16)."""
    return sorted({row.rpartition(" ")[2] for c in found.values() for row in c.rows
                   if row != "static 16" and row.rpartition(" ")[2].isdigit()}, key=int)


def share(record: dict) -> float:
    """The K cache as a share of static 16's, from the run's widths."""
    return sum(record["d_head"]) / (FULL * len(record["d_head"]))


def percent(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}%}"


def budget_table(found: dict[tuple[str, str], Cell]) -> str:
    lines = ["| model | corpus | budget | grown seeds | grown loss | grown − uniform | grown − post-hoc | "
             "grown − static at its widths | grown − static 16 | uniform − static 16 | post-hoc − static 16 | "
             "K cache of static 16's (grown) | statistics' share of training time | goal (≤ uniform and ≤ post-hoc) |",
             "|" + "---|" * 14]
    for (model, corpus), cell in found.items():
        for b in budgets(found):
            grown, uniform, posthoc = (cell.loss(f"{kind} {b}") for kind in ("grown", "uniform static", "post-hoc"))
            if not (grown or uniform or posthoc):
                continue
            versus = [paired(grown, uniform), paired(grown, posthoc)]
            goal = "met" if all(verdict(v) == "≤" for v in versus) else " / ".join(verdict(v) for v in versus)
            lines.append("| " + " | ".join([
                model, corpus, b, str(len(grown)), f"{statistics.mean(grown.values()):.4f}" if grown else "–",
                *map(shown, versus), shown(paired(grown, cell.loss(f"static at the allocator's widths {b}"))),
                *(shown(paired(row, cell.static16)) for row in (grown, uniform, posthoc)),
                percent(cell.mean(f"grown {b}", share), 1),
                percent(cell.mean(f"grown {b}", lambda r: r["time"]["statistics_share"]), 1), goal]) + " |")
    return "\n".join(lines)


def unbudgeted_table(found: dict[tuple[str, str], Cell]) -> str:
    lines = ["| model | corpus | seeds | no budget − static 16 | no budget − today's rule | K cache of static 16's | "
             "statistics' share of training time | no step back |", "|" + "---|" * 8]
    for (model, corpus), cell in found.items():
        free = cell.loss("grown, no budget")
        if not free:
            continue
        back = paired(free, cell.today)
        lines.append("| " + " | ".join([
            model, corpus, str(len(free)), shown(paired(free, cell.static16)), shown(back),
            percent(cell.mean("grown, no budget", share), 1),
            percent(cell.mean("grown, no budget", lambda r: r["time"]["statistics_share"]), 1),
            {"≤": "met", "–": "–"}.get(verdict(back), "not met")]) + " |")
    return "\n".join(lines)


def widths_table(found: dict[tuple[str, str], Cell]) -> str:
    """Per layer: the mean width over the seeds and its range, for the rows whose widths are chosen."""
    lines = ["| model | corpus | row | d_head per layer: mean (min–max over seeds) |", "|---|---|---|---|"]
    chosen = [f"{kind} {b}" for b in budgets(found) for kind in ("grown", "post-hoc")] + ["grown, no budget"]
    for (model, corpus), cell in found.items():
        for row in chosen:
            runs = list(cell.rows.get(row, {}).values())
            if runs:
                layers = zip(*(r["d_head"] for r in runs))
                lines.append(f"| {model} | {corpus} | {row} | "
                             + ", ".join(f"{statistics.mean(w):.1f} ({min(w)}–{max(w)})" for w in layers) + " |")
    return "\n".join(lines)


def flops_table(found: dict[tuple[str, str], Cell]) -> str:
    """Training FLOPs per model size and row, over corpora and seeds (the model's own FLOPs; statistics excluded)."""
    lines = ["| model | row | runs | training FLOPs | × static 16 |", "|---|---|---|---|---|"]
    for model in dict.fromkeys(m for m, _ in found):
        rows: dict[str, list[float]] = {}
        for (m, _), cell in found.items():
            for row, runs in cell.rows.items():
                if m == model:
                    rows.setdefault(row, []).extend(r["flops"] for r in runs.values())
        full = statistics.mean(rows["static 16"]) if "static 16" in rows else None
        for row, flops in rows.items():
            ratio = f"{statistics.mean(flops) / full:.2f}" if full else "–"
            lines.append(f"| {model} | {row} | {len(flops)} | {statistics.mean(flops):.3g} | {ratio} |")
    return "\n".join(lines)


def plot(found: dict[tuple[str, str], Cell], path: Path) -> None:
    """Final loss (% above static 16, paired by seed) against K-cache bytes per token, one panel per model size:
    each row's mean over corpora and seeds, with its standard error."""
    models = list(dict.fromkeys(m for m, _ in found))
    fig, axes = plt.subplots(1, len(models), figsize=(6.4 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        points: dict[str, tuple[list[float], list[float]]] = {}
        for (m, _), cell in found.items():
            if m != model:
                continue
            for row, runs in cell.rows.items():
                for seed, r in runs.items():
                    if seed in cell.static16:
                        xs, ys = points.setdefault(row, ([], []))
                        xs.append(r["kcache_bytes"])
                        ys.append(100 * (r["loss"] / cell.static16[seed] - 1))
        for row, (xs, ys) in points.items():
            se = statistics.stdev(ys) / math.sqrt(len(ys)) if len(ys) > 1 else None
            marker = {"grown": "o", "uniform": "s", "static": "x", "post-hoc": "^"}.get(row.split()[0].rstrip(","), "d")
            ax.errorbar(statistics.mean(xs), statistics.mean(ys), yerr=se, marker=marker, ls="", label=row)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_title(f"{model}: corpora × seeds", fontsize=9)
        ax.set_xlabel("K-cache bytes per token")
        ax.set_ylabel("final validation loss, % above static d_head 16")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_merged(parser: argparse.ArgumentParser, paths: list[Path], merge, script: str) -> dict:
    """The results of `paths` (one grid's files, written side by side) as one dict by `merge`; absent files, or a
    run found in two, fail through `parser` naming `script`, the grid that writes them (the value study's summary
    reads its files with this too)."""
    if absent := [str(p) for p in paths if not p.is_file()]:
        parser.error(f"no results at {', '.join(absent)}: run {script} first (README.md gives the commands)")
    try:
        return merge([json.loads(p.read_text()) for p in paths])
    except ValueError as error:
        parser.error(str(error))


def merged(parts: list[dict]) -> dict:
    """One results dict from the JSONs of parallel invocations (each wrote its own file); a run in two is refused."""
    runs: dict = {}
    for part in parts:
        for model, corpora in part["runs"].items():
            for corpus, rows in corpora.items():
                for row, seeds in rows.items():
                    into = runs.setdefault(model, {}).setdefault(corpus, {}).setdefault(row, {})
                    if twice := sorted(set(into) & set(seeds)):
                        raise ValueError(f"{model} {corpus} {row!r} seeds {twice} are in two of the results files")
                    into.update(seeds)
    return {"runs": runs}


def reruns(found: dict[tuple[str, str], Cell], capacity: dict) -> str:
    """Static 16 run here against the capacity study's run of the same model, corpus and seed (reused elsewhere)."""
    lines = [f"- {model} {corpus} seed {seed}: {r['loss']:.5f} here, {old[seed]['static d_head 16']:.5f} there"
             for (model, corpus), cell in found.items() for seed, r in cell.rows.get("static 16", {}).items()
             if seed in (old := capacity.get(model, {}).get(corpus, {}))]
    return "\n".join(lines) or "- none: every static 16 loss comes from one source"


def report(results: dict, capacity: dict) -> str:
    found = cells(results, capacity)
    return "\n\n".join([
        "At each budget (paired differences by seed, % of the second row's loss, mean ± s.e.):", budget_table(found),
        "Budget null (every column that clears the noise floor) against the ceiling and today's rule:",
        unbudgeted_table(found), "Widths per layer over the seeds:", widths_table(found),
        "Training FLOPs:", flops_table(found),
        "Static 16 re-run against the capacity study's (its losses stand in for the runs not repeated here):",
        reruns(found, capacity)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, nargs="+", default=[HERE / "results.json"])
    parser.add_argument("--capacity", type=Path, default=CAPACITY, help="the capacity study's results.json")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for summary.md and loss_vs_kcache.png")
    args = parser.parse_args(argv)
    results = read_merged(parser, args.results, merged, "kcache_study.py")
    capacity = json.loads(args.capacity.read_text())["runs"]
    text = report(results, capacity)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(cells(results, capacity), args.out / "loss_vs_kcache.png")
    names = ", ".join(p.name for p in args.results)
    (args.out / "summary.md").write_text(f"# K-cache budget study: summary of {names}\n\n{text}\n\n"
                                         "![Final loss against K-cache bytes per token](loss_vs_kcache.png)\n")
    print(text)


if __name__ == "__main__":
    main()
