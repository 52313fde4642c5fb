"""Step size α of a growth event (docs/design.md §3), one per event: evaluation and choice are separate, so that the
caller can all-reduce the candidate losses under DDP and every rank takes the same argmin.

Seed 002's two line searches for a direction (its λ is our α): `low_rank` (λ_LR) rates α by the loss of
the growth itself, after truncation; `full_rank` (λ_FR) rates α by the loss of M + αΔM before truncation,
installed with a full-rank factorisation (head size e′), and truncates only with the chosen α.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def candidate_steps(k_max: int = 4, include_zero: bool = True) -> list[float]:
    """[0,] 1, 1/2, …, 2^-k_max: 0 keeps the function (the growth can never raise the loss it is rated on)."""
    return [0.0] * include_zero + [2.0**-k for k in range(k_max + 1)]


def choose_step(losses: Sequence[float] | Tensor, alphas: Sequence[float]) -> int:
    """Index of the best candidate: lowest loss, ties → the smaller α, NaN losses lose (all NaN → smallest α)."""
    losses = torch.as_tensor(losses, dtype=torch.float64).cpu()
    if losses.shape != (len(alphas),):
        raise ValueError(f"{losses.numel()} losses for {len(alphas)} step sizes")
    losses = torch.where(losses.isnan(), float("inf"), losses)
    best = losses.min()
    return min((i for i in range(len(alphas)) if losses[i] == best), key=lambda i: alphas[i])
