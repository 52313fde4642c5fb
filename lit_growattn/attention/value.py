"""The value side of an attention layer, stored per head so that value growth can widen it (docs/value.md).

W_V (n_kv_head, e′, d_v), the v bias as the last row along e′ (X′ = [X | 1], as `qk.QKForm` stores its bias);
W_O (n_head, d_v, e); one output bias (e,) shared by the heads, not part of any head's W_M = W_V W_O. The two biases
are independent (Qwen2 has a v bias and no output bias): the project's GPT has both or neither. Query head j
reads value head j // (n_head // n_kv_head). New columns append along d_v: the last dim of W_V, the middle one of
W_O, so that the optimizer's moments carry over by slices.

A layer computes y = its attention applied to `values(x)`, then `output(y)`; any combination of attention maps that
is linear in the values fits between the two. Statistics capture (`capture` set, grad enabled) widens the values to
[V | X′] with X′ detached, so that the same attention call also returns P = A·X′ per head, and hooks the gradient
G_Y = ∂L/∂Y of the output: `take_captured` returns the (P, G_Y) pairs of the value statistics. With `sketch` set as
well (the statistics window's `growth.sketch.TestMatrices`), the values are widened by the sketch's k + l + k_c + g·k_c
columns instead of e′ and `take_captured` returns `growth.SketchValueStats.update`'s arguments (`attention.sketch`).

Checkpoints written while V and O were nn.Linear modules `v` and `o` still load: `attach` registers a
load-state-dict pre-hook on the owning attention module that rewrites their keys into these tensors, exactly
(`linear_keys_hook`; Hugging Face attention names them v_proj/o_proj, GPT-2's output is a Conv1D c_proj).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_growattn.attention.qk import augment
from lit_growattn.attention.sketch import ValueSketchCall
from lit_growattn.growth.sketch import TestMatrices
from lit_growattn.growth.value import ValueShape


class ValueMap(ValueShape, nn.Module):
    """Satisfies `lit_growattn.contract.GrowableValues`."""

    def __init__(self, n_embd: int, n_head: int, d_v: int, bias: bool = False, n_kv_head: int | None = None):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_head % n_kv_head or d_v <= 0:
            raise ValueError(f"need d_v > 0 and n_head divisible by n_kv_head, got d_v={d_v}, n_head={n_head}, "
                             f"n_kv_head={n_kv_head}")
        # nn.Linear's modules and init, drawn in their order: a seed gives the weights it gave before this layout.
        v, o = nn.Linear(n_embd, n_kv_head * d_v, bias=bias), nn.Linear(n_head * d_v, n_embd, bias=bias)
        self._hold(*from_linear(v.weight, v.bias, o.weight, o.bias, n_kv_head, n_head), bias)

    @classmethod
    def of(cls, w_v: Tensor, w_o: Tensor, o_bias: Tensor | None, bias: bool) -> ValueMap:
        """A map holding copies of these tensors (no init drawn), `bias`: w_v's last row is the v bias."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._hold(w_v.detach().clone(), w_o.detach().clone(), None if o_bias is None else o_bias.detach().clone(), bias)
        return new

    def _hold(self, w_v: Tensor, w_o: Tensor, o_bias: Tensor | None, bias: bool) -> None:
        self.bias = bias
        self.w_v, self.w_o = nn.Parameter(w_v.contiguous()), nn.Parameter(w_o.contiguous())
        self.o_bias = None if o_bias is None else nn.Parameter(o_bias)
        self.capture: Any = None
        self.sketch: TestMatrices | None = None
        self.captured: list[tuple[Tensor, ...]] = []
        self._sketch_call: ValueSketchCall | None = None  # from `values` to `output` while capturing a sketch

    def bias_row_parameters(self) -> list[nn.Parameter]:
        return [self.w_v] if self.bias else []

    def matrix(self) -> Tensor:
        """W_M (n_head, e′, e) per query head."""
        return self.w_v.repeat_interleave(self.n_head // self.n_kv_head, 0) @ self.w_o

    def capturing(self) -> bool:
        return bool(self.capture) and torch.is_grad_enabled()

    def values(self, x: Tensor) -> Tensor:
        """x (b, s, e) → V (b, n_kv_head, s, d_v); [V | X′] (width d_v + e′) while capturing; with `sketch` set,
        [V | E_V | X′Ψ | X′Ω_c | E_C] (width d_v + k + l + k_c + g·k_c, `attention.sketch.ValueSketchCall`)."""
        b, s, e = x.shape
        flat = self.w_v.transpose(0, 1).reshape(self.e_in, -1)  # (e′, kv·d_v), the bias as its last row
        v = F.linear(x, flat[:e].T, flat[-1] if self.bias else None)
        v = v.view(b, s, self.n_kv_head, self.d_v).transpose(1, 2)
        if not self.capturing():
            return v
        self._sketch_call = None
        if self.sketch is not None:
            xa = augment(x, self.bias).detach()
            self._sketch_call = ValueSketchCall(self.sketch, xa, v, self.n_head, self._record)
            return self._sketch_call.widened
        xa = augment(x, self.bias).detach().to(v.dtype)
        return torch.cat([v, xa.unsqueeze(1).expand(b, self.n_kv_head, s, self.e_in)], -1)

    def output(self, y: Tensor) -> Tensor:
        """y (b, n_head, s, d_v) → Y (b, s, e); while capturing y also holds A·X′ after its d_v columns (with `sketch`,
        the attended sketch columns of `values`)."""
        b, h, s, width = y.shape
        p = y[..., self.d_v:] if width > self.d_v else None
        flat = y[..., : self.d_v].transpose(1, 2).reshape(b, s, h * self.d_v)
        out = F.linear(flat, self.w_o.reshape(h * self.d_v, -1).T, self.o_bias)
        if p is not None and self._sketch_call is not None:
            call, self._sketch_call = self._sketch_call, None
            if width != call.width:
                raise ValueError(f"attended values of width {width}, and the sketch capture widened them to "
                                 f"{call.width}")
            return call.output(y, out)
        if p is not None and out.requires_grad:
            kept = p.detach()
            out.register_hook(lambda grad: self.captured.append((kept, grad.detach().to(kept.dtype))))
        return out

    def _record(self, *captured: Tensor) -> None:
        self.captured.append(captured)

    def take_captured(self) -> list[tuple[Tensor, ...]]:
        """The (P = A·X′ (b, n_head, s, e′), G_Y (b, s, e)) pairs recorded since the last call; with `sketch` set, the
        (X′, E_V.grad, A_jX′Ψ, G_Y, E_C.grad) of `growth.SketchValueStats.update` (shapes in its docstring)."""
        out, self.captured = self.captured, []
        return out

    @torch.no_grad()
    def set_weights(self, w_v: Tensor, w_o: Tensor) -> None:
        """Replaces W_V and W_O (possibly with a new d_v); new Parameter objects, so optimizers must be rebuilt."""
        if w_v.shape[:2] != self.w_v.shape[:2] or (w_o.shape[0], w_o.shape[2]) != (self.n_head, self.e_out) or (
                w_v.shape[2] != w_o.shape[1]):
            raise ValueError(f"new V/O shapes {tuple(w_v.shape)}/{tuple(w_o.shape)} do not fit {self.n_kv_head} value "
                             f"heads, {self.n_head} query heads, input size {self.e_in}, output size {self.e_out}")
        like = self.w_v
        self.w_v = nn.Parameter(w_v.to(like.device, like.dtype).contiguous())
        self.w_o = nn.Parameter(w_o.to(like.device, like.dtype).contiguous())

    def resize_to(self, state_dict: Mapping[str, Tensor], prefix: str) -> None:
        """Takes the value head size of `state_dict[prefix + "w_v"]`, with placeholder values (before loading a grown
        checkpoint)."""
        if (key := f"{prefix}w_v") in state_dict:
            self.resize(state_dict[key].shape[-1])

    def resize(self, d_v: int) -> None:
        """Resizes to d_v, keeping the leading value columns and appending zero ones (placeholders for loading)."""
        if d_v != self.d_v:
            keep = min(d_v, self.d_v)
            w_v = torch.cat([self.w_v[..., :keep], self.w_v.new_zeros(*self.w_v.shape[:2], d_v - keep)], -1)
            w_o = torch.cat([self.w_o[:, :keep], self.w_o.new_zeros(self.n_head, d_v - keep, self.e_out)], 1)
            self.set_weights(w_v, w_o)

    def linear_keys_hook(self, state_dict: dict[str, Tensor], prefix: str, *_, v: str = "v", o: str = "o",
                         conv1d_o: bool = False) -> None:
        """Load-state-dict pre-hook of the owning attention module (`prefix` is its own): rewrites the keys of the
        former value and output modules, nn.Linear `v` and `o` (or the names given; `conv1d_o`: the output is a
        transformers Conv1D, whose weight is a Linear's transposed), into this map's tensors."""
        rename_linear_keys(state_dict, prefix, self.n_kv_head, self.n_head, v, o, conv1d_o)


def rename_linear_keys(state_dict: dict[str, Tensor], prefix: str, n_kv_head: int, n_head: int, v: str, o: str,
                       conv1d_o: bool = False) -> None:
    """Rewrites, in place, the keys of the value and output modules `prefix + v`, `prefix + o` (nn.Linear, or `o` a
    transformers Conv1D) into a value map's `prefix + "value.w_v"`, `"value.w_o"`, `"value.o_bias"`; exact."""
    old = {f"{side}.{name}": state_dict.pop(f"{prefix}{module}.{name}", None)
           for side, module in (("v", v), ("o", o)) for name in ("weight", "bias")}
    if old["v.weight"] is None:
        return
    o_weight = old["o.weight"].T if conv1d_o else old["o.weight"]
    w_v, w_o, o_bias = from_linear(old["v.weight"], old["v.bias"], o_weight, old["o.bias"], n_kv_head, n_head)
    state_dict |= {f"{prefix}value.w_v": w_v, f"{prefix}value.w_o": w_o}
    if o_bias is not None:
        state_dict[f"{prefix}value.o_bias"] = o_bias


def to_linear(values: ValueMap) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """The inverse of `from_linear`: v's nn.Linear weight (kv·d_v, e) and bias, o's weight (e, h·d_v) and bias."""
    e = values.e_in - values.bias
    v_weight = values.w_v[:, :e].transpose(1, 2).reshape(-1, e)
    v_bias = values.w_v[:, -1].reshape(-1) if values.bias else None
    o_weight = values.w_o.reshape(-1, values.e_out).T
    return v_weight.detach(), v_bias.detach() if v_bias is not None else None, o_weight.detach(), (
        None if values.o_bias is None else values.o_bias.detach())


def from_linear(v_weight: Tensor, v_bias: Tensor | None, o_weight: Tensor, o_bias: Tensor | None, n_kv_head: int,
                n_head: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """W_V (kv, e′, d_v), W_O (h, d_v, e), the output bias, from nn.Linear tensors: v (kv·d_v, e) and its bias,
    o (e, h·d_v) and its bias. Exact: the same numbers, rearranged."""
    d_v, e = v_weight.shape[0] // n_kv_head, v_weight.shape[1]
    w_v = v_weight.detach().reshape(n_kv_head, d_v, e).transpose(1, 2)
    if v_bias is not None:
        w_v = torch.cat([w_v, v_bias.detach().reshape(n_kv_head, 1, d_v)], 1)
    w_o = o_weight.detach().T.reshape(n_head, d_v, e)
    return w_v.contiguous(), w_o.contiguous(), None if o_bias is None else o_bias.detach().clone()


def attach(owner: nn.Module, n_embd: int, n_head: int, d_v: int, bias: bool) -> ValueMap:
    """Gives the attention module `owner` its value map as `owner.value`, and the pre-hook that loads checkpoints
    written with `v` and `o` nn.Linear modules."""
    owner.value = ValueMap(n_embd, n_head, d_v, bias)
    owner._register_load_state_dict_pre_hook(owner.value.linear_keys_hook)
    return owner.value
