"""What a growth run shows: one console line per event, a summary table at the end of fit, the event's
TensorBoard scalars and figures, and the custom-scalar layout that groups them."""

from __future__ import annotations

from fractions import Fraction

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from lit_growattn.analysis import spectrum_figure


def say(trainer: L.Trainer, text: str) -> None:
    """Prints on rank 0 only, through the progress bar when there is one (so that its line is not broken)."""
    if not trainer.is_global_zero:
        return
    bar = trainer.progress_bar_callback
    (bar.print if bar is not None and hasattr(bar, "print") else print)(text)


def _alpha(alpha: float | None) -> str:
    if alpha is None:
        return "none (baseline)"
    frac = Fraction(alpha).limit_denominator(1024)
    return str(frac) if float(frac) == alpha else f"{alpha:.3g}"


def _sizes(before: list[int], after: list[int]) -> str:
    if len(set(before)) == 1 and len(set(after)) == 1:
        return f"d_head {before[0]}→{after[0]} per layer"
    return f"d_head {before}→{after}"


def grew(event: dict) -> bool:
    """False for a skipped event and for an automatic check where no layer qualified (nothing was installed)."""
    return not event["skipped"] and any(d["columns"] for d in event.get("decisions", [{"columns": 1}]))


def decision_text(decisions: list[dict]) -> str:
    """e.g. `layer 0 +2 of 15 (2 checks: ratios 3.1 0.9 0.2 vs 0.35, agreement 0.9 0.8 0.2 vs 0.35, shares 0.31 0.09
    0.02, bottleneck 0.62)`: per layer the columns taken, the candidates, the checks pooled, the held-out gain of the
    first few to the existing columns' gain and the agreement of the first 1, 2, … together, each against its bar,
    their share of this window's held-out score, and the bottleneck's energy share; where the components were
    measured, the least-used one's cost against its bar (`, least-used component 0.004 vs 0.03: 2 wanted, width to spare`)."""
    parts = []
    for d in decisions:
        wanted = d.get("wanted", d["columns"])
        shown = lambda xs: " ".join(f"{x:.2g}" for x in xs[: wanted + 2]) or "–"  # noqa: E731
        spare = "" if d.get("least_used") is None else (
            f", least-used component {d['least_used']:.2g} vs {d['spare_bar']:.2g}"
            + (f": {wanted} wanted, width to spare" if d["columns"] < wanted else ""))
        parts.append(f"layer {d['layer']} +{d['columns']} of {d['candidates']} ({d['pooled']} "
                     f"check{'s' if d['pooled'] > 1 else ''}: ratios {shown(d['ratios'])} vs {d['bar']:.2g}, "
                     f"agreement {shown(d['agreement'])} vs {d['agreement_bar']:.2g}, shares {shown(d['shares'])}, "
                     f"bottleneck {d['bottleneck']:.2f}{spare})")
    return "; ".join(parts)


def event_line(event: dict) -> str:
    """e.g. `growth at step 1200 (epoch 1): d_head 1→8 per layer, α=1/4, loss 2.70→2.41 on the kept batches, 0.4 s`;
    an automatic check adds its decision per layer (`decision_text`)."""
    where = f"growth at step {event['step']} (epoch {event['epoch']})"
    decided = f"; {decision_text(event['decisions'])}" if "decisions" in event else ""
    if event["skipped"]:
        return f"{where}: skipped, {event['reason']}; d_head stays {event['d_head']}"
    if not grew(event):
        return f"growth check at step {event['step']} (epoch {event['epoch']}): no layer grows, d_head stays {event['d_head']}{decided}"
    return (
        f"{where}: {_sizes(event['d_head_before'], event['d_head'])}, α={_alpha(event['alpha'])}, "
        f"loss {event['loss_before']:.4g}→{event['loss_after']:.4g} on the kept batches, {event['seconds']:.2g} s{decided}"
    )


def summary_table(history: list[dict]) -> str:
    rows = [("event", "step", "epoch", "d_head", "α", "loss before", "loss after", "seconds")]
    for e in history:
        if e["skipped"] or not grew(e):
            what = "skipped" if e["skipped"] else "no growth"
            rows.append((e["event"], str(e["step"]), str(e["epoch"]), what, "", "", "", ""))
        else:
            rows.append((e["event"], str(e["step"]), str(e["epoch"]), ",".join(map(str, e["d_head"])),
                         _alpha(e["alpha"]), f"{e['loss_before']:.4g}", f"{e['loss_after']:.4g}", f"{e['seconds']:.2g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(["growth summary", *lines[:1], "  ".join("-" * w for w in widths), *lines[1:]])


def event_metrics(event: dict, layer_of: dict[str, int]) -> dict[str, float]:
    metrics = {"growth/skipped": float(event["skipped"])}
    for d in event.get("decisions", []):
        layer = d["layer"]
        metrics[f"growth/auto/columns/layer_{layer}"] = float(d["columns"])
        metrics[f"growth/auto/first_ratio/layer_{layer}"] = d["ratios"][0] if d["ratios"] else 0.0
        metrics[f"growth/auto/first_share/layer_{layer}"] = d["shares"][0] if d["shares"] else 0.0
        metrics[f"growth/auto/first_agreement/layer_{layer}"] = d["agreement"][0] if d["agreement"] else 0.0
        metrics[f"growth/auto/bottleneck/layer_{layer}"] = d["bottleneck"]
        metrics[f"growth/auto/pooled_checks/layer_{layer}"] = float(d["pooled"])
        metrics[f"growth/auto/bar/layer_{layer}"] = d["bar"]
        if d.get("least_used") is not None:
            metrics[f"growth/auto/least_used/layer_{layer}"] = d["least_used"]
    if not grew(event):
        return metrics
    keys = ["sign_fallbacks", "predicted_decrease", "realised_decrease", "seconds"]
    if event["alpha"] is not None:
        keys.append("alpha")
    metrics |= {f"growth/{k}": float(event[k]) for k in keys}
    metrics |= head_size_metrics(event["d_head"])
    for name, energy in event["discarded_energy"].items():  # the forms of a layer add up
        key = f"growth/discarded_energy/layer_{layer_of[name]}"
        metrics[key] = metrics.get(key, 0.0) + energy
    return metrics


def head_size_metrics(sizes: list[int]) -> dict[str, float]:
    return {f"growth/d_head/layer_{i}": float(d) for i, d in enumerate(sizes)}


def log_event(trainer: L.Trainer, event: dict, layer_of: dict[str, int], spectra: dict[str, Tensor] | None) -> None:
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
            "decrease (predicted vs realised)": ["Multiline", ["growth/predicted_decrease", "growth/realised_decrease"]],
            "step size": ["Multiline", ["growth/alpha"]],
            "discarded energy": ["Multiline", per_layer("discarded_energy")],
            "sign fallbacks and skips": ["Multiline", ["growth/sign_fallbacks", "growth/skipped"]],
            "seconds": ["Multiline", ["growth/seconds"]],
            "automatic schedule: columns taken": ["Multiline", per_layer("auto/columns")],
            "automatic schedule: first column's ratio to the existing columns vs bar": ["Multiline", [*per_layer("auto/first_ratio"), *per_layer("auto/bar")]],
            "automatic schedule: checks pooled": ["Multiline", per_layer("auto/pooled_checks")],
            "automatic schedule: first column's share of the held-out score": ["Multiline", per_layer("auto/first_share")],
            "automatic schedule: first column's agreement": ["Multiline", per_layer("auto/first_agreement")],
            "automatic schedule: bottleneck share": ["Multiline", per_layer("auto/bottleneck")],
        },
        "training": {
            "loss": ["Multiline", ["train/loss", "val/loss"]],
            "temperature": ["Multiline", [f"attention/temperature/layer_{i}" for i in range(n_layer)]],
        },
    })
