"""AutoSchedule: spends a KV-cache budget where the statistics say it pays (docs/capacity.md), and what it decides
from at each check.

It checks every `check_every` optimizer steps until `spend_until` of the run, or until its budget is spent. At each
check every growing side of every growing layer offers its candidate columns (`offers`: their held-out gains and
their cache cost), and `growth.allocation` buys the best within the check's allowance (`decide`); the last check
spends what is left (`fill_to`). Its next point, its allowance and whether a check is the last are read from the
history alone (one record per check), so a resumed run continues exactly where it stopped.

A column's cost, the cache values per token it adds, comes from one function, `growth.column_costs`: over every
growing unit when the schedule is bound (the budget and its limits), over the units that kept finite statistics at
a check (the offers).
"""

from __future__ import annotations

import warnings

from lit_growattn import growth
from lit_growattn.callback.schedule import GrowthPoint, GrowthSchedule
from lit_growattn.callback.settings import GrowthSettings, StatisticsSettings, unset
from lit_growattn.callback.window import NamedForms
from lit_growattn.growth import HeadSize, allocation

# AutoSchedule's defaults, read also by the messages that translate an old config (commands/legacy.py).
CHECK_EVERY = 50
SPEND_UNTIL = 0.5
NO_BUDGET = (
    "AutoSchedule needs a budget: the mean head size the grown model may reach (e.g. budget: 4, a quarter of static "
    "d_head 16's K cache; docs/capacity.md). Without one it bought every column that cleared its noise floor, and from "
    "d_head 1 reached 94–176 % of static d_head 16's K cache on a 2-layer model (studies/kcache_budget). To grow "
    "without a cache bound use AtSteps or AtEpochs with growth.rank_threshold; to train at a fixed width drop the "
    "callback and set the model's d_head.")


class AutoSchedule(GrowthSchedule):
    """Spends a KV-cache budget where the statistics say it pays: a check every `check_every` optimizer steps until
    `spend_until` of the run, where every growing side (`growth.grow`: query/key, value or both) of every growing
    layer offers its next columns and the best, by held-out first-order gain per cache value, are bought across
    layers and sides while the check's allowance lasts (`lit_growattn.growth.allocation`). The allowance spreads the
    budget evenly over the checks, so the widths follow the run's length, and what a check does not spend carries
    over. Before the last check a column is bought only above a noise floor measured on the same statistics; the last
    check withholds nothing: after the columns above the floor it buys toward uniform, to the sides narrowest relative
    to the budget, until less than one column's cost is left. So the whole budget is spent, never more (unless the
    last check is skipped: the summary at the end of fit says so). After the last check, or once the budget is
    spent, no statistics are taken and steps cost what plain steps cost. Measured on the query/key side with the
    earlier rule, which withheld what the floor refused (docs/capacity.md): it bought 29 % of the columns its budget
    could buy, mostly in the first layer; on a 2-layer model a uniform static d_head of the budget beat it on 2 of 3
    corpora, on an 8-layer model it was at or below uniform on all three.

    Args:
        budget: the cache the grown model may use, as the mean head size of the growing sides over the growing
            layers, weighted by their cache heads, so that it is proportional to the cache's bytes per token:
            budget × (cache heads) × bytes per value. With growth.grow query_key the K cache (mean d_head over the key
            heads, KV heads under GQA), with value the V cache (mean d_v over the value heads), with both the KV cache
            (the mean of d_head and d_v over both). Required (null is refused, with what to use instead).
        check_every: optimizer steps between checks (the statistics window is the `statistics.batches`
            micro-batches before each).
        spend_until: the share of the run's optimizer steps over which the budget is spread (in (0, 1]); the last
            check comes at or before it.
    """

    unit, kind, splits_window = "step", "auto", True

    def __init__(self, budget: float | None = None, check_every: int = CHECK_EVERY, spend_until: float = SPEND_UNTIL):
        # None stays the default so that a config without a budget gets this message, not the parser's "required".
        if budget is None:
            raise ValueError(NO_BUDGET)
        if not budget > 0:
            raise ValueError(f"budget is a mean head size (> 0); got {budget}")
        if check_every <= 0:
            raise ValueError(f"check_every must be a positive number of optimizer steps, got {check_every}")
        if not 0 < spend_until <= 1:
            raise ValueError(f"spend_until is a share of the run's optimizer steps in (0, 1], got {spend_until}")
        self.budget, self.check_every, self.spend_until = budget, check_every, spend_until
        # Learnt in `bind` and `check_run`: the growing sides' cache cost per column by (layer, head size), their
        # limits and sizes at the start, and the number of checks.
        self.costs: dict[tuple[int, HeadSize], int] = {}
        self.limits: dict[HeadSize, int] = {}
        self.start_sizes: dict[HeadSize, list[int]] = {}
        self.checks: int | None = None

    def bind(self, settings: GrowthSettings, statistics: StatisticsSettings, layers: list[int],
             start_sizes: dict[HeadSize, list[int]], costs: dict[tuple[int, HeadSize], int]) -> None:
        if statistics.layers_per_event is not None and statistics.layers_per_event < len(layers):
            raise ValueError(
                f"AutoSchedule offers every growing layer's columns at each check, but statistics.layers_per_event="
                f"{statistics.layers_per_event} covers {statistics.layers_per_event} of {len(layers)}: "
                f"{unset('statistics.layers_per_event')} with AutoSchedule (or bound memory with growth.layers), or "
                "use AtSteps")
        self.costs = {(layer, side): cost for (layer, side), cost in costs.items() if layer in layers}
        self.limits = {side: settings.max_width(side) for side in ("d_head", "d_v")
                       if any(s == side for _, s in self.costs)}
        self.start_sizes = start_sizes
        weight = self.heads()
        start = self.cache(start_sizes) / weight
        most = sum(self.heads(side) * limit for side, limit in self.limits.items()) / weight
        if self.budget < start:
            raise ValueError(f"AutoSchedule(budget={self.budget}) is below the mean {self._what()} the growing layers "
                             f"are at ({start:.4g}): raise the budget to at least that, or start a new run from a "
                             "narrower model (a resumed run keeps its checkpoint's sizes)")
        if self.budget > most:
            limits = " and ".join(f"growth.max_{side}={limit}" for side, limit in self.limits.items())
            verb = "allow" if len(self.limits) > 1 else "allows"
            raise ValueError(f"AutoSchedule(budget={self.budget}) exceeds the mean {self._what()} that {limits} "
                             f"{verb} ({most:.4g}), so it could never be spent: lower the budget (or raise the limit)")

    def _what(self) -> str:
        """The budget's unit in words, by the sides that grow."""
        return {("d_head",): "query/key head size", ("d_v",): "value head size"}.get(
            tuple(self.limits), "head size of the query/key and value sides")

    def check_run(self, trainer, stats_batches: int) -> None:
        steps = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        # A check needs a batch after it: none comes at the run's last step.
        self.checks = min(int(self.spend_until * steps), int(steps) - 1) // self.check_every
        if self.checks == 0:
            warnings.warn(f"AutoSchedule checks every {self.check_every} optimizer steps until spend_until="
                          f"{self.spend_until} of the run's {int(steps)}: no check fits, so nothing will grow; lower "
                          "check_every or raise spend_until")
        if self.check_every * trainer.accumulate_grad_batches < stats_batches:
            raise ValueError(
                f"check_every={self.check_every} optimizer steps hold fewer than statistics.batches={stats_batches} "
                f"micro-batches (accumulate_grad_batches={trainer.accumulate_grad_batches}): raise check_every or "
                "lower statistics.batches")

    def cache(self, sizes: dict[HeadSize, list[int]], side: HeadSize | None = None) -> int:
        """Cache values per token of the growing sides (or of `side`) of the growing layers at `sizes` (per head
        size, one per layer of the model)."""
        return sum(cost * sizes[s][layer] for (layer, s), cost in self.costs.items() if side in (None, s))

    def heads(self, side: HeadSize | None = None) -> int:
        """The cache heads of the growing sides (or of `side`): the cache values per token of head size 1."""
        return sum(cost for (_, s), cost in self.costs.items() if side in (None, s))

    def _sizes(self, history: list[dict]) -> dict[HeadSize, list[int]]:
        return {side: history[-1][side] for side in self.limits} if history else self.start_sizes

    def _start(self, history: list[dict]) -> dict[HeadSize, list[int]]:
        # A resumed model is built at its grown sizes: where the run started is in its history.
        return {side: history[0][f"{side}_before"] for side in self.limits} if history else self.start_sizes

    def spent(self, history: list[dict]) -> int:
        return self.cache(self._sizes(history)) - self.cache(self._start(history))

    def total(self, history: list[dict]) -> float:
        """The cache values per token the budget adds to the run's start."""
        return self.budget * self.heads() - self.cache(self._start(history))

    def allowance(self, history: list[dict]) -> float:
        checks_done = len(history) + 1  # counting the one about to happen
        return self.total(history) * min(checks_done / self.checks, 1.0) - self.spent(history)

    def fill_to(self, history: list[dict]) -> float | None:
        # The last check's allowance is all that is left (min(k/n, 1) = 1): it buys toward the budget, so nothing
        # expires with it.
        return self.budget if self.checks and len(history) + 1 >= self.checks else None

    def pending(self, history: list[dict]) -> GrowthPoint | None:
        sizes = self._sizes(history)
        left = self.total(history) - self.spent(history)
        affordable = any(cost <= left for (layer, side), cost in self.costs.items()
                         if sizes[side][layer] < self.limits[side])
        if len(history) >= self.checks or not affordable:
            return None
        return GrowthPoint("step", self.check_every * (len(history) + 1))

    def summary(self, history: list[dict]) -> str:
        sizes, weight = self._sizes(history), self.heads()
        cache = self.cache(sizes)
        cache_of = {("d_head",): "K", ("d_v",): "V"}.get(tuple(self.limits), "KV")
        mean = f"mean {self._what()} {cache / weight:.4g}"
        if len(self.limits) > 1:
            per_side = [f"{side} {self.cache(sizes, side) / self.heads(side):.4g}" for side in self.limits]
            mean += f" ({', '.join(per_side)})"
        added, bought = self.total(history), self.spent(history)
        share = f" ({100 * bought / added:.0f} %)" if added else ""
        line = (f"{cache_of}-cache budget: {mean} of {self.budget:.4g}; bought {bought} of the {added:.6g} values per "
                f"token the budget adds to the start{share}, {added - bought:.6g} unspent")
        last = history[-1] if history and len(history) >= (self.checks or 0) else None
        if last is not None and last.get("skipped"):
            line += f": the last check ({last['event']}) was skipped: {last['reason']}"
        elif (due := self.pending(history)) is not None:
            line += f": the run ended before its check at step {due.at}"
        return line


def offers(forms: NamedForms, stats: list[growth.Sums], half: list[growth.Sums],
           s: GrowthSettings) -> list[allocation.Offer]:
    """What each side of every layer of `forms` offers the automatic schedule: its candidate columns' gains, fitted
    on one half of the window (`half`, and the rest of `stats`) and measured on the other, and their cache cost."""
    def growths(sums: list[growth.Sums]) -> dict[str, growth.FormGrowth | growth.GroupedGrowth | growth.ValueGrowth]:
        return {name: growth.growth_for(form, st.means(), s.method, truncation=s.truncation, size_by=s.size_by,
                                        ridge=s.ridge)
                for (_, name, form), st in zip(forms, sums)}

    a, b = growths(half), growths([st - h for st, h in zip(stats, half)])
    costs = growth.column_costs((layer, form) for layer, _, form in forms)
    names: dict[tuple[int, growth.HeadSize], list[str]] = {}
    for layer, name, form in forms:
        names.setdefault((layer, form.side), []).append(name)
    found = []
    for (layer, side), shared in names.items():
        first = a[shared[0]]
        room = max(0, min(s.max_width(side), first.max_width) - first.width)
        found.append(allocation.offer(layer, side, [a[n] for n in shared], [b[n] for n in shared], costs[layer, side],
                                      room))
    return found


def decide(forms: NamedForms, stats: list[growth.Sums], half: list[growth.Sums], s: GrowthSettings,
           allowance: float, fill_to: float | None = None) -> list[allocation.Offer]:
    """The offers of `forms` with the columns each side of each layer buys within `allowance` (`fill_to`: the budget,
    at the last check, which withholds nothing)."""
    return allocation.allocate(offers(forms, stats, half, s), allowance, fill_to)
