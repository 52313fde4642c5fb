"""The growth step on text: does a step along ΔM pay, and which part of growth does? (README.md beside this file)

    python studies/growth_step/growth_step.py probe --text tinyshakespeare.txt --out probe.json  # L(α), noise
    python studies/growth_step/growth_step.py train --text … --runs 'grow natural/append α=0 + Q/K reset' --out runs.jsonl
    python studies/growth_step/growth_step.py report --probes probe_*.json --runs runs.jsonl   # tables, figures

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
import json
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from step_study import GROW_EPOCHS, HERE, STATIC, FINE_GRID, build, grow_args, held_out, mean_loss
from step_study_probe import probe
from step_study_report import report, runs_table  # noqa: F401 - runs_table: the table of `train` runs

from lit_growattn.callback import GrowAttentionCallback  # step_study has put the repository on the path

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
    rp.add_argument("--out", type=Path, default=HERE)
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
