"""Every set of allowed values of a growth setting, as one Literal each.

The Literal is the single source: it types the settings' fields (so LightningCLI lists the choices in
`--help` and refuses others), and the tuples below are derived from it for run-time checks.
"""

from __future__ import annotations

from typing import Literal, get_args

Direction = Literal["natural", "gradient", "pinv"]  # solvers.DIRECTIONS has one function per name
Baseline = Literal["random", "zero"]  # random columns, no direction
Method = Literal[Direction, Baseline]
Mode = Literal["append", "replace"]
Temperature = Literal["keep", "rescale"]
Truncation = Literal["euclidean", "whitened"]
LineSearch = Literal["low_rank", "full_rank"]
StepRule = Literal["grid", "quadratic"]  # the best of `alphas`, or also the minimiser of a fitted quadratic
SecondMoment = Literal["mean", "zero"]  # Adam second moments of new columns

DIRECTION_NAMES: tuple[str, ...] = get_args(Direction)
BASELINES: tuple[str, ...] = get_args(Baseline)
METHODS: tuple[str, ...] = get_args(Method)
MODES: tuple[str, ...] = get_args(Mode)
TEMPERATURES: tuple[str, ...] = get_args(Temperature)
TRUNCATIONS: tuple[str, ...] = get_args(Truncation)
LINE_SEARCHES: tuple[str, ...] = get_args(LineSearch)
STEP_RULES: tuple[str, ...] = get_args(StepRule)
SECOND_MOMENT_POLICIES: tuple[str, ...] = get_args(SecondMoment)


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
