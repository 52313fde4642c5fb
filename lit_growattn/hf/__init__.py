"""Hugging Face causal LMs (transformers, an optional dependency: `pip install lit_growattn[hf]`).

surgery   replace each layer's native attention by a module built from it, by model type.
growable  the growable attention classes: w_q, w_k, log_tau per layer, layout [rotary | NoPE], GQA.
"""

from lit_growattn.hf.growable import GrowableAttention
from lit_growattn.hf.surgery import NATIVE_ATTENTION, attention_modules, replace_attention


def make_growable(model) -> list[str]:
    """Converts the attention of a llama/mistral/qwen2/qwen3/gpt2 model in place; returns the converted names."""
    return replace_attention(model, GrowableAttention.from_native)


__all__ = ["GrowableAttention", "NATIVE_ATTENTION", "attention_modules", "make_growable", "replace_attention"]
