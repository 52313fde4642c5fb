"""Attention variants: one file per variant, registered by name with `@register_attention`; each is an `Attention`."""

from lit_growattn.attention import diff, dint, lowrank_dint, mha  # noqa: F401 - importing registers the variants
from lit_growattn.attention.qk import QKForm
from lit_growattn.attention.registry import ATTENTIONS, Attention, attention_class, register_attention

__all__ = ["ATTENTIONS", "Attention", "QKForm", "attention_class", "register_attention"]
