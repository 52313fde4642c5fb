"""Hugging Face causal LMs (transformers, an optional dependency: `pip install lit_growattn[hf]`).

surgery   replace each layer's native attention by a module built from it, by model type.
growable  the growable attention classes: w_q, w_k, log_tau per layer, layout [rotary | NoPE], GQA.
module    HFCausalLM, the LightningModule that GrowAttentionCallback grows.
"""

from lit_growattn.hf.growable import GrowableAttention, make_growable
from lit_growattn.hf.module import HFCausalLM
from lit_growattn.hf.surgery import NATIVE_ATTENTION, attention_modules, replace_attention


__all__ = ["GrowableAttention", "HFCausalLM", "NATIVE_ATTENTION", "attention_modules", "make_growable", "replace_attention"]
