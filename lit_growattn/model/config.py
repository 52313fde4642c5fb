"""The model's configuration, checked once so that bad values fail before any training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lit_growattn.attention.sdpa import SDPA_PADS, SdpaPad


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    d_head: int | list[int] = 16  # query/key head size, one value for all layers or one per layer
    d_v: int | list[int] | None = None  # value head size, one value or one per layer; None → n_embd // n_head
    bias: bool = False
    dropout: float = 0.0
    attention: str = "mha"  # a name in the attention registry, checked where the model is built (model.GPT)
    attention_args: dict[str, Any] = field(default_factory=dict)  # extra arguments of the attention variant
    sdpa_pad: SdpaPad | bool = "auto"  # bool: YAML 1.1 reads an unquoted on/off as true/false

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        heads = self.d_head if isinstance(self.d_head, list) else [self.d_head]
        if isinstance(self.d_head, list) and len(heads) != self.n_layer:
            raise ValueError(f"d_head has {len(heads)} entries but n_layer is {self.n_layer}: give one per layer or a single int")
        if any(d <= 0 for d in heads):
            raise ValueError(f"d_head must be positive, got {self.d_head}")
        e_in = self.n_embd + int(self.bias)
        if max(heads) > e_in:
            raise ValueError(f"d_head={self.d_head} exceeds n_embd{' + 1 (bias)' if self.bias else ''} = {e_in}: a "
                             f"query/key form has rank ≤ {e_in}, so wider heads add parameters, never rank; use ≤ {e_in}")
        values = self.d_v if isinstance(self.d_v, list) else [self.d_v]
        if isinstance(self.d_v, list) and len(values) != self.n_layer:
            raise ValueError(f"d_v has {len(values)} entries but n_layer is {self.n_layer}: give one per layer or a single int")
        if any(d is not None and d <= 0 for d in values):
            raise ValueError(f"d_v must be positive, got {self.d_v}")
        if self.d_v is None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head}); set d_v explicitly")
        if isinstance(self.sdpa_pad, bool):
            self.sdpa_pad = "on" if self.sdpa_pad else "off"
        if self.sdpa_pad not in SDPA_PADS:
            raise ValueError(f"sdpa_pad must be one of {', '.join(SDPA_PADS)}, got {self.sdpa_pad!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def head_size(self, layer_idx: int) -> int:
        return self.d_head[layer_idx] if isinstance(self.d_head, list) else self.d_head

    def value_head_size(self, layer_idx: int) -> int:
        d_v = self.d_v[layer_idx] if isinstance(self.d_v, list) else self.d_v
        return d_v if d_v is not None else self.n_embd // self.n_head
