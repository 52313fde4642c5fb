"""The conversion of a native Hugging Face causal LM (or a model folder) to DINT: `convert_to_dint` builds the DINT
model from a native one, every native weight copied, the second maps initialised from `seed`, λ = 0, so its outputs
are the native model's (tests/test_hf_dint.py).

The DINT layer and the registered `dint_<family>` model classes are `lit_growattn.hf.dint`'s; their names are also
reachable here, their old path, for users' code and pickles.
"""

from __future__ import annotations

import os
import pickle

import torch
from torch import nn

from lit_growattn.hf import dint as _dint
from lit_growattn.hf.dint import DINT_MODEL_TYPES, FAMILIES, DintSettings, dint_classes, register_all  # noqa: F401
from lit_growattn.hf.loading import write_loading_files
from lit_growattn.training.writing import check_output, new_folder


def __getattr__(name: str) -> type:
    """The generated Dint<Family>Config and Dint<Family>ForCausalLM classes, made by `lit_growattn.hf.dint`."""
    if name.startswith("Dint"):
        return getattr(_dint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def convert_to_dint(model: nn.Module, settings: DintSettings, seed: int = 0) -> nn.Module:
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


def convert_pretrained(src: str, out: str | os.PathLike, settings: DintSettings, seed: int = 0,
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

