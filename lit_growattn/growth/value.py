"""The value side of attention: each head's W_M = W_V W_O, widened by appending value columns (docs/value.md).

Shapes: H query heads, KV value heads (query head j reads value head j // g, g = H / KV), input size e′
(X′ = [X | 1] with a bias), output size e, value head size d → d + p. W_V (KV, e′, d), W_O (H, d, e) and
W_M,j = W_V,j//g W_O,j (e′, e), of rank ≤ d. With P_j = A_j X′ (s, e′), A_j head j's attention (any combination of
softmax maps that is linear in the values), the layer's output is Y = Σ_j P_j W_M,j + b_O: linear in every W_M,j,
so growing d is growing a factored linear map, not a bilinear form.

Statistics, per sequence i with G_Y,i = ∂L/∂Y_i of the mean loss, summed and averaged as `stats.FormStats` does:
    C_j = Σ_i P_ijᵀ P_ij (H, e′, e′),   N_j = Σ_i P_ijᵀ G_Y,i (H, e′, e) = ∂L/∂W_M,j.
Directions: `natural` ΔW_j = −C̄_j⁺ N̄_j, the Gauss–Newton step of min Σ_i ‖P_ij ΔW + η G_Y,i‖² (one-sided: the
output is linear in W_M, so its space needs no preconditioner), or with a ridge −(C̄_j + ρ_jI)⁻¹N̄_j, ρ_j = ridge ×
C̄_j's mean eigenvalue; `gradient` ΔW_j = −N̄_j. Each is scaled so that
α = 1 moves the output by its own RMS, head by head: Σ_j tr(ΔW_jᵀ C̄_j ΔW_j) = Σ_j tr(W_M,jᵀ C̄_j W_M,j).
Bottleneck: a first-order change of the factors, δW_V W_O,j + W_V δW_O,j with δW_V shared by a group, reaches
only part of ΔW; new rank comes from the rest, R_j = (I − P_V)(ΔW_j − A W_O,j) with A the group's least-squares
common change (`bottleneck`; with one head per group R = (I − P_V)ΔW(I − P_O)). Per group, its heads' residuals
side by side, [R_j]_{j in g} (e′, g·e) ≈ U Σ Wᵀ: u_k is the group's new V column, the j-th block of w_k head j's new O row,
    V_new = u (ασ)^½,   O_new,j = w_j (ασ)^½,   so W_M,j′ − W_M,j = α Σ_k σ_k u_k w_k,jᵀ.
Zero fan-in (α = 0, or a vanishing σ): the V column u σ^½ stays and the O row is 0, so the function is unchanged
and the O row gets the gradient σ^½ (P_j u)ᵀ G_Y at once. Append is the only mode: a replace would rotate value
columns the group's heads share, and the baselines `random`/`zero` append N(0, σ²) columns (`zero`: zero O rows).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_growattn.growth.choices import BASELINES, check_choice
from lit_growattn.growth.factorize import FAN_IN_FLOOR, VANISH, Carry, Outcome, sizing_method
from lit_growattn.growth.linalg import canonical_signs, column_basis, psd_pinv, psd_ridge_inverse
from lit_growattn.growth.sketch import SketchSize, SketchValueStats, TestMatrices
from lit_growattn.growth.solvers import energy_scale
from lit_growattn.growth.stats import Moments, Sums
from lit_growattn.growth.unit import GrowableUnit

VALUE_DIRECTIONS = ("natural", "gradient")
VALUE_METHODS = (*VALUE_DIRECTIONS, *BASELINES)


class ValueShape(GrowableUnit):
    """Head counts and sizes read off w_v (KV, e′, d_v) and w_o (H, d_v, e); the value side of a `GrowableUnit`."""

    side = "d_v"
    w_v: Tensor
    w_o: Tensor

    @property
    def n_head(self) -> int:
        return self.w_o.shape[0]

    @property
    def n_kv_head(self) -> int:
        return self.w_v.shape[0]

    @property
    def e_in(self) -> int:
        return self.w_v.shape[1]

    @property
    def e_out(self) -> int:
        return self.w_o.shape[2]

    @property
    def d_v(self) -> int:
        return self.w_v.shape[2]

    @property
    def width(self) -> int:
        """What a growth widens: d_v."""
        return self.d_v

    @property
    def max_width(self) -> int:
        """The largest useful value head size: W_M (e′, e) has rank ≤ min(e′, e)."""
        return min(self.e_in, self.e_out)

    @property
    def leading_tensor(self) -> Tensor:
        return self.w_v

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(ValueWeights))

    def held_weights(self) -> ValueWeights:
        return ValueWeights.of(self)

    def empty_sums(self, method: str, dtype: torch.dtype = torch.float32, sketch: SketchSize | None = None,
                   seed: int = 0, tests: TestMatrices | None = None) -> ValueStats | SketchValueStats:
        if sketch is None:
            return ValueStats.empty_like(self, dtype=dtype)
        return SketchValueStats.empty_like(self, sketch, seed, dtype=dtype, tests=tests)

    def sums_numel(self, method: str, sketch: SketchSize | None = None) -> int:
        """C (h·e′²) and N (h·e′·e), whatever the method; sketched, the range, co-range and Nyström sketches
        (kv·e′·k + h·e·l + h·e′·k_c)."""
        if sketch is not None:
            return (self.n_kv_head * self.e_in * sketch.k + self.n_head * self.e_out * sketch.l
                    + self.n_head * self.e_in * sketch.k_c)
        return self.n_head * self.e_in * (self.e_in + self.e_out)

    def tests_numel(self, sketch: SketchSize | None) -> int:
        """The Ω_j (h·e·k), Ψ (e′·l) and Ω_c (e′·k_c) a sketch draws beside its sums; none without one."""
        if sketch is None:
            return 0
        shapes = SketchValueStats.test_shapes(self.n_head, self.e_in, self.e_out, sketch)
        return sum(math.prod(shape) for shape in shapes.values())


@dataclass
class ValueWeights(ValueShape):
    w_v: Tensor
    w_o: Tensor

    @classmethod
    def of(cls, values: ValueShape) -> ValueWeights:
        """The weights a value map holds now (the same tensors, not copies)."""
        return cls(values.w_v, values.w_o)

    def install(self, values) -> None:
        """Puts these weights in `values` (anything with `set_weights(w_v, w_o)`)."""
        values.set_weights(self.w_v, self.w_o)


@dataclass
class GrownValue(ValueWeights, Outcome):
    """One value map grown: w_v (KV, e′, d_new), w_o (H, d_new, e) in the map's dtype, and its `Outcome`
    (discarded_energy and spectrum per group)."""


class ValueStats(Sums):
    """Running sums C (H, e′, e′) and N (H, e′, e) of one value map (module docstring); `means` gives
    Moments(c = C̄ per head, n = N̄, p = None)."""

    def __init__(self, n_head: int, e_in: int, e_out: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, rcond: float = 1e-6):
        self.rcond = rcond
        zeros = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.c_sum = zeros(n_head, e_in, e_in)
        self.n_sum = zeros(n_head, e_in, e_out)
        self.instances = zeros()
        self.weight = zeros()

    @classmethod
    def empty_like(cls, values: ValueShape, *, dtype: torch.dtype = torch.float32, rcond: float = 1e-6) -> ValueStats:
        return cls(values.n_head, values.e_in, values.e_out, dtype=dtype, device=values.w_v.device, rcond=rcond)

    @property
    def names(self) -> list[str]:
        return ["c_sum", "n_sum", "instances", "weight"]

    @torch.no_grad()
    def update(self, p: Tensor, g_y: Tensor, weight: float = 1.0) -> None:
        """Adds one captured pair: p = A X′ (b, H, s, e′) per head, g_y = ∂L/∂Y (b, s, e) from the (unscaled) loss.
        Raises NonFiniteStatistics, leaving the sums untouched, when the pair holds NaN or inf."""
        self._follow(p)
        p, g = p.detach().to(self.c_sum), g_y.detach().to(self.c_sum)
        b, h, s, e_in = p.shape
        if (h, e_in) != self.c_sum.shape[:2] or g.shape != (b, s, self.n_sum.shape[2]):
            raise ValueError(f"captured P {tuple(p.shape)} and G_Y {tuple(g.shape)} do not fit sums of "
                             f"{self.c_sum.shape[0]} heads, input size {self.c_sum.shape[1]}, output size "
                             f"{self.n_sum.shape[2]}")
        increments = {"c_sum": torch.einsum("bhse,bhsf->hef", p, p), "n_sum": torch.einsum("bhse,bsf->hef", p, g)}
        self._add(increments, b, weight, "captured (A X′, ∂L/∂Y)")

    def means(self) -> Moments:
        """(C̄ (H, e′, e′), N̄ (H, e′, e), None) in float64; raises NonFiniteStatistics on NaN/inf, ValueError when
        empty."""
        w = self._checked_weight()
        return Moments(self.c_sum.double() / self.instances.double(), self.n_sum.double() / w, None)

    @classmethod
    def from_state_dict(cls, state: dict) -> ValueStats:
        c, n = state["c_sum"], state["n_sum"]
        out = cls(c.shape[0], c.shape[1], n.shape[2], dtype=n.dtype, device=n.device)
        out.load_state_dict(state)
        return out


def value_direction(method: str, moments: Moments, w_m: Tensor, rcond: float = 1e-6,
                    ridge: float | None = None) -> Tensor:
    """ΔW (H, e′, e) of a value `method` (natural | gradient), scaled to the output energy of the current W_M
    (H, e′, e) (module docstring); a degenerate side (W_M = 0, or ΔW = 0 on the data) leaves it unscaled. ridge:
    natural's C̄_j + ρ_jI in place of C̄_j, ρ_j = ridge × C̄_j's mean eigenvalue (None: the pseudo-inverse)."""
    check_choice("value method", method, VALUE_DIRECTIONS)
    delta = -(psd_ridge_inverse(moments.c, ridge, rcond) @ moments.n) if method == "natural" else -moments.n
    current, moved = (w_m * (moments.c @ w_m)).sum(), (delta * (moments.c @ delta)).sum()
    return delta * energy_scale(moved, current)


class ValueGrowth(ValueShape):
    """The α-independent part of growing one value map, computed once and reused for every step-size candidate
    (the API of `factorize.FormGrowth`, append only). w_v (KV, e′, d), w_o (H, d, e); moments: `ValueStats.means()`;
    method: natural | gradient | random | zero; truncation: euclidean only; size_by: the direction that sizes a
    baseline's growth; ridge: natural's (`value_direction`)."""

    def __init__(self, w_v: Tensor, w_o: Tensor, moments: Moments, method: str = "natural", *,
                 truncation: str = "euclidean", rcond: float = 1e-6, size_by: str | None = None,
                 ridge: float | None = None):
        check_choice("value method", method, VALUE_METHODS)
        if truncation != "euclidean":
            raise ValueError(f"truncation={truncation!r} whitens a query/key form's two sides by the input covariance; "
                             "the value side truncates in euclidean coordinates only")
        if w_o.shape[0] % w_v.shape[0]:
            raise ValueError(f"{w_o.shape[0]} query heads cannot share {w_v.shape[0]} value heads evenly")
        self.method, self.rcond, self.ridge, self.moments, self.dtype = method, rcond, ridge, moments, w_v.dtype
        self.sizing_method = sizing_method(method, size_by)
        self.w_v, self.w_o = w_v.detach().double(), w_o.detach().double()
        self.group = self.n_head // self.n_kv_head
        self._directions: dict[str, Tensor] = {}
        self._bottlenecks: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    @classmethod
    def from_values(cls, values: ValueShape, moments: Moments, method: str = "natural", **kwargs) -> ValueGrowth:
        return cls(values.w_v, values.w_o, moments, method, **kwargs)

    def per_head(self, w: Tensor) -> Tensor:
        """A value-head tensor (KV, …) repeated for the query heads that read it (H, …)."""
        return w.repeat_interleave(self.group, 0)

    def matrix(self) -> Tensor:
        """W_M (H, e′, e) per query head."""
        return self.per_head(self.w_v) @ self.w_o

    def direction(self, method: str) -> Tensor:
        if method not in self._directions:
            self._directions[method] = value_direction(method, self.moments, self.matrix(), self.rcond, self.ridge)
        return self._directions[method]

    def bottleneck(self, method: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per group: u (KV, e′, k), σ (KV, k) descending, w (KV, g·e, k) with k = min(e′, g·e), ‖ΔW‖² (KV,).

        The residual of ΔW that no first-order change of the factors reaches: δW_M,j = δW_V W_O,j + W_V δW_O,j with
        δW_V shared by the group, so per head R_j = (I − P_V)(ΔW_j − A W_O,j), A the group's least-squares common
        change, A = Σ_j (I − P_V)ΔW_j W_O,jᵀ (Σ_j W_O,j W_O,jᵀ)⁺; for one head per group R = (I − P_V)ΔW(I − P_O)."""
        if method not in self._bottlenecks:
            delta = self.direction(method)
            basis_v = self.per_head(column_basis(self.w_v))
            kv, g, e_in, e_out = self.n_kv_head, self.group, self.e_in, self.e_out
            outside = delta - basis_v @ (basis_v.mT @ delta)  # (I − P_V) ΔW_j
            reach = (outside @ self.w_o.mT).reshape(kv, g, e_in, -1).sum(1)  # Σ_j (I − P_V)ΔW_j W_O,jᵀ
            gram = (self.w_o @ self.w_o.mT).reshape(kv, g, self.d_v, self.d_v).sum(1)  # Σ_j W_O,j W_O,jᵀ
            common = reach @ psd_pinv(gram, self.rcond)
            residual = outside - self.per_head(common) @ self.w_o
            # Heads of a group side by side: (KV, e′, g·e).
            stacked = residual.reshape(kv, g, e_in, e_out).permute(0, 2, 1, 3).reshape(kv, e_in, g * e_out)
            u, s, wh = torch.linalg.svd(stacked, full_matrices=False)
            # Canonical signs: a run whose statistics differ by round-off (compiled kernels) grows the same columns.
            u, w = canonical_signs(u, wh.mT)
            energy = delta.square().sum((-2, -1)).reshape(kv, g).sum(-1)
            self._bottlenecks[method] = u, s, w, energy
        return self._bottlenecks[method]

    def _rows_per_head(self, w: Tensor) -> Tensor:
        """w (KV, g·e, k) → the O rows' directions per query head (H, e, k)."""
        return w.reshape(self.n_kv_head, self.group, self.e_out, -1).reshape(self.n_head, self.e_out, -1)

    def rank(self, threshold: float, max_d_v: int) -> int:
        """Singular values of the bottleneck above threshold × the largest, counted per group, max over groups;
        at least 1, at most max_d_v − d (and the rank bound min(e′, e))."""
        s = self.bottleneck(self.sizing_method)[1]
        count = int((s > threshold * s.max()).sum(-1).max())
        return max(0, min(max(count, 1), min(max_d_v, self.max_width) - self.d_v))

    def column_gains(self, n: Tensor | None = None) -> Tensor:
        """First-order loss decrease −σ_k Σ_{j in group} u_kᵀ N̄_j w_k,j of appending pair k at α = 1, per group
        (KV, k), in the order `grow` takes the pairs; against this map's N̄ or a given one (H, e′, e)."""
        u, s, w, _ = self.bottleneck(self.sizing_method)
        n = self.moments.n if n is None else n
        per_head = torch.einsum("hek,hef,hfk->hk", self.per_head(u), n.to(u.dtype), self._rows_per_head(w))
        return -s * per_head.reshape(self.n_kv_head, self.group, -1).sum(1)

    def grow(self, alpha: float, d_new: int, *, mode: str = "append", temperature: str = "keep",
             generator: torch.Generator | None = None) -> GrownValue:
        """The map grown to value head size d_new at step α ≥ 0 (α is ignored by the baselines). As on the query/key
        side, a direction method whose first-order prediction is not a decrease falls back to `gradient`.
        temperature: unused (the value side has no temperature; the argument mirrors `FormGrowth.grow`, so that one
        plan grows both sides under `temperature: rescale`)."""
        if mode != "append":
            raise ValueError(f"value growth only appends columns (mode='append'), got mode={mode!r}: a replace would "
                             "rotate the value columns that the heads of a group share")
        if not alpha >= 0:
            raise ValueError(f"step size α must be ≥ 0, got {alpha}")
        if not self.d_v <= d_new <= self.max_width:
            raise ValueError(f"d_new={d_new} must lie between the current d_v {self.d_v} and min(e′, e) = {self.max_width}")
        grown = self._build(self.method, alpha, d_new, generator)
        if alpha > 0 and self.method == "natural" and grown.predicted_decrease <= 0:
            grown = dataclasses.replace(self._build("gradient", alpha, d_new, generator), fell_back=True)
        return grown

    def _build(self, method: str, alpha: float, d_new: int, generator) -> GrownValue:
        d, p = self.d_v, d_new - self.d_v
        if method in BASELINES:
            new_v, new_o, discarded, spectrum = self._random_columns(method, p, generator)
        else:
            u, s, w, energy = self.bottleneck(method)
            sigma = s[:, :p]
            live = (sigma > VANISH * s[:, :1]) & (alpha > 0)
            kept = torch.where(live, alpha * sigma, sigma.clamp_min(FAN_IN_FLOOR * s[:, :1]))
            new_v = u[:, :, :p] * kept.sqrt()[:, None, :]
            rows = self._rows_per_head(w[:, :, :p]) * self.per_head(alpha * sigma * live).sqrt()[:, None, :]
            new_o = rows.mT  # (H, p, e)
            discarded = (alpha**2 * (energy - (sigma.square() * live).sum(-1))).clamp_min(0)
            spectrum = sigma
        w_v, w_o = torch.cat([self.w_v, new_v], -1), torch.cat([self.w_o, new_o], -2)
        return GrownValue(
            w_v=w_v.to(self.dtype), w_o=w_o.to(self.dtype),
            carries={"w_v": Carry((slice(None), slice(None), slice(0, d))),
                     "w_o": Carry((slice(None), slice(0, d), slice(None)))},
            predicted_decrease=self._first_order(new_v, new_o), discarded_energy=discarded,
            spectrum=spectrum, alpha=alpha, method=method,
        )

    def _first_order(self, new_v: Tensor, new_o: Tensor) -> float:
        """−⟨N̄, W_M′ − W_M⟩ summed over heads for appended V columns new_v (KV, e′, p) and O rows new_o (H, p, e):
        the old part is unchanged, so W_M,j′ − W_M,j = new_v new_o,j."""
        return -float((self.moments.n * (self.per_head(new_v) @ new_o)).sum())

    def _random_columns(self, method: str, p: int, generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Baselines: N(0, σ²) V columns and O rows, σ the RMS of the head's old ones; `zero`: zero O rows."""
        where = self.w_v.device if generator is None else generator.device

        def normal(w: Tensor, shape: tuple[int, ...]) -> Tensor:
            noise = torch.randn(shape, generator=generator, dtype=torch.float64, device=where).to(w.device)
            return noise * w.square().mean((1, 2), keepdim=True).sqrt()

        new_v = normal(self.w_v, (self.n_kv_head, self.e_in, p))
        new_o = normal(self.w_o, (self.n_head, p, self.e_out))
        new_o = new_o if method == "random" else torch.zeros_like(new_o)
        return new_v, new_o, self.w_v.new_zeros(self.n_kv_head), self.w_v.new_zeros(self.n_kv_head, 0)
