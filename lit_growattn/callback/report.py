"""What a growth run shows: one console line per event, a summary table at the end of fit, the event's
TensorBoard scalars and figures, and the custom-scalar layout that groups them."""

from __future__ import annotations

import math

from fractions import Fraction

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from lit_growattn.analysis import spectrum_figure
from lit_growattn.growth.sketch import SketchSize
from lit_growattn.growth.unit import HeadSize

SUFFIX: dict[HeadSize, str] = {"d_head": "", "d_v": "_v"}  # a side's TensorBoard tags: growth/…{suffix}/layer_i


def say(trainer: L.Trainer, text: str) -> None:
    """Prints on rank 0 only, through the progress bar when there is one (so that its line is not broken)."""
    if not trainer.is_global_zero:
        return
    bar = trainer.progress_bar_callback
    (bar.print if bar is not None and hasattr(bar, "print") else print)(text)


def sketch_record(sketch: SketchSize | None) -> dict[str, dict[str, int]]:
    """An event record's `sketch` entry: the sizes of the sketched statistics it grew from; none from the full
    statistics, so that their records stay those of runs and checkpoints from before the sketch."""
    return {} if sketch is None else {"sketch": {"k": sketch.k, "l": sketch.l, "k_c": sketch.k_c}}


def sketch_line(sketch: SketchSize | None, reason: str, default_ridge: float | None) -> str:
    """The setup's line on the statistics: sketched or full, why (`checks.resolve_sketch`), and `default_ridge`, the
    ridge natural takes under the sketch because growth.ridge is null (None: it does not)."""
    if sketch is None:
        return f"growth statistics kept in full ({reason})"
    line = f"growth statistics sketched: k = {sketch.k}, l = {sketch.l}, k_c = {sketch.k_c} per head ({reason})"
    if default_ridge is not None:
        line += (f"; method natural means ridge {default_ridge} under the sketch (growth.ridge null; docs/design.md, "
                 "sketched statistics)")
    return line


def _alpha(alpha: float | None) -> str:
    if alpha is None:
        return "none (baseline)"
    frac = Fraction(alpha).limit_denominator(1024)
    return str(frac) if float(frac) == alpha else f"{alpha:.3g}"


def _sizes(event: dict) -> str:
    """e.g. `d_head 1→8 per layer, d_v [4, 4]→[6, 5]`: the sizes that an event changed."""
    changed = [key for key in ("d_head", "d_v") if key in event and event[f"{key}_before"] != event[key]]
    parts = []
    for key in changed or ["d_head"]:
        before, after = event[f"{key}_before"], event[key]
        if len(set(before)) == 1 and len(set(after)) == 1:
            parts.append(f"{key} {before[0]}→{after[0]} per layer")
        else:
            parts.append(f"{key} {before}→{after}")
    return ", ".join(parts)


def grew(event: dict) -> bool:
    """False for a skipped event and for an automatic check where no layer qualified (nothing was installed)."""
    return not event["skipped"] and any(d["columns"] for d in event.get("decisions", [{"columns": 1}]))


def decision_text(event: dict) -> str:
    """e.g. `allowance 16 values per token; layer 0 d_head +2 of 3 above the floor (held-out gains 0.031 0.012 0.004
    0.001 vs fitted noise 0.01 0.011 0.009 0.008, 4 values per column)`: what the automatic schedule could buy, and
    per side of each layer the columns bought, how many cleared the noise floor, and the first candidates' held-out
    gains against the noise their half fitted (in-sample − held-out). At the last check, which buys toward the budget
    beyond the floor: `layer 1 d_head +3 (0 of 0 above the floor, 3 toward the budget of 4) (held-out gains …)`."""
    shown = lambda xs: " ".join(f"{x:.2g}" for x in xs) or "–"  # noqa: E731
    parts = [f"allowance {event['allowance']:.4g} values per token"]
    for d in event["decisions"]:
        first = slice(0, d["columns"] + 2)
        noise = [seen - held for held, seen in zip(d["held_out"], d["in_sample"])]
        side = d.get("side", "d_head")  # absent in checks written before the value side could grow
        if "fill_to" in event:
            bought = (f"+{d['columns']} ({d['columns'] - d['filled']} of {d['above_floor']} above the floor, "
                      f"{d['filled']} toward the budget of {event['fill_to']:.4g})")
        else:
            bought = f"+{d['columns']} of {d['above_floor']} above the floor"
        parts.append(f"layer {d['layer']} {side} {bought} (held-out gains {shown(d['held_out'][first])} vs fitted "
                     f"noise {shown(noise[first])}, {d['cost']} values per column)")
    return "; ".join(parts)


def event_line(event: dict) -> str:
    """e.g. `growth at step 1200 (epoch 1): d_head 1→8 per layer, α=1/4, loss 2.70→2.41 on the kept batches, 0.4 s`;
    an automatic check adds its decision per layer (`decision_text`), and any event the sides it skipped at their cap."""
    where = f"growth at step {event['step']} (epoch {event['epoch']})"
    decided = f"; {decision_text(event)}" if "decisions" in event else ""
    decided += f"; skipped: {event['capped']}" if "capped" in event else ""
    kept = ", ".join(f"{key} stays {event[key]}" for key in ("d_head", "d_v") if key in event)
    if event["skipped"]:
        return f"{where}: skipped, {event['reason']}; {kept}"
    if not grew(event):
        return f"growth check at step {event['step']} (epoch {event['epoch']}): no layer grows, {kept}{decided}"
    rated = ("no kept batches to rate it on" if math.isnan(event["loss_before"])
             else f"loss {event['loss_before']:.4g}→{event['loss_after']:.4g} on the kept batches")
    return f"{where}: {_sizes(event)}, α={_alpha(event['alpha'])}, {rated}, {event['seconds']:.2g} s{decided}"


def summary_table(history: list[dict]) -> str:
    values = any("d_v" in e for e in history)  # a d_v column when the value side grew
    rows = [("event", "step", "epoch", "d_head", *(["d_v"] if values else []), "α", "loss before", "loss after",
             "seconds")]
    for e in history:
        where = (e["event"], str(e["step"]), str(e["epoch"]))
        if e["skipped"] or not grew(e):
            what = "skipped" if e["skipped"] else "no growth"
            rows.append((*where, what, *([""] if values else []), "", "", "", ""))
        else:
            sizes = [",".join(map(str, e[key])) for key in ("d_head", *(["d_v"] if values else []))]
            rows.append((*where, *sizes, _alpha(e["alpha"]), f"{e['loss_before']:.4g}", f"{e['loss_after']:.4g}",
                         f"{e['seconds']:.2g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(["growth summary", *lines[:1], "  ".join("-" * w for w in widths), *lines[1:]])


def event_metrics(event: dict, layer_of: dict[str, tuple[int, HeadSize]]) -> dict[str, float]:
    """The event's TensorBoard scalars; `layer_of`: each grown form's (layer, side)."""
    metrics = {"growth/skipped": float(event["skipped"])}
    if "allowance" in event:
        metrics["growth/auto/allowance"] = event["allowance"]
    for d in event.get("decisions", []):
        tag = lambda name: f"growth/auto/{name}{SUFFIX[d.get('side', 'd_head')]}/layer_{d['layer']}"  # noqa: E731
        metrics[tag("columns")] = float(d["columns"])
        metrics[tag("above_floor")] = float(d["above_floor"])
        if "fill_to" in event:
            metrics[tag("filled")] = float(d["filled"])
        if d["held_out"]:
            metrics[tag("first_gain")] = d["held_out"][0]
            metrics[tag("first_noise")] = d["in_sample"][0] - d["held_out"][0]
    if not grew(event):
        return metrics
    keys = ["sign_fallbacks", "predicted_decrease", "realised_decrease", "seconds"]
    if event["alpha"] is not None:
        keys.append("alpha")
    metrics |= {f"growth/{k}": float(event[k]) for k in keys}
    metrics |= head_size_metrics(event["d_head"], event.get("d_v"))
    for name, energy in event["discarded_energy"].items():  # the forms of a layer add up
        layer, side = layer_of[name]
        key = f"growth/discarded_energy{SUFFIX[side]}/layer_{layer}"
        metrics[key] = metrics.get(key, 0.0) + energy
    return metrics


def head_size_metrics(sizes: list[int], value_sizes: list[int] | None = None) -> dict[str, float]:
    """growth/d_head/layer_i, and growth/d_v/layer_i when the value side grows."""
    return {f"growth/{key}/layer_{i}": float(d) for key, per_layer in (("d_head", sizes), ("d_v", value_sizes or []))
            for i, d in enumerate(per_layer)}


def log_event(trainer: L.Trainer, event: dict, layer_of: dict[str, tuple[int, HeadSize]],
              spectra: dict[str, Tensor] | None) -> None:
    if trainer.logger is not None:
        trainer.logger.log_metrics(event_metrics(event, layer_of), step=trainer.global_step)
    # On ranks other than 0 `logger.experiment` is a dummy: figures only there, after every collective.
    if spectra and trainer.is_global_zero and isinstance(trainer.logger, TensorBoardLogger):
        figure = spectrum_figure(list(spectra.values()), list(spectra), ylabel="σ kept by the growth")
        tag = "growth/spectrum/" + event["event"].replace(" ", "_")
        trainer.logger.experiment.add_figure(tag, figure, trainer.global_step)


def add_layout(trainer: L.Trainer, n_layer: int) -> None:
    """TensorBoard's custom-scalars page: the growth charts grouped, one line per layer."""
    if not (trainer.is_global_zero and isinstance(trainer.logger, TensorBoardLogger)):
        return
    per_layer = lambda tag: [f"growth/{tag}/layer_{i}" for i in range(n_layer)]  # noqa: E731
    trainer.logger.experiment.add_custom_scalars({
        "growth": {
            "head size": ["Multiline", per_layer("d_head")],
            "value head size": ["Multiline", per_layer("d_v")],
            "decrease (predicted vs realised)": ["Multiline", ["growth/predicted_decrease", "growth/realised_decrease"]],
            "step size": ["Multiline", ["growth/alpha"]],
            "discarded energy": ["Multiline", [*per_layer("discarded_energy"), *per_layer("discarded_energy_v")]],
            "sign fallbacks and skips": ["Multiline", ["growth/sign_fallbacks", "growth/skipped"]],
            "seconds": ["Multiline", ["growth/seconds"]],
            "automatic schedule: columns bought and above the noise floor": ["Multiline", [
                *per_layer("auto/columns"), *per_layer("auto/above_floor"), *per_layer("auto/filled")]],
            "automatic schedule: value columns bought and above the noise floor": ["Multiline", [
                *per_layer("auto/columns_v"), *per_layer("auto/above_floor_v"), *per_layer("auto/filled_v")]],
            "automatic schedule: first column's held-out gain vs fitted noise": ["Multiline", [
                *per_layer("auto/first_gain"), *per_layer("auto/first_noise"), *per_layer("auto/first_gain_v"),
                *per_layer("auto/first_noise_v")]],
            "automatic schedule: allowance (cache values per token)": ["Multiline", ["growth/auto/allowance"]],
        },
        "training": {
            "loss": ["Multiline", ["train/loss", "val/loss"]],
            "temperature": ["Multiline", [f"attention/temperature/layer_{i}" for i in range(n_layer)]],
        },
    })
