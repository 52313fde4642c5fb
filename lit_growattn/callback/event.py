"""One growth event: plan from the reduced statistics, choose the step size, broadcast rank 0's tensors and
install them. Lightning enters only through `trainer.strategy` (collectives) and the rebuild.

The step-size choice is one function, `choose_step_size(plan, names, loss_of, search, method, terms)`: `loss_of`
rates a list of candidate installs (None: the forms as they are) by their loss, already averaged over ranks, and
`terms` is how many values that loss averages (its round-off: a step must beat α = 0 by more). A new
rule is a new branch there (or a function with the same signature passed as `GrowthEvent.choose_step_size`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from lit_growattn import growth
from lit_growattn.callback.budget import decide
from lit_growattn.callback.settings import GrowthSettings, StepSearch
from lit_growattn.callback.window import NamedForms

LossOf = Callable[[Sequence[dict[str, growth.FormWeights] | None]], Tensor]


@dataclass(frozen=True)
class StepChoice:
    alpha: float | None  # None: a baseline, whose growth does not depend on α
    loss_before: float
    loss_after: float


def plan_growth(forms: NamedForms, stats: list[growth.Sums], s: GrowthSettings, line_search: str,
                sized_later: bool, seed: int) -> growth.GrowthPlan:
    """The GrowthPlan of `forms` (layer, name, query/key form or value map) from their reduced statistics; the forms
    of one side of a layer grow together. `sized_later`: the automatic schedule sizes each layer afterwards
    (`budget.decide`)."""
    side_of = {name: (layer, form.side) for layer, name, form in forms}
    if sized_later:
        grow_by = 0
    elif s.rank_threshold is not None:
        grow_by = {name: s.cap(layer) for layer, name, _ in forms}
    else:
        grow_by = {name: s.count(layer, side) for name, (layer, side) in side_of.items()}
    return growth.GrowthPlan.build(
        {name: form for _, name, form in forms}, stats, method=s.method, grow_by=grow_by,
        dynamic_rank=s.rank_threshold, max_width={name: s.max_width(side) for name, (_, side) in side_of.items()},
        group_of=side_of.__getitem__, mode=s.mode, temperature=s.temperature, truncation=s.truncation,
        line_search=line_search, size_by=s.size_by, ridge=s.ridge,
        # Random columns of the baselines: the same draw on every rank, and on a resumed run.
        generator=torch.Generator().manual_seed(seed),
    )


def choose_step_size(plan: growth.GrowthPlan, names: list[str], loss_of: LossOf, s: StepSearch,
                     method: str, terms: int) -> StepChoice:
    """The step size of the event, from forward-only losses of candidate growths, each a mean of `terms` values
    (tokens): losses closer than their round-off (`growth.loss_rounding`) are equal, and the smaller step wins."""
    if method in growth.BASELINES:
        # α does not enter a baseline: one evaluation of its growth beside the current loss.
        before, after = loss_of([None, {n: plan.grow(n, 0.0) for n in names}]).tolist()
        return StepChoice(None, before, after)
    # α = 0 keeps the function (new pairs with zero fan-in), so its loss is the current one: no forward for it.
    candidates = s.candidates
    moving = [a for a in candidates if a > 0]
    losses = loss_of([None] + [{n: plan.trial(n, a) for n in names} for a in moving])
    before, by_alpha = losses[0], dict(zip(moving, losses[1:]))
    alphas, rated = candidates, torch.stack([by_alpha.get(a, before) for a in candidates])
    if s.rule == "quadratic":
        alphas, rated = _with_quadratic_step(plan, names, loss_of, alphas, before, rated)
    best = growth.choose_step(rated, alphas, terms)
    alpha, after = alphas[best], rated[best]
    if s.line_search == "full_rank":
        # λ_FR rated α before truncation: measure the truncated growth itself, and keep α = 0 if that is better.
        finalists = [0.0, alpha]
        final = loss_of([{n: plan.grow(n, a) for n in names} for a in finalists])
        pick = growth.choose_step(final, finalists, terms)
        alpha, after = finalists[pick], final[pick]
    return StepChoice(alpha, float(before), float(after))


def _with_quadratic_step(plan: growth.GrowthPlan, names: list[str], loss_of: LossOf, alphas: list[float],
                         before: Tensor, rated: Tensor) -> tuple[list[float], Tensor]:
    """The grid's candidates and losses, plus α* = s/2c of the quadratic L(0) − sα + cα² (growth.quadratic_step)
    with its loss: the slope s from the first-order prediction at the smallest positive candidate."""
    probe = min(a for a in alphas if a > 0)
    slope = sum(plan.grow(n, probe).predicted_decrease for n in names) / probe
    star = growth.quadratic_step(slope, alphas, (before - rated).tolist(), max_alpha=max(alphas))
    if star in alphas:
        return alphas, rated
    return [*alphas, star], torch.cat([rated, loss_of([{n: plan.grow(n, star) for n in names}])])


class Stopwatch:
    """Wall time of the event's pieces (synchronised on CUDA, where kernels run asynchronously)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}
        self._start = self._last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, piece: str) -> None:
        now = self._now()
        self.seconds[f"{piece}_s"] = now - self._last
        self._last = now

    def total(self) -> float:
        return self._now() - self._start


@dataclass
class GrowthEvent:
    """Everything one event needs besides the model: where the candidates are rated and how the result is
    installed. `install(grown)` puts the tensors in place and rebuilds what depends on them."""

    settings: GrowthSettings
    search: StepSearch
    loss_of: LossOf
    install: Callable[[dict[str, growth.Growth]], None]
    broadcast: Callable[[dict], dict]  # rank 0's object on every rank
    choose_step_size: Callable[[growth.GrowthPlan, list[str], LossOf, StepSearch, str, int], StepChoice] = choose_step_size
    allowance: float | None = None  # cache values per token the automatic schedule may buy (None: the settings size)
    fill_to: float | None = None  # at the automatic schedule's last check, its budget: nothing is withheld
    terms: int = 1  # values (tokens) each rated loss averages: its round-off (trainer_ops.loss_terms)

    def run(self, forms: NamedForms, stats: list[growth.Sums], seed: int,
            half: list[growth.Sums] | None = None) -> tuple[dict, dict[str, Tensor]]:
        """Grows `forms` from their reduced `stats`; returns the event's record and the kept spectra per form.
        `half`: the sums of half the window's micro-batches, which the automatic schedule's decision needs.
        Raises growth.NonFiniteStatistics (nothing changed) when the statistics hold NaN or inf."""
        clock = Stopwatch(forms[0][2].leading_tensor.device)
        plan = plan_growth(forms, stats, self.settings, self.search.line_search, self.allowance is not None, seed)
        names = [name for _, name, _ in forms]
        decided = {}
        if self.allowance is not None:
            if half is None:
                raise ValueError("the automatic schedule decides from the two halves of the window: pass `half`")
            bought = decide(forms, stats, half, self.settings, self.allowance, self.fill_to)
            # Rank 0's decisions on every rank, as for the grown tensors below.
            decided = {"allowance": self.allowance, "decisions": self.broadcast([o.as_dict() for o in bought])}
            if self.fill_to is not None:
                decided["fill_to"] = self.fill_to
            columns = {(d["layer"], d["side"]): d["columns"] for d in decided["decisions"]}
            plan = plan.resized({name: form.width + columns[layer, form.side]
                                 for layer, name, form in forms})
            if not any(columns.values()):
                clock.lap("plan")
                return {"alpha": None, **decided, "timings": clock.seconds, "seconds": clock.total()}, {}
        clock.lap("plan")
        choice = self.choose_step_size(plan, names, self.loss_of, self.search, self.settings.method, self.terms)
        clock.lap("rating")
        # Rank 0's tensors for every rank, so replicas are bit-identical whatever the SVD did; through the CPU,
        # since a pickled CUDA tensor would land on rank 0's device.
        grown = self.broadcast({n: _to_cpu(plan.grow(n, choice.alpha or 0.0)) for n in names})
        self.install(grown)
        clock.lap("apply")
        record = {
            "alpha": choice.alpha,
            "loss_before": choice.loss_before,
            "loss_after": choice.loss_after,
            "sign_fallbacks": sum(g.fell_back for g in grown.values()),
            "predicted_decrease": float(sum(g.predicted_decrease for g in grown.values())),
            "realised_decrease": choice.loss_before - choice.loss_after,
            "discarded_energy": {name: g.discarded_energy.sum().item() for name, g in grown.items()},
            "timings": clock.seconds,
            "seconds": clock.total(),
            **decided,
        }
        return record, {name: g.spectrum for name, g in grown.items()}


def _to_cpu(g: growth.Growth | growth.GrownValue) -> growth.Growth | growth.GrownValue:
    return dataclasses.replace(g, **{name: getattr(g, name).cpu() for name in g.tensor_names()})
