"""The spend_budget study's tables, criteria and plot (README.md), from its results and the reused rows of
studies/kcache_budget:

    python studies/spend_budget/summary.py      # prints the tables; writes summary.md and loss_vs_kcache.png here

Its own files (`results_<model>_<corpus>.json`: the grown rows of the rule that spends the whole budget and the static
rows at their widths; `posthoc_<model>_<corpus>.json`: activation-aware post-hoc) are read beside the K-cache study's
files of the same model and corpus, whose "uniform static b" and "post-hoc b" rows are reused and whose "grown b" is
the rule before ("grown before b"). Differences are paired by seed, 100 (a/b − 1) % of the second row's loss, as mean
± standard error; the verdicts are kcache_budget's (≤: within one standard error of zero or under it; >: more than
two above it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
KCACHE = HERE.parent / "kcache_budget"


def _kcache_summary():
    """kcache_budget's summary.py, by path (the name `summary` is every study's)."""
    spec = importlib.util.spec_from_file_location("kcache_summary", KCACHE / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


paired, shown, verdict = (getattr(_kcache_summary(), name) for name in ("paired", "shown", "verdict"))

CELLS = [("2layer", "pystdlib", 2), ("2layer", "pystdlib", 4), ("2layer", "usrdoc", 2), ("8layer", "pystdlib", 4),
         ("8layer", "usrdoc", 4)]
SEEDS = {"2layer": 6, "8layer": 3}
CAPACITY = HERE.parent / "capacity" / "results.json"
PHASE_ONE_TOLERANCE = 1e-5  # the reused post-hoc's first phase, reproduced (README, "free reproduction checks")


def rows_of(model: str, corpus: str, budget: int, folder: Path, reused: Path) -> dict[str, dict[str, dict]]:
    """Every row of one cell by its name here, each {seed: run}: the new rows and the reused ones."""
    def cell(path: Path) -> dict:
        return json.loads(path.read_text())["runs"].get(model, {}).get(corpus, {}) if path.is_file() else {}

    new = {**cell(folder / f"results_{model}_{corpus}.json"), **cell(folder / f"posthoc_{model}_{corpus}.json")}
    old = cell(reused / f"results_{model}_{corpus}.json")
    b = str(budget)
    return {"grown": new.get(f"grown {b}", {}), "static at its widths": new.get(f"static at the allocator's widths {b}", {}),
            "activation-aware post-hoc": new.get(f"activation-aware post-hoc {b}", {}),
            "uniform static": old.get(f"uniform static {b}", {}), "post-hoc": old.get(f"post-hoc {b}", {}),
            "grown before": old.get(f"grown {b}", {})}


def losses(runs: dict[str, dict]) -> dict[str, float]:
    return {seed: run["loss"] for seed, run in runs.items()}


def unspent(run: dict, budget: int) -> int:
    """K-cache values per token the budget adds that a grown run left unbought (4 heads: a column costs 4)."""
    return 4 * (budget * len(run["d_head"]) - sum(run["d_head"]))


def criteria_table(cells: dict) -> str:
    lines = ["| model | corpus | budget | seeds (grown, aware) | C1: grown − uniform | C1: grown − aware post-hoc | "
             "C2: runs that spent it all | C3: grown − grown before | C4: aware − weight-SVD post-hoc | C1 |",
             "|" + "---|" * 10]
    for (model, corpus, b), rows in cells.items():
        grown = losses(rows["grown"])
        c1 = [paired(grown, losses(rows["uniform static"])), paired(grown, losses(rows["activation-aware post-hoc"]))]
        spent = sum(unspent(run, b) < 4 for run in rows["grown"].values())
        c3 = paired(grown, losses(rows["grown before"])) if model == "8layer" else None
        c4 = paired(losses(rows["activation-aware post-hoc"]), losses(rows["post-hoc"]))
        complete = len(grown) == SEEDS[model] and len(rows["activation-aware post-hoc"]) == SEEDS[model]
        met = ("met" if all(verdict(v) == "≤" for v in c1) else "not met: " + " / ".join(verdict(v) for v in c1)) \
            if complete else f"not judged (seeds run: {len(grown)}, {len(rows['activation-aware post-hoc'])} of " \
                             f"{SEEDS[model]})"
        lines.append("| " + " | ".join([
            model, corpus, str(b), f"{len(grown)}, {len(rows['activation-aware post-hoc'])}",
            *(f"{shown(v)} {verdict(v)}" for v in c1), f"{spent} of {len(grown)}",
            f"{shown(c3)} {verdict(c3)}" if c3 else "–", f"{shown(c4)} {verdict(c4)}", met]) + " |")
    return "\n".join(lines)


def reported_table(cells: dict, static16: dict) -> str:
    lines = ["| model | corpus | budget | grown − static at its widths | aware post-hoc − uniform | grown − static 16 | "
             "uniform − static 16 | aware post-hoc − static 16 | statistics' share (grown) | shrink seconds (aware) |",
             "|" + "---|" * 10]
    for (model, corpus, b), rows in cells.items():
        full = static16.get(model, {}).get(corpus, {})
        grown = losses(rows["grown"])
        share = [run["time"]["statistics_share"] for run in rows["grown"].values()]
        shrink = [run["time"]["shrink_s"] for run in rows["activation-aware post-hoc"].values()]
        lines.append("| " + " | ".join([
            model, corpus, str(b), shown(paired(grown, losses(rows["static at its widths"]))),
            shown(paired(losses(rows["activation-aware post-hoc"]), losses(rows["uniform static"]))),
            *(shown(paired(losses(rows[row]), full)) for row in ("grown", "uniform static", "activation-aware post-hoc")),
            f"{statistics.mean(share):.1%}" if share else "–", f"{statistics.mean(shrink):.1f}" if shrink else "–"]) + " |")
    return "\n".join(lines)


def widths_table(cells: dict) -> str:
    lines = ["| model | corpus | budget | row | d_head per layer: mean (min–max over seeds) |", "|---|---|---|---|---|"]
    for (model, corpus, b), rows in cells.items():
        for row in ("grown", "grown before", "activation-aware post-hoc", "post-hoc"):
            if runs := list(rows[row].values()):
                layers = zip(*(run["d_head"] for run in runs))
                lines.append(f"| {model} | {corpus} | {b} | {row} | "
                             + ", ".join(f"{statistics.mean(w):.1f} ({min(w)}–{max(w)})" for w in layers) + " |")
    return "\n".join(lines)


def reproduction(cells: dict) -> str:
    """The free checks, judged before any result: the new rows against the reused ones where they must agree."""
    found = []
    for (model, corpus, b), rows in cells.items():
        for seed, aware in rows["activation-aware post-hoc"].items():
            if (old := rows["post-hoc"].get(seed)) is not None:
                at = aware["growths"][0][0]
                mine, theirs = ([p for p in run["curve"] if p[0] <= at] for run in (aware, old))
                same = [p[0] for p in mine] == [p[0] for p in theirs] and all(
                    abs(p[2] - q[2]) <= PHASE_ONE_TOLERANCE for p, q in zip(mine, theirs))
                found.append(f"- {model} {corpus} b{b} seed {seed}: first phase {'equal' if same else 'DIFFERS'}")
        for seed, grown in rows["grown"].items():
            if (old := rows["grown before"].get(seed)) is not None:
                last = grown["last_check"]["step"]
                same = [g for g in grown["growths"] if g[0] < last] == [g for g in old["growths"] if g[0] < last]
                found.append(f"- {model} {corpus} b{b} seed {seed}: growths before step {last} "
                             f"{'equal' if same else 'DIFFER'}")
    return "\n".join(found) or "- none yet"


def plot(cells: dict, static16: dict, path: Path) -> None:
    """Each row's mean final loss (% above static 16, paired by seed, with its standard error) against its K-cache
    bytes per token, one panel per cell."""
    fig, axes = plt.subplots(1, len(cells), figsize=(3.6 * len(cells), 3.6), squeeze=False)
    for ax, ((model, corpus, b), rows) in zip(axes[0], cells.items()):
        full = static16.get(model, {}).get(corpus, {})
        for row, runs in rows.items():
            points = [(run["kcache_bytes"], 100 * (run["loss"] / full[s] - 1)) for s, run in runs.items() if s in full]
            if points:
                xs, ys = zip(*points)
                se = statistics.stdev(ys) / math.sqrt(len(ys)) if len(ys) > 1 else None
                ax.errorbar(statistics.mean(xs), statistics.mean(ys), yerr=se, marker="o", ls="", label=row)
        ax.set_title(f"{model} {corpus}, budget {b}", fontsize=8)
        ax.set_xlabel("K-cache bytes per token", fontsize=7)
        ax.set_ylabel("loss, % above static d_head 16", fontsize=7)
        if ax.get_legend_handles_labels()[0]:  # a cell with no runs yet has nothing to name
            ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=HERE, help="the folder of this study's results files")
    parser.add_argument("--reused", type=Path, default=KCACHE, help="the K-cache study's folder of results files")
    parser.add_argument("--capacity", type=Path, default=CAPACITY, help="the capacity study's results.json")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for summary.md and loss_vs_kcache.png")
    args = parser.parse_args(argv)
    cells = {cell: rows_of(*cell, args.results, args.reused) for cell in CELLS}
    capacity = json.loads(args.capacity.read_text())["runs"]
    static16 = {model: {corpus: {s: run["static d_head 16"] for s, run in seeds.items()}
                        for corpus, seeds in corpora.items()} for model, corpora in capacity.items()}
    text = "\n\n".join([
        "Criteria (README.md; paired by seed, % of the second row's loss, mean ± s.e., then the verdict):",
        criteria_table(cells), "Reported, not judged:", reported_table(cells, static16),
        "Widths per layer over the seeds:", widths_table(cells), "Reproduction checks:", reproduction(cells)])
    args.out.mkdir(parents=True, exist_ok=True)
    plot(cells, static16, args.out / "loss_vs_kcache.png")
    (args.out / "summary.md").write_text(f"# Spending the budget: summary\n\n{text}\n\n"
                                         "![Final loss against K-cache bytes per token](loss_vs_kcache.png)\n")
    print(text)


if __name__ == "__main__":
    main()
