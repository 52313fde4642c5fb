"""Hugging Face causal LMs (transformers, an optional dependency: `pip install lit_growattn[hf]`).

surgery   replace each layer's native attention by a module built from it, by model type.
growable  the growable attention classes: w_q, w_k, log_tau per layer, layout [rotary | NoPE], GQA; the value map.
module    HFCausalLM, the LightningModule that GrowAttentionCallback grows.
export    a trained model as a save_pretrained folder; loading: the README.md that says how such a folder of a
          model type registered here is loaded.
dint      the DINT attention layer and the `dint_<family>` model types (the conversions are `lit_growattn.dint`'s).

Importing this package (and only this: `import lit_growattn` leaves it alone) registers every model type the
project writes with transformers' Auto classes: the grown ones (`growattn_llama`, …) and the DINT ones
(`dint_llama`, …), so an exported or converted model folder loads with `AutoModelForCausalLM.from_pretrained` and no
remote code.
"""

from lit_growattn.hf import dint
from lit_growattn.hf.export import register
from lit_growattn.hf.growable import GrowableAttention, make_growable
from lit_growattn.hf.module import HFCausalLM
from lit_growattn.hf.surgery import NATIVE_ATTENTION, attention_modules, replace_attention

register()
dint.register_all()

__all__ = ["GrowableAttention", "HFCausalLM", "NATIVE_ATTENTION", "attention_modules", "make_growable",
           "replace_attention"]
