"""Step size α of a growth event (docs/design.md §3), one per event: evaluation and choice are separate, so that the
caller can all-reduce the candidate losses under DDP and every rank takes the same argmin.

Seed 002's two line searches for a direction (its λ is our α): `low_rank` (λ_LR) rates α by the loss of
the growth itself, after truncation; `full_rank` (λ_FR) rates α by the loss of M + αΔM before truncation,
installed with a full-rank factorisation (head size e′), and truncates only with the chosen α.

Step rules: `grid` takes the best of the fixed candidates. `quadratic` fits the 1-D model of the loss decrease
d(α) = s·α − c·α², with the slope s from the first-order prediction (−⟨N̄, M′ − M⟩ per unit α) and the
curvature c from the measured decreases at the candidates, and adds its minimiser α* = s/2c as one more
candidate between the grid's points (on text no better than the default grid down to 1/256, studies/growth_step/README.md).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor


def candidate_steps(k_max: int = 8, include_zero: bool = True) -> list[float]:
    """[0,] 1, 1/2, …, 2^-k_max: 0 keeps the function (the growth can never raise the loss it is rated on).

    Down to 1/256 by default: on text the loss of the growth has its minimum at α ≈ 1/256 … 1/32 and is already
    above L(0) at 1/16 (studies/growth_step/README.md), so a grid that stops at 1/16 never takes a step there.
    """
    return [0.0] * include_zero + [2.0**-k for k in range(k_max + 1)]


def loss_rounding(loss: float, dtype: torch.dtype, terms: int = 1) -> float:
    """Round-off of a loss evaluated in `dtype` as a sum of `terms` rounded values: √terms · ε · |loss| (the
    typical error of such a sum). Two losses closer than this are equal as far as the evaluation can tell."""
    return math.sqrt(max(terms, 1)) * torch.finfo(dtype).eps * abs(loss)


def choose_step(losses: Sequence[float] | Tensor, alphas: Sequence[float], terms: int = 1) -> int:
    """Index of the best candidate: lowest loss, ties → the smaller α, NaN losses lose (all NaN → smallest α).

    Losses within `loss_rounding` (of the losses' dtype and `terms`) of the best one tie: a step must beat the
    smaller ones (α = 0 first) by more than the evaluation's round-off, or it is not taken."""
    dtype = losses.dtype if isinstance(losses, Tensor) and losses.is_floating_point() else torch.float64
    losses = torch.as_tensor(losses, dtype=torch.float64).cpu()
    if losses.shape != (len(alphas),):
        raise ValueError(f"{losses.numel()} losses for {len(alphas)} step sizes")
    losses = torch.where(losses.isnan(), float("inf"), losses)
    best = float(losses.min())
    tolerance = loss_rounding(best, dtype, terms) if math.isfinite(best) else 0.0
    return min((i for i in range(len(alphas)) if losses[i] <= best + tolerance), key=lambda i: alphas[i])


def quadratic_step(slope: float, alphas: Sequence[float], decreases: Sequence[float], max_alpha: float = 1.0) -> float:
    """Minimiser in [0, max_alpha] of the loss model L(0) − s·α + c·α², i.e. α* = s / 2c.

    slope s: first-order decrease per unit α; alphas, decreases: the measured L(0) − L(α) at each α. c is the
    least-squares fit of s·α_i − d_i = c·α_i² over the α_i up to the one with the largest decrease: past it the
    loss climbs far faster than a quadratic (measured on text, studies/growth_step/README.md), and those points would
    drag α* down. α = 0 and non-finite decreases are ignored. No descent (s ≤ 0) gives 0; no curvature seen
    (c ≤ 0: the decrease keeps up with the slope, no model to extrapolate with) gives the best measured α.
    """
    a = torch.as_tensor(alphas, dtype=torch.float64).cpu()
    d = torch.as_tensor(decreases, dtype=torch.float64).cpu()
    if a.shape != d.shape or a.ndim != 1:
        raise ValueError(f"{d.numel()} decreases for {a.numel()} step sizes")
    if not max_alpha > 0:
        raise ValueError(f"max_alpha must be positive, got {max_alpha}")
    used = (a > 0) & d.isfinite()
    if not used.any():
        raise ValueError("the quadratic step needs the loss at one step size α > 0 at least")
    if not slope > 0:
        return 0.0
    a, d = a[used], d[used]
    best = float(a[d.argmax()])
    local = a <= best
    a, d = a[local], d[local]
    curvature = float(((slope * a - d) * a**2).sum() / (a**4).sum())
    if curvature <= 0:
        return min(best, max_alpha)
    return min(slope / (2 * curvature), max_alpha)
