"""Export of a growable Hugging Face model as a `save_pretrained` folder that `AutoModelForCausalLM.from_pretrained`
loads back after `import lit_growattn.hf` (no remote code; `hf.loading` adds a README.md saying so).

- Expressible natively (every layer at its rotary/original query/key width and its original value width, and for
  Qwen3 one temperature per layer, since its q_norm is scale-invariant): the original architecture, with τ_j/scaling
  folded into head j's query rows, so that the native `scaling` gives back τ_j, and W_V, W_O laid back into v_proj
  and o_proj (GPT-2: c_attn's value part and c_proj). Any transformers install loads it. So is a model loaded from a
  growattn_<type> folder whose widths ended native (e.g. shrunk back): its config is the original type's again.
- Otherwise (grown): model_type `growattn_<type>` (e.g. growattn_llama), a registered subclass of the original
  config with `qk_head_sizes` (and `qk_rotary`, the rotary columns) and `v_head_sizes` per layer, whose model class
  builds the original model, makes its attention growable and sizes it. A growattn_<type> folder written before the
  value map (no `v_head_sizes`: v_proj/o_proj, GPT-2 v_proj/c_proj tensors) loads with its keys rewritten, exactly.
  `register()` (run by `import lit_growattn.hf`) registers all five.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from lit_growattn.attention.value import rename_linear_keys, to_linear
from lit_growattn.hf.growable import GrowableAttention, growable_class, make_growable, named_growables
from lit_growattn.hf.surgery import NATIVE_ATTENTION, native_attention_class
from lit_growattn.training.writing import check_output, new_folder

PREFIX = "growattn_"


def natively_expressible(model: nn.Module) -> bool:
    for _, m in named_growables(model):
        if m.d_head != m.head_dim or m.rotary not in (0, m.head_dim):  # grown, or fewer rotary columns (keep_rotary)
            return False
        if m.value.d_v != m.head_dim:
            return False
        if hasattr(m, "q_norm") and not torch.allclose(m.log_tau, m.log_tau[:1].expand_as(m.log_tau), rtol=0, atol=0):
            return False
    return True


@torch.no_grad()
def to_native(attn: GrowableAttention) -> nn.Module:
    """The native attention module computing what `attn` computes (its width must be the original one)."""
    native_cls = next(c for c in type(attn).__mro__ if c.__module__.startswith("transformers."))
    native = native_cls(attn.config, layer_idx=attn.layer_idx).to(attn.w_q.device, attn.w_q.dtype)
    shared = native.state_dict().keys()  # the q/k norms
    native.load_state_dict({k: v for k, v in attn.state_dict().items() if k in shared}, strict=False)
    gain = attn.tau / attn.scaling  # (H,): native multiplies by `scaling`
    if hasattr(attn, "q_norm"):
        native.q_norm.weight.mul_(gain[0])  # RMSNorm is scale-invariant: the one temperature goes into its weight
        gain = torch.ones_like(gain)
    w_q, w_k = attn.w_q * gain[:, None, None], attn.w_k
    flat = lambda w: w.transpose(0, 1).reshape(w.shape[1], -1)  # (heads, e′, d) → (e′, heads·d)  # noqa: E731
    v_weight, v_bias, o_weight, o_bias = to_linear(attn.value)
    if hasattr(native, "c_attn"):  # GPT-2: Conv1D weights (in, out) are Linear weights transposed, the bias row last
        v = torch.cat([v_weight.T, v_bias[None]])
        fused = torch.cat([flat(w_q), flat(w_k), v], 1)
        native.c_attn.weight.copy_(fused[:-1])
        native.c_attn.bias.copy_(fused[-1])
        native.c_proj.weight.copy_(o_weight.T)
        native.c_proj.bias.copy_(o_bias)
        return native
    for proj, w in ((native.q_proj, w_q), (native.k_proj, w_k)):
        full = flat(w)
        proj.weight.copy_(full[: proj.in_features].T)
        if proj.bias is not None:
            proj.bias.copy_(full[-1])
    for proj, weight, bias in ((native.v_proj, v_weight, v_bias), (native.o_proj, o_weight, o_bias)):
        proj.weight.copy_(weight)
        if proj.bias is not None:
            proj.bias.copy_(bias)
    return native


def export(model: nn.Module, out: str | os.PathLike, overwrite: bool = False) -> str:
    """Writes `model` (a growable AutoModelForCausalLM, unchanged) to the folder `out`; returns the model type written.
    `out` is written whole or not at all (`lit_growattn.training.writing`): never onto, into or above the folder the
    model was loaded from, and in place of an existing non-empty folder only with overwrite=True."""
    loaded_from = model.config.name_or_path
    out = check_output(out, "folder", {"the folder the model was loaded from": loaded_from if os.path.isdir(
        loaded_from) else None}, overwrite, option="out")
    with new_folder(out, overwrite, option="out") as folder:
        return save_export(model, folder)


def save_export(model: nn.Module, folder: str | os.PathLike) -> str:
    """export's writing, into `folder` as it is: for a folder of the writing layer that gets more files (the
    `export` command adds the tokenizer)."""
    model = copy.deepcopy(model)
    base_type = model.config.model_type.removeprefix(PREFIX)
    settings = {k: v for k, v in model.config.to_dict().items()
                if k not in ("model_type", "architectures", "transformers_version")}
    if natively_expressible(model):
        for name, attn in named_growables(model):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, to_native(attn))
        if model.config.model_type.startswith(PREFIX):
            # Loaded from a growattn_<type> folder, and its widths ended native (shrunk back, or never grown): its
            # attention modules are native now, so its config and class are too; the grown ones would look for
            # w_q/w_k/value tensors the folder does not hold, and load them random.
            config_cls, model.__class__ = base_classes(base_type)
            model.config = config_cls(**{k: v for k, v in settings.items() if k not in GROWN_FIELDS})
    else:
        config_cls, model.__class__ = grown_classes(base_type)
        model.config = config_cls(**settings | {"qk_head_sizes": [m.d_head for _, m in named_growables(model)],
                                                "qk_rotary": [m.rotary for _, m in named_growables(model)],
                                                "v_head_sizes": [m.value.d_v for _, m in named_growables(model)]})
    model.save_pretrained(folder)
    return model.config.model_type


GROWN_FIELDS = ("qk_head_sizes", "qk_rotary", "v_head_sizes")  # what a growattn_<type> config adds to its base's


def base_classes(base_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) of the native `base_type`, e.g. LlamaConfig, LlamaForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base_config = type(AutoConfig.for_model(base_type))
    return base_config, AutoModelForCausalLM._model_mapping[base_config]


_GROWN: dict[str, tuple[type, type]] = {}


def grown_classes(base_type: str) -> tuple[type, type]:
    """(config class, model class) of grown models of `base_type`, e.g. GrowAttnLlamaConfig, GrowAttnLlamaForCausalLM."""
    if base_type not in _GROWN:
        base_config, base_model = base_classes(base_type)
        stem = base_config.__name__.removesuffix("Config")

        def config_init(self, qk_head_sizes: list[int] | None = None, qk_rotary: list[int] | None = None,
                        v_head_sizes: list[int] | None = None, **kwargs):
            base_config.__init__(self, **kwargs)
            self.qk_head_sizes, self.qk_rotary, self.v_head_sizes = qk_head_sizes, qk_rotary, v_head_sizes

        def model_init(self, config):
            base_model.__init__(self, config)
            make_growable(self)
            for (_, attn), r in zip(named_growables(self), config.qk_rotary or []):
                if r != attn.rotary:
                    attn.keep_rotary(r)
            for (_, attn), d in zip(named_growables(self), config.qk_head_sizes or []):
                attn.resize(d)
            for (_, attn), d in zip(named_growables(self), config.v_head_sizes or []):  # none before value growth
                attn.value.resize(d)

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path=None, *args, config=None, **kwargs):
            folder = pretrained_model_name_or_path
            if folder is not None and os.path.isdir(folder):
                config = cls.config_class.from_pretrained(folder) if config is None else config
                if config.v_head_sizes is None:  # written before the value map
                    kwargs["state_dict"], folder = former_layout_weights(folder, config), None
            return super(model_cls, cls).from_pretrained(folder, *args, config=config, **kwargs)

        # type() takes __module__ from this module's globals: pickling finds the classes here by name
        config_cls = type(f"GrowAttn{stem}Config", (base_config,),
                          {"model_type": PREFIX + base_type, "base_model_type": base_type, "__init__": config_init})
        model_cls = type(f"GrowAttn{base_model.__name__}", (base_model,),
                         {"config_class": config_cls, "__init__": model_init, "from_pretrained": from_pretrained})
        _GROWN[base_type] = config_cls, model_cls
    return _GROWN[base_type]


def __getattr__(name: str) -> type:
    """Pickling (torch.save of a whole model, ddp_spawn) finds a grown class by name here, also in a process that
    has not made it yet."""
    for base_type in NATIVE_ATTENTION if name.startswith("GrowAttn") else ():
        found = [cls for cls in grown_classes(base_type) if cls.__name__ == name]
        if found:
            return found[0]
    raise AttributeError(name)


def former_layout_weights(folder: str, config) -> dict[str, torch.Tensor]:
    """The weights of a growattn_<type> folder written before the value map, with each attention's v/o modules
    rewritten into its value map's tensors (exactly: the same numbers, rearranged)."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights; save the model again with save_pretrained")
    state_dict = {k: v for f in files for k, v in load_file(os.path.join(folder, f)).items()}
    former = growable_class(native_attention_class(config.base_model_type)).former_value_modules
    n_head = config.num_attention_heads
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    suffix = f"{former['v']}.weight"
    for prefix in [key.removesuffix(suffix) for key in state_dict if key.endswith(f".{suffix}")]:
        rename_linear_keys(state_dict, prefix, n_kv_head, n_head, **former)
    return state_dict


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
