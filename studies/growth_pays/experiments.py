"""Does growing d_head pay? Static small vs static large vs growth (each method and mode, and baselines).

    python studies/growth_pays/experiments.py              # fused-pair recall (built in), 3 seeds
    python studies/growth_pays/experiments.py --text tinyshakespeare.txt
    python studies/growth_pays/experiments.py --quick      # a smoke run: 1 seed, a few steps, 3 runs
    python studies/growth_pays/experiments.py --attention  # mha vs diff vs dint vs lowrank_dint (static),
                                                           # at about equal parameter count

Every run is the project's own CLI config (configs/recall_grow.yaml or configs/text_grow.yaml) with
overrides, trained in this process; static runs keep the config's callbacks except growth (the attention
analysis of text_grow.yaml included). Writes OUT/experiments_<task>.md (the table, also printed), the results
as OUT/experiments_<task>.json (each run with its task, every validation set and the attention entropy) and
OUT/experiments_<task>_loss_vs_flops.png, OUT/experiments_<task>_d_head.png; OUT is --out, by default this
folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STUDIES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(STUDIES))  # study_runs, shared with the other studies

from study_runs import merge, run  # noqa: E402 - study_runs puts the repository on the path

from lit_growattn import growth  # noqa: E402

TASKS = {
    # config, static small d_head, static large d_head (= the size growth ends at), metric
    "recall": ("configs/recall_grow.yaml", 1, 15, "acc"),
    "text": ("configs/text_grow.yaml", 2, 16, "loss"),
}
GROWTH = [(m, mode) for m in growth.DIRECTIONS for mode in growth.MODES]
GROWTH += [(baseline, "append") for baseline in growth.BASELINES]


def grows(name: str) -> bool:
    """Growth runs are named `grow <method>/<mode>`; every other run is static (the same callbacks, but no growth)."""
    return name.startswith("grow ")


def variants(task: str) -> dict[str, list[str]]:
    _, small, large, _ = TASKS[task]
    out = {
        f"static d_head {small}": [f"--model.init_args.d_head={small}"],
        f"static d_head {large}": [f"--model.init_args.d_head={large}"],
    }
    for method, mode in GROWTH:
        out[f"grow {method}/{mode}"] = [f"--trainer.callbacks.init_args.growth.method={method}",
                                        f"--trainer.callbacks.init_args.growth.mode={mode}"]
    return out


def attention_variants(task: str) -> dict[str, list[str]]:
    """Static runs of each attention variant at the large d_head, with the query/key width of the two-map
    variants adjusted so that every model has about the same number of parameters."""
    large = TASKS[task][2]
    static = []
    if task == "recall":  # DIFF pairs heads: two heads of half the value size, the same parameters as one
        static += ["--model.init_args.n_head=2", "--model.init_args.d_v=32"]
    return {
        "mha": [*static, f"--model.init_args.d_head={large}"],
        "diff": [*static, "--model.init_args.attention=diff", f"--model.init_args.d_head={large}"],
        "dint": [*static, "--model.init_args.attention=dint", f"--model.init_args.d_head={max(1, large // 2)}"],
        "lowrank_dint": [*static, "--model.init_args.attention=lowrank_dint", f"--model.init_args.d_head={large}",
                         "--model.init_args.attention_args={rank: 2}"],
    }


def summarise(task: str, results: dict[str, list[dict]], baseline: str | None = None) -> str:
    """The table; "within 1 %" compares the task's metric (recall: accuracy, whose loss goes to 0; text: loss) with
    the baseline (default: the static large model), whose columns are left out when it is missing or alone."""
    _, _, large, metric = TASKS[task]
    baseline = baseline or f"static d_head {large}"
    mean = statistics.mean
    spread = lambda xs: f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""  # noqa: E731
    sets = sorted({name for runs in results.values() for r in runs for name in r["final"].get("sets", {})})
    header = ["run", "seeds", "params", "val loss", "val acc"]
    header += [f"{s} val {m}" for s in sets for m in ("loss", "acc")]
    compare = baseline in results and len(results) > 1
    if compare:
        reference = mean(r["final"][metric] for r in results[baseline])
        ref_flops = mean(r["flops"] for r in results[baseline])
        header += [f"{metric} within 1 % of {baseline}", f"train FLOPs (× {baseline})",
                   f"FLOPs to within 1 % (× {baseline}'s total)"]

        def reached(value: float) -> bool:
            return value <= 1.01 * reference if metric == "loss" else value >= 0.99 * reference

        def flops_to_reach(run: dict) -> float | None:
            """Training FLOPs at the first validation within 1 % of the baseline's final value (None: never)."""
            return next((point["flops"] for point in run["curve"] if reached(point[metric])), None)
    header += ["sign fallbacks", "seconds"]

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, runs in results.items():
        losses = [r["final"]["loss"] for r in runs]
        accs = [r["final"]["acc"] for r in runs]
        row = [name, str(len(runs)), str(runs[0].get("params", "–")), f"{mean(losses):.3f}{spread(losses)}",
               f"{mean(accs):.3f}{spread(accs)}"]
        for s in sets:
            for m in ("loss", "acc"):
                values = [r["final"].get("sets", {}).get(s, {}).get(m) for r in runs]
                row.append(f"{mean(values):.3f}{spread(values)}" if None not in values else "–")
        if compare:
            flops = mean(r["flops"] for r in runs)
            to_reach = [flops_to_reach(r) for r in runs]
            row += [
                "yes" if reached(mean(r["final"][metric] for r in runs)) else "no",
                f"{flops:.3g} ({flops / ref_flops:.2f})",
                f"{mean(to_reach) / ref_flops:.2f}" if None not in to_reach
                else f"{len(runs) - to_reach.count(None)} of {len(runs)} seeds reach it",
            ]
        row += [str(sum(e.get("sign_fallbacks", 0) for r in runs for e in r["events"])),
                f"{mean(r['seconds'] for r in runs):.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    if not compare:
        why = "is the only run" if baseline in results else "is not among these runs"
        lines.append(f"\nNo baseline to compare with: {baseline} {why}. Run it beside the others, or merge its "
                     "results with --from-json.")
    return "\n".join(lines)


def plot(task: str, results: dict[str, list[dict]], out: Path, stem: str) -> list[Path]:
    metric = TASKS[task][3]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, runs in results.items():
        first = runs[0]["curve"]
        mean = [statistics.mean(r["curve"][i][metric] for r in runs) for i in range(len(first))]
        ax.plot([p["flops"] for p in first], mean, marker=".", label=name, lw=2 if "static" in name else 1)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel(f"validation {metric} (mean over seeds)")
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    loss_path = out / f"{stem}_{metric}_vs_flops.png"
    fig.savefig(loss_path, dpi=110)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, runs in results.items():
        ax.step([p["step"] for p in runs[0]["curve"]], [p["d_head"][0] for p in runs[0]["curve"]], where="post",
                label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("d_head (layer 0)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    d_path = out / f"{stem}_d_head.png"
    fig.savefig(d_path, dpi=110)
    return [loss_path, d_path]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", help="a text file: run the text task instead of fused-pair recall")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", help="run names to keep (e.g. 'static d_head 1' 'grow natural/append')")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 3 runs, a few steps")
    parser.add_argument("--attention", action="store_true", help="compare attention variants instead of growth")
    parser.add_argument("--out", help="folder for the results (default: the study's own folder)")
    parser.add_argument("--from-json", nargs="+", help="re-render the table and plots from the results JSONs of "
                        "earlier runs, merged run by run (e.g. parallel invocations with different --only); pass "
                        "the same --text/--override as those runs so that the table's header names them")
    parser.add_argument("--override", nargs="+", action="extend", default=[], help="extra CLI overrides for every run, e.g. --trainer.max_epochs=4")
    args = parser.parse_args(argv)

    task = "text" if args.text else "recall"
    config = TASKS[task][0]
    runs = attention_variants(task) if args.attention else variants(task)
    if args.only:
        unknown = set(args.only) - set(runs)
        if unknown:
            parser.error(f"unknown run names {sorted(unknown)}; known: {sorted(runs)}")
        runs = {k: v for k, v in runs.items() if k in args.only}
    common = ([f"--data.init_args.path={args.text}"] if args.text else []) + args.override
    seeds = args.seeds
    if args.quick:
        seeds, runs = seeds[:1], dict(list(runs.items())[:3])
        common += ["--trainer.max_epochs=3", "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=2",
                   "--trainer.callbacks.init_args.statistics.batches=2"]
    out = Path(args.out or Path(__file__).resolve().parent)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    if args.from_json:
        try:
            results = merge([json.loads(Path(p).read_text()) for p in args.from_json], order=list(runs), task=task)
        except ValueError as error:
            parser.error(str(error))
        runs = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, overrides in runs.items():
            for seed in seeds:
                seeded = [f"--seed_everything={seed}", f"--data.init_args.seed={seed}"]
                result = {"seed": seed, "task": task, **run(config, [*common, *overrides, *seeded], logs, grows(name))}
                results.setdefault(name, []).append(result)
                print(json.dumps({"run": name, "seed": seed, **{k: result[k] for k in ("seconds", "flops", "final")}}),
                      flush=True)
    stem = f"experiments_{task}_attention" if args.attention else f"experiments_{task}"
    table = summarise(task, results, baseline="mha" if args.attention else None)
    plots = plot(task, results, out, stem)
    (out / f"{stem}.md").write_text(
        f"# {stem} ({config}, overrides {common})\n\n{table}\n\n" + "\n".join(f"![]({p.name})" for p in plots) + "\n"
    )
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    print(table)


if __name__ == "__main__":
    main()
