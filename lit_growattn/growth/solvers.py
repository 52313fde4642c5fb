"""Growth directions ΔM per head (h, e′, e′) from the statistics' means (docs/design.md §2).

A direction is a descent direction when ⟨N̄, ΔM⟩ < 0. A new method is one function `(moments, rcond) → ΔM`
decorated with `@register_direction("name")`, in this file or in a module of your own (imported before the callback
is built; from the command line: `extensions: [your_module]`). The registry is the list of allowed `method` names.
The baselines `random` and `zero` use no direction: they only add random columns (see `factorize`).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from lit_growattn.growth.linalg import psd_ridge_inverse, score_energy
from lit_growattn.growth.stats import Moments
from lit_growattn.growth.registry import registrar

DirectionFn = Callable[[Moments, float], Tensor]
DIRECTIONS: dict[str, DirectionFn] = {}  # method name → direction, filled by @register_direction (natural first)
# @register_direction("name") on `fn(moments, rcond) → ΔM (h, e′, e′)` makes it growth method `name`.
register_direction = registrar(DIRECTIONS, "growth direction")


@register_direction("natural")
def natural(mo: Moments, rcond: float, ridge: float | None = None) -> Tensor:
    """ΔM = −C̄⁺N̄C̄⁺: Gauss–Newton in score space, Kronecker-factored (C̄ΔMC̄ = −N̄ on range(C̄)); always descent.
    With a ridge, C̄ + ρI in place of C̄ (ρ = ridge × C̄'s mean eigenvalue, `linalg.psd_ridge_inverse`): the step
    no longer amplifies the directions the inputs barely span, where N̄ is mostly noise."""
    cp = psd_ridge_inverse(mo.c, ridge, rcond)
    return -(cp @ mo.n @ cp)


@register_direction("gradient")
def gradient(mo: Moments, rcond: float) -> Tensor:
    """Seed 002's dZ⁰: ΔM = −N̄, steepest descent in M."""
    return -mo.n


@register_direction("pinv")
def pinv(mo: Moments, rcond: float) -> Tensor:
    """Seed 000 batch option (i) with the solution closest to M: ΔM = −mean_i C_i⁺N_iC_i⁺ (needs pinv statistics)."""
    if mo.p is None:
        raise ValueError("method 'pinv' needs statistics gathered with FormStats(..., pinv=True)")
    return -mo.p


def energy_scale(current: Tensor, target: Tensor) -> Tensor | float:
    """√(target / current): the factor that gives a direction of energy `current` the energy `target`; 1 when either
    is zero (a degenerate side is left unscaled)."""
    return (target / current).sqrt() if target > 0 and current > 0 else 1.0


def direction(method: str, mo: Moments, m_energy: Tensor, rcond: float = 1e-6, ridge: float | None = None) -> Tensor:
    """The normalised direction (h, e′, e′) of `method` for a form whose current bilinear form M has the score
    energy m_energy = Σ_heads tr(MᵀC̄MC̄) (`linalg.score_energy`, or `factored_score_energy` from W_Q, W_K).

    Scaled (one scalar per form) so that α = 1 moves the scores by their own RMS, summed over the heads:
    Σ_i ‖X_i ΔM X_iᵀ‖² = Σ_i tr(ΔMᵀC_iΔMC_i) is approximated by n·tr(ΔMᵀC̄ΔMC̄) (Kronecker factorisation,
    E[C⊗C] ≈ C̄⊗C̄, exact for one instance); the same approximation on both sides leaves their ratio honest,
    and the causal mask, which drops the same half of both score maps, is ignored. A degenerate side (M = 0,
    or ΔM = 0 on the data) leaves the direction unscaled. ridge: natural's (`natural`); the other directions take
    none.
    """
    if method not in DIRECTIONS:
        raise ValueError(f"method {method!r} has no direction; directions: {', '.join(DIRECTIONS)}")
    # Only natural takes a ridge: the registry's functions, a user's included, are called as (moments, rcond).
    delta = natural(mo, rcond, ridge) if method == "natural" else DIRECTIONS[method](mo, rcond)
    return delta * energy_scale(score_energy(delta, mo.c), m_energy)
