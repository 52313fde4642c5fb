"""Registered DINT model classes, so that a converted model round-trips `save_pretrained`/`from_pretrained`
with no remote code: importing this module (which `import lit_growattn.hf` does) registers them with transformers' Auto classes.

For each family (llama, mistral, qwen2, qwen3) there is a config `Dint<Family>Config` (model_type
`dint_<family>`, the native config plus a `dint` dict of `DintSettings`) and a model `Dint<Family>ForCausalLM`,
the native causal LM whose attention layers are replaced by DINT ones when it is built (through the attention
surgery, `hf.surgery.replace_attention`).

`convert_to_dint` builds the DINT model from a native one: every native weight copied, the second maps
initialised from `seed`, λ = 0, so its outputs are the native model's (tests/test_hf_dint.py).
"""

from __future__ import annotations

import importlib
import os
import pickle

import torch
from torch import nn

# The module, not its names: importing lit_growattn.dint.attention first imports lit_growattn.hf, which imports this
# module while that one is still half-built.
from lit_growattn.dint import attention as dint_layer
from lit_growattn.hf.loading import write_loading_files
from lit_growattn.hf.surgery import replace_attention
from lit_growattn.training.writing import check_output, new_folder

FAMILIES = {
    "llama": ("llama", "Llama"),
    "mistral": ("mistral", "Mistral"),
    "qwen2": ("qwen2", "Qwen2"),
    "qwen3": ("qwen3", "Qwen3"),
}
DINT_MODEL_TYPES = tuple(f"dint_{t}" for t in FAMILIES)
_REGISTERED: dict[str, tuple[type, type]] = {}


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
            settings = dint_layer.DintSettings(**config.dint)
            replace_attention(self, lambda m: dint_layer.DintAttention.from_native(m, settings))

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



def convert_to_dint(model: nn.Module, settings: dint_layer.DintSettings, seed: int = 0) -> nn.Module:
    """A DINT copy of the native causal LM `model` (same dtype and device), outputs unchanged at λ = 0."""
    native_type = model.config.model_type
    config_cls, model_cls = dint_classes(native_type)
    fields = {k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures")}
    config = config_cls(**fields, dint=settings.to_dict())
    config.architectures = [model_cls.__name__]
    config._attn_implementation = model.config._attn_implementation
    weight = next(model.parameters())
    with torch.random.fork_rng(devices=[]):  # the second maps' init, without touching the global RNG
        torch.manual_seed(seed)
        converted = model_cls(config).to(device=weight.device, dtype=weight.dtype)
    missing, unexpected = converted.load_state_dict(model.state_dict(), strict=False)
    new = {name for name, _ in converted.named_parameters() if ".second." in name or name.endswith((
        ".lam", ".q2_norm.weight", ".k2_norm.weight"))}
    if set(missing) - new or unexpected:
        raise ValueError(f"the {native_type} weights do not fit its DINT model: missing {sorted(set(missing) - new)}, "
                         f"unexpected {sorted(unexpected)}")
    converted.generation_config = model.generation_config
    return converted.eval() if not model.training else converted


def convert_pretrained(src: str, out: str | os.PathLike, settings: dint_layer.DintSettings, seed: int = 0,
                       overwrite: bool = False) -> nn.Module:
    """Converts the model folder `src` (save_pretrained layout) to DINT and writes it, with src's tokenizer when it
    has one and a README.md on how to load it, to the folder `out`; the weights keep their stored dtype. `out` is
    written whole or not at all (`lit_growattn.training.writing`): never onto, into or above src, and in place of
    an existing non-empty folder only with overwrite=True. Returns the converted model."""
    from transformers import AutoTokenizer

    from lit_growattn.hf.module import from_pretrained
    from lit_growattn.training.checkpoint import refusal, unsafe_load_refused

    if not os.path.isfile(os.path.join(src, "config.json")):
        raise FileNotFoundError(f"--pretrained {src!r} is not a model folder (no config.json): give a local folder "
                                "written by save_pretrained (models are never downloaded here)")
    out = check_output(out, "folder", {"the model folder src": src}, overwrite, option="out")
    try:
        model = from_pretrained(src, dtype="auto")
    except (pickle.UnpicklingError, RuntimeError) as error:  # a pytorch_model.bin that weights_only loading refuses
        if unsafe_load_refused(error):
            raise refusal(f"a weights file of {src}", error) from None
        raise
    converted = convert_to_dint(model, settings, seed)
    with new_folder(out, overwrite, option="out") as folder:
        converted.save_pretrained(folder)
        if any(os.path.isfile(os.path.join(src, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            AutoTokenizer.from_pretrained(src).save_pretrained(folder)
        write_loading_files(folder, converted.config.model_type, str(out), f"the DINT conversion of {src}")
    return converted


register_all()  # importing this module (or lit_growattn.hf) registers dint_* with the Auto classes
