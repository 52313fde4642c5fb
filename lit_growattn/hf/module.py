"""HFCausalLM: a LightningModule holding a Hugging Face `AutoModelForCausalLM` whose attention is growable, so that
the same GrowAttentionCallback grows it (it implements `lit_growattn.contract.GrowableModule`).

Built from a local model folder (`pretrained`, as written by save_pretrained or downloaded beforehand: nothing is
fetched from a hub) or from a config mapping (`config`, with its `model_type`, for training from scratch).
Batches are the data modules' (inputs, labels) pairs with labels already shifted, so the loss is a plain
cross-entropy (the model's own loss would shift a second time).

A checkpoint does not need the pretrained folder: the folder's config is recorded in the hyperparameters
(`pretrained_config`), and the weights are in the checkpoint. Where a folder is there, it must hold that config.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lit_growattn.contract import NamedForm
from lit_growattn.data.tokenizer import load_tokenizer, vocabulary
from lit_growattn.hf.growable import make_growable, named_growables
from lit_growattn.hf.surgery import NATIVE_ATTENTION, supported
from lit_growattn.training.divergence import MAX_NONFINITE_STEPS
from lit_growattn.training.fsdp2 import FsdpParamDtype
from lit_growattn.training.lm import NOT_HPARAMS, GrowableLM
from lit_growattn.training.optimization import LR_SCHEDULE, MIN_LR_RATIO, WARMUP_STEPS, LrSchedule, default_optimizer


def build_model(pretrained: str | None, config: dict[str, Any] | None, attn_implementation: str,
                pretrained_config: dict[str, Any] | None = None):
    """The AutoModelForCausalLM of a local folder or a config mapping, in train mode; the model type is checked
    before any weight is read. A folder that is gone is rebuilt from its recorded `pretrained_config` (random
    weights, for a checkpoint's state dict to fill)."""
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    if (pretrained is None) == (config is None):
        raise ValueError("give exactly one of `pretrained` (a local model folder) or `config` (a mapping with "
                         "`model_type`, to train from scratch)")
    in_folder = pretrained is not None and os.path.isfile(os.path.join(pretrained, "config.json"))
    if pretrained is not None and not in_folder and pretrained_config is None:
        raise FileNotFoundError(f"pretrained={pretrained!r} is not a model folder (no config.json there); give a "
                                "local folder written by save_pretrained (models are never downloaded here)")
    if in_folder:
        hf_config = AutoConfig.from_pretrained(pretrained)
        if pretrained_config is not None:  # a checkpoint's model: the folder must hold the config it recorded
            refuse_another_model(pretrained, hf_config, pretrained_config)
    elif pretrained is not None:
        hf_config = CONFIG_MAPPING[pretrained_config["model_type"]].from_dict(pretrained_config)
    else:
        settings = dict(config)
        model_type = settings.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"config needs a `model_type` (one of {supported()})")
        if model_type not in NATIVE_ATTENTION:
            raise ValueError(f"model_type {model_type!r} is not supported; supported model types: {supported()}")
        hf_config = AutoConfig.for_model(model_type, **settings)
    if getattr(hf_config, "base_model_type", hf_config.model_type) not in NATIVE_ATTENTION:
        raise ValueError(f"{pretrained} is a {hf_config.model_type!r} model; supported model types: {supported()} "
                         "(and their DINT conversions, dint_<type>)")
    if in_folder:
        model = from_pretrained(pretrained, dtype=torch.float32, attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation=attn_implementation)
    # from_pretrained returns the model in eval mode, and Lightning keeps modules' modes: fine-tuning would run
    # without dropout.
    return model.train()


# Fields of config.json that say how a folder was written or is loaded, or what generation and the Auto classes do
# around the model, not what its forward computes: the transformers release that wrote it, the folder's own path, the
# class names, the dtype it was saved in (weights are read in float32 here), the attention kernel (HFCausalLM's own
# attn_implementation setting picks it), `auto_map` (which code loads it), the special token ids (the tokenizer's
# business; a folder often gains a pad_token_id), the cache and output switches, and the task heads' labels. Any
# other field differing is another model, e.g. tie_word_embeddings or rope_parameters.
LOADING_FIELDS = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
                  "attn_implementation", "_attn_implementation", "auto_map", "bos_token_id", "eos_token_id",
                  "pad_token_id", "tokenizer_class", "use_cache", "output_attentions", "output_hidden_states",
                  "return_dict", "torchscript", "id2label", "label2id", "problem_type", "task_specific_params"}


def refuse_another_model(folder: str, hf_config, recorded: dict[str, Any]) -> None:
    """Refuses a pretrained folder whose config is not the one a checkpoint recorded: its weights would be laid out
    the same and compute something else (different logits, no error)."""
    from transformers import CONFIG_MAPPING

    # The recorded mapping read back by this transformers release, as the folder's is: fields a newer release adds
    # then carry the same defaults on both sides.
    recorded = CONFIG_MAPPING[recorded["model_type"]].from_dict(recorded).to_dict()
    found = hf_config.to_dict()
    fields = ["model_type"] if recorded["model_type"] != found["model_type"] else sorted(
        k for k in recorded.keys() | found.keys() if k not in LOADING_FIELDS and recorded.get(k) != found.get(k))
    if fields:
        listed = "; ".join(f"{k}: recorded {recorded.get(k)!r}, folder {found.get(k)!r}" for k in fields)
        raise ValueError(f"{folder} is not the model this checkpoint was trained from: its config.json differs from "
                         f"the config the checkpoint recorded ({listed}). Point at the folder the model was trained "
                         "from (export: --pretrained DIR; Python: HFCausalLM.load_from_checkpoint(CKPT, "
                         f"pretrained=DIR)); where that folder is lost, move {folder} away: the model is then rebuilt "
                         "from the config the checkpoint recorded (export also needs the tokenizer the model was "
                         "trained with: --tokenizer DIR, a copy of it)")


def from_pretrained(folder: str, **kwargs):
    """The folder's model (kwargs go to AutoModelForCausalLM.from_pretrained); a damaged weights file is named
    (safetensors' own error does not)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except SafetensorError as error:
        files = ", ".join(unreadable_safetensors(folder)) or f"a .safetensors file in {folder}"
        raise ValueError(f"{files} is damaged (truncated or overwritten?) and cannot be read ({error}); save or "
                         "download the model folder again") from error


def unreadable_safetensors(folder: str) -> list[str]:
    """The .safetensors files of `folder` whose header cannot be read (e.g. truncated)."""
    from safetensors import SafetensorError, safe_open

    unreadable = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(folder, name), "pt"):
                    pass
            except SafetensorError:
                unreadable.append(os.path.join(folder, name))
    return unreadable


class HFCausalLM(GrowableLM):
    """Args:
        pretrained: a local model folder (config.json and weights), e.g. one downloaded beforehand. Its tokenizer is
            the one to train with: the CLI gives it to a data module whose tokenizer is left out, and a data
            tokenizer of another vocabulary is refused at setup.
        config: or a config mapping with `model_type` (llama, mistral, qwen2, qwen3, gpt2), for training from scratch.
        vocab_size, block_size: linked from the data module by the CLI; a tokenizer with more tokens than the model's
            vocabulary, or blocks longer than its positions, are refused before training.
        rotary_dim: with `config` only, the rotary query/key columns per head: the RoPE of a model of head_dim =
            rotary_dim (every head_dim/rotary_dim-th frequency pair) while v keeps head_dim; to start growth from a
            query/key width below head_dim. None: head_dim rotary columns, as the model has.
        head_sizes: query/key head size per layer (recorded after growth, so that a grown checkpoint rebuilds).
        v_head_sizes: value head size per layer (recorded after a value growth, docs/value.md).
        attn_implementation: transformers' attention interface (sdpa | eager | …).
        growable: convert the attention into growable attention (for GrowAttentionCallback); false keeps the
            model's attention as loaded, e.g. a DINT model written by `convert --pretrained` (seed 001), which the
            growth callback cannot grow.
        optimizer, scheduler, lr_schedule, warmup_steps, min_lr_ratio, init_from, max_nonfinite_steps,
            fsdp_param_dtype: as on GrowAttentionLM.
        tokenizer: the tokenizer the model is trained with, recorded at setup from the data module: 'bytes', a
            tokenizer.json file or a folder holding one, or a hub name. The CLI gives it to a data module whose
            tokenizer is left out (so a resumed run keeps its tokenizer).
        pretrained_config: recorded: the pretrained folder's config (config.json as a mapping), from which a
            checkpoint rebuilds the model when the folder has moved, and which a folder found must match.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        block_size: int | None = None,
        rotary_dim: int | None = None,
        head_sizes: list[int] | None = None,
        v_head_sizes: list[int] | None = None,
        attn_implementation: str = "sdpa",
        growable: bool = True,
        optimizer: OptimizerCallable = default_optimizer,
        scheduler: LRSchedulerCallable | None = None,
        lr_schedule: LrSchedule = LR_SCHEDULE,
        warmup_steps: int = WARMUP_STEPS,
        min_lr_ratio: float = MIN_LR_RATIO,
        init_from: str | None = None,
        max_nonfinite_steps: int = MAX_NONFINITE_STEPS,
        fsdp_param_dtype: FsdpParamDtype | None = None,
        tokenizer: str | None = None,
        pretrained_config: dict[str, Any] | None = None,
    ):  # pragma: no mutate block  (save_hyperparameters reads this frame: docs/testing.md)
        super().__init__()
        self.save_hyperparameters(ignore=NOT_HPARAMS)
        self._init_training(optimizer, scheduler, max_nonfinite_steps, fsdp_param_dtype)
        if config is not None and vocab_size is not None:
            config = {"vocab_size": vocab_size, **config}  # from scratch: the tokenizer's size unless given
        self.model = build_model(pretrained, config, attn_implementation, pretrained_config)
        if pretrained is not None:
            self.hparams["pretrained_config"] = self.model.config.to_dict()
        self._check_data_fits(vocab_size, block_size)
        if growable and getattr(self.model.config, "dint", None) is not None:  # a DINT conversion's settings
            raise ValueError(f"{pretrained} holds a DINT model, whose attention cannot be made growable: set "
                             "--model.init_args.growable=false to fine-tune it")
        if growable and not self.growable_forms():  # an exported grown model (growattn_<type>) comes growable
            make_growable(self.model)
        if rotary_dim is not None:
            if pretrained is not None or not growable:
                raise ValueError("rotary_dim drops rotary columns, so it is for growable models trained from scratch "
                                 "(`config`), not a pretrained folder")
            for named in self.growable_forms():
                named.form.keep_rotary(rotary_dim)
        given = [n for n, v in [("head_sizes", head_sizes), ("v_head_sizes", v_head_sizes)] if v is not None]
        if given and not self.growable_forms():
            nulls = " ".join(f"--model.init_args.{name}=null" for name in given)
            raise ValueError(f"{' and '.join(given)} size growable attention, but growable=false keeps the model's own "
                             f"attention: set growable=true (a checkpoint of a growth run needs it), or set "
                             f"{' and '.join(given)} to null ({nulls})")
        if head_sizes is not None:
            if len(head_sizes) != len(self.growable_forms()):
                raise ValueError(f"head_sizes has {len(head_sizes)} entries for {len(self.growable_forms())} layers")
            for named, d in zip(self.growable_forms(), head_sizes):
                named.form.resize(d)
        if v_head_sizes is not None:
            if len(v_head_sizes) != len(self.growable_values()):
                raise ValueError(f"v_head_sizes has {len(v_head_sizes)} entries for {len(self.growable_values())} layers")
            for named, d in zip(self.growable_values(), v_head_sizes):
                named.form.resize(d)
        self._load_init(init_from)

    def _check_data_fits(self, vocab_size: int | None, block_size: int | None) -> None:
        cfg = self.model.config
        if vocab_size is not None and vocab_size > cfg.vocab_size:
            fix = ("train it with its folder's tokenizer, --data.init_args.tokenizer=null (if that is the one given, "
                   "the folder's tokenizer does not belong to its weights)" if self.hparams.pretrained is not None
                   else f"raise vocab_size in the model's config to at least {vocab_size}")
            raise ValueError(f"the tokenizer has {vocab_size} tokens but the model's vocabulary has {cfg.vocab_size}: "
                             f"{fix}")
        positions = getattr(cfg, "max_position_embeddings", None)  # GPT-2's config maps it to n_positions
        if block_size is not None and positions is not None and block_size > positions:
            raise ValueError(f"blocks of {block_size} tokens exceed the model's {positions} positions: lower block_size")

    # -- what GrowAttentionCallback needs (lit_growattn.contract.GrowableModule) ------------------
    def growable_forms(self) -> list[NamedForm]:
        return [NamedForm(m.layer_idx, f"model.{name}", m) for name, m in named_growables(self.model)]

    def head_sizes(self) -> list[int]:
        return [named.form.d_head for named in self.growable_forms()]

    def growable_values(self) -> list[NamedForm]:
        return [NamedForm(named.layer, f"{named.name}.value", named.form.value) for named in self.growable_forms()]

    def value_sizes(self) -> list[int]:
        return [named.form.d_v for named in self.growable_values()]

    def record_head_sizes(self) -> None:
        self.hparams["head_sizes"] = self.head_sizes()
        self.hparams["v_head_sizes"] = self.value_sizes()

    def batch_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, labels = batch
        return self.loss(self(inputs), labels)

    # -- what growth under FSDP2 needs (lit_growattn.contract.ShardableModule) -------------------
    def blocks(self) -> nn.ModuleList:
        base = self.model.base_model
        return base.h if hasattr(base, "h") else base.layers  # GPT-2 names its decoder layers h

    def build_block(self, layer: int) -> nn.Module:
        """A new decoder layer of `layer`'s class with the project's surgery (growable attention) and the rotary
        columns the layer keeps now (`keep_rotary`, which loading a state does not restore); its head sizes are the
        config's until loading a block's state resizes them (`Resizable.resize_to`)."""
        now = self.blocks()[layer]
        # Its own class: a sharded layer's is the subclass fully_shard made (FSDPLlamaDecoderLayer), an FSDPModule
        # without FSDP state.
        cls = next(c for c in type(now).__mro__ if not issubclass(c, FSDPModule))
        block = cls(self.model.config, layer)
        make_growable(block, self.model.config)
        for (_, new), (_, kept) in zip(named_growables(block), named_growables(now), strict=True):
            if new.rotary != kept.rotary:
                new.keep_rotary(kept.rotary)
        return block

    def _former_value_layout(self) -> tuple[str, str] | None:
        if not self.growable_forms():  # a model kept as loaded (growable=false) still has its v_proj
            return None
        return "attn.v_proj.weight", "v_proj and o_proj (GPT-2: c_proj)"

    # -- the data's tokenizer -------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        super().setup(stage)  # GrowableLM: fsdp_param_dtype's refusals; DivergenceGuard: refuses 16-true
        datamodule = self.trainer.datamodule
        if getattr(datamodule, "tokenizer_source", None) is not None:
            self._check_tokenizer(datamodule.tokenizer, datamodule.tokenizer_source)
            source = datamodule.tokenizer_source
            # A local path is recorded absolute: export and a resumed run may start in another working directory.
            self.hparams["tokenizer"] = os.path.abspath(source) if os.path.exists(source) else source

    def _check_tokenizer(self, tokenizer, source: str) -> None:
        """The data's tokenizer must be the pretrained folder's (when the folder has one): the embeddings' rows are
        its tokens."""
        folder = self.hparams.pretrained
        if folder is None or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return
        own, given = vocabulary(load_tokenizer(folder)), vocabulary(tokenizer)
        if given == own:
            return
        if given is None:
            differs = f"raw bytes against a vocabulary of {len(own)} tokens"
        else:
            changed = sum(own.get(token) != i for token, i in given.items()) + len(own.keys() - given.keys())
            differs = f"vocabularies of {len(given)} and {len(own)} tokens, {changed} of them differing"
        raise ValueError(f"the data's tokenizer {source!r} does not match the model's, {folder} ({differs}): train "
                         f"with the model's, --data.init_args.tokenizer={folder}")

    # -- steps ---------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.batch_loss(batch)
        self.observe_loss(loss, batch_idx)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], split: str, dataloader_idx: int) -> Tensor:
        loss = self.batch_loss(batch)
        names = getattr(self.trainer.datamodule, "val_names", None) if self._trainer else None
        name = names[dataloader_idx] if names else ""  # "" is the main held-out set: `val/loss`, `test/loss`
        prefix = f"{split}/{name}" if name else split
        self.log(f"{prefix}/loss", loss, prog_bar=not name, add_dataloader_idx=False, sync_dist=True)
        return loss
