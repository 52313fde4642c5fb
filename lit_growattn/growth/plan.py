"""A growth event over many forms: what the Lightning callback drives.

    stats = unflatten_stats(all_reduce_sum(flatten_stats(pending)), pending)
    plan = GrowthPlan.build(dict(named_forms), stats, method="natural", grow_by=8)   # may raise NonFiniteStatistics
    for α in alphas:
        with installed(forms, {name: plan.trial(name, α) for name in forms}): evaluate the loss
    α* = alphas[choose_step(all_reduce_mean(losses), alphas)]; install plan.grow(name, α*), carry Adam's state
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Mapping, Sequence

import torch

from lit_growattn.growth.choices import BASELINES, LINE_SEARCHES, check_choice
from lit_growattn.growth.factorize import FormGrowth, Growth
from lit_growattn.growth.form import FormWeights
from lit_growattn.growth.grouped import GroupedGrowth
from lit_growattn.growth.sides import growth_for, restore
from lit_growattn.growth.stats import Sums
from lit_growattn.growth.value import GrownValue, ValueGrowth, ValueWeights


class GrowthPlan:
    """One growth per name (a query/key form's FormGrowth or GroupedGrowth, a value map's ValueGrowth) with its new
    width and the event's settings.

    Results are memoised per (form, α), so the final `grow` at the chosen α costs nothing after the
    line search, and a baseline draws its random columns once whatever α is asked for.
    """

    def __init__(
        self,
        forms: Mapping[str, FormGrowth | GroupedGrowth | ValueGrowth],
        d_new: Mapping[str, int],
        *,
        mode: str = "append",
        temperature: str = "keep",
        line_search: str = "low_rank",
        generator: torch.Generator | None = None,
    ):
        # mode and temperature are checked by each form's `grow`, a baseline's full-rank trial (a replace) too.
        check_choice("line_search", line_search, LINE_SEARCHES)
        self.forms, self.d_new = dict(forms), dict(d_new)
        self.mode, self.temperature, self.line_search, self.generator = mode, temperature, line_search, generator
        self._memo: dict[tuple, Growth | GrownValue] = {}

    @classmethod
    def build(
        cls,
        forms: Mapping[str, object],
        stats: Sequence[Sums],
        *,
        method: str = "natural",
        grow_by: int | Mapping[str, int] | None = 1,
        dynamic_rank: float | None = None,
        max_width: int | Mapping[str, int | None] | None = None,
        group_of: Callable[[str], Hashable] | None = None,
        mode: str = "append",
        temperature: str = "keep",
        truncation: str = "euclidean",
        line_search: str = "low_rank",
        rcond: float = 1e-6,
        generator: torch.Generator | None = None,
        size_by: str | None = None,
        ridge: float | None = None,
    ) -> GrowthPlan:
        """Plans the growth of `forms` (name → query/key form or value map, in the order of `stats`, reduced sums);
        forms with shared keys (GQA) or rotary columns grow by `grouped.GroupedGrowth`, value maps by
        `value.ValueGrowth` (`sides.growth_for`).

        New columns p per form: `grow_by` (one int or per name); with `dynamic_rank` set, `FormGrowth.rank`
        with that threshold, `grow_by` then only caps it (None: no cap). Always width + p ≤ max_width (one int or
        per name; None: no cap) ≤ the form's own bound (e′ for query/key, min(e′, e) for values).
        Forms with equal `group_of(name)` (e.g. the layer) get the same p, the largest, since they share a width.
        size_by: the direction that sizes the baselines' growth (`factorize.sizing_method`). ridge: the natural
        direction's (`solvers.natural`; None: the pseudo-inverse). Sketched sums (`sketch`) grow by the sketched
        growths.
        Raises NonFiniteStatistics (from the means) when the statistics hold NaN/inf.
        """
        if len(stats) != len(forms):
            raise ValueError(f"{len(stats)} statistics for {len(forms)} forms")
        if dynamic_rank is None and grow_by is None:
            raise ValueError("give grow_by, or dynamic_rank to choose it from the spectrum")
        growths = {
            name: growth_for(form, s.means(), method, truncation=truncation, rcond=rcond, size_by=size_by, ridge=ridge)
            for (name, form), s in zip(forms.items(), stats)
        }
        d_new = {}
        for name, g in growths.items():
            bound = max_width if isinstance(max_width, int) or max_width is None else max_width[name]
            limit = min(bound or g.max_width, g.max_width)
            cap = grow_by if isinstance(grow_by, int) or grow_by is None else grow_by[name]
            if cap is not None:
                limit = min(limit, g.width + cap)
            if dynamic_rank is not None:
                d_new[name] = g.width + g.rank(dynamic_rank, limit)
            else:
                d_new[name] = max(limit, g.width)
        if group_of is not None:
            groups: dict[Hashable, list[str]] = {}
            for name in growths:
                groups.setdefault(group_of(name), []).append(name)
            for names in groups.values():
                if len({growths[n].width for n in names}) > 1:
                    raise ValueError(f"forms {names} must share their width to grow together")
                largest = max(d_new[n] for n in names)
                d_new.update({n: largest for n in names})
        return cls(growths, d_new, mode=mode, temperature=temperature, line_search=line_search, generator=generator)

    def resized(self, d_new: Mapping[str, int]) -> GrowthPlan:
        """The same growths (directions and bottlenecks computed once) to other head sizes."""
        return GrowthPlan(self.forms, d_new, mode=self.mode, temperature=self.temperature,
                          line_search=self.line_search, generator=self.generator)

    def grow(self, name: str, alpha: float) -> Growth | GrownValue:
        """The final growth of form `name` at step α."""
        form = self.forms[name]
        return self._memoised(("grow", name, alpha), lambda: form.grow(
            alpha, self.d_new[name], mode=self.mode, temperature=self.temperature, generator=self.generator
        ))

    def trial(self, name: str, alpha: float) -> Growth | GrownValue:
        """What the loss of candidate α is measured on: the growth itself (low_rank, λ_LR), or M + αΔM before
        truncation, factorised at full rank e′ (full_rank, λ_FR); install it, evaluate, restore."""
        if self.line_search == "low_rank":
            return self.grow(name, alpha)
        form = self.forms[name]
        return self._memoised(("trial", name, alpha), lambda: form.grow(alpha, form.e_in, mode="replace"))

    def _memoised(self, key: tuple, compute: Callable[[], Growth | GrownValue]) -> Growth | GrownValue:
        kind, name, alpha = key
        if self.forms[name].method in BASELINES:
            key = (kind, name, None)  # α does not enter a baseline: one draw of random columns per event
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]


@contextmanager
def installed(forms: Mapping[str, object], grown: Mapping[str, FormWeights | ValueWeights] | None) -> Iterator[None]:
    """Inside the block, every form named in `grown` holds its candidate growth (None: the forms as they are); on
    exit every form of `forms` (name → query/key form or value map, with set_weights) gets its own parameters back,
    the same objects, also after an error: for rating candidates, not for installing the chosen one."""
    originals = {name: form.held_weights() for name, form in forms.items()}
    try:
        for name, weights in (grown or {}).items():
            weights.install(forms[name])
        yield
    finally:
        for name, weights in originals.items():
            restore(forms[name], weights)
