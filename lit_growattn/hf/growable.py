"""Growable attention for Hugging Face causal LMs: a subclass of the native attention class (so `isinstance`
checks and output capture still see it) with the same forward signature, still dispatching through
transformers' attention interface (docs/hf.md, "Conversion").

Per layer, with H query heads, KV key/value heads (GQA: query head j uses key head j // (H/KV)), input size
e′ (= hidden + 1 when q/k have a bias: the bias is the last row, as in `attention.qk`):
    w_q (H, e′, d), w_k (KV, e′, d), log_tau (H,),  d = rotary + nope,
columns laid out [rotary | NoPE]: the first `rotary` columns (the model's head_dim, or fewer after `keep_rotary`;
0 for GPT-2) get RoPE with the model's own cos/sin (inv_freq is never recomputed), growth appends NoPE columns,
which are one bilinear form of X′. Qwen3's q_norm/k_norm apply to the rotary part only, so appended columns leave
it exact. The temperature τ = exp(log_tau), initialised at the model's `scaling`, is folded into q; the interface
gets scaling = 1.
The value and output projections are taken into a `ValueMap` `value` (W_V (KV, e′, d_v) with the v bias as its last
row, W_O (H, d_v, e), the output bias apart; docs/value.md), whose width d_v grows independently of q/k's: values are
`value.values(x)` per KV head (what the KV cache stores), the interface attends them, `value.output` maps the heads
back. A state dict of the former layout (v_proj/o_proj, GPT-2's v_proj/c_proj modules) loads through its pre-hook.
Statistics capture (`capture` set, grad enabled) records G X′ per query head as `attention.qk` does (docs/design.md §4):
`extend` appends E = 0 (b, H, s, e′) to q and X′ to k (E.grad = G X′), `explicit` builds the score map and hooks
its gradient (cheaper on CPU; the callback's capture=auto picks it there). The value map's capture appends X′ to
the values, so the same attention call returns A·X′ per query head (`ValueMap.values`). With `sketch` set (here and
on the value map), both record the sketch's products instead, through k + l extra query/key columns after RoPE and
the norms, keys per KV head (`attention.sketch`, docs/design.md §12).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from lit_growattn.attention.qk import augment, causal_scores
from lit_growattn.attention.capture import extended_queries_keys, score_gradient_products
from lit_growattn.attention.value import ValueMap, from_linear
from lit_growattn.growth.form import FormShape
from lit_growattn.growth.sketch import TestMatrices
from lit_growattn.hf.surgery import generated_class, native_subclass, replace_attention

_CLASSES: dict[str, type[nn.Module]] = {}


@functools.lru_cache(maxsize=8)
def rotary_columns(width: int, rotary: int) -> Tensor:
    """Indices of the cos/sin (and q/k) columns of every (width/rotary)-th frequency pair of a rotary width `width`,
    laid out as `rotate_half` pairs them (column i with i + half): the RoPE of head_dim = rotary."""
    pairs = torch.arange(0, width // 2, width // rotary)
    return torch.cat([pairs, pairs + width // 2])


class GrowableAttention(FormShape, nn.Module):
    """Mixin placed before the native class; built with `from_native`, never with the native __init__."""

    rotary: int
    qk_bias: bool
    value: ValueMap
    # The value and output modules of the former layout (state dicts written before the value map): the keyword
    # arguments of `attention.value.rename_linear_keys`.
    former_value_modules: dict[str, str | bool]

    @staticmethod
    def from_native(native: nn.Module) -> GrowableAttention:
        """A growable copy of `native` (its norms shared, q/k copied into w_q, w_k, v/o into the value map)."""
        cls = growable_class(type(native))
        new = cls.__new__(cls)
        new.__dict__.update(native.__dict__)
        for key in ("_parameters", "_buffers", "_modules", "_load_state_dict_pre_hooks"):
            new.__dict__[key] = native.__dict__[key].copy()
        new._adopt()
        return new

    def _init_form(self, w_q: Tensor, w_k: Tensor, scaling: float, rotary: int, bias: bool, value: ValueMap) -> None:
        self.rotary, self.qk_bias = rotary, bias
        self.value = value  # a state dict of the former layout loads through its pre-hook
        self._register_load_state_dict_pre_hook(functools.partial(value.linear_keys_hook, **self.former_value_modules))
        self.w_q = nn.Parameter(w_q.detach().clone().contiguous())
        self.w_k = nn.Parameter(w_k.detach().clone().contiguous())
        self.log_tau = nn.Parameter(torch.full((w_q.shape[0],), float(scaling), dtype=w_q.dtype).log())
        self.capture: str | None = None
        self.sketch: TestMatrices | None = None
        self.captured: list[tuple[Tensor, ...]] = []

    @torch.no_grad()
    def set_weights(self, w_q: Tensor, w_k: Tensor, log_tau: Tensor) -> None:
        """Replaces the parameters (possibly with a new d_head); new Parameter objects, so optimizers must be rebuilt."""
        if (w_q.shape[:2] != self.w_q.shape[:2] or w_k.shape[:2] != self.w_k.shape[:2] or w_q.shape[-1] != w_k.shape[-1]
                or w_q.shape[-1] < self.rotary or log_tau.shape != self.log_tau.shape):
            raise ValueError(f"new Q/K shapes {tuple(w_q.shape)}/{tuple(w_k.shape)} do not fit {self.n_head} query heads, "
                             f"{self.n_kv_head} key heads, input size {self.w_q.shape[1]}, {self.rotary} rotary columns")
        like = self.w_q
        self.w_q = nn.Parameter(w_q.to(like.device, like.dtype).contiguous())
        self.w_k = nn.Parameter(w_k.to(like.device, like.dtype).contiguous())
        self.log_tau = nn.Parameter(log_tau.to(like.device, like.dtype).clone())

    def resize_to(self, state_dict, prefix: str) -> None:
        """Takes the head size of `state_dict[prefix + "w_q"]` (zero NoPE columns; loading then fills them)."""
        if (key := f"{prefix}w_q") in state_dict:
            self.resize(state_dict[key].shape[-1])

    def resize(self, d_head: int) -> None:
        """Resizes to d_head ≥ rotary, keeping the leading columns and appending zero NoPE columns."""
        if d_head != self.d_head:
            fit = lambda w: torch.cat([w[..., :d_head], w.new_zeros(*w.shape[:-1], max(0, d_head - w.shape[-1]))], -1)  # noqa: E731
            self.set_weights(fit(self.w_q), fit(self.w_k), self.log_tau)

    @torch.no_grad()
    def keep_rotary(self, rotary: int) -> None:
        """Keeps `rotary` of the rotary columns (even, dividing the current count): every (current/rotary)-th frequency
        pair, i.e. the RoPE a model of head_dim = rotary has; the NoPE columns after them stay. For training from a
        small query/key width while the value width stays head_dim (not exact: the other rotary columns are dropped)."""
        if hasattr(self, "q_norm") or not self.rotary:
            why = (f"its q_norm/k_norm normalise all {self.rotary} rotary columns of a head together, and fewer "
                   "columns would change what they compute" if self.rotary else "it has no rotary position embeddings")
            raise ValueError(f"rotary_dim is refused for {self.config.model_type} models ({why}): set it to null "
                             "(--model.init_args.rotary_dim=null). It applies to llama, mistral and qwen2")
        if rotary <= 0 or rotary % 2 or self.rotary % rotary:
            raise ValueError(f"rotary_dim={rotary} must be even and divide the {self.rotary} rotary columns of a head")
        keep = rotary_columns(self.rotary, rotary).to(self.w_q.device)
        w_q, w_k = (torch.cat([w[..., keep], w[..., self.rotary:]], -1) for w in (self.w_q, self.w_k))
        self.rotary = rotary
        self.set_weights(w_q, w_k, self.log_tau)

    def bias_row_parameters(self) -> list[nn.Parameter]:
        return [self.w_q, self.w_k] if self.qk_bias else []

    def _record(self, xa: Tensor, *grads: Tensor) -> None:
        self.captured.append((xa, *(g.detach().to(xa.dtype) for g in grads)))

    def take_captured(self) -> list[tuple[Tensor, ...]]:
        """The (X′, G X′) pairs recorded since the last call, G X′ (b, H, s, e′); with `sketch` set, the
        (X′, G X′Ω (b, H, s, k), Σ_{j∈g} G_jᵀX′Ψ_j (b, KV, s, l)) triples of `growth.SketchFormStats.update`."""
        out, self.captured = self.captured, []
        return out

    # -- forward pieces --------------------------------------------------------------------------------
    def project(self, x: Tensor, w: Tensor) -> Tensor:
        """x (b, s, e) through per-head columns w (heads, e′, d) → (b, heads, s, d): one matmul, as the native Linear."""
        heads, e_in, d = w.shape
        flat = w.to(x.dtype).transpose(0, 1).reshape(e_in, heads * d)  # (e′, heads·d), the bias as its last row
        out = x @ flat[: x.shape[-1]] + flat[-1] if self.qk_bias else x @ flat
        return out.view(*x.shape[:-1], heads, d).transpose(1, 2)

    def queries_keys(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """x (b, s, e) → (τ·q (b, H, s, d), k (b, KV, s, d)), RoPE (and Qwen3's norms) on the first `rotary` columns."""
        q, k = self.project(x, self.w_q), self.project(x, self.w_k)
        if r := self.rotary:
            q_rot, k_rot = (q, k) if self.d_head == r else (q[..., :r], k[..., :r])
            if hasattr(self, "q_norm"):
                q_rot, k_rot = self.q_norm(q_rot), self.k_norm(k_rot)
            cos, sin = position_embeddings
            if cos.shape[-1] != r:  # fewer rotary columns than the model's head_dim (keep_rotary)
                keep = rotary_columns(cos.shape[-1], r).to(cos.device)
                cos, sin = cos[..., keep], sin[..., keep]
            q_rot, k_rot = self.apply_rotary(q_rot, k_rot, cos, sin)
            q, k = (q_rot, k_rot) if self.d_head == r else (torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1))
        return q * self.tau.to(q.dtype)[:, None, None], k

    def attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, attention_mask, dropout: float, **kwargs):
        """Through the configured attention interface with scaling 1; with statistics capture on, the queries'
        zero-extension (`extend`) or an explicit score map whose gradient is recorded (`explicit`), docs/design.md §4."""
        capturing = self.capture is not None and torch.is_grad_enabled()
        if (capturing or self.value.capturing()) and k.shape[2] != x.shape[1]:
            raise RuntimeError("statistics capture needs a forward without a KV cache (use_cache=False)")
        if capturing and self.capture == "explicit":
            return self._attend_explicit(augment(x, self.qk_bias).detach(), q, k, v, attention_mask, dropout)
        if capturing:
            kept = augment(x, self.qk_bias).detach()
            q, k = extended_queries_keys(self.sketch, kept, q, k, lambda *grads: self._record(kept, *grads))
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.eager_attention)
        return interface(self, q, k, v, attention_mask, dropout=dropout, scaling=1.0, **kwargs)

    def _attend_explicit(self, xa: Tensor, q: Tensor, k: Tensor, v: Tensor, attention_mask, dropout: float):
        """softmax(q·kᵀ + mask)·v with the score map's gradient G recorded as G·X′ (with `sketch`: as G X′Ω and
        Σ_{j∈g} G_jᵀX′Ψ_j); returns (b, s, H, v's width), None."""
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        if attention_mask is None:  # sdpa's is_causal path: the model passed no mask
            scores = causal_scores(q, k)
        elif attention_mask.dtype == torch.bool:  # True: attend
            scores = (q @ k.transpose(-1, -2)).masked_fill(~attention_mask, float("-inf"))
        else:  # additive
            scores = q @ k.transpose(-1, -2) + attention_mask
        sketch = self.sketch
        scores.register_hook(lambda grad: self._record(xa, *score_gradient_products(sketch, xa, grad, self.n_kv_head)))
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        weights = nn.functional.dropout(weights, p=dropout, training=self.training)
        return (weights @ v).transpose(1, 2), None


class GrowableRopeAttention(GrowableAttention):
    """Llama, Mistral, Qwen2, Qwen3: separate q/k/v projections, RoPE, GQA."""

    former_value_modules = {"v": "v_proj", "o": "o_proj"}

    def _adopt(self) -> None:
        hd, e = self.head_dim, self.q_proj.in_features
        bias = self.q_proj.bias is not None
        if (self.k_proj.bias is not None) != bias:
            raise ValueError("q_proj and k_proj must both have a bias or neither")

        def per_head(linear: nn.Linear) -> Tensor:
            w = linear.weight.detach().T.reshape(e, -1, hd).transpose(0, 1)  # (heads, e, hd)
            return torch.cat([w, linear.bias.detach().reshape(-1, 1, hd)], 1) if bias else w

        v, o = self.v_proj, self.o_proj
        w_v, w_o, o_bias = from_linear(v.weight, v.bias, o.weight, o.bias, v.out_features // hd, o.in_features // hd)
        value = ValueMap.of(w_v, w_o, o_bias, v.bias is not None)
        self._init_form(per_head(self.q_proj), per_head(self.k_proj), self.scaling, hd, bias, value)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | None = None,
                attention_mask: Tensor | None = None, past_key_values=None, **kwargs) -> tuple[Tensor, Tensor | None]:
        q, k = self.queries_keys(hidden_states, position_embeddings)
        v = self.value.values(hidden_states)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        window = self.sliding_window if hasattr(self, "sliding_window") else getattr(self.config, "sliding_window", None)
        out, weights = self.attend(hidden_states, q, k, v, attention_mask, 0.0 if not self.training else self.attention_dropout,
                                   sliding_window=window, **kwargs)
        return self.value.output(out.transpose(1, 2)), weights


class GrowableFusedQKVAttention(GrowableAttention):
    """GPT-2: fused c_attn split into w_q, w_k (with the bias row) and the value map's W_V (with the v bias), c_proj
    into its W_O and output bias; no RoPE. (The former layout kept the value part as a Linear `v_proj`.) Not named
    GrowableGPT2Attention: that is the name of the class generated over GPT2Attention, which pickling looks up in this
    module by name (`generated_class`)."""

    former_value_modules = {"v": "v_proj", "o": "c_proj", "conv1d_o": True}

    def _adopt(self) -> None:
        if self.is_cross_attention:
            raise ValueError("GPT-2 cross-attention is not supported; only causal self-attention grows")
        e, hd, h = self.embed_dim, self.head_dim, self.num_heads
        w, b = self.c_attn.weight.detach(), self.c_attn.bias.detach()  # Conv1D: (e, 3e), (3e,)
        per_head = lambda i: torch.cat([w[:, i * e:(i + 1) * e], b[None, i * e:(i + 1) * e]]).reshape(e + 1, h, hd).transpose(0, 1)  # noqa: E731
        o = self.c_proj  # Conv1D: weight (h·hd, e), a Linear's transposed
        w_v, w_o, o_bias = from_linear(w[:, 2 * e:].T, b[2 * e:], o.weight.T, o.bias, h, h)
        self._init_form(per_head(0), per_head(1), self.scaling, 0, True, ValueMap.of(w_v, w_o, o_bias, True))
        del self.c_attn, self.c_proj

    def forward(self, hidden_states: Tensor, past_key_values=None, attention_mask: Tensor | None = None,
                encoder_hidden_states: Tensor | None = None, encoder_attention_mask: Tensor | None = None,
                output_attentions: bool | None = False, **kwargs) -> tuple[Tensor, Tensor | None]:
        if encoder_hidden_states is not None:
            raise ValueError("growable GPT-2 attention is causal self-attention only")
        q, k = self.queries_keys(hidden_states, None)
        v = self.value.values(hidden_states)
        if past_key_values is not None:
            cache = getattr(past_key_values, "self_attention_cache", past_key_values)
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = self.attend(hidden_states, q, k, v, attention_mask, self.attn_dropout.p if self.training else 0.0, **kwargs)
        return self.resid_dropout(self.value.output(out.transpose(1, 2))), weights


def named_growables(module: nn.Module) -> list[tuple[str, GrowableAttention]]:
    """(qualified name, module) of every growable attention in `module` (a model or one of its layers), in order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, GrowableAttention)]


def make_growable(model: nn.Module, config=None) -> list[str]:
    """Converts the attention of a llama/mistral/qwen2/qwen3/gpt2 model (or of a decoder layer of the model of
    `config`) in place; returns the converted names."""
    return replace_attention(model, GrowableAttention.from_native, config)


def growable_class(native: type[nn.Module]) -> type[GrowableAttention]:
    """The growable subclass of a native attention class (created once, importable from this module by name)."""
    base = GrowableFusedQKVAttention if native.__name__ == "GPT2Attention" else GrowableRopeAttention
    return native_subclass(_CLASSES, "Growable", base, native, __name__)


def __getattr__(name: str):
    return generated_class(name, "Growable", growable_class)
