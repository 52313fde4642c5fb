"""Issue 21's small experiment: does growing d_k pay on a tiny Llama (RoPE, GQA), and what do the appended NoPE
columns do? configs/hf_llama_grow.yaml (hidden 64, 2 layers, 4 query heads sharing 2 key/value heads, head_dim 8,
byte tokenizer) on a text file, four runs per seed, the same steps for all:

    static full    d_k 8: the config's 8 rotary columns
    static small   d_k 4: 4 rotary columns, the RoPE of a head_dim-4 Llama (HFCausalLM rotary_dim=4); v width stays 8
    grow fixed     from small, +2 NoPE columns at epochs 1 and 2 (AtEpochs): 4 rotary + 4 NoPE = 8 at the end
    grow auto      from small, AutoSchedule (a check every `--check-every` steps, a K-cache budget of `--budget`,
                   default 8: static full's d_k)

    python studies/hf_growth/hf_experiment.py --text tinyshakespeare.txt        # 3 seeds, hf_experiment.* here
    python studies/hf_growth/hf_experiment.py --text FILE --seeds 0 --override --trainer.max_epochs=1   # a smoke run

After each run, on `--probe-batches` validation batches, with "extra columns" the query/key columns a small model
lacks (static full: the 4 rotary columns of the frequency pairs rotary_dim=4 drops; grown: the NoPE columns): the
validation loss with the extra columns zeroed in the keys, the RMS of the scores' parts from the small model's
columns and from the extra ones (causal entries), and the attention entropy per layer. Writes
<out>/hf_experiment.md (the tables, also printed) and <out>/hf_experiment.json (every run; each AutoSchedule
decision keeps its first 8 candidates).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from itertools import islice
from pathlib import Path

import lightning as L
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # studies/: study_runs, shared with the other studies

from study_runs import run  # noqa: E402 - study_runs puts the repository on the path

from lit_growattn.dint.entropy import layer_entropies  # noqa: E402
from lit_growattn.hf.growable import rotary_columns  # noqa: E402

CONFIG = "configs/hf_llama_grow.yaml"
SMALL = ["--model.init_args.rotary_dim=4"]


def schedules(check_every: int, budget: float) -> dict[str, dict]:
    """The growth callback of each growing run (replacing the config's)."""
    def grow(schedule: dict, columns: int | None) -> dict:
        return {"class_path": "lit_growattn.GrowAttentionCallback",
                "init_args": {"schedule": schedule, "statistics": {"batches": 16},
                              "growth": {"columns": columns, "method": "natural", "mode": "append"}}}

    return {"grow fixed": grow({"class_path": "lit_growattn.AtEpochs", "init_args": {"epochs": [1, 2]}}, 2),
            "grow auto": grow({"class_path": "lit_growattn.AutoSchedule",
                               "init_args": {"check_every": check_every, "budget": budget}}, None)}


class SplitProbe(L.Callback):
    """At the end of fit: what the columns beyond the small model's carry (see the module docstring)."""

    def __init__(self, batches: int):
        self.batches = batches
        self.result: dict = {}

    @torch.no_grad()
    def on_fit_end(self, trainer, pl_module):
        was_training = pl_module.training
        pl_module.eval()
        loader = trainer.datamodule.val_dataloader()
        batches = [(x.to(pl_module.device), y.to(pl_module.device)) for x, y in islice(loader, self.batches)]
        loss = lambda: statistics.mean(float(pl_module.batch_loss(b)) for b in batches)  # noqa: E731
        forms = [named.form for named in pl_module.growable_forms()]
        self.result = {"loss": loss(), "entropy": layer_entropies(pl_module.model, batches).tolist(),
                       "rms_small": [], "rms_extra": []}
        inputs = _attention_inputs(pl_module, forms, batches[0][0])
        for form, (x, position) in zip(forms, inputs):
            q, k = form.queries_keys(x, position)  # rotated: a rotary pair's score part is its columns' product
            k = k.repeat_interleave(form.n_head // form.n_kv_head, 1)
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
            extra = _extra_columns(form)
            small = torch.tensor([c for c in range(form.d_head) if c not in extra.tolist()])
            rms = lambda cols: float((q[..., cols] @ k[..., cols].mT)[..., causal].square().mean().sqrt())  # noqa: E731
            self.result["rms_small"].append(rms(small))
            self.result["rms_extra"].append(rms(extra) if len(extra) else 0.0)
        kept = [form.w_k.detach().clone() for form in forms]
        for form in forms:  # keys of the columns a small model lacks set to zero: their scores vanish
            extra = _extra_columns(form)
            form.w_k.data[..., extra] = 0
        self.result["loss_without_extra"] = loss()
        for form, w_k in zip(forms, kept):
            form.w_k.data.copy_(w_k)
        pl_module.train(was_training)


def _extra_columns(form) -> torch.Tensor:
    """Columns beyond a 4-rotary model's: NoPE columns, or the rotary pairs rotary_dim=4 does not keep."""
    if form.rotary > 4:
        return torch.tensor([c for c in range(form.rotary) if c not in rotary_columns(form.rotary, 4).tolist()])
    return torch.arange(form.rotary, form.d_head)


def _attention_inputs(pl_module, forms, inputs) -> list[tuple[torch.Tensor, tuple]]:
    """Each layer's attention input and rotary (cos, sin), captured by forward pre-hooks on one batch."""
    seen = []
    hooks = [f.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (kwargs.get("hidden_states", args[0] if args else None), kwargs["position_embeddings"])), with_kwargs=True)
        for f in forms]
    try:
        pl_module(inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _compact(event: dict, kept: int = 8) -> dict:
    """A growth record with each decision's per-candidate lists cut to the first `kept` candidates (of up to e′)."""
    cut = lambda d: {k: v[:kept] if isinstance(v, list) else v for k, v in d.items()}  # noqa: E731
    return {**event, "decisions": [cut(d) for d in event["decisions"]]} if "decisions" in event else event


def table(results: dict[str, list[dict]]) -> str:
    mean, sd = statistics.mean, lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
    fmt = lambda xs, p=3: f"{mean(xs):.{p}f} ± {sd(xs):.{p}f}"  # noqa: E731
    head = ["run", "seeds", "params", "val loss", "final d_k per layer (per seed)",
            "probe loss → with the extra columns' keys zeroed",
            "score RMS, small model's columns / extra columns (per layer)", "attention entropy (per layer)", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, runs in results.items():
        probes = [r["probe"] for r in runs]
        layers = range(len(probes[0]["entropy"]))
        per_layer = lambda key: " ".join(f"{mean(p[key][i] for p in probes):.2f}" for i in layers)  # noqa: E731
        lines.append("| " + " | ".join([
            name, str(len(runs)), " ".join(sorted({str(r["params"]) for r in runs}, key=int)),
            fmt([r["final"]["loss"] for r in runs]),
            " ".join(str(r["final"]["d_head"]) for r in runs),
            f"{fmt([p['loss'] for p in probes])} → {fmt([p['loss_without_extra'] for p in probes])}"
            if name != "static small" else fmt([p["loss"] for p in probes]),
            f"{per_layer('rms_small')} / {per_layer('rms_extra')}", per_layer("entropy"),
            f"{mean(r['seconds'] for r in runs):.0f}"]) + " |")
    trajectory = ["| run | seed | d_k after each event: step → per layer (checks that grew nothing left out) |",
                  "|---|---|---|"]
    for name, runs in results.items():
        for r in runs:
            steps = [f"{e['step']} → {e['d_head']}" for e in r["events"] if e["d_head"] != e["d_head_before"]]
            if steps:
                trajectory.append(f"| {name} | {r['seed']} | {', '.join(steps)} |")
    return "\n".join(lines) + "\n\n" + "\n".join(trajectory)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", help="a text file (e.g. tinyshakespeare.txt)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", help="run names to keep")
    parser.add_argument("--check-every", type=int, default=100, help="AutoSchedule's steps between checks")
    parser.add_argument("--budget", type=float, default=8.0,
                        help="AutoSchedule's K-cache budget, a mean query/key head size (default 8: static full's d_k)")
    parser.add_argument("--probe-batches", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--override", nargs="+", action="extend", default=[], help="extra CLI overrides for every run")
    parser.add_argument("--from-json", help="re-render the tables from an earlier run's hf_experiment.json (pass "
                        "that run's --text and --override, which the header names)")
    args = parser.parse_args(argv)
    if not args.text:
        parser.error("--text FILE is needed (the corpus; with --from-json, the one the results were trained on)")
    grown = schedules(args.check_every, args.budget)
    runs = {"static full": ([], False), "static small": (SMALL, False),
            "grow fixed": (SMALL, True), "grow auto": (SMALL, True)}
    runs = {k: v for k, v in runs.items() if not args.only or k in args.only}
    common = [f"--data.init_args.path={args.text}", *args.override]
    results: dict[str, list[dict]] = json.loads(Path(args.from_json).read_text()) if args.from_json else {}
    if args.from_json:
        runs = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, (overrides, grows) in runs.items():
            extra = []
            if grows:
                callbacks = Path(logs) / f"{name.replace(' ', '_')}.yaml"
                callbacks.write_text(yaml.safe_dump({"trainer": {"callbacks": [grown[name]]}}))
                extra = [f"--config={callbacks}"]
            for seed in args.seeds:
                probe = SplitProbe(args.probe_batches)
                seeded = [f"--seed_everything={seed}", f"--data.init_args.seed={seed}"]
                result = run(CONFIG, [*extra, *common, *overrides, *seeded], logs, grows, callbacks=[probe])
                result["events"] = [_compact(e) for e in result["events"]]
                results.setdefault(name, []).append({"seed": seed, **result, "probe": probe.result})
                print(json.dumps({"run": name, "seed": seed, "seconds": result["seconds"], "final": result["final"],
                                  "probe": probe.result}), flush=True)
    text = table(results)
    out = Path(args.out)
    (out / "hf_experiment.md").write_text(f"# hf_experiment ({CONFIG}, overrides {common})\n\n{text}\n")
    if not args.from_json:
        (out / "hf_experiment.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
