"""Hugging Face causal LMs (transformers, an optional dependency: `pip install lit_growattn[hf]`).

surgery   replace each layer's native attention by a module built from it, by model type.
growable  the growable attention classes: w_q, w_k, log_tau per layer, layout [rotary | NoPE], GQA.
module    HFCausalLM, the LightningModule that GrowAttentionCallback grows.
dint      DINT / low-rank DINT attention (seed 001); dint_models: its registered model classes and conversion.
export    a trained model as a save_pretrained folder; loading: the README.md and loader that say how such a
          folder of a model type registered here is loaded.

Importing this package (and only this: `import lit_growattn` leaves transformers alone) registers the grown model
types (`growattn_llama`, …) and the DINT ones (`dint_llama`, …) with transformers' Auto classes, so an exported or
converted model folder loads with `AutoModelForCausalLM.from_pretrained` and no remote code.
"""

from lit_growattn.hf.dint import DintAttention, DintSettings
from lit_growattn.hf.dint_models import convert_to_dint, register_all
from lit_growattn.hf.export import register
from lit_growattn.hf.growable import GrowableAttention, make_growable
from lit_growattn.hf.module import HFCausalLM
from lit_growattn.hf.surgery import NATIVE_ATTENTION, attention_modules, replace_attention

register()
register_all()

__all__ = ["DintAttention", "DintSettings", "GrowableAttention", "HFCausalLM", "NATIVE_ATTENTION", "attention_modules",
           "convert_to_dint", "make_growable", "replace_attention"]
