"""The value-growth study's tables and plot, from its results.json (value_study.py's runs):

    python studies/value_growth/summary.py     # prints the tables; writes summary.md and loss_vs_vcache.png beside it
    python studies/value_growth/summary.py --results A.json B.json --out DIR   # invocations run in parallel, merged

Differences are paired by seed, in % of the second row's loss (100 (a/b − 1)), as mean ± standard error over the
seeds (the K-cache study's summary.py computes and judges them). Static d_v 16 is taken from these runs where they
hold it, else from the capacity study's results.json (static d_head 16: the same run, as d_v 16 = n_embd / n_head).
The verdicts are the criteria stated in README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
CAPACITY = HERE.parent / "capacity" / "results.json"
FULL, SMALL, GROWN, AUTO = "static d_v 16", "static d_v 4", "grown d_v 4→16", "auto d_v 4, budget 16"
FULL_VCACHE = 4 * 2 * 16 * 4  # bytes per token of static d_v 16: 4 heads × 2 layers × d_v 16 × 4 B


def _kcache_summary():
    """The K-cache study's summary.py, by path (`summary` alone names whichever study's summary came first)."""
    spec = importlib.util.spec_from_file_location("kcache_summary", HERE.parent / "kcache_budget" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kcache = _kcache_summary()
paired, shown, verdict, percent = kcache.paired, kcache.shown, kcache.verdict, kcache.percent
read_merged = kcache.read_merged


class Cell:
    """One corpus: each row's runs by seed, with static d_v 16's losses completed from the capacity study."""

    def __init__(self, rows: dict[str, dict[str, dict]], capacity: dict):
        self.rows = rows
        self.static16 = {s: r["loss"] for s, r in rows.get(FULL, {}).items()}
        for seed, old in capacity.items():
            self.static16.setdefault(seed, old["static d_head 16"])

    def loss(self, row: str) -> dict[str, float]:
        return self.static16 if row == FULL else {s: r["loss"] for s, r in self.rows.get(row, {}).items()}

    def mean(self, row: str, key) -> float | None:
        values = [key(r) for r in self.rows.get(row, {}).values()]
        return statistics.mean(values) if values else None


def cells(results: dict, capacity: dict) -> dict[str, Cell]:
    return {corpus: Cell(rows, capacity.get(corpus, {})) for corpus, rows in results["runs"].items()}


def final_share(record: dict) -> float:
    """The V cache at the end as a share of static d_v 16's."""
    return sum(record["d_v"]) / (16 * len(record["d_v"]))


def training_share(record: dict) -> float:
    """The V cache over training as a share of static d_v 16's: its size at each step, averaged over the steps."""
    start = record["growths"][0][1] if record["growths"] else record["d_v"]
    sizes = [(0, start), *((step, after) for step, _, after in record["growths"]), (record["step"], None)]
    held = sum((b - a) * sum(d_v) for (a, d_v), (b, _) in zip(sizes, sizes[1:]))
    return held / (16 * len(record["d_v"]) * record["step"])


def loss_table(found: dict[str, Cell]) -> str:
    lines = ["| corpus | seeds (static 16, static 4, grown, auto) | static d_v 16 loss | static d_v 4 loss | grown loss | "
             "auto loss | grown − static d_v 4 | grown − static d_v 16 | static d_v 4 − static d_v 16 | "
             "auto − static d_v 16 | auto − static d_v 4 | auto − grown | grown at the ceiling (≤ static d_v 16) | "
             "auto at the ceiling |", "|" + "---|" * 14]
    for corpus, cell in found.items():
        full, small, grown, auto = (cell.loss(row) for row in (FULL, SMALL, GROWN, AUTO))
        mean = lambda losses: f"{statistics.mean(losses.values()):.4f}" if losses else "–"  # noqa: E731
        judged = lambda a, b: f"{shown(paired(a, b))} ({verdict(paired(a, b))})"  # noqa: E731
        met = lambda a: {"≤": "met", "–": "–"}.get(verdict(paired(a, full)), "not met")  # noqa: E731
        lines.append("| " + " | ".join([
            corpus, f"{len(full)}, {len(small)}, {len(grown)}, {len(auto)}", mean(full), mean(small), mean(grown),
            mean(auto), judged(grown, small), judged(grown, full), judged(small, full), judged(auto, full),
            judged(auto, small), judged(auto, grown), met(grown), met(auto)]) + " |")
    return "\n".join(lines)


def cache_table(found: dict[str, Cell]) -> str:
    """V cache, training FLOPs and the statistics' cost per row, means over the seeds."""
    lines = ["| corpus | row | runs | d_v per layer at the end | V-cache bytes per token | V cache of static d_v 16's "
             "(end; over training) | training FLOPs × static d_v 16 | statistics' share of training time |",
             "|" + "---|" * 8]
    for corpus, cell in found.items():
        flops16 = cell.mean(FULL, lambda r: r["flops"])
        for row in (FULL, SMALL, GROWN, AUTO):
            runs = list(cell.rows.get(row, {}).values())
            if not runs:
                continue
            flops = cell.mean(row, lambda r: r["flops"])
            lines.append("| " + " | ".join([
                corpus, row, str(len(runs)),
                ", ".join(f"{statistics.mean(w):.1f}" for w in zip(*(r["d_v"] for r in runs))),
                f"{cell.mean(row, lambda r: r['vcache_bytes']):.0f}",
                f"{percent(cell.mean(row, final_share))}; {percent(cell.mean(row, training_share))}",
                f"{flops / flops16:.2f}" if flops16 else "–",
                percent(cell.mean(row, lambda r: r["time"]["statistics_share"]), 1)]) + " |")
    return "\n".join(lines)


def plot(found: dict[str, Cell], path: Path) -> None:
    """Final validation loss against V-cache bytes per token at the end: each row's mean over the seeds, one marker
    per row, one colour per corpus."""
    fig, ax = plt.subplots(figsize=(8.4, 4.2))
    markers = {FULL: "x", SMALL: "s", GROWN: "o", AUTO: "^"}
    for i, (corpus, cell) in enumerate(found.items()):
        for row, marker in markers.items():
            losses = cell.loss(row)
            if not losses:
                continue
            vcache = cell.mean(row, lambda r: r["vcache_bytes"]) or FULL_VCACHE  # static 16 from the capacity study
            ax.plot(vcache, statistics.mean(losses.values()), marker=marker, ls="", color=f"C{i}",
                    label=f"{corpus}: {row}")
    ax.set_xlabel("V-cache bytes per token (at the end of training)")
    ax.set_ylabel("final validation loss, mean over seeds")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))  # beside the axes: points fill them
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merged(parts: list[dict]) -> dict:
    """One results dict from the JSONs of parallel invocations; a run in two is refused."""
    return {"runs": kcache.merged([{"runs": {"2layer": part["runs"]}} for part in parts])["runs"].get("2layer", {})}


def reruns(found: dict[str, Cell], capacity: dict) -> str:
    """Static d_v 16 run here against the capacity study's run of the same corpus and seed (reused elsewhere)."""
    lines = [f"- {corpus} seed {seed}: {r['loss']:.5f} here, {old[seed]['static d_head 16']:.5f} there"
             for corpus, cell in found.items() for seed, r in cell.rows.get(FULL, {}).items()
             if seed in (old := capacity.get(corpus, {}))]
    return "\n".join(lines) or "- none: every static d_v 16 loss comes from one source"


def report(results: dict, capacity: dict) -> str:
    found = cells(results, capacity)
    return "\n\n".join([
        "Final validation loss (paired differences by seed, % of the second row's loss, mean ± s.e.):",
        loss_table(found), "V cache, FLOPs and the statistics' cost (means over the seeds):", cache_table(found),
        "Static d_v 16 re-run against the capacity study's static d_head 16 (its losses stand in for the runs not "
        "repeated here):", reruns(found, capacity)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, nargs="+", default=[HERE / "results.json"])
    parser.add_argument("--capacity", type=Path, default=CAPACITY, help="the capacity study's results.json")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for summary.md and loss_vs_vcache.png")
    args = parser.parse_args(argv)
    results = read_merged(parser, args.results, merged, "value_study.py")
    capacity = json.loads(args.capacity.read_text())["runs"]["2layer"]
    text = report(results, capacity)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(cells(results, capacity), args.out / "loss_vs_vcache.png")
    names = ", ".join(p.name for p in args.results)
    (args.out / "summary.md").write_text(f"# Value-growth study: summary of {names}\n\n{text}\n\n"
                                         "![Final loss against V-cache bytes per token](loss_vs_vcache.png)\n")
    print(text)


if __name__ == "__main__":
    main()
