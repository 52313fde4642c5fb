"""Module surgery on Hugging Face causal LMs: every layer's attention replaced by a module built from it.

Targets follow peft's convention: by module type, per `config.model_type`, with a loud error when the model
type is not supported or nothing matches. The surgery is generic: `replace_attention(model, build)` swaps each
native attention module `m` for `build(m)` (which must copy m's weights, not re-initialise them) and moves the
result to m's device and dtype; growable attention (`growable.py`) and other conversions (e.g. DINT) are `build`s.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable

from torch import nn

# model_type → (module, class name) of the native attention; imported lazily so that transformers stays optional.
NATIVE_ATTENTION: dict[str, tuple[str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaAttention"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralAttention"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"),
    "gpt2": ("transformers.models.gpt2.modeling_gpt2", "GPT2Attention"),
}


def supported() -> str:
    return ", ".join(sorted(NATIVE_ATTENTION))


def native_attention_class(model_type: str) -> type[nn.Module]:
    """The attention class that `model_type` builds; a ValueError listing the supported types otherwise."""
    if model_type not in NATIVE_ATTENTION:
        raise ValueError(f"model type {model_type!r} is not supported for attention surgery; supported model types: "
                         f"{supported()}")
    module, name = NATIVE_ATTENTION[model_type]
    return getattr(importlib.import_module(module), name)


def attention_modules(model: nn.Module, config=None) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every native attention module of `model` (a PreTrainedModel, or one of its
    decoder layers, which holds no config: then give the model's `config`), in layer order."""
    config = model.config if config is None else config
    # A registered derived config (e.g. an exported grown model's) names the model type it builds on.
    model_type = getattr(config, "base_model_type", config.model_type)
    cls = native_attention_class(model_type)
    found = [(name, m) for name, m in model.named_modules() if type(m) is cls]
    if not found:
        raise ValueError(f"no {cls.__name__} module found in this {model_type} model "
                         f"({type(model).__name__}): was it converted already?")
    return found


def replace_attention(model: nn.Module, build: Callable[[nn.Module], nn.Module], config=None) -> list[str]:
    """Replaces, in place, every native attention module m of `model` (or of a decoder layer of the model of
    `config`) by `build(m)`, moved to m's device and dtype; returns the replaced modules' qualified names (e.g.
    'model.layers.0.self_attn')."""
    names = []
    for name, original in attention_modules(model, config):
        parent_name, _, child = name.rpartition(".")
        weight = next(original.parameters())
        replacement = build(original).to(device=weight.device, dtype=weight.dtype)
        setattr(model.get_submodule(parent_name), child, replacement)
        names.append(name)
    return names


def native_subclass(cache: dict[str, type], prefix: str, base: type, native: type[nn.Module], owner: str) -> type:
    """`prefix + native's name`: `base` over the native attention class, with the native module's eager attention
    (and RoPE, where it has one); created once, and found by name in module `owner` (see `generated_class`)."""
    name = f"{prefix}{native.__name__}"
    if name not in cache:
        module = sys.modules[native.__module__]
        extras = {"eager_attention": staticmethod(module.eager_attention_forward), "__module__": owner}
        if hasattr(module, "apply_rotary_pos_emb"):
            extras["apply_rotary"] = staticmethod(module.apply_rotary_pos_emb)
        cache[name] = type(name, (base, native), extras)
    return cache[name]


def generated_class(name: str, prefix: str, make: Callable[[type[nn.Module]], type]) -> type:
    """For a module's `__getattr__`: pickling (ddp_spawn, deepcopy across processes) finds generated classes by name."""
    for model_type in NATIVE_ATTENTION:
        native = native_attention_class(model_type)
        if name == f"{prefix}{native.__name__}":
            return make(native)
    raise AttributeError(name)
