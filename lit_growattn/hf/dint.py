"""DINT and low-rank DINT attention for Llama-family Hugging Face models (seed 001; docs/seed001.md), and the
registered DINT model types that are built with it.

Per layer, with H query heads, KV key/value heads and head size d (GQA: query head j uses key head j // (H/KV)):

    y = A1·V + λ·(A3·V − A2·V),   A1 = softmax(Q1 K1ᵀ/√d),  A2 = softmax(Q2 K2ᵀ/√d₂),  A3·V = running mean of A1·V

- Q1, K1, V, O and the model's norms are the native module's own (unchanged), so at λ = 0 the output is the
  native one. λ (H,) is a free parameter that starts at exactly 0: ∂L/∂λ = ⟨∂L/∂y, (A3 − A2)·V⟩ is not zero,
  so it moves at the first step, and the second map starts learning once it has.
- The second map: `full` Q2 = X W_Q2 (H, e, d), K2 = X W_K2 (KV, e, d), or `lowrank` Q2 = X D_q U_q with
  D (·, e, r), U (·, r, d); every factor U(−1/√fan_in, 1/√fan_in) (nn.Linear's init). Q2 and K2 get RoPE like
  Q1 and K1, K2 one per key/value head; for Qwen3 they pass through RMSNorms of their own (weight 1 when built),
  as Q1 and K1 pass through q_norm and k_norm.
- d₂ = d · d2_ratio. `d2_ratio_for_init` derives it from the init above: a low-rank product has 1/3 of a full
  map's variance, each of Q2 and K2 loses that, the scores 1/9, so d₂ = d/9 (the seed's d/81 is
  wrong); a full map gets d₂ = d; behind an RMSNorm (Qwen3) the scale is the norm's, d₂ = d.
- A3 is causal: row i of A3 is the mean of the rows ≤ i of A1 *in the same document*, so A3·V is the
  running mean of A1·V restarted at every document start: where position_ids is 0 (packing, and generate's
  left padding) and where the attention mask lets a row see no earlier key (a packed or padded 4-D mask).
- Both maps run in one call of the model's attention interface (sdpa, eager, flash…): queries [Q1 | Q2] as 2H
  heads against keys [K1 | K2] and values [V | V] as 2KV heads keep the GQA grouping of each map.
- Generation with the KV cache is supported for greedy and sampled decoding with a `DynamicCache`: the cache
  holds [K1 | K2] and [V | V] (twice the native value memory) and, beside it, the running sum of A1·V and its
  count per sequence. A cache this layer did not fill, or one that was cropped or reordered (beam search,
  assisted decoding), is refused with an error rather than decoded wrongly.

For each family (llama, mistral, qwen2, qwen3) there is a config `Dint<Family>Config` (model_type `dint_<family>`,
the native config plus a `dint` dict of `DintSettings`) and a model `Dint<Family>ForCausalLM`, the native causal LM
whose attention layers are replaced by DINT ones when it is built (through the attention surgery,
`hf.surgery.replace_attention`). `register_all`, which importing lit_growattn.hf calls, registers them with
transformers' Auto classes, so that a converted model round-trips `save_pretrained`/`from_pretrained` with no remote
code. The conversions themselves are `lit_growattn.dint.models`'.
"""

from __future__ import annotations

import copy
import importlib
import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from lit_growattn.attention.lowrank_dint import uniform_parameter
from lit_growattn.hf.surgery import generated_class, native_subclass, replace_attention

_CLASSES: dict[str, type[nn.Module]] = {}
FAMILIES = {
    "llama": ("llama", "Llama"),
    "mistral": ("mistral", "Mistral"),
    "qwen2": ("qwen2", "Qwen2"),
    "qwen3": ("qwen3", "Qwen3"),
}
DINT_MODEL_TYPES = tuple(f"dint_{t}" for t in FAMILIES)
_REGISTERED: dict[str, tuple[type, type]] = {}


@dataclass
class DintSettings:
    """Args:
        kind: `lowrank` (second map of rank `rank`) or `full` (a second full-width map).
        rank: Rank r of the low-rank second map's factors (lowrank only).
        d2_ratio: d₂ / d of the second map's softmax; None derives it from the init (`d2_ratio_for_init`).
    """

    kind: Literal["lowrank", "full"] = "lowrank"
    rank: int | None = None
    d2_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("lowrank", "full"):
            raise ValueError(f"DINT kind must be 'lowrank' or 'full', not {self.kind!r}")
        if (self.kind == "lowrank") != (self.rank is not None) or (self.rank is not None and self.rank < 1):
            raise ValueError(f"give a rank ≥ 1 exactly for lowrank DINT, got kind={self.kind!r}, rank={self.rank}")
        if self.d2_ratio is not None and self.d2_ratio <= 0:
            raise ValueError(f"d2_ratio must be positive, got {self.d2_ratio}")

    def to_dict(self) -> dict:
        return asdict(self)


def d2_ratio_for_init(kind: str, fan_in: int, rank: int | None, normalised: bool) -> float:
    """d₂/d that gives the fresh second map the score variance of a fresh full map with U(±1/√fan_in) weights."""
    if normalised or kind == "full":
        return 1.0
    var_full = 1 / (3 * fan_in)
    var_lowrank = rank * (1 / (3 * fan_in)) * (1 / (3 * rank))  # Σ over r of products of independent factors
    return (var_lowrank / var_full) ** 2  # queries and keys each scaled: scores by the square


def document_running_mean(y: Tensor, starts: Tensor, prior_sum: Tensor, prior_count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Running mean along dim 2 of y (b, h, s, d), restarted where starts (b, s) is True and otherwise continuing
    a prior (sum (b, h, d), count (b,)) of earlier positions. Returns (means (b, h, s, d), last sum, last count),
    accumulated in float32 at least."""
    b, h, s, d = y.shape
    wide = y.to(torch.promote_types(y.dtype, torch.float32))
    idx = torch.arange(s, device=y.device)
    last_start = torch.cummax(torch.where(starts, idx, -1), dim=-1).values  # (b, s); -1: no start yet in this chunk
    sums = torch.cat([prior_sum.to(wide.dtype)[:, :, None], wide], 2).cumsum(2)  # sums[t] = prior + y[0..t-1]
    gather = last_start.clamp(min=0)[:, None, :, None].expand(b, h, s, d)
    fresh = (last_start >= 0)[:, None, :, None]
    total = sums[:, :, 1:] - torch.where(fresh, sums.gather(2, gather), 0)
    count = torch.where(last_start >= 0, idx - last_start + 1, prior_count[:, None] + idx + 1).to(wide.dtype)
    return (total / count[:, None, :, None]).to(y.dtype), total[:, :, -1], count[:, -1]


def document_starts(b: int, s: int, position_ids: Tensor | None, mask: Tensor | None, device) -> Tensor:
    """(b, s) True where a query row starts a document (see the module docstring)."""
    starts = torch.zeros(b, s, dtype=torch.bool, device=device)
    if position_ids is not None:
        starts |= (position_ids == 0).expand(b, s)
    if isinstance(mask, Tensor) and mask.dim() == 4:
        allowed = mask if mask.dtype == torch.bool else mask == 0
        kv = allowed.shape[-1]
        own = torch.arange(kv - s, kv, device=device)  # each query's own key comes last in the chunk
        earlier = torch.arange(kv, device=device)[None, :] < own[:, None]  # (s, kv)
        starts |= ~(allowed[:, 0] & earlier).any(-1).expand(b, s)
    return starts


class SecondMap(nn.Module):
    """Q2 (b, H, s, d) and K2 (b, KV, s, d) of X (b, s, e), before RoPE; full or low-rank per head."""

    def __init__(self, settings: DintSettings, e: int, n_head: int, n_kv: int, d: int, like: Tensor):
        super().__init__()
        kw = dict(device=like.device, dtype=like.dtype)
        if settings.kind == "full":
            self.w_q, self.w_k = uniform_parameter(n_head, e, d, fan_in=e, **kw), uniform_parameter(n_kv, e, d, fan_in=e, **kw)
        else:
            r = settings.rank
            self.down_q, self.up_q = uniform_parameter(n_head, e, r, fan_in=e, **kw), uniform_parameter(n_head, r, d, fan_in=r, **kw)
            self.down_k, self.up_k = uniform_parameter(n_kv, e, r, fan_in=e, **kw), uniform_parameter(n_kv, r, d, fan_in=r, **kw)

    def _project(self, x: Tensor, name: str) -> Tensor:
        if hasattr(self, f"w_{name}"):
            return torch.einsum("bse,hed->bhsd", x, getattr(self, f"w_{name}"))
        return torch.einsum("bse,her->bhsr", x, getattr(self, f"down_{name}")) @ getattr(self, f"up_{name}")

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self._project(x, "q"), self._project(x, "k")


class DintAttention(nn.Module):
    """Mixin placed before the native attention class (Llama, Mistral, Qwen2, Qwen3); built with `from_native`."""

    @classmethod
    def from_native(cls, native: nn.Module, settings: DintSettings) -> DintAttention:
        """A DINT copy of `native`: its projections and norms shared, a fresh second map, λ = 0."""
        new_cls = dint_class(type(native))
        new = new_cls.__new__(new_cls)
        new.__dict__.update(native.__dict__)
        for key in ("_parameters", "_buffers", "_modules"):
            new.__dict__[key] = dict(native.__dict__[key])
        e, w = native.q_proj.in_features, native.q_proj.weight
        if settings.rank is not None and settings.rank > min(e, native.head_dim):
            raise ValueError(
                f"low-rank DINT rank={settings.rank} exceeds the head size {native.head_dim}: the second map's form has "
                f"rank ≤ min(rank, hidden size {e}, head size {native.head_dim}) and a DINT model's head size is fixed, "
                f"so a larger rank adds parameters, never rank; use rank ≤ {min(e, native.head_dim)} (or the full "
                "second map, kind 'full': convert --to dint)")
        n_head, n_kv = native.config.num_attention_heads, native.config.num_key_value_heads
        new.second = SecondMap(settings, e, n_head, n_kv, native.head_dim, w)
        normalised = hasattr(native, "q_norm")
        if normalised:
            new.q2_norm, new.k2_norm = copy.deepcopy(native.q_norm), copy.deepcopy(native.k_norm)
        ratio = settings.d2_ratio or d2_ratio_for_init(settings.kind, e, settings.rank, normalised)
        new.q2_gain = math.sqrt(1 / ratio)  # 1/√d₂ = gain · 1/√d: the interface's one scaling serves both maps
        new.lam = nn.Parameter(torch.zeros(n_head, device=w.device, dtype=w.dtype))
        return new

    def _queries_keys_values(self, x: Tensor, position_embeddings) -> tuple[Tensor, Tensor, Tensor]:
        """[Q1 | Q2] (b, 2H, s, d), [K1 | K2] (b, 2KV, s, d), [V | V] (b, 2KV, s, d), RoPE applied."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        q1, k1 = self.q_proj(x).view(shape), self.k_proj(x).view(shape)
        q2, k2 = (t.transpose(1, 2) for t in self.second(x))
        if hasattr(self, "q_norm"):
            q1, k1, q2, k2 = self.q_norm(q1), self.k_norm(k1), self.q2_norm(q2), self.k2_norm(k2)
        q1, k1 = self.apply_rotary(q1.transpose(1, 2), k1.transpose(1, 2), *position_embeddings)
        q2, k2 = self.apply_rotary(q2.transpose(1, 2), k2.transpose(1, 2), *position_embeddings)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        return torch.cat([q1, q2 * self.q2_gain], 1), torch.cat([k1, k2], 1), torch.cat([v, v], 1)

    def _prior(self, cache, b: int, n_head: int, d: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The running (sum, count) of A1·V that this layer left beside `cache`, or zeros for a fresh cache."""
        from transformers import DynamicCache

        if cache is not None and not isinstance(cache, DynamicCache):
            raise RuntimeError(f"DINT decodes with a DynamicCache (generate's default), not a {type(cache).__name__}: "
                               "its keys and values hold both maps, twice the native key/value heads")
        seen = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        zeros = (like.new_zeros(b, n_head, d, dtype=torch.float32), like.new_zeros(b, dtype=torch.float32))
        if seen == 0:
            return zeros
        state = getattr(cache, "dint_running", {}).get(self.layer_idx)
        if state is None or state[2] != seen or state[0].shape[0] != b:
            raise RuntimeError(
                "DINT keeps the running mean of A1·V beside the KV cache, and this cache was not filled by this layer "
                "step by step (a prefilled, cropped or reordered cache: beam search or assisted decoding). Decode "
                "greedily or by sampling from an empty DynamicCache, or pass use_cache=False.")
        return state[0], state[1]

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | None = None,
                attention_mask: Tensor | None = None, past_key_values=None, **kwargs) -> tuple[Tensor, Tensor | None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        b, s, _ = hidden_states.shape
        n_head, d = self.lam.shape[0], self.head_dim
        q, k, v = self._queries_keys_values(hidden_states, position_embeddings)
        prior_sum, prior_count = self._prior(past_key_values, b, n_head, d, hidden_states)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.eager_attention)
        window = self.sliding_window if hasattr(self, "sliding_window") else getattr(self.config, "sliding_window", None)
        out, weights = interface(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                                 scaling=self.scaling, sliding_window=window, **kwargs)
        y1, y2 = out[:, :, :n_head].transpose(1, 2), out[:, :, n_head:].transpose(1, 2)  # (b, H, s, d)
        starts = document_starts(b, s, kwargs.get("position_ids"), attention_mask, hidden_states.device)
        y3, last_sum, last_count = document_running_mean(y1, starts, prior_sum, prior_count)
        if past_key_values is not None:
            running = past_key_values.__dict__.setdefault("dint_running", {})
            running[self.layer_idx] = (last_sum, last_count, past_key_values.get_seq_length(self.layer_idx))
        lam = self.lam.to(y1.dtype)[:, None, None]
        y = y1 + lam * (y3 - y2)  # grouped so that λ = 0 gives A1·V exactly
        if weights is not None:  # eager: (b, 2H, s, kv) → the combined map, when all of A3's rows are in this chunk
            a1, a2 = weights[:, :n_head], weights[:, n_head:]
            first_chunk = bool(prior_count.eq(0).all())  # after a cached prefix, A1's earlier rows are gone
            a3 = document_running_mean(a1, starts, a1.new_zeros(a1.shape[:2] + a1.shape[3:]), prior_count)[0]
            weights = a1 + lam * (a3 - a2) if first_chunk else None
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1).contiguous()), weights


def dint_class(native: type[nn.Module]) -> type[DintAttention]:
    """The DINT subclass of a native attention class (created once, importable from this module by name)."""
    return native_subclass(_CLASSES, "Dint", DintAttention, native, __name__)


def __getattr__(name: str):
    return generated_class(name, "Dint", dint_class)


def dint_classes(model_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) of the DINT version of a native `model_type`, registered on first use."""
    if model_type not in FAMILIES:
        raise ValueError(f"DINT conversion supports model types {', '.join(FAMILIES)}, not {model_type!r}")
    if model_type not in _REGISTERED:
        from transformers import AutoConfig, AutoModelForCausalLM

        module_name, prefix = FAMILIES[model_type]
        module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        native_config, native_model = getattr(module, f"{prefix}Config"), getattr(module, f"{prefix}ForCausalLM")

        def __init__(self, config) -> None:
            native_model.__init__(self, config)
            settings = DintSettings(**config.dint)
            replace_attention(self, lambda m: DintAttention.from_native(m, settings))

        # type() sets __module__ to this module's name, under which the classes are also reachable (globals below).
        config_cls = type(f"Dint{prefix}Config", (native_config,), {
            "model_type": f"dint_{model_type}", "base_model_type": model_type})
        model_cls = type(f"Dint{prefix}ForCausalLM", (native_model,), {"config_class": config_cls, "__init__": __init__})
        AutoConfig.register(config_cls.model_type, config_cls)
        AutoModelForCausalLM.register(config_cls, model_cls)
        globals()[config_cls.__name__], globals()[model_cls.__name__] = config_cls, model_cls
        _REGISTERED[model_type] = config_cls, model_cls
    return _REGISTERED[model_type]


def register_all() -> None:
    for model_type in FAMILIES:
        dint_classes(model_type)
