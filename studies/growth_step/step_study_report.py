"""`growth_step.py report`: the tables (printed) and figures of this study's README.md from the probe JSONs
and the run JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

from step_study import GROW_EPOCHS, GRIDS, HERE, KEPT, WINDOW

from lit_growattn import growth  # step_study has put the repository on the path


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


def spread(xs) -> str:
    xs = list(xs)
    m = mean(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return f"{m:.3f} ± {sd:.3f}"


def decreases(event: dict, point: dict) -> dict:
    """L(0) − L(α) on the window (16 batches), the kept batches (its last 2) and the held-out batches."""
    base = event["base"]
    return {"window": mean(base["window"]) - mean(point["window"]),
            "kept": mean(base["window"][-KEPT:]) - mean(point["window"][-KEPT:]),
            "held_out": mean(base["held_out"]) - mean(point["held_out"]),
            "predicted": point["predicted"]}


def rule_outcomes(event: dict, curve: dict) -> dict[str, dict]:
    """The point each step rule installs, as the callback chooses it (best kept-batch loss among its candidates):
    grid 1 … 1/16 (the old default), grid 1 … 1/256, and that grid plus the quadratic α* (recomputed here with
    the current `quadratic_step`; evaluated in the probe, or a grid point); `oracle`: best held-out on the grid."""
    by_alpha = {p["alpha"]: p for p in curve["points"]}
    kept = lambda p: decreases(event, p)["kept"]  # noqa: E731

    def pick(alphas, extra=()):
        candidates = [by_alpha[a] for a in alphas] + list(extra)
        return candidates[growth.choose_step([-kept(p) for p in candidates], [p["alpha"] for p in candidates])]

    out = {}
    for label, grid in GRIDS.items():
        out[f"grid {label}"] = pick([0.0, *grid])
    fine = GRIDS["1 … 1/256"]
    slope = by_alpha[min(fine)]["predicted"] / min(fine)
    star = growth.quadratic_step(slope, fine, [kept(by_alpha[a]) for a in fine])
    stored = curve["rules"].get("1 … 1/256", {}).get("quadratic")  # absent from probes of an older rule
    star_point = by_alpha.get(star) or (stored if stored and abs(stored["alpha"] - star) < 1e-12 else None)
    if star_point is not None:
        out["quadratic 1 … 1/256"] = pick([0.0, *fine], [star_point])
    out["oracle"] = max(curve["points"], key=lambda p: decreases(event, p)["held_out"])
    return out


def step_table(events: list[dict]) -> str:
    """Per method/mode, over all events: where the held-out minimum lies, how deep it is, and what each rule gets."""
    rules = ["grid 1 … 1/16", "grid 1 … 1/256", "quadratic 1 … 1/256", "oracle"]
    lines = ["| method/mode | best α on held-out (median) | decrease there: held-out | window | first order | "
             + " | ".join(f"{r}: held-out decrease (events > 0)" for r in rules) + " |",
             "|---|---|---|---|---|" + "---|" * len(rules)]
    pairs = [(c["method"], c["mode"]) for c in events[0]["curves"] if c["rules"]]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    for method, mode in pairs:
        found = {r: [] for r in rules}
        for e in events:
            curve = next(c for c in e["curves"] if (c["method"], c["mode"]) == (method, mode))
            for r, point in rule_outcomes(e, curve).items():
                found[r].append((e, point))
        oracle = [decreases(e, p) for e, p in found["oracle"]]
        cells = []
        for r in rules:
            held = [decreases(e, p)["held_out"] for e, p in found[r]]
            cells.append(f"{mean(held):+.4f} ({sum(h > 1e-5 for h in held)} of {len(held)})" if held else "–")
        best_alpha = median([p["alpha"] for _, p in found["oracle"]])
        lines.append(f"| {method}/{mode} | {'0' if best_alpha == 0 else f'1/{1 / best_alpha:.0f}'} | "
                     f"{mean(o['held_out'] for o in oracle):.4f} | {mean(o['window'] for o in oracle):.4f} | "
                     f"{mean(o['predicted'] for o in oracle):.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def noise_table(events: list[dict]) -> str:
    """Cosine / overlap of the two halves per K; last column: the cosine of the K = 16 estimate with its noise-free
    limit, 1/√(1 + r) with r = (1/cos_half − 1)/2 (independent batches, noise of equal size in every direction)."""
    rows = [r for e in events for r in e["noise"]]
    sizes = sorted({r["batches"] for r in rows})
    lines = ["| method | " + " | ".join(f"{k} batches" for k in sizes) + " | 16-batch ΔM vs its limit (cosine, est.) |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for method in ("natural", "gradient", "pinv"):
        cells = []
        for k in sizes:
            sel = [r for r in rows if r["method"] == method and r["batches"] == k]
            cells.append(f"{mean(r['cosine'] for r in sel):.2f} / {mean(r['overlap'] for r in sel):.2f}")
        half = mean(r["cosine"] for r in rows if r["method"] == method and r["batches"] == WINDOW)
        limit = (1 + (1 / half - 1) / 2) ** -0.5
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {limit:.2f} |")
    return "\n".join(lines)


TABLE_ORDER = [
    "static d_head 2 (experiments_text.json)", "static d_head 16 (experiments_text.json)", "static d_head 2 + Q/K reset",
    "grow random/append", "grow zero/append", "grow natural/append α=0", "grow natural/append α=0 + Q/K reset",
    "grow natural/replace α=0", "grow natural/append α=1/4096", "grow natural/append grid 1 … 1/256",
    "grow natural/append grid 1 … 1/256 + Q/K reset", "grow natural/append quadratic", "grow natural/replace quadratic",
    "grow gradient/append quadratic", "grow gradient/replace quadratic",
]


def reused(path: Path, names: list[str]) -> list[dict]:
    """Rows of studies/growth_pays/experiments.py's JSON (seeds 0, 1, … in order) in this script's format (no held-out loss
    around the events)."""
    rows = json.loads(path.read_text())
    return [{"run": f"{name} ({path.name})", "seed": seed, "final": r["final"]["loss"], "event_loss": None,
             "val": [{"step": p["step"], "loss": p["loss"]} for p in r["curve"]], "events": r["events"]}
            for name in names for seed, r in enumerate(rows[name])]


def runs_table(runs: list[dict], reference: str = "grow zero/append") -> str:
    """One row per run name; the last column pairs seeds: final loss minus the reference's on the same seed."""
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        by_name.setdefault(r["run"], []).append(r)
    order = [n for n in TABLE_ORDER if n in by_name] + [n for n in by_name if n not in TABLE_ORDER]
    by_name = {n: by_name[n] for n in order}
    ref = {r["seed"]: r["final"] for r in by_name.get(reference, [])}
    lines = ["| run | seeds | final val loss | val loss 150 steps after event 1 / 2 | held-out jump at event 1 / 2 | "
             f"α chosen (per seed) | final − {reference}, same seed |", "|---|---|---|---|---|---|---|"]
    for name, rs in by_name.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        after = [spread(r["val"][i]["loss"] for r in rs) for i in (1, 2)]
        jumps = (["–", "–"] if rs[0]["event_loss"] is None else
                 [spread(r["event_loss"]["after"][i] - r["event_loss"]["before"][i] for r in rs) for i in (0, 1)])
        alphas = "; ".join(",".join(f"{e['alpha']:.3g}" for e in r["events"]) for r in rs) or "–"
        paired = [r["final"] - ref[r["seed"]] for r in rs if r["seed"] in ref]
        lines.append(f"| {name} | {len(rs)} | {spread(r['final'] for r in rs)} | {after[0]} / {after[1]} | "
                     f"{jumps[0]} / {jumps[1]} | {alphas} | {spread(paired) if len(paired) > 1 else '–'} |")
    return "\n".join(lines)


def plot_steps(events: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ("natural", "gradient", "pinv")
    fig, axes = plt.subplots(len(GROW_EPOCHS), len(methods), figsize=(13, 7), sharex=True, sharey=True)
    for row, epoch in enumerate(GROW_EPOCHS):
        chosen = [e for e in events if e["epoch"] == epoch]
        for col, method in enumerate(methods):
            ax = axes[row][col]
            for mode, color in (("append", "tab:blue"), ("replace", "tab:red")):
                curves = [next(c for c in e["curves"] if (c["method"], c["mode"]) == (method, mode)) for e in chosen]
                alphas = [p["alpha"] for p in curves[0]["points"] if p["alpha"] > 0]
                for key, style in (("held_out", "-"), ("window", "--"), ("predicted", ":")):
                    ys = [mean(decreases(e, p)[key] for e, c in zip(chosen, curves) for p in c["points"]
                               if p["alpha"] == a) for a in alphas]
                    ax.plot(alphas, ys, style, color=color, marker="." if style == "-" else None,
                            label=f"{mode}: {key.replace('_', '-')}")
            ax.axhline(0, color="k", lw=0.5)
            ax.axvline(1 / 16, color="gray", lw=0.5, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.012, 0.016)
            ax.set_title(f"{method}, growth at epoch {epoch} ({len(chosen)} seeds)")
            if row == len(GROW_EPOCHS) - 1:
                ax.set_xlabel("step size α (grid's smallest, 1/16, dashed)")
            if col == 0:
                ax.set_ylabel("loss decrease L(0) − L(α)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_noise(events: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for e in events for r in e["noise"]]
    sizes = sorted({r["batches"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, color in (("natural", "tab:blue"), ("gradient", "tab:green"), ("pinv", "tab:orange")):
        for key, style in (("cosine", "-"), ("overlap", "--")):
            ys = [mean(r[key] for r in rows if r["method"] == method and r["batches"] == k) for k in sizes]
            ax.plot(sizes, ys, style, color=color, marker=".", label=f"{method}: {key}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("statistics batches K (two halves of K/2)")
    ax.set_ylabel("agreement of the two halves")
    ax.axvline(16, color="gray", lw=0.5, ls="--")
    # Two random 7-dimensional subspaces of the 64-dimensional input overlap by p/e′ on average.
    ax.axhline(7 / 64, color="gray", lw=0.5, ls=":", label="overlap of random subspaces, p/e′ = 7/64")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(probes: list[Path], runs: list[Path], out: Path) -> None:
    events = [e for p in probes for e in json.loads(p.read_text())]
    results = [json.loads(line) for p in runs for line in p.read_text().splitlines() if line.strip()]
    results += reused(HERE.parent / "growth_pays" / "experiments_text.json", ["static d_head 2", "static d_head 16"])
    (out / "growth_step.json").write_text(json.dumps({"probe": events, "runs": results}))
    plot_steps(events, out / "growth_step_loss_vs_alpha.png")
    plot_noise(events, out / "growth_step_noise.png")
    print("## L(α)\n", step_table(events), "\n\n## noise (cosine / overlap)\n", noise_table(events),
          "\n\n## runs\n", runs_table(results), sep="\n")
