"""How many columns a layer grows by under the automatic schedule (docs/design.md, "Automatic capacity").

Every quantity here is a ratio of two first-order loss decreases measured on the same statistics, so the loss's
scale, the learning rate, the corpus and the direction's normalisation all cancel; nothing is calibrated.

The statistics window is split in two halves A and B (alternate micro-batches). From each half X the natural
direction ΔM^X and the SVD of its bottleneck ΔM⊥^X = (I − P_Q)ΔM^X(I − P_K) (the part the current columns cannot
express to first order, TINY's expressivity bottleneck) give, against the score gradient N̄^Y of either half Y:
    g_j^{XY} = −σ_j u_jᵀ N̄^Y v_j   first-order decrease of appending bottleneck pair j of X at α = 1,
    G^{XY}   = −⟨N̄^Y, ΔM^X⟩        the same for the whole direction.
Held out (X ≠ Y), noise fitted on X does not help on Y: in expectation only the signal survives. Per layer
(heads and forms summed), with g_j = ½(g_j^{AB} + g_j^{BA}) and in-sample ĝ_j = ½(g_j^{AA} + g_j^{BB}), Ĝ and G likewise:
    existing    = Ĝ − Σ_j ĝ_j  what the layer's existing query/key columns can still gain along ΔM − ΔM⊥ (SENN's
                               natural-gradient score of the current parameters), in sample; G − Σ_j g_j held out;
    ratio_j     = g_j / existing                what column j adds, held out, against that (SENN's expansion score
                                                ratio);
    agreement_n = Σ_{j≤n} g_j / Σ_{j≤n} ĝ_j      the part of the first n columns' in-sample gain that holds out
                                                (1: signal, ≤ 0: noise).
An in-sample gain is signal plus the noise fitted on one window; a held-out gain is signal alone, in expectation.
Evidence is pooled over the layer's last checks at its current width (up to `pool`, this one included), as if they
were one window k times larger: held-out gains are their means over the k checks, and in-sample gains (ĝ_j and the
in-sample `existing`) keep their held-out mean plus 1/k of their mean excess over it, the noise a k-fold window
fits. At k = 1 this is the single window's rule; as k grows both ratios approach the signal's own. The first n
columns (largest σ first) qualify when ratio_j ≥ `ratio` for each of them and agreement_n ≥ `agreement`; a layer
takes the largest n that qualifies, up to the room left below max_d_head. Agreement is judged over the block the
columns are appended as: the leading pair of a noisy SVD fits the most noise, so judged alone its agreement would
veto the columns behind it. The ratio is judged per column, held out and so unbiased: noise columns padding a strong
one would pass a block's ratio where the existing columns gain nothing (ratio +∞).
Logged beside them: shares_j = g_j / G (held-out score of the whole direction) and the bottleneck's share of the
direction's energy ‖ΔM⊥‖²/‖ΔM‖².
Forms whose query heads share keys (GQA) or carry rotary columns (`grouped.GroupedGrowth`) give the same quantities
per group of heads: column j is the group's shared K column with one Q part per head, its gain summed over the
group's heads; rotary columns count in `existing` as they act at relative position 0.

Those bars see what the direction wants, not whether the width suffices (studies/capacity/README.md, "How the
rule decides"). So a layer that the bars would grow (`wanted`) grows only when it has no width to spare: removing
its least-used query/key component (`key_components`: the i-th rank-one part of M, projected out of the keys'
inputs) must raise the loss on the kept batches by at least `spare_below` of what removing an average component does
(`gated`). Measured, not first order, and again a ratio of two loss changes on the same batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from lit_growattn.growth.factorize import FormGrowth
from lit_growattn.growth.grouped import GroupedGrowth

Growths = Sequence[FormGrowth | GroupedGrowth]


@dataclass(frozen=True)
class CapacityRule:
    """ratio: each column taken must gain, held out, at least this share of what the layer's existing columns can
    gain; agreement: at least this share of the columns' in-sample gain, together, must hold out on the other half
    of the window (½: more signal than fitted noise); pool: the evidence of at most this many checks at the layer's
    current width is pooled as one window that many times larger; min_fall: the schedule may end only once the loss
    falls by less than this share of itself per check (growth never ends while the loss still falls fast);
    spare_below: a layer whose least-used query/key component costs less than this share of an average one has
    width to spare and grows nothing (0: not measured)."""

    ratio: float = 0.5
    agreement: float = 0.5
    pool: int = 3
    min_fall: float = 0.01
    spare_below: float = 0.03

    def __post_init__(self):
        if not self.ratio > 0:
            raise ValueError(f"threshold is a positive ratio to the existing columns' gain (e.g. 0.5), got {self.ratio}")
        if not 0 < self.agreement <= 1:
            raise ValueError(f"agreement is a share of the in-sample gain in (0, 1], got {self.agreement}")
        if not (isinstance(self.pool, int) and self.pool >= 1):
            raise ValueError(f"pool is a number of checks (≥ 1; 1: each check decides alone), got {self.pool}")
        if not self.min_fall >= 0:
            raise ValueError(f"min_fall is a relative loss decrease per check (≥ 0, e.g. 0.01), got {self.min_fall}")
        if not 0 <= self.spare_below < 1:
            raise ValueError(f"spare_below is a share of an average component's cost in [0, 1) (e.g. 0.03; 0: not "
                             f"measured), got {self.spare_below}")


@dataclass(frozen=True)
class Decision:
    """One layer at one check: this window's evidence, per candidate column in the order they would be appended,
    `held_out` and `in_sample` gains and the existing columns' gain `existing` (in sample) and `existing_held_out`;
    the `pooled` checks give per column the `ratios` and, for the first n = 1, 2, … columns together, the
    `agreement`; the largest n whose ratios clear `bar` and whose agreement clears `agreement_bar` (the rule's) is
    `wanted`; `columns` are taken, none when the layer has width to spare: its `component_costs`
    (loss increase without each query/key component, measured only when columns are wanted and d_head ≥ 2) give
    `least_used` (the smallest over their mean; None: not measured) below `spare_bar`. Logged only: `shares` of
    this window's held-out score `score`, and `bottleneck` ‖ΔM⊥‖²/‖ΔM‖²."""

    layer: int
    d_head: int
    candidates: int
    held_out: list[float]
    in_sample: list[float]
    existing: float
    existing_held_out: float
    pooled: int
    ratios: list[float]
    agreement: list[float]
    bar: float
    agreement_bar: float
    wanted: int
    columns: int
    shares: list[float]
    score: float
    bottleneck: float
    spare_bar: float
    component_costs: list[float] = dataclasses.field(default_factory=list)
    least_used: float | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def layer_gains(growths: Growths, n: Sequence[Tensor] | None = None) -> Tensor:
    """(e′,) first-order decrease at α = 1 of appending column j to every head (every group of heads sharing keys)
    of every form of one layer, against each form's own N̄ or the given ones (held out)."""
    held = n if n is not None else [None] * len(growths)
    return torch.stack([g.column_gains(h).sum(0) for g, h in zip(growths, held)]).sum(0)


def layer_score(growths: Growths, n: Sequence[Tensor] | None = None) -> float:
    """First-order decrease at α = 1 of the whole direction ΔM of every form of one layer, against their own N̄ or
    the given ones."""
    held = n if n is not None else [None] * len(growths)
    return sum(g.score(h) for g, h in zip(growths, held))


def bottleneck_share(growths: Growths) -> float:
    """‖ΔM⊥‖²/‖ΔM‖² over the heads and forms of one layer: how much of the direction the current width cannot express."""
    parts = [g.bottleneck(g.sizing_method) for g in growths]
    total = sum(float(energy.sum()) for _, _, _, energy in parts)
    return sum(float(s.square().sum()) for _, s, _, _ in parts) / total if total > 0 else 0.0


def decide(layer: int, full: Growths, a: Growths, b: Growths, rule: CapacityRule,
           max_d_head: int, cap: int | None = None, earlier: Sequence[dict] = ()) -> Decision:
    """How many columns `layer` grows by: its forms' growths from the whole window (`full`, whose columns are
    appended) and from the halves `a`, `b` of the window, pooled with the `earlier` decisions of this layer at its
    current width (`pooled_with` picks them); at most `cap` (None: no cap) and max_d_head."""
    d_head = full[0].d_head
    room = max(0, min(max_d_head, full[0].e_in) - d_head)
    if cap is not None:
        room = min(room, cap)
    n_a, n_b = [g.moments.n for g in a], [g.moments.n for g in b]
    # All bottleneck columns: the existing columns' gains are the whole direction's less all of them.
    every_held_out = (layer_gains(a, n_b) + layer_gains(b, n_a)) / 2
    every_in_sample = (layer_gains(a) + layer_gains(b)) / 2
    held_out, in_sample = every_held_out[:room], every_in_sample[:room]
    score = (layer_score(a, n_b) + layer_score(b, n_a)) / 2
    existing = (layer_score(a) + layer_score(b)) / 2 - float(every_in_sample.sum())
    existing_held_out = score - float(every_held_out.sum())
    checks = poolable(earlier, {"held_out": held_out.tolist(), "in_sample": in_sample.tolist(), "existing": existing,
                                "existing_held_out": existing_held_out})
    ratios, agreement, columns = leading_block(*as_one_window(checks, held_out.dtype), rule)
    shares = held_out / score if score > 0 else torch.zeros_like(held_out)
    return Decision(layer, d_head, room, held_out.tolist(), in_sample.tolist(), existing, existing_held_out,
                    len(checks), ratios.tolist(), agreement.tolist(), rule.ratio, rule.agreement, columns, columns,
                    shares.tolist(), score, bottleneck_share(full), rule.spare_below)


def poolable(earlier: Sequence[dict], current: dict) -> list[dict]:
    """The `earlier` checks that scored as many candidate columns as `current`, then `current`: a check with another
    room (nearer max_d_head, or under another cap) scored other columns, which cannot be averaged with these."""
    return [d for d in earlier if len(d["held_out"]) == len(current["held_out"])] + [current]


def as_one_window(checks: Sequence[dict], dtype: torch.dtype) -> tuple[Tensor, Tensor, float]:
    """The held-out and in-sample gains per column and the existing columns' gain of k checks (each with `held_out`,
    `in_sample`, `existing`, `existing_held_out`) pooled as one window k times larger."""
    k = len(checks)
    mean = lambda key: torch.tensor([d[key] for d in checks], dtype=dtype).mean(0)  # noqa: E731
    # In-sample gains are signal plus the noise fitted on one window; k pooled windows fit a k-th of that noise.
    fitted_once = lambda held, seen: held + (seen - held) / k  # noqa: E731
    held_out = mean("held_out")
    # The held-out existing gain is a difference of two noisy sums: below zero it says only that the signal is small.
    existing = fitted_once(max(float(mean("existing_held_out")), 0.0), float(mean("existing")))
    return held_out, fitted_once(held_out, mean("in_sample")), existing


def leading_block(held_out: Tensor, in_sample: Tensor, existing: float,
                  rule: CapacityRule) -> tuple[Tensor, Tensor, int]:
    """Per column, its held-out gain over the existing columns' gain (`ratios`); for the first n = 1, 2, … columns
    together, the share of their in-sample gain that holds out (`agreement`); and the number of columns to take: the
    largest n whose columns each clear the ratio bar and together clear the agreement bar (0: none)."""
    # Existing columns that can gain nothing: any column that holds out is worth having (ratio +inf).
    ratios = (held_out / existing if existing > 0
              else torch.where(held_out > 0, torch.inf, 0.0).to(held_out))
    block_held_out, block_in_sample = held_out.cumsum(0), in_sample.cumsum(0)
    # A block without positive in-sample gain is noise: agreement 0.
    agreement = torch.where(block_in_sample > 0,
                            block_held_out / block_in_sample.clamp_min(torch.finfo(held_out.dtype).tiny), 0.0)
    leading = (ratios >= rule.ratio).cumprod(0).bool()  # a column under the ratio bar ends the block
    qualifies = (leading & (agreement >= rule.agreement)).nonzero()
    return ratios, agreement, int(qualifies[-1]) + 1 if len(qualifies) else 0


def needs_costs(decision: dict) -> bool:
    """Whether the gate must measure the layer's components: columns wanted, a gate, and more than one component to
    compare."""
    return decision["wanted"] > 0 and decision["spare_bar"] > 0 and decision["d_head"] >= 2


def gated(decision: dict, costs: Sequence[float]) -> dict:
    """The decision once its layer's component costs are known: with the least-used component below `spare_bar` of
    the mean cost (or no component that costs anything), the layer has width to spare and takes no column."""
    mean = sum(costs) / len(costs)
    least_used = min(costs) / mean if mean > 0 else 0.0
    columns = decision["wanted"] if least_used >= decision["spare_bar"] else 0
    return decision | {"component_costs": list(costs), "least_used": least_used, "columns": columns}


def key_components(w_q: Tensor, w_k: Tensor, log_tau: Tensor) -> Tensor:
    """(KV, d, e′) the right singular vectors v_i (σ descending) of each key head's M: its g query heads' forms
    M_h = τ_h W_Qh W_Kᵀ stacked (g·e′ × e′; g = 1 without shared keys). w_q (H, e′, d), w_k (KV, e′, d), log_tau (H,).
    Projecting v_i out of the key's inputs (`without_key_direction`) removes exactly σ_i u_i v_iᵀ from the stacked M;
    rotary columns count as at relative position 0, and lose the same input direction."""
    kv, e, d = w_k.shape
    group = w_q.shape[0] // kv
    w_q, w_k, log_tau = w_q.double(), w_k.double(), log_tau.double()
    m = log_tau.exp()[:, None, None] * w_q @ w_k.repeat_interleave(group, 0).mT
    return torch.linalg.svd(m.reshape(kv, group * e, e), full_matrices=False)[2][:, :d]


def without_key_direction(w_k: Tensor, v: Tensor) -> Tensor:
    """(I − v vᵀ) W_K per key head: w_k (KV, e′, d) blind to the input direction v (KV, e′), in w_k's dtype."""
    v = v.to(w_k.dtype)
    return w_k - v[:, :, None] * (v[:, None, :] @ w_k)


def pooled_with(history: Sequence[dict], layer: int, d_head: int, pool: int) -> list[dict]:
    """The decisions of `layer` at the last checks of `history` (oldest first, at most pool − 1) that saw it at
    `d_head` in an unbroken run: a skipped check, a check that grew it or a record without raw gains (an older
    checkpoint) ends the run."""
    found: list[dict] = []
    for event in reversed(history):
        if len(found) >= pool - 1:
            break
        decision = next((d for d in event.get("decisions", ()) if d["layer"] == layer), None)
        if decision is None or decision["d_head"] != d_head or decision["columns"] or "existing_held_out" not in decision:
            break
        found.append(decision)
    return found[::-1]


def loss_fall(history: list[dict], checks: int) -> float | None:
    """Relative decrease of the loss per check over the last `checks` checks, (L₀ − L)/(checks · L₀), from the
    loss each check measured on its kept batches; None while fewer than checks + 1 checks measured it."""
    losses = [e.get("loss_before") for e in history[-checks - 1:]]
    if len(losses) < checks + 1 or None in losses or not losses[0] > 0:
        return None
    return (losses[0] - losses[-1]) / (checks * losses[0])
