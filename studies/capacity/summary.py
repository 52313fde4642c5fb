"""The capacity study's table and plot, from results.json (the current rule's runs, seeds 0–5, both model sizes):

    python studies/capacity/summary.py     # prints the table, writes loss_vs_kcache.png beside this file
    python studies/capacity/summary.py --collect 2layer:usrdoc=OUT/experiments_capacity.json …  # results.json first

`--collect SIZE:CORPUS=FILE …` rebuilds results.json from the capacity runs' JSONs (finals only, growths as
[step, d_head]). Each loss is compared with static d_head 16 of the same model size, corpus and seed (in % above it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
FULL = 16  # static d_head 16: the reference width


def above(loss: float, reference: float) -> float:
    return 100 * (loss / reference - 1)


def rows(runs: dict) -> list[dict]:
    """One row per model size, corpus and seed: each model's loss against static 16, and auto's K-cache share."""
    out = []
    for size, corpora in runs.items():
        for corpus, seeds in corpora.items():
            for seed, run in seeds.items():
                reference, auto = run["static d_head 16"], run["auto from d_head 1"]
                out.append({"size": size, "corpus": corpus, "seed": seed,
                            "auto": above(auto["loss"], reference),
                            "static 8": above(run["static d_head 8"], reference),
                            "static at found": above(run["static at the auto sizes"], reference),
                            "k_cache": sum(auto["d_head"]) / (FULL * len(auto["d_head"]))})
    return out


def table(found: list[dict]) -> str:
    lines = ["| model | corpus | auto vs static 16 (mean, worst) | within 1 % | K cache of static 16 | "
             "static 8 (half the cache) | static at auto's widths |", "|---|---|---|---|---|---|---|"]
    for size in dict.fromkeys(r["size"] for r in found):
        for corpus in dict.fromkeys(r["corpus"] for r in found):
            cell = [r for r in found if r["size"] == size and r["corpus"] == corpus]
            auto, share = [r["auto"] for r in cell], [r["k_cache"] for r in cell]
            lines.append(f"| {size} | {corpus} | {statistics.mean(auto):+.1f} %, {max(auto):+.1f} % | "
                         f"{sum(a <= 1 for a in auto)} of {len(auto)} | {min(share):.0%}–{max(share):.0%} | "
                         f"{statistics.mean(r['static 8'] for r in cell):+.1f} % | "
                         f"{statistics.mean(r['static at found'] for r in cell):+.1f} % |")
    return "\n".join(lines)


def plot(found: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.scatter([r["k_cache"] for r in found], [r["auto"] for r in found], label="auto from d_head 1", s=18)
    ax.scatter([r["k_cache"] for r in found], [r["static at found"] for r in found], marker="x", s=18,
               label="static at auto's widths")
    ax.scatter([0.5] * len(found), [r["static 8"] for r in found], marker="s", s=14, label="static d_head 8")
    ax.axhline(0, color="k", lw=0.8, label="static d_head 16")
    ax.axhline(1, color="k", lw=0.6, ls="--", label="1 % above static 16")
    ax.set_xlabel("K cache, share of static d_head 16's")
    ax.set_ylabel("final validation loss, % above static 16")
    ax.set_title("2- and 8-layer text models, 3 corpora × 6 seeds, 750 steps", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


ROWS = ("static d_head 16", "static d_head 8", "auto from d_head 1", "static at the auto sizes")
WHAT = ("final validation loss (750 steps) per model size, corpus and seed (seeds 0-5); the automatic schedule's run "
        "from d_head 1 with the widths it found and each growth as [step, d_head per layer after it]")


def growths(events: list[dict]) -> list[list]:
    """[step, d_head after] for each check that changed the widths (the checks that grew nothing left out)."""
    out, before = [], None
    for event in events:
        if event["d_head"] != before:
            out.append([event["step"], event["d_head"]])
            before = event["d_head"]
    return out


def collect(sources: list[str]) -> dict:
    """SIZE:CORPUS=FILE (a capacity run's experiments_capacity.json) → results.json's runs."""
    runs: dict = {}
    for source in sources:
        cell, path = source.split("=", 1)
        size, corpus = cell.split(":")
        study = json.loads(Path(path).read_text())
        for name in ROWS:
            for run in study.get(name, []):  # a row not run in that invocation
                seeds = runs.setdefault(size, {}).setdefault(corpus, {}).setdefault(str(run["seed"]), {})
                loss = round(run["final"]["loss"], 5)
                seeds[name] = ({"loss": loss, "d_head": run["final"]["d_head"], "growths": growths(run["events"])}
                               if name == "auto from d_head 1" else loss)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", nargs="+", metavar="SIZE:CORPUS=FILE", help="rebuild results.json first")
    args = parser.parse_args()
    if args.collect:
        (HERE / "results.json").write_text(json.dumps({"what": WHAT, "runs": collect(args.collect)}))
    found = rows(json.loads((HERE / "results.json").read_text())["runs"])
    print(table(found))
    plot(found, HERE / "loss_vs_kcache.png")


if __name__ == "__main__":
    main()
