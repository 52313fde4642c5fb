"""The growth step on text: does a step along ΔM pay, and which part of growth does? (docs/growth_step.md)

    python scripts/growth_step.py probe --text ../shared/data/tinyshakespeare.txt        # L(α), noise → JSON
    python scripts/growth_step.py train --text … --runs 'grow natural/append α=0 + Q/K reset' --out runs.jsonl
    python scripts/growth_step.py report --probes probe_*.json --runs runs.jsonl         # tables, figures

`probe` trains configs/text_grow.yaml (the experiments setting: 5 epochs of 150 steps; growing with
natural/replace on the old grid 0, 1/16 … 1, as the config shipped when it was measured) and, at the start of
each growth epoch, before the callback grows, copies the model and measures on it: the loss L(α) of every
method × mode on a log grid of α, on window batches (as the callback keeps them) and on held-out batches,
against the first-order prediction; and the agreement of the direction estimated from two halves of the
statistics. `train` runs the mechanism table's variants, with the loss on held-out batches just before and
just after each growth event. Everything here drives the public growth API (GrowthPlan, FormStats, QKForm
capture); nothing reads the callback's internals.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lit_growattn import growth  # noqa: E402
from lit_growattn.callbacks import GrowAttentionCallback  # noqa: E402
from lit_growattn.cli import main as cli_main  # noqa: E402

CONFIG = "configs/text_grow.yaml"
SETTING = ["--trainer.max_epochs=5", "--data.init_args.samples_per_epoch=9600"]  # as docs/experiments_text.md
GROW_EPOCHS = (1, 2)
HELD_OUT_BATCHES = 8
FINE_GRID = [0.0] + [2.0**-k for k in range(9)]  # 1 … 1/256: on text the best step lies at 1/256 … 1/32
OLD_GRID = "--trainer.callbacks.init_args.step_search.alphas=[0,0.0625,0.125,0.25,0.5,1]"
STATIC = ["--trainer.callbacks=null"]


def grow_args(method: str, mode: str, *extra: str) -> list[str]:
    return [f"--trainer.callbacks.init_args.growth.method={method}", f"--trainer.callbacks.init_args.growth.mode={mode}", *extra]


# name → (CLI overrides, reset the Q/K Adam moments at the growth epochs)
RUNS: dict[str, tuple[list[str], bool]] = {
    "static d_head 2": ([*STATIC, "--model.init_args.d_head=2"], False),
    "static d_head 16": ([*STATIC, "--model.init_args.d_head=16"], False),
    "static d_head 2 + Q/K reset": ([*STATIC, "--model.init_args.d_head=2"], True),
    "grow zero/append": (grow_args("zero", "append"), False),
    "grow random/append": (grow_args("random", "append"), False),
    "grow natural/append α=0": (grow_args("natural", "append", "--trainer.callbacks.init_args.step_search.alphas=[0]"), False),
    "grow natural/append α=0 + Q/K reset": (grow_args("natural", "append", "--trainer.callbacks.init_args.step_search.alphas=[0]"), True),
    "grow natural/replace α=0": (grow_args("natural", "replace", "--trainer.callbacks.init_args.step_search.alphas=[0]"), False),
}
QUADRATIC = ["--trainer.callbacks.init_args.step_search.rule=quadratic", f"--trainer.callbacks.init_args.step_search.alphas={FINE_GRID}"]
RUNS |= {f"grow {m}/{mode} quadratic": (grow_args(m, mode, *QUADRATIC), False)
         for m in ("natural", "gradient") for mode in ("append", "replace")}
# A step far below the minimum of L(α): new pairs along the same directions, function all but kept.
RUNS["grow natural/append α=1/4096"] = (grow_args("natural", "append", "--trainer.callbacks.init_args.step_search.alphas=[0.000244140625]"), False)
RUNS["grow natural/append grid 1 … 1/256"] = (grow_args("natural", "append", f"--trainer.callbacks.init_args.step_search.alphas={FINE_GRID}"), False)
RUNS["grow natural/append grid 1 … 1/256 + Q/K reset"] = (RUNS["grow natural/append grid 1 … 1/256"][0], True)


def held_out(datamodule, n: int = HELD_OUT_BATCHES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = datamodule.val_dataloader()
    loader = loader[0] if isinstance(loader, list) else loader
    return [batch for _, batch in zip(range(n), loader)]


@torch.no_grad()
def mean_loss(module, batches) -> float:
    was_training = module.training
    module.eval()
    try:
        return sum(float(module.loss(module(x), y)) for x, y in batches) / len(batches)
    finally:
        module.train(was_training)


class EventLoss(L.Callback):
    """Held-out loss at the start of each growth epoch; placed before the growth callback (`before`) and after it."""

    def __init__(self, record: dict, key: str):
        self.record, self.key = record, key

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch in GROW_EPOCHS:
            self.record.setdefault(self.key, []).append(mean_loss(pl_module, held_out(trainer.datamodule)))


class ResetQKMoments(L.Callback):
    """Drops Adam's state (moments and step count) of every W_Q, W_K at the growth epochs, after the growth: the
    reset `replace` implies, without its rotation."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch in GROW_EPOCHS:
            (optimizer,) = trainer.optimizers
            for forms in pl_module.model.qk_forms():
                for form in forms:
                    optimizer.state.pop(form.w_q, None)
                    optimizer.state.pop(form.w_k, None)


def build(text: str, overrides: list[str], seed: int, log_dir: str):
    return cli_main(
        ["--config", str(REPO / CONFIG), "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         f"--trainer.logger.init_args.save_dir={log_dir}", f"--data.init_args.path={text}", *SETTING, *overrides,
         f"--seed_everything={seed}", f"--data.init_args.seed={seed}"],
        run=False,
    )


def train(text: str, name: str, seed: int, log_dir: str, extra: list[str]) -> dict:
    overrides, reset = RUNS[name]
    cli = build(text, [*overrides, *extra], seed, log_dir)
    record: dict = {}
    callbacks = cli.trainer.callbacks
    callbacks.insert(0, EventLoss(record, "before"))
    callbacks.append(EventLoss(record, "after"))  # after the growth callback, and after a reset
    if reset:
        callbacks.insert(len(callbacks) - 1, ResetQKMoments())
    val: list[dict] = []
    callbacks.append(L.pytorch.callbacks.LambdaCallback(on_validation_epoch_end=lambda trainer, module: None if
                     trainer.sanity_checking else val.append({"step": trainer.global_step,
                                                              "loss": float(trainer.callback_metrics["val/loss"])})))
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    grow = next((c for c in callbacks if isinstance(c, GrowAttentionCallback)), None)
    return {"run": name, "seed": seed, "seconds": time.perf_counter() - start, "final": val[-1]["loss"], "val": val,
            "event_loss": record, "events": grow.history if grow else []}


# -- probe: L(α) and the noise of the statistics at real growth events ------------------------------------
GRID = [0.0] + [2.0**-k for k in range(13)]  # 1 … 1/4096
PAIRS = [(m, mode) for m in growth.DIRECTION_NAMES for mode in growth.MODES]
PAIRS += [(baseline, "append") for baseline in growth.BASELINES]
WINDOW, KEPT, MAX_BATCHES = 16, 2, 64  # configs/text_grow.yaml's stats_batches; line_search_batches' default
GRIDS = {"1 … 1/16": [2.0**-k for k in range(5)], "1 … 1/256": [2.0**-k for k in range(9)]}  # candidates of a rule


def named_forms(model) -> dict:
    return {f"blocks.{i}.{j}": form for i, forms in enumerate(model.qk_forms()) for j, form in enumerate(forms)}


def layer_of(name: str) -> str:
    return name.split(".")[1]


def random_batches(train_set, n: int, batch_size: int, generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(n):
        xs, ys = zip(*(train_set[int(i)] for i in torch.randint(len(train_set), (batch_size,), generator=generator)))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def per_batch_stats(model, forms: dict, batches) -> list[list[growth.FormStats]]:
    """Statistics of each batch alone, at the frozen model (the callback gathers them while training)."""
    out = []
    for x, y in batches:
        stats = [growth.FormStats.empty_like(f, "pinv", dtype=torch.float64) for f in forms.values()]
        for f in forms.values():
            f.capture = "explicit"
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        for st, f in zip(stats, forms.values()):
            for xa, gx in f.take_captured():
                st.update(xa, gx)
            f.capture = None
        model.zero_grad(set_to_none=True)
        out.append(stats)
    return out


def summed(stats: list[list[growth.FormStats]]) -> list[growth.FormStats]:
    total = stats[0]
    for more in stats[1:]:
        total = [a + b for a, b in zip(total, more)]
    return total


@torch.no_grad()
def losses_with(model, forms: dict, grown: dict | None, batches) -> list[float]:
    originals = {n: (f.w_q, f.w_k, f.log_tau) for n, f in forms.items()}
    try:
        for n, f in forms.items():
            if grown is not None:
                f.set_weights(grown[n].w_q, grown[n].w_k, grown[n].log_tau)
        return [float(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in batches]
    finally:
        for n, f in forms.items():
            f.w_q, f.w_k, f.log_tau = originals[n]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


def noise(forms: dict, stats: list[list[growth.FormStats]], p: int) -> list[dict]:
    """Agreement of the estimates from two disjoint halves of K batches: cosine of ΔM, and the overlap
    ‖U_AᵀU_B‖²/p of the top-p bottleneck directions that `append` grows along (1: same subspace)."""
    rows = []
    for k in (2, 4, 8, 16, 32, 64):
        halves = [summed(stats[:k // 2]), summed(stats[k // 2:k])]
        for method in ("natural", "gradient", "pinv"):
            cos, overlap = [], []
            for i, f in enumerate(forms.values()):
                a, b = (growth.FormGrowth.from_form(f, h[i].means(), method) for h in halves)
                cos.append(cosine(a.direction(method), b.direction(method)))
                ua, ub = a.bottleneck(method)[0][..., :p], b.bottleneck(method)[0][..., :p]
                overlap.append(float((ua.mT @ ub).square().sum((-2, -1)).mean() / p))
            rows.append({"batches": k, "method": method, "cosine": sum(cos) / len(cos),
                         "overlap": sum(overlap) / len(overlap)})
    return rows


def measure_event(model, train_set, held: list, generator, grow_by: int = 7) -> dict:
    model = copy.deepcopy(model).train(False)
    forms = named_forms(model)
    batches = random_batches(train_set, MAX_BATCHES, held[0][0].shape[0], generator)
    stats = per_batch_stats(model, forms, batches)
    window, kept = batches[:WINDOW], batches[WINDOW - KEPT:WINDOW]
    evaluate = {"window": window, "held_out": held}
    base = {k: losses_with(model, forms, None, b) for k, b in evaluate.items()}
    curves = []
    for method, mode in PAIRS:
        plan = growth.GrowthPlan.build(forms, summed(stats[:WINDOW]), method=method, grow_by=grow_by, mode=mode,
                                       group_of=layer_of, generator=torch.Generator().manual_seed(0))
        def at(alpha: float) -> dict:
            grown = {n: plan.grow(n, alpha) for n in forms}
            out = {k: losses_with(model, forms, grown, b) for k, b in evaluate.items()}
            return {"alpha": alpha, "predicted": sum(g.predicted_decrease for g in grown.values()),
                    "fell_back": any(g.fell_back for g in grown.values()), **out}
        points = [at(a) for a in (GRID if method not in growth.BASELINES else [0.0])]
        rules = {}
        if method not in growth.BASELINES:
            kept_loss = lambda pt: sum(pt["window"][WINDOW - KEPT:]) / KEPT  # noqa: E731
            by_alpha = {pt["alpha"]: pt for pt in points}
            for label, grid in GRIDS.items():  # what the callback would choose, from the kept batches
                decreases = [kept_loss(by_alpha[0.0]) - kept_loss(by_alpha[a]) for a in grid]
                best = growth.choose_step([-d for d in [0.0, *decreases]], [0.0, *grid])
                slope = by_alpha[min(grid)]["predicted"] / min(grid)
                star = growth.quadratic_step(slope, grid, decreases)
                rules[label] = {"grid": [0.0, *grid][best], "quadratic": at(star)}
        curves.append({"method": method, "mode": mode, "points": points, "rules": rules})
    return {"base": base, "curves": curves, "noise": noise(forms, stats, grow_by)}


class Probe(L.Callback):
    """Measures each growth event on a copy of the model, before the growth callback grows it."""

    def __init__(self, out: Path, seed: int):
        self.out, self.seed, self.events = out, seed, []

    def on_train_epoch_start(self, trainer, pl_module):
        epoch = trainer.current_epoch
        if epoch not in GROW_EPOCHS:
            return
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(1000 * self.seed + epoch)
        event = measure_event(pl_module.model, trainer.datamodule.train_set, held_out(trainer.datamodule), generator)
        self.events.append({"seed": self.seed, "epoch": epoch, "step": trainer.global_step,
                            "seconds": time.perf_counter() - start, **event})
        self.out.write_text(json.dumps(self.events))
        print(f"probe seed {self.seed} epoch {epoch}: {time.perf_counter() - start:.0f} s", flush=True)
        if epoch == max(GROW_EPOCHS):
            trainer.should_stop = True


def probe(text: str, seed: int, out: Path, log_dir: str, extra: list[str]) -> None:
    cli = build(text, [*grow_args("natural", "replace", OLD_GRID), *extra], seed, log_dir)
    cli.trainer.callbacks.insert(0, Probe(out, seed))
    cli.trainer.fit(cli.model, cli.datamodule)


# -- report: tables and figures from the probe and run results ------------------------------------------
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
        return max(candidates, key=lambda p: (kept(p), -p["alpha"]))

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
    """Rows of scripts/experiments.py's JSON (seeds 0, 1, … in order) in this script's format (no held-out loss
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
    results += reused(REPO / "docs/experiments_text.json", ["static d_head 2", "static d_head 16"])
    (out / "growth_step.json").write_text(json.dumps({"probe": events, "runs": results}))
    plot_steps(events, out / "growth_step_loss_vs_alpha.png")
    plot_noise(events, out / "growth_step_noise.png")
    print("## L(α)\n", step_table(events), "\n\n## noise (cosine / overlap)\n", noise_table(events),
          "\n\n## runs\n", runs_table(results), sep="\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="mechanism-table runs")
    t.add_argument("--text", required=True)
    t.add_argument("--runs", nargs="+", required=True, choices=list(RUNS))
    t.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    t.add_argument("--out", required=True, help="JSON lines file, one run per line (appended)")
    t.add_argument("--override", nargs="+", action="extend", default=[], help="extra CLI overrides (smoke runs)")
    pr = sub.add_parser("probe", help="L(α) and noise at the growth events of one seed")
    pr.add_argument("--text", required=True)
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--out", required=True, help="JSON file")
    pr.add_argument("--override", nargs="+", action="extend", default=[], help="extra CLI overrides (smoke runs)")
    rp = sub.add_parser("report", help="tables (printed) and figures in --out from probe JSONs and run JSON lines")
    rp.add_argument("--probes", nargs="+", type=Path, required=True)
    rp.add_argument("--runs", nargs="*", type=Path, default=[])
    rp.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "report":
        report(args.probes, args.runs, args.out)
    if args.command == "probe":
        with tempfile.TemporaryDirectory() as logs:
            probe(args.text, args.seed, Path(args.out), logs, args.override)
    if args.command == "train":
        with tempfile.TemporaryDirectory() as logs:
            for name in args.runs:
                for seed in args.seeds:
                    result = train(args.text, name, seed, logs, args.override)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(result) + "\n")
                    print(json.dumps({k: result[k] for k in ("run", "seed", "seconds", "final", "event_loss")}), flush=True)


if __name__ == "__main__":
    main()
