"""A query/key form's weights, the one type of them: W_Q (n_head, e′, d_head), W_K (n_kv_head, e′, d_head) and
log τ (n_head,) (shapes: `lit_growattn.contract`).

FormShape reads head counts and sizes off the three tensors, so they follow every growth: the attention modules
(parameters), the growths' float64 copies and FormWeights (values) all take it. FormWeights is a form's weights as
values: a candidate to rate or a growth to install (`factorize.Growth` is one, with what it carries besides).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_growattn.growth.sketch import SketchFormStats, SketchSize, TestMatrices
from lit_growattn.growth.stats import FormStats
from lit_growattn.growth.unit import GrowableUnit


class FormShape(GrowableUnit):
    """Head counts, input size, head size and temperature read off w_q, w_k and log_tau; the query/key side of a
    `GrowableUnit`."""

    side = "d_head"
    w_q: Tensor
    w_k: Tensor
    log_tau: Tensor

    @property
    def n_head(self) -> int:
        return self.w_q.shape[0]

    @property
    def n_kv_head(self) -> int:
        return self.w_k.shape[0]

    @property
    def e_in(self) -> int:
        return self.w_q.shape[1]

    @property
    def d_head(self) -> int:
        return self.w_q.shape[-1]

    @property
    def width(self) -> int:
        """What a growth widens: d_head."""
        return self.d_head

    @property
    def max_width(self) -> int:
        """The largest useful head size: M (e′, e′) has rank ≤ e′."""
        return self.e_in

    @property
    def tau(self) -> Tensor:
        return self.log_tau.exp()

    @property
    def leading_tensor(self) -> Tensor:
        return self.w_q

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(FormWeights))

    def held_weights(self) -> FormWeights:
        return FormWeights.of(self)

    def empty_sums(self, method: str, dtype: torch.dtype = torch.float32, sketch: SketchSize | None = None,
                   seed: int = 0, tests: TestMatrices | None = None) -> FormStats | SketchFormStats:
        if sketch is None:
            return FormStats.empty_like(self, method, dtype=dtype)
        return SketchFormStats.empty_like(self, sketch, seed, dtype=dtype, tests=tests)

    def sums_numel(self, method: str, sketch: SketchSize | None = None) -> int:
        """C̄ (e′²) and N (h·e′²), and C⁺NC⁺ (h·e′²) for pinv; sketched, C̄ and the range and co-range sketches
        (h·e′·k + kv·e′·l)."""
        if sketch is not None:
            return self.e_in * (self.e_in + self.n_head * sketch.k + self.n_kv_head * sketch.l)
        return self.e_in * self.e_in * (1 + self.n_head * (2 if method == "pinv" else 1))

    def tests_numel(self, sketch: SketchSize | None) -> int:
        """Ω (e′·k) and the Ψ_j (h·e′·l) a sketch draws beside its sums; none without one."""
        if sketch is None:
            return 0
        return sum(math.prod(shape) for shape in SketchFormStats.test_shapes(self.n_head, self.e_in, sketch).values())


@dataclass
class FormWeights(FormShape):
    w_q: Tensor
    w_k: Tensor
    log_tau: Tensor

    @classmethod
    def of(cls, form: FormShape) -> FormWeights:
        """The weights a form holds now (the same tensors, not copies)."""
        return cls(form.w_q, form.w_k, form.log_tau)

    def install(self, form) -> None:
        """Puts these weights in `form` (anything with `set_weights(w_q, w_k, log_tau)`, as the contract asks)."""
        form.set_weights(self.w_q, self.w_k, self.log_tau)

