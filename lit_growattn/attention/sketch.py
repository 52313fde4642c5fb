"""Sketch capture: the attention columns that give a statistics step the sketched sums (`growth.sketch`) instead of
the full ones, shared by `qk.QKForm`, `value.ValueMap` and the Hugging Face `hf.growable.GrowableAttention`.

A unit captures a sketch when its `sketch` attribute holds the `growth.sketch.TestMatrices` of its sums (set by the
statistics window for a statistics step, with `capture`), and `take_captured` then returns the positional arguments of
`SketchFormStats.update` / `SketchValueStats.update`. Nothing of width e′ per head is formed: the attention call is
widened by k + l columns on the query/key side and k + l + k_c + g·k_c on the value side (docs/design.md §12).

Query/key side (test matrices Ω (e′, k), Ψ_j (e′, l) per query head; X′ detached, G_j = ∂L/∂S_j):
- `extend`: Q̃_j = [τQ_j | E_Y,j | X′Ψ_j], K̃_g = [K_g | X′Ω | E_W,g] with E_Y (b, H, s, k), E_W (b, KV, s, l) zero
  leaves; the extra score terms E_Y,j(X′Ω)ᵀ + (X′Ψ_j)E_W,gᵀ are zero, and backward gives E_Y,j.grad = G_j X′Ω and
  E_W,g.grad = Σ_{j∈g} G_jᵀX′Ψ_j (the GQA repeat of the keys sums the group), whatever the mask.
- `explicit`: from the hooked score gradient G, G(X′Ω) and Σ_{j∈g} Gᵀ(X′Ψ_j) directly (`explicit_products`).

Value side (Ω_j (e, k) per query head, Ψ (e′, l), Ω_c (e′, k_c); `ValueSketchCall`): the values of each KV head are
widened to Ṽ_g = [V_g | E_V | X′Ψ | X′Ω_c | E_C] (E_V (k), E_C (g·k_c) zero leaves), so head j's output is
[A_jV | A_jE_V | A_jX′Ψ | A_jX′Ω_c | A_jE_C]. The output then adds Σ_j (A_jE_V)Ω_jᵀ (zero; E_V.grad =
Σ_{j∈g} A_jᵀG_YΩ_j), keeps A_jX′Ψ, and hands A_jE_C the fixed cotangent A_jX′Ω_c in the block of head j's place i in its group (`Inject`), so
block i of E_C.grad is A_jᵀA_jX′Ω_c: C_V,jΩ_c per head, not borne by the loss's gradient (a GradScaler does not
scale it). Every linear combination of attention maps between `values` and `output` (DINT's) is one map A_j here.

The zero leaves E receive their gradients from `loss.backward()`, as training calls it (`torch.autograd.grad` of chosen
inputs does not reach them, as it does not reach the full `extend` capture's E).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from lit_growattn.growth.sketch import TestMatrices


def matrix_like(sketch: TestMatrices, name: str, like: Tensor) -> Tensor:
    """The test matrix `name` in `like`'s dtype and on its device."""
    return sketch[name].to(device=like.device, dtype=like.dtype)


class Gather:
    """Collects the gradients of one captured call as they arrive in backward (in any order); once every slot holds
    one, hands them to `done` in slot order and starts over (a second backward through the same graph records again)."""

    def __init__(self, slots: int, done: Callable[..., None]):
        self.grads: list[Tensor | None] = [None] * slots
        self.done = done

    def slot(self, i: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            self.grads[i] = grad.detach()
            if all(g is not None for g in self.grads):
                grads, self.grads = self.grads, [None] * len(self.grads)
                self.done(*grads)
        return hook


class Inject(torch.autograd.Function):
    """z ↦ a zero scalar, whose backward hands z the fixed cotangent `cot` whatever comes from above: added to a layer's
    output it changes nothing, and with z = A·E (E zero value columns) E.grad = Aᵀcot."""

    @staticmethod
    def forward(ctx, z: Tensor, cot: Tensor) -> Tensor:
        ctx.save_for_backward(cot)
        return z.new_zeros(())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (cot,) = ctx.saved_tensors
        return cot, None


def extend_queries_keys(sketch: TestMatrices, xa: Tensor, q: Tensor, k: Tensor,
                        record: Callable[[Tensor, Tensor], None]) -> tuple[Tensor, Tensor]:
    """Q̃ = [q | E_Y | X′Ψ_j] (b, H, s, d + k + l) and K̃ = [k | X′Ω | E_W] (b, KV, s, d + k + l) from q (b, H, s, d),
    k (b, KV, s, d) and the detached X′ (b, s, e′); `record(E_Y.grad, E_W.grad)` once backward has given both:
    G_j X′Ω (b, H, s, k) and Σ_{j∈g} G_jᵀX′Ψ_j (b, KV, s, l)."""
    (b, h, s, _), kv = q.shape, k.shape[1]
    omega, psi = matrix_like(sketch, "omega", xa), matrix_like(sketch, "psi", xa)
    x_omega = (xa @ omega).to(k.dtype).unsqueeze(1).expand(b, kv, s, omega.shape[-1])
    x_psi = torch.einsum("bse,hel->bhsl", xa, psi).to(q.dtype)
    e_y = q.new_zeros(b, h, s, omega.shape[-1], requires_grad=True)
    e_w = k.new_zeros(b, kv, s, psi.shape[-1], requires_grad=True)
    gather = Gather(2, record)
    e_y.register_hook(gather.slot(0))
    e_w.register_hook(gather.slot(1))
    return torch.cat([q, e_y, x_psi], -1), torch.cat([k, x_omega, e_w], -1)


def explicit_products(sketch: TestMatrices, xa: Tensor, grad: Tensor, n_kv_head: int) -> tuple[Tensor, Tensor]:
    """From the score gradient G (b, H, s, s) and the detached X′ (b, s, e′): G_j(X′Ω) (b, H, s, k) and
    Σ_{j∈g} G_jᵀ(X′Ψ_j) (b, KV, s, l), in X′'s dtype (two s×s-by-thin products instead of G X′)."""
    g = grad.to(xa.dtype)
    omega, psi = matrix_like(sketch, "omega", xa), matrix_like(sketch, "psi", xa)
    g_omega = g @ (xa @ omega).unsqueeze(1)
    gt_psi = g.mT @ torch.einsum("bse,hel->bhsl", xa, psi)
    b, h, s, l = gt_psi.shape
    return g_omega, gt_psi.view(b, n_kv_head, h // n_kv_head, s, l).sum(2)


class ValueSketchCall:
    """One attention call of a value map capturing its sketch: `widened` are the values to attend, `output` finishes
    the layer's output from the attended widened values and records, once backward has reached E_V, E_C and the output,
    (X′, E_V.grad, A_jX′Ψ, G_Y, E_C.grad per query head) through `record`: `SketchValueStats.update`'s arguments."""

    def __init__(self, sketch: TestMatrices, xa: Tensor, v: Tensor, n_head: int,
                 record: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]):
        b, kv, s, self.d_v = v.shape
        self.sketch, self.xa, self.n_head, self.group, self.record = sketch, xa, n_head, n_head // kv, record
        psi, omega_c = matrix_like(sketch, "psi", xa), matrix_like(sketch, "omega_c", xa)
        self.k, self.l, self.k_c = sketch["omega"].shape[-1], psi.shape[-1], omega_c.shape[-1]
        self.e_v = v.new_zeros(b, kv, s, self.k, requires_grad=True)
        self.e_c = v.new_zeros(b, kv, s, self.group * self.k_c, requires_grad=True)
        x_cols = torch.cat([xa @ psi, xa @ omega_c], -1).to(v.dtype).unsqueeze(1).expand(b, kv, s, self.l + self.k_c)
        self.widened = torch.cat([v, self.e_v, x_cols, self.e_c], -1)
        self.gather = Gather(3, self._record)
        self.a_xpsi: Tensor | None = None

    @property
    def width(self) -> int:
        """The widened values' width: d_v + k + l + k_c + g·k_c."""
        return self.widened.shape[-1]

    def output(self, y: Tensor, out: Tensor) -> Tensor:
        """The layer's output from `out` (the output of y's first d_v columns) and the attended widened values y
        (b, H, s, width): out + Σ_j (A_jE_V)Ω_jᵀ + Inject(A_jE_C), equal to `out`."""
        o_e, o_psi, o_c, o_ec = y[..., self.d_v:].split([self.k, self.l, self.k_c, self.group * self.k_c], -1)
        self.a_xpsi = o_psi.detach()
        out = out + torch.einsum("bhsk,hek->bse", o_e, matrix_like(self.sketch, "omega", out))
        # Head j, the i-th of its group, gets its A_jX′Ω_c in block i of the g blocks of E_C's output, 0 elsewhere.
        place = torch.arange(self.n_head, device=y.device) % self.group
        blocks = torch.nn.functional.one_hot(place, self.group).to(o_c.dtype)  # (H, g)
        cot = (o_c.detach().unsqueeze(-2) * blocks[:, None, :, None]).flatten(-2)
        out = out + Inject.apply(o_ec, cot)
        if out.requires_grad:
            out.register_hook(self.gather.slot(2))
            self.e_v.register_hook(self.gather.slot(0))
            self.e_c.register_hook(self.gather.slot(1))
        return out

    def _record(self, e_v_grad: Tensor, e_c_grad: Tensor, g_y: Tensor) -> None:
        x = self.xa
        b, kv, s, _ = e_c_grad.shape
        per_head = e_c_grad.view(b, kv, s, self.group, self.k_c).transpose(2, 3).reshape(b, self.n_head, s, self.k_c)
        self.record(x, e_v_grad.to(x.dtype), self.a_xpsi.to(x.dtype), g_y.to(x.dtype), per_head.to(x.dtype))
