"""Mergeable gradient statistics: the base `Sums`, and those of one query/key form (docs/design.md §4–§5).

Per instance i (one sequence) with input X′ᵢ (s, e′) and score gradient Gᵢ = ∂L/∂Sᵢ per head:
    C_i = X′ᵢᵀX′ᵢ (e′, e′),   N_i = X′ᵢᵀ Gᵢ X′ᵢ (h, e′, e′) = ∂L/∂M from that instance,
    and, for the `pinv` method only, C_i⁺ N_i C_i⁺ (h, e′, e′).
The sums are plain sums of what autograd gives on the mean loss, so Σ_i N_i over a micro-batch already is
that micro-batch's ∂L/∂M. Each micro-batch brings a `weight`, its share of one optimizer step's loss
(1/accumulate_grad_batches), and the means divide by the summed weights:
    N̄ = Σ N / Σ weight,   P̄ = Σ C⁺NC⁺ / Σ weight,   C̄ = Σ C / number of instances.
Under DDP the caller sums the flattened buffers of all ranks (weights included), which makes N̄ the
DDP-averaged gradient; nothing here divides by the world size.
"""

from __future__ import annotations

import copy
import math
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from lit_growattn.growth.linalg import psd_pinv


class NonFiniteStatistics(FloatingPointError):
    """NaN or inf in the statistics: the growth that would use them must be skipped."""


class Moments(NamedTuple):
    """Means of the statistics in float64: c = C̄ (e′, e′), n = N̄ (h, e′, e′), p = P̄ (h, e′, e′) or None."""

    c: Tensor
    n: Tensor
    p: Tensor | None


class Sums:
    """Mergeable running sums (torchmetrics' Metric in spirit): named tensors that add, subtract, move, flatten into
    one all-reduce buffer (`flatten_stats`) and survive checkpoints. Subclasses name their tensors (`names`), fold
    captured pairs in (`update`, through `_add`) and turn the sums into means (`means`); `instances` (sequences)
    and `weight` (summed shares of an optimizer step's loss) are always among the names."""

    rcond: float
    instances: Tensor
    weight: Tensor
    # The positions among `update`'s captured arguments (0: the first) of those that carry the loss's gradient: under
    # 16-mixed a GradScaler's scale multiplies them, and only them, so the caller divides those by it before `update`.
    gradient_parts: ClassVar[tuple[int, ...]] = (1,)

    @property
    def names(self) -> list[str]:
        raise NotImplementedError

    def tensors(self) -> list[Tensor]:
        return [getattr(self, name) for name in self.names]

    def _add(self, increments: dict[str, Tensor], instances: int, weight: float, what: str) -> None:
        """Adds the increments (name → tensor) of one captured pair; raises NonFiniteStatistics, leaving the sums
        untouched, when they hold NaN or inf."""
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight}")
        _check_finite(increments, what)
        for name, inc in increments.items():
            getattr(self, name).add_(inc)
        self.instances += instances
        self.weight += weight

    def _checked_weight(self) -> Tensor:
        """Σ weight in float64, after checking that the sums are finite and not empty."""
        _check_finite(dict(zip(self.names, self.tensors())), "summed statistics")
        if not (self.instances > 0 and self.weight > 0):
            raise ValueError("no statistics were accumulated")
        return self.weight.double()

    def _follow(self, data: Tensor) -> None:
        if data.device != self.weight.device:
            self.to(data.device)  # e.g. sums restored from a checkpoint onto the CPU: they follow the data

    def to(self, device: torch.device | str) -> Sums:
        """Moves the sums in place; returns self."""
        for name in self.names:
            setattr(self, name, getattr(self, name).to(device))
        return self

    def __add__(self, other: Sums) -> Sums:
        return self._combined(other, 1.0)

    def __sub__(self, other: Sums) -> Sums:
        """The sums of self without those of other (other's micro-batches are a part of self's)."""
        return self._combined(other, -1.0)

    def _combined(self, other: Sums, sign: float) -> Sums:
        if (type(self) is not type(other) or self.names != other.names
                or any(a.shape != b.shape for a, b in zip(self.tensors(), other.tensors()))):
            raise ValueError("cannot combine statistics of forms with different shapes or methods")
        out = copy.copy(self)
        for name, a, b in zip(self.names, self.tensors(), other.tensors()):
            setattr(out, name, a + sign * b)
        return out

    def state_dict(self) -> dict:
        return {"rcond": self.rcond, **{name: t.detach().clone() for name, t in zip(self.names, self.tensors())}}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"rcond", *self.names}:
            raise ValueError(f"state has {sorted(state)}, expected {sorted(['rcond', *self.names])}")
        self.rcond = state["rcond"]
        for name in self.names:
            getattr(self, name).copy_(state[name])


class FormStats(Sums):
    """Running sums for one form with h heads and input size e′ (e′ = n_embd + 1 with a bias).

    Accumulates in `dtype` (float32 by default, float64 optional); the per-instance pseudo-inverses of the
    `pinv` statistics are always taken in float64 with the relative cut-off `rcond`.
    """

    def __init__(
        self,
        n_head: int,
        e_in: int,
        *,
        pinv: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        rcond: float = 1e-6,
    ):
        self.rcond = rcond
        zeros = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.c_sum = zeros(e_in, e_in)
        self.n_sum = zeros(n_head, e_in, e_in)
        self.pinv_sum = zeros(n_head, e_in, e_in) if pinv else None
        self.instances = zeros()
        self.weight = zeros()

    @classmethod
    def empty_like(
        cls, form, method: str = "gradient", *, dtype: torch.dtype = torch.float32, rcond: float = 1e-6
    ) -> FormStats:
        """Empty sums for a QKForm-like `form` (needs `w_q` (h, e′, d)); `pinv` sums only for method 'pinv'."""
        h, e_in, _ = form.w_q.shape
        return cls(h, e_in, pinv=method == "pinv", dtype=dtype, device=form.w_q.device, rcond=rcond)

    @property
    def names(self) -> list[str]:
        """Names of the state tensors, in the order of `flatten_stats`."""
        return ["c_sum", "n_sum"] + (["pinv_sum"] if self.pinv_sum is not None else []) + ["instances", "weight"]

    @torch.no_grad()
    def update(self, xa: Tensor, gx: Tensor, weight: float = 1.0) -> None:
        """Adds one captured pair: xa = X′ (b, s, e′), gx = G X′ (b, h, s, e′) with G from the (unscaled) loss.

        Raises NonFiniteStatistics, leaving the sums untouched, when the pair holds NaN or inf.
        """
        self._follow(xa)
        x, g = xa.detach().to(self.c_sum), gx.detach().to(self.c_sum)
        b, s, e = x.shape
        if g.shape != (b, self.n_sum.shape[0], s, e):
            raise ValueError(f"gx has shape {tuple(g.shape)}, expected {(b, self.n_sum.shape[0], s, e)}")
        flat = x.reshape(b * s, e)
        increments = {"c_sum": flat.mT @ flat, "n_sum": torch.einsum("bse,bhsf->hef", x, g)}
        if self.pinv_sum is not None:
            increments["pinv_sum"] = self._pinv_increment(x, g)
        self._add(increments, b, weight, "captured (X′, G X′)")

    def _pinv_increment(self, x: Tensor, g: Tensor) -> Tensor:
        """Σ_i C_i⁺ N_i C_i⁺ = Σ_i X_i⁺ (G_i X_i) C_i⁺ with X⁺ = C⁺X′ᵀ: e′×e′ inverses only, never s×s."""
        xd = x.double()
        cp = psd_pinv(xd.mT @ xd, self.rcond).to(x.dtype)  # (b, e′, e′), one per instance shared by the heads
        return torch.einsum("bes,bhsf->hef", cp @ x.mT, g @ cp.unsqueeze(1))

    def means(self) -> Moments:
        """(C̄, N̄, P̄ or None) in float64; raises NonFiniteStatistics on NaN/inf, ValueError when empty."""
        w = self._checked_weight()
        p = None if self.pinv_sum is None else self.pinv_sum.double() / w
        return Moments(self.c_sum.double() / self.instances.double(), self.n_sum.double() / w, p)

    @classmethod
    def from_state_dict(cls, state: dict) -> FormStats:
        n = state["n_sum"]
        out = cls(n.shape[0], n.shape[1], pinv="pinv_sum" in state, dtype=n.dtype, device=n.device)
        out.load_state_dict(state)
        return out


def _check_finite(tensors: dict[str, Tensor], what: str) -> None:
    # One reduction and one host sync: a sum is NaN/inf as soon as any element is.
    totals = torch.stack([t.sum(dtype=torch.float64) for t in tensors.values()])
    if not torch.isfinite(totals).all():
        bad = [name for name, total in zip(tensors, totals.tolist()) if not math.isfinite(total)]
        raise NonFiniteStatistics(f"non-finite values in the {what}: {', '.join(bad)}")


def flatten_stats(stats: list[Sums]) -> Tensor:
    """Every sum of every form in one 1-D buffer, so that the caller does a single (sum) all-reduce."""
    return torch.cat([t.reshape(-1) for s in stats for t in s.tensors()])


def unflatten_stats(flat: Tensor, like: list[Sums]) -> list[Sums]:
    """The inverse of `flatten_stats`: new sums shaped as `like`, filled from `flat` (like is untouched)."""
    sizes = [t.numel() for s in like for t in s.tensors()]
    if flat.numel() != sum(sizes):
        raise ValueError(f"buffer has {flat.numel()} values, the statistics need {sum(sizes)}")
    chunks = iter(flat.split(sizes))
    out = []
    for s in like:
        new = copy.copy(s)
        for name, t in zip(s.names, s.tensors()):
            setattr(new, name, next(chunks).view_as(t).to(t).clone())
        out.append(new)
    return out
