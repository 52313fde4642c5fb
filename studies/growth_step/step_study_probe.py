"""`growth_step.py probe`: L(α) and the noise of the statistics at real growth events, measured on a copy
of the model at the start of each growth epoch, before the callback grows it."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Callable

import lightning as L
import torch

from step_study import GROW_EPOCHS, GRIDS, KEPT, OLD_GRID, WINDOW, build, grow_args, held_out

from lit_growattn import StepSearch, growth  # step_study has put the repository on the path
from lit_growattn.callback.event import choose_step_size
from lit_growattn.callback.trainer_ops import loss_terms

GRID = [0.0] + [2.0**-k for k in range(13)]  # 1 … 1/4096
PAIRS = [(m, mode) for m in growth.DIRECTIONS for mode in growth.MODES]
PAIRS += [(baseline, "append") for baseline in growth.BASELINES]
MAX_BATCHES = 64  # statistics batches drawn at each event, for the noise study


def named_forms(model) -> dict:
    return {f"blocks.{i}.{j}": form for i, forms in enumerate(model.qk_forms()) for j, form in enumerate(forms)}


def layer_of(name: str) -> str:
    return name.split(".")[1]


def random_batches(train_set, n: int, batch_size: int, generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(n):
        xs, ys = zip(*(train_set[int(i)] for i in torch.randint(len(train_set), (batch_size,), generator=generator)))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def per_batch_stats(model, loss, forms: dict, batches) -> list[list[growth.FormStats]]:
    """Statistics of each batch alone, at the frozen model (the callback gathers them while training)."""
    out = []
    for x, y in batches:
        stats = [growth.FormStats.empty_like(f, "pinv", dtype=torch.float64) for f in forms.values()]
        for f in forms.values():
            f.capture = "explicit"
        loss(model(x), y).backward()
        for st, f in zip(stats, forms.values()):
            for xa, gx in f.take_captured():
                st.update(xa, gx)
            f.capture = None
        model.zero_grad(set_to_none=True)
        out.append(stats)
    return out


def summed(stats: list[list[growth.FormStats]]) -> list[growth.FormStats]:
    total = stats[0]
    for more in stats[1:]:
        total = [a + b for a, b in zip(total, more)]
    return total


@torch.no_grad()
def losses_with(model, loss, forms: dict, grown: dict | None, batches) -> list[float]:
    with growth.installed(forms, grown):
        return [float(loss(model(x), y)) for x, y in batches]


def rate_rule(plan, forms: dict, search: StepSearch, method: str,
              kept_loss: Callable[[float], float], terms: int) -> tuple[float, list[float]]:
    """The step the callback's own choice (`choose_step_size`) installs under `search`, rated on the kept
    batches (`terms` tokens) through `kept_loss(α)`; and every α it rated (the quadratic rule adds its minimiser α*)."""
    rated: list[float] = []

    def loss_of(candidates) -> torch.Tensor:
        alphas = [0.0 if c is None else next(iter(c.values())).alpha for c in candidates]
        rated.extend(alphas)
        return torch.tensor([kept_loss(a) for a in alphas])

    return choose_step_size(plan, list(forms), loss_of, search, method, terms).alpha, rated


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


def noise(forms: dict, stats: list[list[growth.FormStats]], p: int) -> list[dict]:
    """Agreement of the estimates from two disjoint halves of K batches: cosine of ΔM, and the overlap
    ‖U_AᵀU_B‖²/p of the top-p bottleneck directions that `append` grows along (1: same subspace)."""
    rows = []
    for k in (2, 4, 8, 16, 32, 64):
        halves = [summed(stats[:k // 2]), summed(stats[k // 2:k])]
        for method in ("natural", "gradient", "pinv"):
            cos, overlap = [], []
            for i, f in enumerate(forms.values()):
                a, b = (growth.FormGrowth.from_form(f, h[i].means(), method) for h in halves)
                cos.append(cosine(a.direction(method), b.direction(method)))
                ua, ub = a.bottleneck(method)[0][..., :p], b.bottleneck(method)[0][..., :p]
                overlap.append(float((ua.mT @ ub).square().sum((-2, -1)).mean() / p))
            rows.append({"batches": k, "method": method, "cosine": sum(cos) / len(cos),
                         "overlap": sum(overlap) / len(overlap)})
    return rows


def measure_event(pl_module, train_set, held: list, generator, grow_by: int = 7) -> dict:
    model, loss = copy.deepcopy(pl_module.model).train(False), pl_module.loss  # the module's own loss
    forms = named_forms(model)
    batches = random_batches(train_set, MAX_BATCHES, held[0][0].shape[0], generator)
    stats = per_batch_stats(model, loss, forms, batches)
    window, terms = batches[:WINDOW], loss_terms(batches[WINDOW - KEPT:WINDOW])
    evaluate = {"window": window, "held_out": held}
    base = {k: losses_with(model, loss, forms, None, b) for k, b in evaluate.items()}
    curves = []
    for method, mode in PAIRS:
        plan = growth.GrowthPlan.build(forms, summed(stats[:WINDOW]), method=method, grow_by=grow_by, mode=mode,
                                       group_of=layer_of, generator=torch.Generator().manual_seed(0))

        def at(alpha: float) -> dict:
            grown = {n: plan.grow(n, alpha) for n in forms}
            out = {k: losses_with(model, loss, forms, grown, b) for k, b in evaluate.items()}
            return {"alpha": alpha, "predicted": sum(g.predicted_decrease for g in grown.values()),
                    "fell_back": any(g.fell_back for g in grown.values()), **out}

        points = [at(a) for a in (GRID if method not in growth.BASELINES else [0.0])]
        rules = {}
        if method not in growth.BASELINES:
            by_alpha = {pt["alpha"]: pt for pt in points}

            def kept_loss(alpha: float) -> float:  # the window's last KEPT batches, as the callback keeps them
                point = by_alpha.get(alpha) or at(alpha)
                return sum(point["window"][WINDOW - KEPT:]) / KEPT

            for label, grid in GRIDS.items():
                chosen, _ = rate_rule(plan, forms, StepSearch([0.0, *grid], rule="grid"), method, kept_loss, terms)
                _, rated = rate_rule(plan, forms, StepSearch([0.0, *grid], rule="quadratic"), method, kept_loss, terms)
                star = next((a for a in rated if a not in (0.0, *grid)), None)  # None: α* is a grid point
                rules[label] = {"grid": chosen, **({"quadratic": at(star)} if star is not None else {})}
        curves.append({"method": method, "mode": mode, "points": points, "rules": rules})
    return {"base": base, "curves": curves, "noise": noise(forms, stats, grow_by)}


class Probe(L.Callback):
    """Measures each growth event on a copy of the model, before the growth callback grows it."""

    def __init__(self, out: Path, seed: int):
        self.out, self.seed, self.events = out, seed, []

    def on_train_epoch_start(self, trainer, pl_module):
        epoch = trainer.current_epoch
        if epoch not in GROW_EPOCHS:
            return
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(1000 * self.seed + epoch)
        event = measure_event(pl_module, trainer.datamodule.train_set, held_out(trainer.datamodule), generator)
        self.events.append({"seed": self.seed, "epoch": epoch, "step": trainer.global_step,
                            "seconds": time.perf_counter() - start, **event})
        self.out.write_text(json.dumps(self.events))
        print(f"probe seed {self.seed} epoch {epoch}: {time.perf_counter() - start:.0f} s", flush=True)
        if epoch == max(GROW_EPOCHS):
            trainer.should_stop = True


def probe(text: str, seed: int, out: Path, log_dir: str, extra: list[str]) -> None:
    cli = build(text, [*grow_args("natural", "replace", OLD_GRID), *extra], seed, log_dir)
    cli.trainer.callbacks.insert(0, Probe(out, seed))
    cli.trainer.fit(cli.model, cli.datamodule)
