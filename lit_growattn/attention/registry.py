"""Attention variants by name: `@register_attention("name")` on the class is the one line a new variant needs.

The registry is the list of allowed `attention` names (GPTConfig checks them). A variant outside this package
registers the same way, from a module imported before the model is built (from the command line:
`extensions: [your_module]`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from lit_growattn.attention.qk import QKForm
from lit_growattn.attention.sdpa import SdpaPad
from lit_growattn.attention.value import ValueMap
from lit_growattn.growth.registry import registrar


class AttentionConfig(Protocol):
    """What a variant reads of the model's configuration (`model.GPTConfig` is one), so that the variants need nothing
    of the model that is built from them."""

    n_embd: int
    n_head: int
    bias: bool
    sdpa_pad: SdpaPad

    def head_size(self, layer_idx: int) -> int: ...

    def value_head_size(self, layer_idx: int) -> int: ...


@runtime_checkable
class Attention(Protocol):
    """What a variant must provide. It is an nn.Module built as `cls(cfg: AttentionConfig, layer_idx: int,
    **cfg.attention_args)`, mapping (b, s, e) → (b, s, e) with a causal mask.

    Optional beyond these: `score_maps()`, every softmax map (each with `n_head` and `d_head`) when some map
    does not grow (FLOPs count it, see `GPT.flops_per_token`; default `qk_forms()`), and `attention_maps(x)`,
    the explicit maps for analysis (entropy; default: built from the forms). Training never calls either.
    """

    value: ValueMap  # W_V and W_O per head (`attention.value`); the per-head W_M = W_V W_O of `analysis.wm_spectra`
    value_growable: bool  # the output is linear in each head's W_M, so value growth applies (docs/value.md)

    def qk_forms(self) -> list[QKForm]:
        """The growable query/key bilinear forms: every softmax map that growth may widen goes through one."""
        ...

    def forward(self, x: Tensor) -> Tensor: ...


ATTENTIONS: dict[str, type[nn.Module]] = {}  # name → variant class, filled by @register_attention
# @register_attention("name") on an `Attention` class makes it variant `name`.
register_attention = registrar(ATTENTIONS, "attention")


def attention_class(name: str) -> type[nn.Module]:
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; registered attentions: {', '.join(sorted(ATTENTIONS))} (a new "
                         "variant registers with lit_growattn.attention.register_attention; from the command line, "
                         "import its module with `extensions: [module]`)")
    return ATTENTIONS[name]
