"""Every set of allowed values of a growth setting, as one Literal each, or one registry.

A Literal is the single source of a fixed set: it types the settings' fields (so LightningCLI lists the
choices in `--help` and refuses others), and the tuples below are derived from it for run-time checks. The growth
methods are open: their names are the keys of `solvers.DIRECTIONS` (filled by `@register_direction`) and the
baselines, read when a setting is checked, so a direction registered by the user's own module is allowed too.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Literal, get_args

from lit_growattn.growth.solvers import DIRECTIONS


class RegisteredNames(Collection[str]):
    """The names in some registries as they are now (a tuple built at import would miss later registrations)."""

    def __init__(self, *registries: Collection[str], hint: str = ""):
        self.registries, self.hint = registries, hint

    def __iter__(self) -> Iterator[str]:
        return (name for registry in self.registries for name in registry)

    def __contains__(self, name: object) -> bool:
        return any(name in registry for registry in self.registries)

    def __len__(self) -> int:
        return sum(len(registry) for registry in self.registries)


Direction = str  # a name in solvers.DIRECTIONS
Baseline = Literal["random", "zero"]  # random columns, no direction
Method = str  # a Direction or a Baseline: checked against METHODS when the settings are built
Mode = Literal["append", "replace"]
Temperature = Literal["keep", "rescale"]
Truncation = Literal["euclidean", "whitened"]
LineSearch = Literal["low_rank", "full_rank"]
StepRule = Literal["grid", "quadratic"]  # the best of `alphas`, or also the minimiser of a fitted quadratic
SecondMoment = Literal["mean", "zero"]  # Adam second moments of new columns
Side = Literal["query_key", "value", "both"]  # what grows: the query/key head size, the value head size, or both

BASELINES: tuple[str, ...] = get_args(Baseline)
METHODS = RegisteredNames(DIRECTIONS, BASELINES, hint="a new direction registers with growth.register_direction")
MODES: tuple[str, ...] = get_args(Mode)
TEMPERATURES: tuple[str, ...] = get_args(Temperature)
TRUNCATIONS: tuple[str, ...] = get_args(Truncation)
LINE_SEARCHES: tuple[str, ...] = get_args(LineSearch)
STEP_RULES: tuple[str, ...] = get_args(StepRule)
SECOND_MOMENT_POLICIES: tuple[str, ...] = get_args(SecondMoment)
SIDES: tuple[str, ...] = get_args(Side)


def check_choice(name: str, value: str, allowed: Collection[str]) -> None:
    if value not in allowed:
        hint = f" ({allowed.hint})" if isinstance(allowed, RegisteredNames) and allowed.hint else ""
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}{hint}")
