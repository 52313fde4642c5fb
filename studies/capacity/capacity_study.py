"""`studies/growth_pays/experiments.py --capacity --text FILE`: does the automatic schedule find a small query/key width that
matches full attention? Six rows on the text task, equal total steps (the growth study's setting):

    static d_head 16 | static d_head 2 | auto from d_head 1 (configs/text_auto.yaml) |
    static at the auto-found sizes (from scratch) | static 16 for part of the steps, SVD-shrunk to the auto-found
    sizes (`convert --to mha --d_head …`) and fine-tuned for the rest | auto from d_head 16 (ample: should not grow).

The fourth and fifth rows take the sizes of the auto run of the same seed, so they run after it in one invocation.
`--only "static d_head N"` runs a static model at any other width too (e.g. 15 and 17: how far a one-column change
moves the loss on a seed, the noise the per-seed comparison with static 16 stands in), and `"static d_head [6, 10]"`
one width per layer.
Corpora other than Tiny Shakespeare: `python studies/capacity/corpora.py DIR` (Python stdlib sources, /usr/share/doc).
Writes OUT/experiments_capacity.{md,json} and its plots (d_head per layer against steps, loss against K-cache size);
OUT is --out, by default studies/capacity.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from study_runs import TEXT_SETTING, fine_tune_shrunk, k_cache_bytes, merge, run, sizes, train_to_shrink

# Every run reads the auto config (static runs drop its growth callback and set d_head), so that the automatic
# schedule's overrides parse for all of them.
AUTO_CONFIG = "configs/text_auto.yaml"
AUTO, AMPLE = "auto from d_head 1", "auto from d_head 16"
ROWS = ["static d_head 16", "static d_head 2", AUTO, "static at the auto sizes", "static 16, shrunk, fine-tuned", AMPLE]
# Any other static width, one for every layer or one per layer ("static d_head [6, 10]"), run after the rows above.
STATIC = re.compile(r"static d_head ([1-9][0-9]*|\[[1-9][0-9]*(, [1-9][0-9]*)*\])")


def run_rows(text: str, seeds: list[int], only: list[str] | None, extra: list[str], work: Path, logs: str):
    rows = only or ROWS
    if unknown := {r for r in rows if r not in ROWS and not STATIC.fullmatch(r)}:
        raise ValueError(f"unknown capacity rows {sorted(unknown)}; known: {ROWS}, or 'static d_head N' for any N "
                         f"('static d_head [N, M, …]': one per layer)")
    if AUTO not in rows and set(rows) & set(ROWS[3:5]):
        raise ValueError(f"rows {ROWS[3:5]} take the sizes the auto run found: run {AUTO!r} in the same invocation")
    common = [f"--data.init_args.path={text}", *TEXT_SETTING, *extra]
    results: dict[str, list[dict]] = {}
    for seed in seeds:
        seeded = [*common, f"--seed_everything={seed}", f"--data.init_args.seed={seed}"]
        found = None
        for name in [r for r in ROWS if r in rows] + [r for r in dict.fromkeys(rows) if r not in ROWS]:
            if name == AUTO:
                result = run(AUTO_CONFIG, seeded, logs, grow=True)
                found, steps = result["final"]["d_head"], result["final"]["step"]
            elif name == AMPLE:
                result = run(AUTO_CONFIG, [*seeded, "--model.init_args.d_head=16"], logs, grow=True)
            elif name == "static at the auto sizes":
                result = run(AUTO_CONFIG, [*seeded, sizes(found)], logs, grow=False)
            elif name == "static 16, shrunk, fine-tuned":
                # Shrinking cannot widen: a layer that auto grew past 16 keeps 16 (the table shows the sizes).
                first = train_to_shrink(AUTO_CONFIG, seeded, steps, work / "static16.ckpt", logs)
                result = fine_tune_shrunk(AUTO_CONFIG, seeded, first, work / "static16.ckpt",
                                          [min(d, 16) for d in found], steps, work, logs)
            else:
                widths = name.removeprefix("static d_head ")
                result = run(AUTO_CONFIG, [*seeded, f"--model.init_args.d_head={widths}"], logs, grow=False)
            result |= {"seed": seed, "task": "text",
                       "kcache_bytes": k_cache_bytes(result["n_head"], result["final"]["d_head"])}
            results.setdefault(name, []).append(result)
            print(json.dumps({"run": name, "seed": seed, **{k: result[k] for k in ("seconds", "flops", "kcache_bytes")},
                              "loss": result["final"]["loss"], "d_head": result["final"]["d_head"]}), flush=True)
    return results


def table(results: dict[str, list[dict]]) -> str:
    mean = statistics.mean
    spread = lambda xs: f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""  # noqa: E731
    ref = results.get("static d_head 16")
    ref_flops = mean(r["flops"] for r in ref) if ref else None
    header = ["run", "seeds", "final d_head per layer", "val loss", "val bpb", "train FLOPs (× static 16)",
              "K-cache bytes/token", "events"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, runs in results.items():
        losses = [r["final"]["loss"] for r in runs]
        bpbs = [r["final"].get("bpb") for r in runs]
        flops = mean(r["flops"] for r in runs)
        grown = [e for e in runs[0]["events"] if e["d_head"] != e["d_head_before"]]
        events = ", ".join(f"{e['event']}: {e['d_head_before']}→{e['d_head']}" for e in grown) or "–"
        lines.append("| " + " | ".join([
            name, str(len(runs)), "; ".join(str(r["final"]["d_head"]) for r in runs),
            f"{mean(losses):.3f}{spread(losses)}",
            f"{mean(bpbs):.3f}{spread(bpbs)}" if None not in bpbs else "–",
            f"{flops:.3g}" + (f" ({flops / ref_flops:.2f})" if ref_flops else ""),
            f"{mean(r['kcache_bytes'] for r in runs):.0f}", events,
        ]) + " |")
    return "\n".join(lines)


def paired(results: dict[str, list[dict]]) -> str:
    """Per seed: the auto run against static d_head 16 and the two peers at the sizes it found (the comparison that
    matters, since the sizes differ from seed to seed), its K cache as a share of static 16's, and what the run
    started at d_head 16 ended at; then how much each layer's found width varies over the seeds."""
    rows = {name: {r["seed"]: r for r in results.get(name, [])} for name in ROWS}
    lines = ["| seed | auto sizes | static d_head 16 | auto (vs static 16) | K cache (share of static 16's) | "
             "static at the auto sizes | static 16, shrunk, fine-tuned | started at d_head 16 |", "|" + "---|" * 8]
    loss = lambda name, seed: rows[name][seed]["final"]["loss"] if seed in rows[name] else None  # noqa: E731
    shown = lambda value: "–" if value is None else f"{value:.3f}"  # noqa: E731
    for seed, auto in sorted(rows[AUTO].items()):
        static, found = loss(ROWS[0], seed), auto["final"]["d_head"]
        versus = f" ({auto['final']['loss'] / static - 1:+.1%})" if static else ""
        share = f"{auto['kcache_bytes'] / k_cache_bytes(auto['n_head'], [16] * len(found)):.0%}"
        ample = rows[AMPLE].get(seed)
        started = "–" if ample is None else f"{ample['final']['d_head']}, {ample['final']['loss']:.3f}"
        lines.append(f"| {seed} | {found} | {shown(static)} | {auto['final']['loss']:.3f}{versus} | {share} | "
                     f"{shown(loss(ROWS[3], seed))} | {shown(loss(ROWS[4], seed))} | {started} |")
    if len(rows[AUTO]) > 1:
        widths = zip(*(r["final"]["d_head"] for r in rows[AUTO].values()))
        lines.append("\nFound width per layer, largest/smallest over the seeds: "
                     + " ".join(f"{max(w) / min(w):.1f}" for w in widths))
    return "\n".join(lines)


def signals(results: dict[str, list[dict]]) -> str:
    """The decision inputs at every check of the first seed of each auto row: per layer the first candidate column's
    held-out ratio to the existing columns' gain, its agreement, its share of the held-out score, the bottleneck's
    energy share, and the columns taken."""
    lines = ["| run | step | loss | layer | d_head | ratio₁ | agreement₁ | share₁ | bottleneck | columns |",
             "|" + "---|" * 10]
    for name in (AUTO, AMPLE):
        for event in results.get(name, [{}])[0].get("events", []):
            for d in event.get("decisions", []):
                first = lambda key: f"{d[key][0]:.2f}" if d[key] else "–"  # noqa: E731
                lines.append(f"| {name} | {event['step']} | {event['loss_before']:.3f} | {d['layer']} | {d['d_head']} | "
                             f"{first('ratios')} | {first('agreement')} | {first('shares')} | {d['bottleneck']:.2f} | "
                             f"{d['columns']} |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in results.items():
        # Every seed of the auto run (its sizes differ from seed to seed), the first seed of the others.
        for run_ in runs if name == AUTO else runs[:1]:
            final = run_["final"]["d_head"]
            start = run_["events"][0]["d_head_before"] if run_["events"] else final
            steps = [0] + [e["step"] for e in run_["events"]] + [run_["final"]["step"]]
            values = [start] + [e["d_head"] for e in run_["events"]] + [final]
            label = f"{name}, seed {run_['seed']}" if name == AUTO else name
            for layer in range(len(final)):
                ax.step(steps, [v[layer] for v in values], where="post", ls="-" if layer == 0 else "--",
                        lw=2 if name == AUTO else 0.8, alpha=1 if name == AUTO else 0.6,
                        label=f"{label}, layer {layer}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("d_head")
    ax.set_yscale("log", base=2)
    ax.legend(fontsize=5.5, ncol=2)
    fig.tight_layout()
    trajectory = out / "experiments_capacity_d_head.png"
    fig.savefig(trajectory, dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in results.items():
        ax.errorbar(statistics.mean(r["kcache_bytes"] for r in runs), statistics.mean(r["final"]["loss"] for r in runs),
                    yerr=statistics.stdev([r["final"]["loss"] for r in runs]) if len(runs) > 1 else None,
                    marker="o", ls="", label=name)
    ax.set_xlabel("K-cache bytes per token")
    ax.set_ylabel("final validation loss")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    loss_vs_cache = out / "experiments_capacity_loss_vs_kcache.png"
    fig.savefig(loss_vs_cache, dpi=110)
    return [trajectory, loss_vs_cache]


def write(results: dict[str, list[dict]], out: Path, command: str) -> str:
    text = table(results) + "\n\nValidation loss per seed:\n\n" + paired(results)
    if AUTO in results or AMPLE in results:
        text += "\n\nDecision inputs at each check (first seed):\n\n" + signals(results)
    plots = plot(results, out)
    (out / "experiments_capacity.md").write_text(
        f"# experiments_capacity ({command})\n\n{text}\n\n" + "\n".join(f"![]({p.name})" for p in plots) + "\n")
    (out / "experiments_capacity.json").write_text(json.dumps(results, indent=1))
    return text


def main(args, parser) -> None:
    """experiments.py's `--capacity`: --text, --seeds, --only, --override, --out and --from-json as there."""
    if not args.text and not args.from_json:
        parser.error("--capacity runs on text: give --text FILE")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if args.from_json:
            results = merge([json.loads(Path(p).read_text()) for p in args.from_json], order=ROWS, task="text")
        else:
            with tempfile.TemporaryDirectory() as work:
                results = run_rows(args.text, args.seeds, args.only, args.override, Path(work), work)
    except ValueError as error:
        parser.error(str(error))
    source = Path(args.text).name if args.text else "merged JSON"
    print(write(results, out, f"--capacity on {source}: {AUTO_CONFIG} with "
                              f"{TEXT_SETTING + args.override}; events of the first seed"))
