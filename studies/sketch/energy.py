"""The sketch energy report (issue 55; studies/sketch/README.md): at every growth event of the shipped text configs,
trained on the full statistics path, what share of each unit's full top-p bottleneck energy the sketched columns
capture, and what the sketched and full top-p changes gain held out, for the gradient, natural (pseudo-inverse) and
natural (ridge 1.0) directions.

    python studies/sketch/energy.py --text ../shared/data/tinyshakespeare.txt   # the runs → results.json, results.md
    python studies/sketch/energy.py --report                                    # results.md, results_share.png

A read-only probe (`EnergyProbe`, a callback placed before the growth callback) reads, at the start of the batch
where an event happens, the window's reduced full sums and their half (`StatsWindow.stats`, `.half`) of every unit
about to grow, and computes everything from them (`analyse`); training is the same as without it. The sketch is
built from the full sums as the capture would sum it (`sketch_of`) and reconstructed and grown by the project's
classes. --configs picks configs; --override adds CLI overrides to every run; --ks replaces the sizes (default p + 1
and max(24, 2p + 8)). Results go to --out after each config; a config already there is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

STUDY = Path(__file__).resolve().parent
REPO = STUDY.parents[1]
sys.path.insert(0, str(REPO))

from lit_growattn import growth  # noqa: E402
from lit_growattn.callback import GrowAttentionCallback  # noqa: E402
from lit_growattn.callback.schedule import Clock  # noqa: E402
from lit_growattn.commands.cli import main as cli_main  # noqa: E402
from lit_growattn.growth.sketch import SketchSize  # noqa: E402

CONFIGS = {"text_grow": "configs/text_grow.yaml", "text_grow_both": "configs/text_grow_both.yaml",
           "text_auto": "configs/text_auto.yaml"}
# name → (method, ridge): the directions compared, gradient first (the held-out gains are in its units).
DIRECTIONS = {"gradient": ("gradient", None), "natural pinv": ("natural", None), "natural ridge 1.0": ("natural", 1.0)}
DRAWS = 5
AUTO_P = 8  # the pairs an event may append per head when AutoSchedule chooses (the sketch's default size rule)
OUT = STUDY / "results.json"
WHAT = ("runs[config]: seconds (the run), probe_seconds, final val loss, the growth events (step, sizes, α) and "
        "units: one record per event × unit about to grow (layer, side d_head | d_v, width before, p, ks) with, per "
        "direction, stable_rank and top_p (of the full bottleneck's energy), share[k] {mean, min} over heads × draws, "
        "and held_out and in_sample gains {full, k} ÷ the full gradient's held-out gain at that event "
        "(gradient_held_out: its raw value)")


def default_k(p: int) -> int:
    """The sketch size rule of issue 55: max(24, 2p + 8)."""
    return max(24, 2 * p + 8)


# -- the sketch, from full sums ----------------------------------------------------------------------------------
def sketch_of(unit, sums: growth.Sums, k: int, seed: int) -> growth.Sums:
    """The sketch sums of `unit` at size k with test matrices drawn from `seed`, built from its full sums as the
    capture sums them (linear in N and C, so the sums' sketch is the sketch's sum): query/key Y_j = N_jΩ,
    W_g = Σ_{j∈g} N_jᵀΨ_j, C kept; value Y_V,g = Σ_{j∈g} N_V,jΩ_j, W_V,j = N_V,jᵀΨ, F_j = C_V,jΩ_c. In the sums' dtype,
    as the capture would hold them (products in float64 from the cast test matrices)."""
    dtype = sums.weight.dtype
    sketch = unit.empty_sums("gradient", dtype, sketch=SketchSize.of(k), seed=seed)
    tests = {name: t.double() for name, t in sketch.tests.matrices.items()}
    n = sums.n_sum.double()
    if unit.side == "d_head":
        h, e, _ = n.shape
        kv = sketch.w_sum.shape[0]
        sketch.c_sum = sums.c_sum.clone()
        sketch.y_sum = (n @ tests["omega"]).to(dtype)
        sketch.w_sum = (n.mT @ tests["psi"]).reshape(kv, h // kv, e, -1).sum(1).to(dtype)
    else:
        h, e_in, _ = n.shape
        kv = sketch.y_sum.shape[0]
        sketch.y_sum = (n @ tests["omega"]).reshape(kv, h // kv, e_in, -1).sum(1).to(dtype)
        sketch.w_sum = (n.mT @ tests["psi"]).to(dtype)
        sketch.f_sum = (sums.c_sum.double() @ tests["omega_c"]).to(dtype)
    sketch.instances, sketch.weight = sums.instances.clone(), sums.weight.clone()
    return sketch


def draw_seed(tag: str, draw: int) -> int:
    """The draw's seed: crc32 of "<event>/<unit>/<draw>" (stable across processes)."""
    return zlib.crc32(f"{tag}/{draw}".encode())


# -- share and gains ---------------------------------------------------------------------------------------------
def share(u_s: Tensor, v_s: Tensor, u: Tensor, s: Tensor, v: Tensor, p: int) -> Tensor:
    """‖U_sᵀ B V_s‖²_F / Σ_{j≤p} σ_j² per group: B = u diag(s) vᵀ the full bottleneck (all its pairs), U_s, V_s
    orthonormal bases of the sketched top-p columns u_s[..., :p], v_s[..., :p]."""
    q_u, q_v = torch.linalg.qr(u_s[..., :p]).Q, torch.linalg.qr(v_s[..., :p]).Q
    b = (u * s.unsqueeze(-2)) @ v.mT
    return (q_u.mT @ b @ q_v).square().sum((-2, -1)) / s[..., :p].square().sum(-1)


def top_change(unit, u: Tensor, s: Tensor, v: Tensor, p: int) -> Tensor:
    """Δ_p = Σ_{j≤p} σ_j u_j v_jᵀ of each group's bottleneck pairs, per query head in the unit's own layout: query/key
    (H, e′, e′) from u (KV, g·e′, ·), v (KV, e′, ·); value (H, e′, e) from u (KV, e′, ·), w (KV, g·e, ·)."""
    d = (u[..., :p] * s[..., :p].unsqueeze(-2)) @ v[..., :p].mT
    h = unit.n_head
    if unit.side == "d_head":
        e = d.shape[-1]
        return d.reshape(h, e, e)
    kv, e_in = d.shape[:2]
    return d.reshape(kv, e_in, h // kv, -1).permute(0, 2, 1, 3).reshape(h, e_in, -1)


def gain(unit, delta: Tensor, moments: growth.Moments, fit: growth.Moments) -> float:
    """First-order decrease −⟨N̄, Δ⟩ on `moments` per unit score energy under the fitted half's C̄ (query/key
    √Σ_{j∈g} tr(Δ_jᵀC̄Δ_jC̄), value √Σ_{j∈g} tr(Δ_jᵀC̄_jΔ_j)), per group, mean over groups."""
    inner = -(moments.n * delta).sum((-2, -1))
    c = fit.c
    energy = (delta * (c @ delta @ c if unit.side == "d_head" else c @ delta)).sum((-2, -1))
    kv = unit.n_kv_head
    inner, energy = inner.reshape(kv, -1).sum(-1), energy.reshape(kv, -1).sum(-1)
    return float(torch.where(energy > 0, inner / energy.clamp_min(1e-300).sqrt(), 0.0).mean())


def both_ways(unit, fits: list[tuple[Tensor, Tensor, Tensor]], halves: list[growth.Moments], p: int
              ) -> tuple[float, float]:
    """(held out, in sample) gain of the top-p changes fitted on each half: scored on the other half (and on itself),
    the two ways averaged."""
    deltas = [top_change(unit, *fit, p) for fit in fits]
    held = (gain(unit, deltas[0], halves[1], halves[0]) + gain(unit, deltas[1], halves[0], halves[1])) / 2
    own = (gain(unit, deltas[0], halves[0], halves[0]) + gain(unit, deltas[1], halves[1], halves[1])) / 2
    return held, own


def analyse(unit, whole: growth.Sums, half: growth.Sums, p: int, ks: list[int], draws: int, tag: str) -> dict:
    """Everything the report keeps of one unit at one event (see WHAT), from its window's full sums `whole` and the
    sums of one half of its micro-batches `half`. Reads only."""
    halves = [half, whole - half]
    m_whole, m_halves = whole.means(), [h.means() for h in halves]
    sketches = {k: [(sketch_of(unit, whole, k, draw_seed(tag, d)), [sketch_of(unit, h, k, draw_seed(tag, d))
                                                                      for h in halves]) for d in range(draws)]
                for k in ks}
    sketch_means = {k: [(w.means(), [h.means() for h in hs]) for w, hs in per_draw] for k, per_draw in sketches.items()}
    out, base = {}, None
    for name, (method, ridge) in DIRECTIONS.items():
        def pairs(moments) -> tuple[Tensor, Tensor, Tensor]:
            return growth.growth_for(unit, moments, method, ridge=ridge).bottleneck(method)[:3]

        u, s, v = pairs(m_whole)
        energy = s.square()
        held, own = both_ways(unit, [pairs(m) for m in m_halves], m_halves, p)
        if base is None:
            base = held  # the full gradient's held-out gain (DIRECTIONS starts with it)
        row = {"stable_rank": float((energy.sum(-1) / energy[..., 0]).mean()),
               "top_p": float((energy[..., :p].sum(-1) / energy.sum(-1)).mean()),
               "share": {}, "held_out": {"full": held / base}, "in_sample": {"full": own / base}}
        for k in ks:
            shares, helds, owns = [], [], []
            for sk_whole, sk_halves in sketch_means[k]:
                u_s, _, v_s = pairs(sk_whole)
                shares.append(share(u_s, v_s, u, s, v, p))
                h, o = both_ways(unit, [pairs(m) for m in sk_halves], m_halves, p)
                helds.append(h)
                owns.append(o)
            shares = torch.stack(shares)
            row["share"][str(k)] = {"mean": float(shares.mean()), "min": float(shares.min())}
            row["held_out"][str(k)] = sum(helds) / len(helds) / base
            row["in_sample"][str(k)] = sum(owns) / len(owns) / base
        out[name] = row
    return {"gradient_held_out": base, "directions": out}


# -- the probe ---------------------------------------------------------------------------------------------------
class EnergyProbe(L.Callback):
    """Placed before `grow` (the run's GrowAttentionCallback) among the trainer's callbacks: at the start of the batch
    where `grow` is about to grow, `analyse`s every unit of the event from the window's sums. It turns the window's
    half-sums on after setup (read only by AutoSchedule's decision, which the fixed schedules do not make), so every
    config has the two halves; nothing else of the run is touched. ks: the sketch sizes (None: p + 1 and default_k)."""

    def __init__(self, grow: GrowAttentionCallback, ks: list[int] | None = None, draws: int = DRAWS):
        self.grow, self.ks, self.draws = grow, ks, draws
        self.records: list[dict] = []
        self.seconds = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.grow.window.halves = True

    def p_of(self, layer: int, side: str) -> int:
        settings = self.grow.settings
        if self.grow.schedule.kind == "auto" or settings.rank_threshold is not None:
            return AUTO_P
        return settings.count(layer, side)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        grow, window = self.grow, self.grow.window
        clock = Clock(trainer.current_epoch, batch_idx, trainer.global_step, trainer.num_training_batches,
                      trainer.accumulate_grad_batches)
        point = grow.schedule.pending(grow.history)
        if point is None or not point.reached(clock) or window.event != point.name or window.stats is None:
            return
        if window.half is None or (not window.reduced and trainer.world_size > 1):
            raise RuntimeError("the probe needs the window's halves, summed over ranks")
        start = time.perf_counter()
        for (layer, name, unit), whole, half in zip(grow._forms(pl_module), window.stats, window.half, strict=True):
            if not (half.instances > 0 and whole.instances > half.instances):
                continue  # a half without statistics: nothing to score
            p = self.p_of(layer, unit.side)
            ks = self.ks or [p + 1, default_k(p)]
            record = analyse(unit, whole, half, p, ks, self.draws, f"{point.name}/{name}")
            self.records.append({"event": point.name, "step": trainer.global_step, "layer": layer, "side": unit.side,
                                 "width": unit.width, "p": p, "ks": ks, **record})
        self.seconds += time.perf_counter() - start


class FinalLoss(L.Callback):
    def __init__(self):
        self.loss = None

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.loss = float(trainer.callback_metrics["val/loss"])


def run_config(config: str, overrides: list[str], log_dir: str, probe: bool = True, ks: list[int] | None = None,
               draws: int = DRAWS) -> dict:
    """One training run of `config` through the project's CLI, with the probe before its growth callback."""
    cli = cli_main(["--config", str(REPO / config), "--trainer.enable_progress_bar=false",
                    "--trainer.enable_model_summary=false", f"--trainer.logger.init_args.save_dir={log_dir}",
                    *overrides], run=False)
    callbacks = cli.trainer.callbacks
    grow = next(c for c in callbacks if isinstance(c, GrowAttentionCallback))
    final = FinalLoss()
    energy = EnergyProbe(grow, ks, draws) if probe else None
    if energy is not None:
        callbacks.insert(callbacks.index(grow), energy)
    callbacks.append(final)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    events = [{key: e.get(key) for key in ("event", "step", "skipped", "alpha", "d_head_before", "d_head",
                                            "d_v_before", "d_v") if key in e} for e in grow.history]
    return {"seconds": time.perf_counter() - start, "probe_seconds": energy.seconds if energy else 0.0,
            "final_loss": final.loss, "events": events, "units": energy.records if energy else [],
            "weights": {n: t.detach().clone() for n, t in cli.model.state_dict().items()}}


# -- report --------------------------------------------------------------------------------------------------------
def cell(stat: dict) -> str:
    return f"{stat['mean']:.2f} ({stat['min']:.2f})"


def tables(results: dict) -> str:
    """Per config, one row per event × unit: shares at each k (mean (min) over heads × draws) and held-out gains (÷
    the full gradient's) for every direction."""
    lines = [f"# Sketch energy report: results ({results.get('text', '')})", "",
             "Share: mean (min) over heads × draws of ‖U_sᵀBV_s‖² / Σ_{j≤p}σ_j². Held out: gain of the top-p change "
             "fitted on one half, scored on the other, ÷ the full gradient's; columns full, then each k.", ""]
    for config, run in results["runs"].items():
        units = run["units"]
        if not units:
            continue
        ks = units[0]["ks"]
        lines += [f"## {config} (p {units[0]['p']}, k {', '.join(map(str, ks))}; final val loss "
                  f"{run['final_loss']:.4f}, {run['seconds']:.0f} s, probe {run['probe_seconds']:.0f} s)", ""]
        head = "| event | layer | side | width |" + "".join(f" {d} share k {k} |" for d in DIRECTIONS for k in ks)
        lines += [head, "|" + "---|" * (4 + len(DIRECTIONS) * len(ks))]
        for u in units:
            lines.append(f"| {u['event']} | {u['layer']} | {u['side']} | {u['width']} |" + "".join(
                f" {cell(u['directions'][d]['share'][str(k)])} |" for d in DIRECTIONS for k in ks))
        lines.append("")
        variants = ["full", *map(str, ks)]
        head = "| event | layer | side |" + "".join(f" {d} held out {v} |" for d in DIRECTIONS for v in variants)
        lines += [head, "|" + "---|" * (3 + len(DIRECTIONS) * (1 + len(ks)))]
        for u in units:
            lines.append(f"| {u['event']} | {u['layer']} | {u['side']} |" + "".join(
                f" {u['directions'][d]['held_out'][v]:.2f} |" for d in DIRECTIONS for v in ["full", *map(str, ks)]))
        lines.append("")
        head = "| event | layer | side |" + "".join(f" {d} stable rank, top-p share |" for d in DIRECTIONS)
        lines += [head, "|" + "---|" * (3 + len(DIRECTIONS))]
        for u in units:
            lines.append(f"| {u['event']} | {u['layer']} | {u['side']} |" + "".join(
                f" {u['directions'][d]['stable_rank']:.2f}, {u['directions'][d]['top_p']:.2f} |" for d in DIRECTIONS))
        lines.append("")
    return "\n".join(lines) + "\n"


def raw(unit: dict, direction: str, variant: str, measure: str = "held_out") -> float:
    """A gain as measured (the records keep it ÷ the full gradient's held-out gain at that event)."""
    return unit["directions"][direction][measure][variant] * unit["gradient_held_out"]


def pooled(units: list[dict], direction: str, variant: str, measure: str = "held_out") -> float:
    """A unit's gains pooled over its events, in units of the full gradient's in-sample gain (positive at every
    event): Σ_e gain_e / Σ_e (full gradient's in-sample gain)_e. The pre-registered ratio to the full gradient's
    held-out gain is kept per event (results.md), but it is ill-conditioned where that gain is near zero or negative
    (noise-dominated windows), and a sum of such denominators can change sign."""
    scale = sum(raw(u, "gradient", "full", "in_sample") for u in units)
    return sum(raw(u, direction, variant, measure) for u in units) / scale


def summary_rows(results: dict) -> list[dict]:
    """Per config × layer × side × direction: over its events, the mean share at each k per event, the lowest share of
    any head × draw, the held-out and in-sample gains pooled over events (`pooled`; full, then each k), the stable
    ranks, and the events where the full gradient's held-out gain is not positive."""
    rows = []
    for config, run in results["runs"].items():
        keys = sorted({(u["layer"], u["side"]) for u in run["units"]}, key=lambda t: (t[1], t[0]))
        for layer, side in keys:
            units = [u for u in run["units"] if (u["layer"], u["side"]) == (layer, side)]
            ks = [str(k) for k in units[0]["ks"]]
            for d in DIRECTIONS:
                rows.append({"config": config, "layer": layer, "side": side, "direction": d, "events": len(units),
                             "ks": ks, **{f"share {k}": [u["directions"][d]["share"][k]["mean"] for u in units]
                                          for k in ks},
                             **{f"min {k}": min(u["directions"][d]["share"][k]["min"] for u in units) for k in ks},
                             **{f"held {v}": pooled(units, d, v) for v in ["full", *ks]},
                             "in_sample": pooled(units, d, "full", "in_sample"),
                             "held_per_event": [u["directions"][d]["held_out"]["full"] for u in units],
                             "stable_rank": [u["directions"][d]["stable_rank"] for u in units],
                             "gradient_not_positive": sum(u["gradient_held_out"] <= 0 for u in units)})
    return rows


def summary_table(results: dict) -> str:
    rows = summary_rows(results)
    ks = rows[0]["ks"] if rows else []
    names = ["k = p + 1", "default k"] if len(ks) == 2 else [f"k {k}" for k in ks]
    lines = ["Share: mean over events of the per-event mean (lowest event; lowest head × draw), at each k of column "
             "k. Gains pooled over events in % of the full gradient's in-sample gain (`pooled`): held out for the "
             "full top-p change, then the sketched ones at each k, and in sample for the full one. Last column: events "
             "where the full gradient's held-out gain is ≤ 0.", "",
             "| config | layer | side | direction | events | k | stable rank |"
             + "".join(f" share, {n} |" for n in names)
             + f" held out: full / {' / '.join(names)} | in sample: full | gradient held out ≤ 0 |",
             "|" + "---|" * (10 + len(ks))]
    for r in rows:
        sr = r["stable_rank"]

        def shared(k: str) -> str:
            means = r[f"share {k}"]
            return f"{sum(means) / len(means):.2f} ({min(means):.2f}; {r[f'min {k}']:.2f})"

        held = " / ".join(f"{100 * r['held ' + v]:.1f}" for v in ["full", *r["ks"]])
        shares = "".join(f" {shared(k)} |" for k in r["ks"])
        lines.append(f"| {r['config']} | {r['layer']} | {r['side']} | {r['direction']} | {r['events']} | "
                     f"{', '.join(r['ks'])} | {min(sr):.2f}–{max(sr):.2f} |{shares} {held} | "
                     f"{100 * r['in_sample']:.0f} | {r['gradient_not_positive']} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Mean share per event against the event's step: one panel per direction, one line per config × layer × side,
    solid at the default k, dashed at k = p + 1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(DIRECTIONS), figsize=(5 * len(DIRECTIONS), 4.8), sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    series = 0
    for config, run in results["runs"].items():
        keys = sorted({(u["layer"], u["side"]) for u in run["units"]}, key=lambda t: (t[1], t[0]))
        for layer, side in keys:
            units = [u for u in run["units"] if (u["layer"], u["side"]) == (layer, side)]
            small, big = str(min(units[0]["ks"])), str(max(units[0]["ks"]))
            colour = colours[series % len(colours)]
            series += 1
            steps = [u["step"] for u in units]
            for ax, d in zip(axes, DIRECTIONS):
                ax.plot(steps, [u["directions"][d]["share"][big]["mean"] for u in units], "o-", color=colour,
                        label=f"{config} L{layer} {side}")
                ax.plot(steps, [u["directions"][d]["share"][small]["mean"] for u in units], "x--", color=colour,
                        alpha=0.7)
    for ax, d in zip(axes, DIRECTIONS):
        ax.set_title(d)
        ax.set_xlabel("event (optimizer step)")
        ax.axhline(0.9, color="grey", lw=0.8, ls=":")
        ax.set_ylim(0, 1.02)
    axes[0].set_ylabel("share (mean over heads × draws)")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=4)
    fig.suptitle("Share of the full bottleneck's top-p energy in the sketched top-p columns, per event "
                 "(solid: default k 24; dashed: k p + 1; dotted: 0.9)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: dict, out: Path) -> None:
    """<out>.md (the tables) and <out>_share.png (the plot) beside the results <out>.json."""
    out.with_suffix(".md").write_text(tables(results) + "\n## Summary over events\n\n" + summary_table(results))
    if any(run["units"] for run in results["runs"].values()):
        plot(results, out.with_name(f"{out.stem}_share.png"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", help="the corpus (Tiny Shakespeare)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--override", action="append", default=[], help="a CLI override for every run")
    parser.add_argument("--ks", type=int, nargs="+", help="sketch sizes (default: p + 1 and max(24, 2p + 8))")
    parser.add_argument("--draws", type=int, default=DRAWS)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--report", action="store_true", help="only write the tables and the plot from --out")
    args = parser.parse_args(argv)
    results = json.loads(args.out.read_text()) if args.out.exists() else {"what": WHAT, "runs": {}}
    if not args.report:
        if args.text is None:
            parser.error("--text is needed to run")
        settings = {"text": Path(args.text).name, "overrides": args.override, "ks": args.ks, "draws": args.draws}
        if results["runs"] and {k: results.get(k) for k in settings} != settings:
            parser.error(f"{args.out} holds runs with other settings ({ {k: results.get(k) for k in settings} }): "
                         "choose another --out")
        results.update(settings)
        with tempfile.TemporaryDirectory() as logs:
            for config in args.configs:
                if config in results["runs"]:
                    continue
                overrides = [f"--data.init_args.path={args.text}", *args.override]
                run = run_config(CONFIGS[config], overrides, logs, ks=args.ks, draws=args.draws)
                run.pop("weights")
                results["runs"][config] = run
                args.out.write_text(json.dumps(results, indent=1) + "\n")
                print(f"{config}: {run['seconds']:.0f} s (probe {run['probe_seconds']:.1f} s), "
                      f"{len(run['units'])} unit records", flush=True)
    report(results, args.out)
    return results


if __name__ == "__main__":
    main()
