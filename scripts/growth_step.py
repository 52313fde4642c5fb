"""The growth step on text: does a step along ΔM pay, and which part of growth does? (docs/growth_step.md)

    python scripts/growth_step.py probe --text ../shared/data/tinyshakespeare.txt        # L(α), noise → JSON
    python scripts/growth_step.py train --text … --runs 'grow natural/append + Q/K reset' --seeds 0 1 2
    python scripts/growth_step.py report                                                  # md table + plots

`probe` trains configs/text_grow.yaml (the experiments setting: 5 epochs of 150 steps) and, at the start of
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
FINE_GRID = [0.0] + [2.0**-k for k in range(9)]  # 1 … 1/256: on text the best step lies at 1/32 … 1/128
STATIC = ["--trainer.callbacks=null"]


def grow_args(method: str, mode: str, *extra: str) -> list[str]:
    return [f"--trainer.callbacks.init_args.method={method}", f"--trainer.callbacks.init_args.mode={mode}", *extra]


# name → (CLI overrides, reset the Q/K Adam moments at the growth epochs)
RUNS: dict[str, tuple[list[str], bool]] = {
    "static d_head 2": ([*STATIC, "--model.init_args.d_head=2"], False),
    "static d_head 16": ([*STATIC, "--model.init_args.d_head=16"], False),
    "static d_head 2 + Q/K reset": ([*STATIC, "--model.init_args.d_head=2"], True),
    "grow zero/append": (grow_args("zero", "append"), False),
    "grow random/append": (grow_args("random", "append"), False),
    "grow natural/append α=0": (grow_args("natural", "append", "--trainer.callbacks.init_args.alphas=[0]"), False),
    "grow natural/append α=0 + Q/K reset": (grow_args("natural", "append", "--trainer.callbacks.init_args.alphas=[0]"), True),
    "grow natural/replace α=0": (grow_args("natural", "replace", "--trainer.callbacks.init_args.alphas=[0]"), False),
}
QUADRATIC = ["--trainer.callbacks.init_args.step_size=quadratic", f"--trainer.callbacks.init_args.alphas={FINE_GRID}"]
RUNS |= {f"grow {m}/{mode} quadratic": (grow_args(m, mode, *QUADRATIC), False)
         for m in ("natural", "gradient") for mode in ("append", "replace")}


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
PAIRS = [(m, mode) for m in ("natural", "gradient", "pinv") for mode in ("append", "replace")]
PAIRS += [("zero", "append"), ("random", "append")]
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
    cli = build(text, extra, seed, log_dir)
    cli.trainer.callbacks.insert(0, Probe(out, seed))
    cli.trainer.fit(cli.model, cli.datamodule)


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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
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
