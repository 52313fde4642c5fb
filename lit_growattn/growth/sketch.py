"""Sketched growth statistics: what a growth event needs of N̄, kept in e′·k numbers per head instead of e′² (the
growths from them: `sketched`).

Why. The full statistics hold N̄_j (e′ × e′) per query head on the query/key side and N̄_V,j, C̄_V,j (e′ × e, e′ × e′)
per head on the value side: at a 1B-parameter model's width that is gigabytes per layer. A growth event reads far less
of them. It appends, per head (per group of heads sharing keys or values), the top p singular pairs of the bottleneck
and ranks them by their first-order gain −σ_j u_jᵀN̄v_j; the direction's normalisation and the predicted decrease are
traces that a thin factorisation gives exactly. So N̄ is only ever needed on a subspace of dimension about p, and a
sketch of rank k ≈ 2p + 8 carries it whenever N̄ is close to low rank, which the gradient's N̄ is on real text.

What is sketched (query/key side, `SketchFormStats`). A group g of query heads sharing one key head has the stacked
statistics S_g = [N̄_j]_{j∈g} (g·e′ × e′), the very matrix `GroupedGrowth` factorises. With Gaussian test matrices Ω
(e′ × k, one per layer) and Ψ_j (e′ × l, one per query head, Ψ_g their stack) the sums are

    C = Σ_i X′ᵢᵀX′ᵢ (full: one e′ × e′ matrix per layer),
    Y_j = Σ_i X′ᵢᵀG_ij(X′ᵢΩ) = N_jΩ (e′ × k, per query head),   so [Y_j]_{j∈g} = S_gΩ,
    W_g = Σ_{j∈g} Σ_i X′ᵢᵀG_ijᵀ(X′ᵢΨ_j) = Σ_{j∈g} N_jᵀΨ_j (e′ × l, per key head) = S_gᵀΨ_g:

a two-sided sketch of S_g. The capture hands G X′Ω and Σ_{j∈g} GᵀX′Ψ_j, thin products that attention with k + l extra
columns gives without ever forming G (growth/ needs only their values).

Value side (`SketchValueStats`). With P_j = A_jX′ and G_Y = ∂L/∂Y, a value head's group has T_g = [N̄_V,j]_{j∈g}
(e′ × g·e, heads side by side); with Ω_j (e × k, per query head), Ψ (e′ × l) and Ω_c (e′ × k_c, per layer)

    Y_V,g = Σ_{j∈g} N_V,jΩ_j = T_g[Ω_j]_j (e′ × k, per value head),   W_V,j = N_V,jᵀΨ (e × l, per query head),
    F_j = C_V,jΩ_c (e′ × k_c, per query head): a Nyström sketch of each head's input covariance.

Reconstruction (generalised Nyström). From y = AΩ and w = AᵀΨ alone, A ≈ Q(ΨᵀQ)⁺wᵀ with Q an orthonormal basis of
range(y) (`nystrom`): exact whenever rank A ≤ k, since then range(A) = range(y) and (ΨᵀQ)⁺Ψᵀ inverts Q on it. So
N̄_j ≈ L_jR_gᵀ with L = Q split per head (e′ × k) and R_g (e′ × k) shared by the group, as its heads share K. The
value side's C_V,j is rebuilt as Ĉ_j = F(Ω_cᵀF)⁺Fᵀ = B_jB_jᵀ (`nystrom_psd`), exact when rank C_V,j ≤ k_c.

Mergeable. Every sum is linear in what is captured, so micro-batches add, the halves of a window subtract and one
all-reduce of `stats.flatten_stats` merges ranks, as for `FormStats`. The test matrices are not among the sums (an
all-reduce would multiply them by the world size) nor in a checkpoint: they are drawn again from a seed (a float64 CPU
generator, then cast), identical on every rank and after a resume, and a checkpoint keeps the seed, the sizes and a
checksum that refuses a resume whose generator now draws other matrices.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from lit_growattn.growth.stats import Sums


@dataclass(frozen=True)
class SketchSize:
    """k: range columns per head (the most pairs an event can price), l: co-range columns (l ≥ k, so that the
    Nyström core ΨᵀQ has full column rank), k_c: the value side's Nyström columns for C_V."""

    k: int
    l: int
    k_c: int

    def __post_init__(self):
        for name in ("k", "l", "k_c"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"a sketch's {name} must be a positive int, got {value!r}")
        if self.l < self.k:
            raise ValueError(f"a sketch's co-range needs l ≥ k columns for an exact reconstruction at rank ≤ k, got "
                             f"l={self.l} < k={self.k}")

    @classmethod
    def of(cls, k: int) -> SketchSize:
        """The sizes for k: l = ⌈3k/2⌉ (enough over k that ΨᵀQ is well conditioned), k_c = k."""
        return cls(k, math.ceil(3 * k / 2), k)


@dataclass(frozen=True, eq=False)
class TestMatrices:
    """The Gaussian test matrices of one unit's sketch (name → tensor), drawn from `seed`: in float64 on the CPU,
    whatever the device, then cast, so every rank and every resume draws the same ones. checksum: the sha256 of the
    float64 draws, to notice a torch whose generator draws others."""

    __test__ = False  # not a pytest class, whatever its name

    seed: int
    matrices: dict[str, Tensor]
    checksum: str

    @classmethod
    def draw(cls, seed: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> TestMatrices:
        generator = torch.Generator().manual_seed(seed)
        drawn = {name: torch.randn(shape, generator=generator, dtype=torch.float64) for name, shape in shapes.items()}
        return cls(seed, {name: t.to(dtype=dtype, device=device) for name, t in drawn.items()}, cls.checksum_of(drawn))

    @staticmethod
    def checksum_of(matrices: dict[str, Tensor]) -> str:
        """The sha256 (hex) of the bytes of float64 CPU matrices, in order. A hash of the bytes, not a float sum: a BLAS
        reduction's last bits depend on the thread count, and a resume under torchrun (other OMP threads) must find
        the same checksum."""
        digest = hashlib.sha256()
        for t in matrices.values():
            digest.update(t.contiguous().numpy())
        return digest.hexdigest()

    def __getitem__(self, name: str) -> Tensor:
        return self.matrices[name]

    def to(self, device: torch.device | str) -> TestMatrices:
        """These matrices on `device`: themselves when they are there (so sums that share them keep sharing)."""
        if all(t.device == torch.device(device) for t in self.matrices.values()):
            return self
        return TestMatrices(self.seed, {name: t.to(device) for name, t in self.matrices.items()}, self.checksum)

    @classmethod
    def given_or_drawn(cls, given: TestMatrices | None, seed: int, shapes: dict[str, tuple[int, ...]],
                       dtype: torch.dtype, device: torch.device | str | None) -> TestMatrices:
        """`given` (another sums' matrices, shared rather than drawn again) when it is of this seed and these
        shapes, else matrices drawn from `seed`."""
        if given is None:
            return cls.draw(seed, shapes, dtype, device)
        have = {name: tuple(t.shape) for name, t in given.matrices.items()}
        if given.seed != seed or have != {name: tuple(shape) for name, shape in shapes.items()}:
            raise ValueError(f"the given test matrices (seed {given.seed}, shapes {have}) are not those of seed {seed} "
                             f"and shapes {dict(shapes)}")
        return given


class Factored(NamedTuple):
    """A statistic held as thin factors, N̄ ≈ left rightᵀ per head or group (see the moments that hold it)."""

    left: Tensor
    right: Tensor


class SketchMoments(NamedTuple):
    """A query/key form's sketched means: c = C̄ (e′, e′); n: N̄_j ≈ n.left_j n.right_gᵀ with left (H, e′, r) per
    query head and right (KV, e′, r) per key head."""

    c: Tensor
    n: Factored


class SketchValueMoments(NamedTuple):
    """A value map's sketched means: c_root (H, e′, r_c) with Ĉ_j = c_root_j c_root_jᵀ, the Nyström estimate of C̄_j;
    n: N̄_V,j ≈ n.left_g n.right_jᵀ with left (KV, e′, r) per value head and right (H, e, r) per query head."""

    c_root: Tensor
    n: Factored


def nystrom(y: Tensor, w: Tensor, psi: Tensor) -> Factored:
    """A ≈ Q(ΨᵀQ)⁺Wᵀ = left rightᵀ from the sketches y = AΩ (…, m, k) and w = AᵀΨ (…, n, l) with the co-range's test
    matrix psi (…, m, l): left = Q (…, m, r), an orthonormal basis of y's columns, right = W(ΨᵀQ)⁺ᵀ (…, n, r),
    r = min(m, k). Exact when rank A ≤ k: range(A) ⊆ span(Q), and ΨᵀQ (l > r rows) has full column rank, so
    (ΨᵀQ)⁺ΨᵀA = QᵀA. Q keeps all k columns even when y has lower rank: the extra ones carry rows of `right` at round-off
    and keep the least-squares problem well posed.

    The least squares go through a QR of ΨᵀQ and a triangular solve, not `torch.linalg.lstsq`: on the CPU its result
    depends in the last bits on where the tensors lie in memory, so a resumed run (the same sums at other addresses)
    would not grow bit-identically to the uninterrupted one."""
    q = torch.linalg.qr(y).Q
    core = torch.linalg.qr(psi.mT @ q)  # (…, l, r), l > r, full column rank
    return Factored(q, torch.linalg.solve_triangular(core.R, core.Q.mT @ w.mT, upper=True).mT)


def nystrom_psd(f: Tensor, omega: Tensor, cut: float) -> Tensor:
    """A root B (…, m, k) of the Nyström estimate Ĉ = F(ΩᵀF)⁺Fᵀ = BBᵀ of symmetric PSD matrices C from f = CΩ
    (…, m, k). The core ΩᵀCΩ has condition number about cond(C)·cond(Ω)², so it is cut at round-off (eigenvalues
    below `cut` × its largest: their columns of B are zero), not at the growth's rcond, which then applies to Ĉ."""
    core = omega.mT @ f
    lam, vec = torch.linalg.eigh((core + core.mT) / 2)
    keep = lam > cut * lam[..., -1:]
    return f @ (vec * torch.where(keep, torch.where(keep, lam, 1.0).rsqrt(), 0.0).unsqueeze(-2))


def nystrom_solve(root: Tensor, rhs: Tensor, ridge: float | None, rcond: float) -> Tensor:
    """(Ĉ + ρI)⁻¹ rhs for Ĉ = root rootᵀ (root (…, e, m), rhs (…, e, r)), ρ = ridge × Ĉ's mean eigenvalue (tr Ĉ / e),
    by Woodbury on Ĉ = U diag(λ) Uᵀ: U diag(1/(λ + ρ)) Uᵀ + (I − UUᵀ)/ρ. ridge None or 0: Ĉ⁺ rhs, eigenvalues
    ≤ rcond × the largest counting as zero, as `linalg.psd_pinv`."""
    u, s, _ = torch.linalg.svd(root, full_matrices=False)
    lam = s.square()  # descending
    along = u.mT @ rhs
    if not ridge:
        keep = lam > rcond * lam[..., :1]
        return u @ (torch.where(keep, 1.0 / torch.where(keep, lam, 1.0), 0.0).unsqueeze(-1) * along)
    if ridge < 0:
        raise ValueError(f"ridge must be ≥ 0 (a multiple of the mean eigenvalue), got {ridge}")
    rho = (ridge * lam.sum(-1) / root.shape[-2])[..., None, None]
    return u @ (along / (lam.unsqueeze(-1) + rho)) + (rhs - u @ along) / rho


class SketchSums(Sums):
    """Sums of a sketch (module docstring): `Sums` with the unit's test matrices, which are neither summed nor saved.
    Sums of different test matrices do not combine; a state restores only onto the same seed, sizes and draws."""

    size: SketchSize
    tests: TestMatrices

    def to(self, device: torch.device | str) -> SketchSums:
        super().to(device)
        self.tests = self.tests.to(device)
        return self

    def _combined(self, other: Sums, sign: float) -> Sums:
        if not isinstance(other, SketchSums) or (other.tests.seed, other.size) != (self.tests.seed, self.size):
            raise ValueError("cannot combine sketches drawn with different test matrices (seed or size)")
        return super()._combined(other, sign)

    def _sketch_state(self) -> dict:
        return {"seed": self.tests.seed, "k": self.size.k, "l": self.size.l, "k_c": self.size.k_c,
                "checksum": self.tests.checksum}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sketch": self._sketch_state()}

    def load_state_dict(self, state: dict) -> None:
        saved, drawn = state.get("sketch", {}), self._sketch_state()
        other = [f"{name} {saved.get(name)}, here {drawn[name]}" for name in ("seed", "k", "l", "k_c")
                 if saved.get(name) != drawn[name]]
        if other:
            raise ValueError(f"the saved sums are of another sketch ({'; '.join(other)}): sums of other test matrices "
                             "do not combine")
        if saved["checksum"] != drawn["checksum"]:
            raise ValueError("the sketch's test matrices drawn now differ from the window's (torch changed its "
                             "generator?): resume from a checkpoint outside the window")
        super().load_state_dict({k: v for k, v in state.items() if k != "sketch"})

    @staticmethod
    def _saved_size(state: dict) -> tuple[SketchSize, int]:
        sketch = state["sketch"]
        return SketchSize(sketch["k"], sketch["l"], sketch["k_c"]), sketch["seed"]


class SketchFormStats(SketchSums):
    """Running sums of one query/key form's sketch: c_sum (e′, e′), y_sum (H, e′, k), w_sum (KV, e′, l); test
    matrices omega (e′, k) and psi (H, e′, l). `means` gives SketchMoments (the reconstruction is done there)."""

    gradient_parts = (1, 2)  # G X′Ω and GᵀX′Ψ

    def __init__(self, n_head: int, n_kv_head: int, e_in: int, size: SketchSize, seed: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, rcond: float = 1e-6,
                 tests: TestMatrices | None = None):
        if n_head % n_kv_head:
            raise ValueError(f"{n_head} query heads cannot share {n_kv_head} key heads evenly")
        self.rcond, self.size = rcond, size
        self.tests = TestMatrices.given_or_drawn(tests, seed, self.test_shapes(n_head, e_in, size), dtype, device)
        zeros = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.c_sum = zeros(e_in, e_in)
        self.y_sum = zeros(n_head, e_in, size.k)
        self.w_sum = zeros(n_kv_head, e_in, size.l)
        self.instances = zeros()
        self.weight = zeros()

    @staticmethod
    def test_shapes(n_head: int, e_in: int, size: SketchSize) -> dict[str, tuple[int, ...]]:
        """The test matrices drawn beside the sums: Ω (e′, k) and Ψ_j (e′, l) per query head."""
        return {"omega": (e_in, size.k), "psi": (n_head, e_in, size.l)}

    @classmethod
    def empty_like(cls, form, size: SketchSize, seed: int, *, dtype: torch.dtype = torch.float32,
                   rcond: float = 1e-6, tests: TestMatrices | None = None) -> SketchFormStats:
        """Empty sums for a form with w_q (H, e′, d) and w_k (KV, e′, d); `tests`: the matrices of other sums of
        this seed, shared instead of drawn again."""
        (h, e_in, _), kv = form.w_q.shape, form.w_k.shape[0]
        return cls(h, kv, e_in, size, seed, dtype=dtype, device=form.w_q.device, rcond=rcond, tests=tests)

    @property
    def names(self) -> list[str]:
        return ["c_sum", "y_sum", "w_sum", "instances", "weight"]

    @torch.no_grad()
    def update(self, xa: Tensor, g_omega: Tensor, gt_psi: Tensor, weight: float = 1.0) -> None:
        """Adds one captured triple: xa = X′ (b, s, e′), g_omega = G_j X′Ω (b, H, s, k) per query head and
        gt_psi = Σ_{j∈g} G_jᵀX′Ψ_j (b, KV, s, l) per key head, G from the (unscaled) loss. Raises
        NonFiniteStatistics, leaving the sums untouched, when they hold NaN or inf."""
        self._follow(xa)
        x, gy, gw = (t.detach().to(self.c_sum) for t in (xa, g_omega, gt_psi))
        b, s, e = x.shape
        expected = (b, self.y_sum.shape[0], s, self.size.k), (b, self.w_sum.shape[0], s, self.size.l)
        if (tuple(gy.shape), tuple(gw.shape)) != expected:
            raise ValueError(f"captured G X′Ω {tuple(gy.shape)} and GᵀX′Ψ {tuple(gw.shape)}, expected {expected}")
        flat = x.reshape(b * s, e)
        increments = {"c_sum": flat.mT @ flat, "y_sum": torch.einsum("bse,bhsk->hek", x, gy),
                      "w_sum": torch.einsum("bse,bgsl->gel", x, gw)}
        self._add(increments, b, weight, "captured (X′, G X′Ω, GᵀX′Ψ)")

    def means(self) -> SketchMoments:
        """C̄ and the factors of N̄ in float64 (sums divided as `FormStats.means` does); raises NonFiniteStatistics on
        NaN/inf, ValueError when empty."""
        w = self._checked_weight()
        (h, e, k), (kv, _, l) = self.y_sum.shape, self.w_sum.shape
        group = h // kv
        left, right = nystrom((self.y_sum.double() / w).reshape(kv, group * e, k), self.w_sum.double() / w,
                              self.tests["psi"].double().reshape(kv, group * e, l))
        return SketchMoments(self.c_sum.double() / self.instances.double(),
                             Factored(left.reshape(h, e, left.shape[-1]), right))

    @classmethod
    def from_state_dict(cls, state: dict) -> SketchFormStats:
        size, seed = cls._saved_size(state)
        (h, e, _), kv, y = state["y_sum"].shape, state["w_sum"].shape[0], state["y_sum"]
        out = cls(h, kv, e, size, seed, dtype=y.dtype, device=y.device)
        out.load_state_dict(state)
        return out


class SketchValueStats(SketchSums):
    """Running sums of one value map's sketch: y_sum (KV, e′, k), w_sum (H, e, l), f_sum (H, e′, k_c); test matrices
    omega (H, e, k), psi (e′, l), omega_c (e′, k_c). `means` gives SketchValueMoments."""

    # E_V's gradient and G_Y. Not A_jX′Ψ (forward values) nor E_C's gradient, A_jᵀA_jX′Ω_c: it comes from a fixed
    # cotangent injected in backward, which no loss scale multiplies.
    gradient_parts = (1, 3)

    def __init__(self, n_head: int, n_kv_head: int, e_in: int, e_out: int, size: SketchSize, seed: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, rcond: float = 1e-6,
                 tests: TestMatrices | None = None):
        if n_head % n_kv_head:
            raise ValueError(f"{n_head} query heads cannot share {n_kv_head} value heads evenly")
        self.rcond, self.size = rcond, size
        self.tests = TestMatrices.given_or_drawn(tests, seed, self.test_shapes(n_head, e_in, e_out, size), dtype,
                                                 device)
        zeros = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.y_sum = zeros(n_kv_head, e_in, size.k)
        self.w_sum = zeros(n_head, e_out, size.l)
        self.f_sum = zeros(n_head, e_in, size.k_c)
        self.instances = zeros()
        self.weight = zeros()

    @staticmethod
    def test_shapes(n_head: int, e_in: int, e_out: int, size: SketchSize) -> dict[str, tuple[int, ...]]:
        """The test matrices drawn beside the sums: Ω_j (e, k) per query head, Ψ (e′, l) and Ω_c (e′, k_c)."""
        return {"omega": (n_head, e_out, size.k), "psi": (e_in, size.l), "omega_c": (e_in, size.k_c)}

    @classmethod
    def empty_like(cls, values, size: SketchSize, seed: int, *, dtype: torch.dtype = torch.float32,
                   rcond: float = 1e-6, tests: TestMatrices | None = None) -> SketchValueStats:
        """Empty sums for a value map with w_v (KV, e′, d) and w_o (H, d, e); `tests` as `SketchFormStats`."""
        (kv, e_in, _), (h, _, e_out) = values.w_v.shape, values.w_o.shape
        return cls(h, kv, e_in, e_out, size, seed, dtype=dtype, device=values.w_v.device, rcond=rcond, tests=tests)

    @property
    def names(self) -> list[str]:
        return ["y_sum", "w_sum", "f_sum", "instances", "weight"]

    @torch.no_grad()
    def update(self, xa: Tensor, e_v_grad: Tensor, a_xpsi: Tensor, g_y: Tensor, e_c_grad: Tensor,
               weight: float = 1.0) -> None:
        """Adds one captured step: xa = X′ (b, s, e′); e_v_grad = Σ_{j∈g} A_jᵀG_YΩ_j (b, KV, s, k) per value head;
        a_xpsi = A_jX′Ψ (b, H, s, l) and e_c_grad = A_jᵀA_jX′Ω_c (b, H, s, k_c) per query head; g_y = ∂L/∂Y (b, s, e)
        from the (unscaled) loss. Raises NonFiniteStatistics, leaving the sums untouched, on NaN or inf."""
        self._follow(xa)
        x, ev, ap, g, ec = (t.detach().to(self.y_sum) for t in (xa, e_v_grad, a_xpsi, g_y, e_c_grad))
        b, s, _ = x.shape
        (kv, _, k), (h, e_out, l), k_c = self.y_sum.shape, self.w_sum.shape, self.size.k_c
        expected = (b, kv, s, k), (b, h, s, l), (b, s, e_out), (b, h, s, k_c)
        if tuple(tuple(t.shape) for t in (ev, ap, g, ec)) != expected:
            raise ValueError(f"captured {[tuple(t.shape) for t in (ev, ap, g, ec)]}, expected {list(expected)}")
        increments = {"y_sum": torch.einsum("bse,bgsk->gek", x, ev), "w_sum": torch.einsum("bsf,bhsl->hfl", g, ap),
                      "f_sum": torch.einsum("bse,bhsc->hec", x, ec)}
        self._add(increments, b, weight, "captured value sketch")

    def means(self) -> SketchValueMoments:
        """The Nyström root of each C̄_j and the factors of N̄_V in float64 (C per instance, N per weight, as
        `ValueStats.means`); raises NonFiniteStatistics on NaN/inf, ValueError when empty."""
        w = self._checked_weight()
        (kv, e_in, _), (h, e_out, l) = self.y_sum.shape, self.w_sum.shape
        group = h // kv
        left, right = nystrom(self.y_sum.double() / w, (self.w_sum.double() / w).reshape(kv, group * e_out, l),
                              self.tests["psi"].double())
        # The core's round-off comes from the sums' precision and grows with the size summed over.
        cut = e_in * torch.finfo(self.f_sum.dtype).eps
        c_root = nystrom_psd(self.f_sum.double() / self.instances.double(), self.tests["omega_c"].double(), cut)
        return SketchValueMoments(c_root, Factored(left, right.reshape(h, e_out, right.shape[-1])))

    @classmethod
    def from_state_dict(cls, state: dict) -> SketchValueStats:
        size, seed = cls._saved_size(state)
        (kv, e_in, _), (h, e_out, _), y = state["y_sum"].shape, state["w_sum"].shape, state["y_sum"]
        out = cls(h, kv, e_in, e_out, size, seed, dtype=y.dtype, device=y.device)
        out.load_state_dict(state)
        return out
