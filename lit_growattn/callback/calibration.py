"""The input covariances that weigh an activation-aware shrink (`convert --kv_budget B --calibration FILE`,
`growth.shrink`): C̄ = mean X′ᵀX′ of every query/key form's inputs and C̄_j = mean P_jᵀP_j of every value head's
attention-mixed inputs P_j = A_j X′, per sequence.

They are gathered exactly as a growth window gathers its statistics (`window.StatsWindow`, `fold_captured`): a forward
and backward pass of the module's own `batch_loss` per batch with capture on, then only C̄ is kept. There is no
optimizer step; the gradients are dropped, and the module's mode and `requires_grad` flags are put back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lit_growattn import growth
from lit_growattn.callback.memory import form_bytes
from lit_growattn.callback.settings import Capture
from lit_growattn.callback.window import StatsWindow, capture_mode, fold_captured
from lit_growattn.contract import growable_units
from lit_growattn.growth.unit import HeadSize


def calibration_moments(module, batches: Iterable, sides: set[HeadSize], capture: Capture = "auto",
                        layers_per_pass: int | None = None) -> dict[str, Tensor]:
    """C̄ (float64) per unit name (`contract.growable_units`): (e′, e′) for a query/key form, (H, e′, e′) for a value
    map, of the units of `sides` ("d_head", "d_v"). `batches`: as the module's `batch_loss` takes them (moved to its
    device here); `layers_per_pass`: capture that many layers per pass over the batches (None: all in one), for
    models whose statistics of every layer at once would not fit. A NonFiniteStatistics names the unit."""
    units = [named for named in growable_units(module) if named.form.side in sides]
    layers = sorted({named.layer for named in units})
    per_pass = layers_per_pass or len(layers)
    batches = list(batches)  # read again by each pass
    device = next(module.parameters()).device
    mode = capture_mode(capture, device)
    training, requires = module.training, [(p, p.requires_grad) for p in module.parameters()]
    moments: dict[str, Tensor] = {}
    try:
        # Eval mode: no dropout. Capture needs the scores' gradient, so every weight takes part in the backward.
        module.eval()
        for p, _ in requires:
            p.requires_grad_(True)
        with torch.enable_grad():
            for start in range(0, len(layers), per_pass):
                active = set(layers[start:start + per_pass])
                part = [named for named in units if named.layer in active]
                window = StatsWindow("gradient")
                for batch in batches:
                    window.begin_step("calibration", part, active, mode, {})
                    try:
                        module.batch_loss(apply_to_collection(batch, Tensor, lambda t: t.to(device))).backward()
                        fold_captured(part, window.stats, 1.0, None)
                    finally:
                        window.end_step(part)
                        module.zero_grad(set_to_none=True)
                for (layer, name, _), sums in zip(part, window.stats):
                    try:
                        moments[name] = sums.means().c
                    except growth.NonFiniteStatistics as error:
                        raise growth.NonFiniteStatistics(
                            f"{name} (layer {layer}): {error}; the calibration text drives the model to NaN or inf "
                            "activations or gradients, so its covariance cannot weigh the shrink: check that the "
                            "checkpoint's weights are finite, or calibrate on other text") from error
    finally:
        module.train(training)
        for p, flag in requires:
            p.requires_grad_(flag)
    return moments


def calibration_layers_per_pass(units, free_bytes: int | None) -> int | None:
    """`calibration_moments`' layers_per_pass for the units (`contract.growable_units`) when `free_bytes` are free on
    the device after the model (None: unknown): the covariances kept of every layer (float64: e′² per form, h·e′² per
    value map) plus the window's sums of k layers (float32, `callback.memory.form_bytes`: a growth window's) within
    half of it, None when every layer fits in one pass, and at least 1. Passes over fewer layers give the same
    covariances; they only cost time (a forward and backward pass over the batches each)."""
    window: dict[int, int] = {}
    kept = 0
    for layer, _, unit in units:
        window[layer] = window.get(layer, 0) + form_bytes(unit, "gradient")
        kept += 8 * unit.e_in ** 2 * (unit.n_head if unit.side == "d_v" else 1)
    if free_bytes is None or not window:
        return None
    room = free_bytes / 2 - kept
    fits = int(room // max(window.values())) if room > 0 else 0
    return None if fits >= len(window) else max(fits, 1)
