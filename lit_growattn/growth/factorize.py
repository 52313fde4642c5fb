"""From a direction ΔM to new weights W_Q′, W_K′, log τ′ of one form (docs/design.md §2–§3).

Shapes: h heads, input size e′, head size d → d_new = d + p. M = τ W_Q W_Kᵀ (h, e′, e′).
- `replace`: M′ = trunc_{d_new}(M + αΔM), W_Q′ = U(Σ/τ′)^½, W_K′ = V(Σ/τ′)^½; every column rotates.
- `append`: old columns kept (× c = (τ/τ′)^½), p new pairs from the top-p singular pairs (u, σ, v) of the
  bottleneck ΔM_⊥ = (I − P_Q)ΔM(I − P_K): (u(ασ/τ′)^½, v(ασ/τ′)^½), so M′ = M + α·trunc_p(ΔM_⊥).
Either way τ′W_Q′W_K′ᵀ = M′. Two zero columns of a bilinear form never receive gradient, so a pair that
would vanish (α = 0, or a vanishing singular value) is made *zero fan-in*: Q column u(σ/τ′)^½, K column 0;
the function is unchanged and the K column gets gradient τ′N̄ᵀu at once.
`whitened` truncation runs all of this in the coordinates X′C̄^{-½}, where the Frobenius norm of M is the
norm of the scores it makes: W ↦ C̄^½W, M ↦ C̄^½MC̄^½, and back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_growattn.growth.choices import BASELINES, METHODS, MODES, TEMPERATURES, TRUNCATIONS, check_choice
from lit_growattn.growth.form import FormShape, FormWeights
from lit_growattn.growth.linalg import column_basis, factored_score_energy, project_out, psd_sqrt
from lit_growattn.growth.solvers import DIRECTIONS, direction
from lit_growattn.growth.stats import Moments

# Singular values below this share of a head's largest are rounding noise of a rank-deficient matrix
# (1e-16 in float64, amplified by at most cond(C̄) = 1/rcond through whitening): their pairs would vanish.
VANISH = 1e-8
# A zero fan-in Q column is at least this share of the strongest bottleneck pair, so that it is never zero.
FAN_IN_FLOOR = 1e-3


@dataclass(frozen=True)
class Carry:
    """How Adam's state of one parameter crosses a growth.

    old_index selects the old tensor inside the new one (None: the values rotated, reset the state, `step`
    included); the old slice's first moments are multiplied by first_scale and its second moments by
    second_scale (append + rescale multiplies old columns by c, hence their gradients by 1/c); new entries
    start empty.
    """

    old_index: tuple[slice, ...] | None
    first_scale: float = 1.0
    second_scale: float = 1.0


@dataclass(kw_only=True)
class Outcome:
    """What a growth carries besides its new weights (`Growth` for a query/key form, `value.GrownValue` for a
    value map): carries per parameter name; predicted_decrease = −⟨N̄, M′ − M⟩ summed over heads (first order);
    discarded_energy (per head or group) = ‖Z − M′‖²_F with Z = M + αΔM, in the truncation's coordinates (replace +
    euclidean: Σ discarded σ²; 0 for baselines); spectrum (heads or groups, k): singular values kept by the
    truncation: of M′ (replace, k = d_new), of the bottleneck pairs appended (append, k = p, before the factor α),
    empty for baselines; method: the direction used (`gradient` after a sign fallback)."""

    carries: dict[str, Carry]
    predicted_decrease: float
    discarded_energy: Tensor
    spectrum: Tensor
    alpha: float
    method: str
    fell_back: bool = False


@dataclass
class Growth(FormWeights, Outcome):
    """One query/key form grown: w_q, w_k (h, e′, d_new) and log_tau (h,) in the form's dtype and device, and
    its `Outcome`."""


def sizing_method(method: str, size_by: str | None, name: str = "size_by") -> str:
    """The direction whose bottleneck sizes a growth and rates its columns: a direction method's own; for a baseline
    `size_by`, or the gradient's, so that it grows as much as the gradient method would. name: for the errors."""
    if size_by is None:
        return method if method in DIRECTIONS else "gradient"
    check_choice(name, size_by, DIRECTIONS)
    if method in DIRECTIONS and size_by != method:
        raise ValueError(f"{name}={size_by!r} only applies to the baselines {BASELINES}: method {method!r} is sized "
                         f"by its own direction; set {name} to null")
    return size_by


def zero_fan_in_columns(u: Tensor, s: Tensor, order: Tensor, tau: Tensor) -> Tensor:
    """Q columns u_j(σ_j/τ′)^½ (h, e′, k) of the pairs j = order (h, k) of u (h, e′, m), s (h, m), σ_j at least the
    floor, in working coordinates: zero fan-in columns, whose K columns are zero."""
    sigma = s.gather(-1, order).clamp_min(FAN_IN_FLOOR * s[:, :1])
    cols = u.gather(-1, order.unsqueeze(1).expand(-1, u.shape[1], -1))
    return cols * (sigma / tau[:, None]).sqrt().unsqueeze(1)


class FormGrowth(FormShape):
    """The α-independent part of growing one form, computed once and reused for every step-size candidate.

    w_q, w_k (h, e′, d), log_tau (h,): the form's current parameters; moments: `FormStats.means()`;
    method: one of METHODS; truncation: euclidean | whitened; rcond: relative eigenvalue cut-off of C̄⁺, C̄^{±½};
    size_by: the direction whose bottleneck sizes a baseline's growth (see `sizing_method`); ridge: natural's
    (`solvers.natural`; None: the pseudo-inverse).
    """

    def __init__(
        self,
        w_q: Tensor,
        w_k: Tensor,
        log_tau: Tensor,
        moments: Moments,
        method: str = "natural",
        *,
        truncation: str = "euclidean",
        rcond: float = 1e-6,
        size_by: str | None = None,
        ridge: float | None = None,
    ):
        check_choice("method", method, METHODS)
        check_choice("truncation", truncation, TRUNCATIONS)
        self.method, self.truncation, self.rcond, self.ridge, self.moments = method, truncation, rcond, ridge, moments
        self.sizing_method = sizing_method(method, size_by)
        self.dtype = w_q.dtype
        self.w_q, self.w_k, self.log_tau = (t.detach().double() for t in (w_q, w_k, log_tau))
        self._roots = psd_sqrt(moments.c, rcond) if truncation == "whitened" else None
        self._directions: dict[str, Tensor] = {}
        self._bottlenecks: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    @functools.cached_property
    def m(self) -> Tensor:
        """The current bilinear form M = τ W_Q W_Kᵀ (h, e′, e′)."""
        return self.log_tau.exp()[:, None, None] * self.w_q @ self.w_k.mT

    @classmethod
    def from_form(cls, form, moments: Moments, method: str = "natural", **kwargs) -> FormGrowth:
        """From a QKForm-like object (attributes w_q, w_k, log_tau)."""
        return cls(form.w_q, form.w_k, form.log_tau, moments, method, **kwargs)

    def direction(self, method: str) -> Tensor:
        """Normalised ΔM (h, e′, e′) of a direction method (see `solvers.direction`)."""
        if method not in self._directions:
            tau_q = self.log_tau.exp()[:, None, None] * self.w_q
            m_energy = factored_score_energy(tau_q, self.w_k, self.moments.c)
            self._directions[method] = direction(method, self.moments, m_energy, self.rcond, self.ridge)
        return self._directions[method]

    def bottleneck(self, method: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """SVD of ΔM_⊥ in the truncation's coordinates: u (h, e′, e′), σ (h, e′) descending, v (h, e′, e′),
        and ‖ΔM‖²_F per head (h,) in the same coordinates."""
        if method not in self._bottlenecks:
            delta = self._to_work(self.direction(method))
            basis_q, basis_k = column_basis(self._cols(self.w_q, 0)), column_basis(self._cols(self.w_k, 0))
            u, s, vh = torch.linalg.svd(project_out(delta, basis_q, basis_k))
            self._bottlenecks[method] = u, s, vh.mT, delta.square().sum((-2, -1))
        return self._bottlenecks[method]

    def rank(self, threshold: float, max_d_head: int) -> int:
        """Dynamic rank p (seed 004): singular values of the bottleneck above threshold × the largest in the form,
        counted per head, max over heads (d_head is uniform in a form); at least 1, at most max_d_head − d.
        Baselines use the gradient's bottleneck, so that they grow as much as the gradient method would."""
        s = self.bottleneck(self.sizing_method)[1]
        count = int((s > threshold * s.max()).sum(-1).max())
        return max(0, min(max(count, 1), min(max_d_head, self.e_in) - self.d_head))

    def column_gains(self, n: Tensor | None = None) -> Tensor:
        """First-order loss decrease −⟨N̄, σ_j u_j v_jᵀ⟩ of appending bottleneck pair j at α = 1, per head (h, e′),
        in the order `append` takes the pairs (σ descending); against this form's N̄ or a given one (h, e′, e′)."""
        u, s, v, _ = self.bottleneck(self.sizing_method)
        u, v = self._cols(u, 1), self._cols(v, 1)
        n = self.moments.n if n is None else n
        return -s * torch.einsum("hej,hef,hfj->hj", u, n.to(u.dtype), v)

    def grow(
        self,
        alpha: float,
        d_new: int,
        *,
        mode: str = "append",
        temperature: str = "keep",
        generator: torch.Generator | None = None,
    ) -> Growth:
        """The form grown to head size d_new at step α ≥ 0 (α is ignored by the baselines).

        Sign check: when α > 0 and the first-order prediction −⟨N̄, M′ − M⟩ is ≤ 0 for a method other than
        `gradient`, the growth is recomputed with the gradient direction and flagged `fell_back`.
        generator: for the baselines' random columns (any device).
        """
        check_choice("mode", mode, MODES)
        check_choice("temperature", temperature, TEMPERATURES)
        if not alpha >= 0:
            raise ValueError(f"step size α must be ≥ 0, got {alpha}")
        if not self.d_head <= d_new <= self.e_in:
            raise ValueError(f"d_new={d_new} must lie between the current d_head {self.d_head} and e′ = {self.e_in}")
        if self.method in BASELINES and mode != "append":
            raise ValueError(f"baseline {self.method!r} only appends columns; use mode='append'")
        grown = self._build(self.method, alpha, d_new, mode, temperature, generator)
        if alpha > 0 and self.method in DIRECTIONS and self.method != "gradient" and grown.predicted_decrease <= 0:
            grown = self._build("gradient", alpha, d_new, mode, temperature, generator)
            grown = dataclasses.replace(grown, fell_back=True)
        return grown

    def _build(self, method: str, alpha: float, d_new: int, mode: str, temperature: str, generator) -> Growth:
        d = self.d_head
        log_tau = self.log_tau + 0.5 * math.log(d / d_new) if temperature == "rescale" else self.log_tau
        tau = log_tau.exp()
        if mode == "replace":
            w_q, w_k, discarded, spectrum = self._replace(method, alpha, d_new, tau)
            carries = {"w_q": Carry(None), "w_k": Carry(None)}
        else:
            c = (d_new / d) ** 0.25 if temperature == "rescale" else 1.0  # (τ/τ′)^½
            if method in BASELINES:
                new_q, new_k, discarded, spectrum = self._random_pairs(method, d_new - d, c, generator)
            else:
                new_q, new_k, discarded, spectrum = self._append(method, alpha, d_new - d, tau)
            w_q, w_k = torch.cat([c * self.w_q, new_q], -1), torch.cat([c * self.w_k, new_k], -1)
            old = (slice(None), slice(None), slice(0, d))
            carries = {"w_q": Carry(old, 1 / c, 1 / c**2), "w_k": Carry(old, 1 / c, 1 / c**2)}
        carries["log_tau"] = Carry((slice(None),))
        return Growth(
            w_q=w_q.to(self.dtype),
            w_k=w_k.to(self.dtype),
            log_tau=log_tau.to(self.dtype),
            carries=carries,
            predicted_decrease=self._first_order(tau, w_q, w_k),
            discarded_energy=discarded,
            spectrum=spectrum,
            alpha=alpha,
            method=method,
        )

    def _first_order(self, tau: Tensor, w_q: Tensor, w_k: Tensor) -> float:
        """The predicted decrease −⟨N̄, M′ − M⟩, summed over heads, of the grown form M′_j = τ′_j W_Q,j′ W_K,g(j)′ᵀ: tau
        = τ′ (H,), w_q (H, e′, d′) and w_k (KV, e′, d′) are the grown form's whole weights in float64 (KV = H here),
        whatever the mode. The one meaning of this hook for every query/key growth, full or sketched (`GroupedGrowth`,
        `sketched.SketchedForm`): each computes ⟨N̄, ·⟩ from what its statistics hold."""
        m_new = tau[:, None, None] * w_q @ w_k.mT
        return -float((self.moments.n * (m_new - self.m)).sum())

    def _replaced_pairs(self, method: str, alpha: float) -> tuple[Tensor, Tensor, Tensor]:
        """SVD u (h, e′, k), s (h, k) descending, v (h, e′, k) of M + αΔM in the truncation's coordinates."""
        u, s, vh = torch.linalg.svd(self._to_work(self.m + alpha * self.direction(method)))
        return u, s, vh.mT

    def _replace(self, method: str, alpha: float, d_new: int, tau: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        u, s, v = self._replaced_pairs(method, alpha)
        kept = s[:, :d_new]
        live = kept > VANISH * s[:, :1]
        root = (kept * live / tau[:, None]).sqrt().unsqueeze(1)
        w_q, w_k = u[:, :, :d_new] * root, v[:, :, :d_new] * root
        if not live.all():
            # Vanishing pairs (trailing, as σ is sorted) take the bottleneck pairs in order, as zero fan-in.
            order = (torch.arange(d_new, device=s.device) - live.sum(-1, keepdim=True)).clamp_min(0)
            w_q = torch.where(live.unsqueeze(1), w_q, self._zero_fan_in(method, order, tau))
        discarded = s[:, d_new:].square().sum(-1) + (kept.square() * ~live).sum(-1)
        return self._cols(w_q, 1), self._cols(w_k, 1), discarded, kept * live

    def _append(self, method: str, alpha: float, p: int, tau: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        u, s, v, energy = self.bottleneck(method)
        sigma = s[:, :p]
        live = (sigma > VANISH * s[:, :1]) & (alpha > 0)
        root = (alpha * sigma * live / tau[:, None]).sqrt().unsqueeze(1)
        order = torch.arange(p, device=s.device).expand(self.n_head, p)
        new_q = torch.where(live.unsqueeze(1), u[:, :, :p] * root, self._zero_fan_in(method, order, tau))
        discarded = (alpha**2 * (energy - (sigma.square() * live).sum(-1))).clamp_min(0)
        return self._cols(new_q, 1), self._cols(v[:, :, :p] * root, 1), discarded, sigma

    def _zero_fan_in(self, method: str, order: Tensor, tau: Tensor) -> Tensor:
        """Q columns of the bottleneck pairs j = order (h, k) as zero fan-in (`zero_fan_in_columns`)."""
        return zero_fan_in_columns(*self.bottleneck(method)[:2], order, tau)

    def _random_pairs(self, method: str, p: int, c: float, generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Baselines: N(0, σ²) columns, σ the RMS of the head's (rescaled) old columns; `zero` has zero K columns."""
        h, e, _ = self.w_q.shape
        # Drawn on the generator's device, so that one CPU generator gives the same columns whatever the form's device.
        where = self.w_q.device if generator is None else generator.device

        def normal_like(w: Tensor) -> Tensor:
            noise = torch.randn(h, e, p, generator=generator, dtype=torch.float64, device=where).to(w.device)
            return noise * (c * w).square().mean((1, 2), keepdim=True).sqrt()

        new_q = normal_like(self.w_q)
        new_k = normal_like(self.w_k) if method == "random" else torch.zeros_like(new_q)
        return new_q, new_k, self.w_q.new_zeros(h), self.w_q.new_zeros(h, 0)

    def _to_work(self, a: Tensor) -> Tensor:
        return a if self._roots is None else self._roots[0] @ a @ self._roots[0]

    def _cols(self, w: Tensor, which: int) -> Tensor:
        """Columns into (which = 0) or out of (which = 1) the truncation's coordinates."""
        return w if self._roots is None else self._roots[which] @ w
