"""Export of a growable Hugging Face model as a `save_pretrained` folder that `AutoModelForCausalLM.from_pretrained`
loads back after `import lit_growattn.hf` (no remote code; `hf.loading` adds a README.md saying so, and a loader for
`trust_remote_code=True` that only imports lit_growattn.hf).

- Expressible natively (every layer at its rotary/original width, and for Qwen3 one temperature per layer, since
  its q_norm is scale-invariant): the original architecture, with τ_j/scaling folded into head j's query rows, so
  that the native `scaling` gives back τ_j. Any transformers install loads it.
- Otherwise (grown): model_type `growattn_<type>` (e.g. growattn_llama), a registered subclass of the original
  config with `qk_head_sizes` (and `qk_rotary`, the rotary columns) per layer, whose model class builds the original
  model, makes its attention growable and sizes it. `register()` (run by `import lit_growattn.hf`) registers all five.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn

from lit_growattn.hf.growable import GrowableAttention, make_growable
from lit_growattn.hf.loading import write_loading_files
from lit_growattn.hf.surgery import NATIVE_ATTENTION, native_attention_class

PREFIX = "growattn_"


def _growables(model: nn.Module) -> list[tuple[str, GrowableAttention]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, GrowableAttention)]


def natively_expressible(model: nn.Module) -> bool:
    for _, m in _growables(model):
        if m.d_head != m.head_dim or m.rotary not in (0, m.head_dim):  # grown, or fewer rotary columns (keep_rotary)
            return False
        if hasattr(m, "q_norm") and not torch.allclose(m.log_tau, m.log_tau[:1].expand_as(m.log_tau), rtol=0, atol=0):
            return False
    return True


@torch.no_grad()
def to_native(attn: GrowableAttention) -> nn.Module:
    """The native attention module computing what `attn` computes (its width must be the original one)."""
    native_cls = next(c for c in type(attn).__mro__ if c.__module__.startswith("transformers."))
    native = native_cls(attn.config, layer_idx=attn.layer_idx).to(attn.w_q.device, attn.w_q.dtype)
    shared = native.state_dict().keys()  # o_proj/c_proj, v_proj, the q/k norms
    native.load_state_dict({k: v for k, v in attn.state_dict().items() if k in shared}, strict=False)
    gain = attn.tau / attn.scaling  # (H,): native multiplies by `scaling`
    if hasattr(attn, "q_norm"):
        native.q_norm.weight.mul_(gain[0])  # RMSNorm is scale-invariant: the one temperature goes into its weight
        gain = torch.ones_like(gain)
    w_q, w_k = attn.w_q * gain[:, None, None], attn.w_k
    flat = lambda w: w.transpose(0, 1).reshape(w.shape[1], -1)  # (heads, e′, d) → (e′, heads·d)  # noqa: E731
    if hasattr(native, "c_attn"):  # GPT-2: Conv1D weight (e, 3e), bias (3e,) with the bias row last
        v = torch.cat([attn.v_proj.weight.T, attn.v_proj.bias[None]])
        fused = torch.cat([flat(w_q), flat(w_k), v], 1)
        native.c_attn.weight.copy_(fused[:-1])
        native.c_attn.bias.copy_(fused[-1])
        return native
    for proj, w in ((native.q_proj, w_q), (native.k_proj, w_k)):
        full = flat(w)
        proj.weight.copy_(full[: proj.in_features].T)
        if proj.bias is not None:
            proj.bias.copy_(full[-1])
    return native


def export(model: nn.Module, out: str | os.PathLike) -> str:
    """Writes `model` (a growable AutoModelForCausalLM, unchanged) to the folder `out`; returns the model type written."""
    model = copy.deepcopy(model)
    if natively_expressible(model):
        for name, attn in _growables(model):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, to_native(attn))
    else:
        base_type = model.config.model_type.removeprefix(PREFIX)
        config_cls, model_cls = grown_classes(base_type)
        settings = model.config.to_dict() | {"qk_head_sizes": [m.d_head for _, m in _growables(model)],
                                             "qk_rotary": [m.rotary for _, m in _growables(model)]}
        settings.pop("model_type", None)
        model.config = config_cls(**{k: v for k, v in settings.items() if k not in ("architectures", "transformers_version")})
        model.__class__ = model_cls
    model.save_pretrained(out)
    return model.config.model_type


_GROWN: dict[str, tuple[type, type]] = {}


def grown_classes(base_type: str) -> tuple[type, type]:
    """(config class, model class) of grown models of `base_type`, e.g. GrowAttnLlamaConfig, GrowAttnLlamaForCausalLM."""
    if base_type not in _GROWN:
        from transformers import AutoConfig, AutoModelForCausalLM

        base_config = type(AutoConfig.for_model(base_type))
        base_model = AutoModelForCausalLM._model_mapping[base_config]
        stem = base_config.__name__.removesuffix("Config")

        def config_init(self, qk_head_sizes: list[int] | None = None, qk_rotary: list[int] | None = None, **kwargs):
            base_config.__init__(self, **kwargs)
            self.qk_head_sizes, self.qk_rotary = qk_head_sizes, qk_rotary

        def model_init(self, config):
            base_model.__init__(self, config)
            make_growable(self)
            for (_, attn), r in zip(_growables(self), config.qk_rotary or []):
                if r != attn.rotary:
                    attn.keep_rotary(r)
            for (_, attn), d in zip(_growables(self), config.qk_head_sizes or []):
                attn.resize(d)

        config_cls = type(f"GrowAttn{stem}Config", (base_config,), {"model_type": PREFIX + base_type, "base_model_type": base_type, "__init__": config_init,
                                                                       "__module__": __name__})
        model_cls = type(f"GrowAttn{base_model.__name__}", (base_model,), {"config_class": config_cls, "__init__": model_init,
                                                                             "__module__": __name__})
        _GROWN[base_type] = config_cls, model_cls
    return _GROWN[base_type]


def register() -> None:
    """Registers the grown config and model classes of every supported model type with the Auto classes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for base_type in NATIVE_ATTENTION:
        config_cls, model_cls = grown_classes(base_type)
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


def registered_here(model_type: str) -> bool:
    """True for the model types that only `import lit_growattn.hf` makes known to transformers."""
    return model_type.startswith((PREFIX, "dint_"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def training_tokenizer(hparams: dict, pretrained: str | None) -> str | None:
    """Where the tokenizer the checkpoint's model was trained with is now (a folder or a tokenizer.json file), or
    None for raw bytes. `pretrained`: where the model folder is now (`--pretrained`, else the recorded one)."""
    recorded_folder = hparams.get("pretrained")
    tokenizer = hparams.get("tokenizer") or recorded_folder  # recorded since fit names it; before, the folder's own
    if tokenizer in (None, "bytes"):
        return None
    if recorded_folder is not None and Path(tokenizer).resolve() == Path(recorded_folder).resolve():
        tokenizer = pretrained  # the model folder's own tokenizer, wherever the folder is now
    if not os.path.exists(tokenizer):
        moved = tokenizer == pretrained
        raise FileNotFoundError(
            f"the model was trained with the tokenizer of {tokenizer}, which is not a folder or file here (moved?): "
            + ("give --pretrained DIR, the folder's new place" if moved else "put it there (export copies the "
               "tokenizer the model was trained with, never another)"))
    return tokenizer


def copy_tokenizer(source: str | None, folder: Path) -> list[str]:
    """Copies the tokenizer at `source` (a folder's tokenizer files, or a tokenizer.json file) into folder; returns
    the names written."""
    import json
    import shutil

    if source is None:
        return []
    if os.path.isfile(source):  # a bare tokenizers file: a tokenizer_config.json lets AutoTokenizer load it
        shutil.copy(source, folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        return ["tokenizer.json", "tokenizer_config.json"]
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    for name in copied:
        shutil.copy(os.path.join(source, name), folder / name)
    return copied


def main(argv: list[str]) -> None:
    """`python -m lit_growattn export --ckpt CKPT --out DIR [--pretrained DIR] [--overwrite]`: an HFCausalLM
    checkpoint (as `fit` writes it) as a save_pretrained folder, with the tokenizer the model was trained with."""
    import argparse
    import inspect

    from lit_growattn.checkpoint import read_checkpoint
    from lit_growattn.divergence import ADVICE, TrainingDiverged, first_names, non_finite
    from lit_growattn.hf.module import HFCausalLM
    from lit_growattn.writing import check_output, new_folder

    parser = argparse.ArgumentParser(prog="python -m lit_growattn export", description=main.__doc__)
    parser.add_argument("--ckpt", required=True, help="a checkpoint of lit_growattn.hf.HFCausalLM written by fit")
    parser.add_argument("--out", required=True, help="the folder to write (save_pretrained); written beside, then "
                        "renamed into place")
    parser.add_argument("--pretrained", help="where the model's pretrained folder is now, if it moved since training "
                        "(its tokenizer, and the model's architecture)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    ckpt = read_checkpoint(args.ckpt)
    hparams = {k: v for k, v in ckpt.get("hyper_parameters", {}).items() if not k.startswith("_")}
    if "pretrained" not in hparams or "config" not in hparams:
        raise ValueError(f"{args.ckpt} is not a checkpoint of lit_growattn.hf.HFCausalLM (its hyperparameters have "
                         "no pretrained/config); for GrowAttentionLM checkpoints use `python -m lit_growattn convert`")
    if args.pretrained is not None:
        if hparams["pretrained"] is None:
            raise ValueError(f"{args.ckpt} was trained from a config, not a pretrained folder: leave out --pretrained")
        hparams["pretrained"] = args.pretrained
    tokenizer = training_tokenizer(ckpt["hyper_parameters"], hparams["pretrained"])
    recorded = ckpt["hyper_parameters"]["pretrained"]
    out = check_output(args.out, "folder", {"the checkpoint": args.ckpt, "the model's pretrained folder": hparams[
        "pretrained"], "the pretrained folder the checkpoint names": recorded, "the model's tokenizer": tokenizer},
        args.overwrite)
    if names := non_finite(ckpt["state_dict"].items()):
        raise TrainingDiverged(f"{args.ckpt} holds non-finite weights ({len(names)} tensors: {first_names(names)}), "
                               f"so it is not exported: its run had diverged. Export an earlier checkpoint, or train "
                               f"again: {ADVICE}")
    # The model's own settings; others recorded beside them (e.g. the data's tokenizer) do not build it.
    module = HFCausalLM(**{k: v for k, v in hparams.items() if k in inspect.signature(HFCausalLM).parameters})
    module.load_state_dict(ckpt["state_dict"])
    with new_folder(out) as folder:
        written = export(module.model, folder)
        copied = copy_tokenizer(tokenizer, folder)
        if registered_here(written):
            write_loading_files(folder, written, str(out), f"`python -m lit_growattn export` of {args.ckpt}")
    if copied:
        tokens = f"tokenizer files {', '.join(copied)}"
    elif hparams.get("tokenizer") == "bytes":
        tokens = "no tokenizer files: the model was trained on raw bytes (token ids 0–255, the bytes of UTF-8 text)"
    else:
        tokens = f"no tokenizer files ({tokenizer} has none)" if tokenizer else "no tokenizer (the checkpoint names none)"
    loading = (f"; load it after `import lit_growattn.hf`, or with trust_remote_code=True ({out / 'README.md'})"
               if registered_here(written) else "")
    sizes = f", query/key head sizes {module.head_sizes()}" if module.head_sizes() else ""  # none: DINT, not growable
    print(f"wrote {out}: model type {written}{sizes}, {tokens}{loading}")
