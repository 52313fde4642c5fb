"""HFCausalLM: a LightningModule holding a Hugging Face `AutoModelForCausalLM` whose attention is growable, so that
the same GrowAttentionCallback grows it (it implements `lit_growattn.contract.GrowableModule`).

Built from a local model folder (`pretrained`, as written by save_pretrained or downloaded beforehand: nothing is
fetched from a hub) or from a config mapping (`config`, with its `model_type`, for training from scratch).
Batches are the data modules' (inputs, labels) pairs with labels already shifted, so the loss is a plain
cross-entropy (the model's own loss would shift a second time).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from lit_growattn.checkpoint import resize_to_checkpoint
from lit_growattn.contract import NamedForm
from lit_growattn.hf.dint_models import DINT_MODEL_TYPES
from lit_growattn.hf.growable import GrowableAttention, make_growable
from lit_growattn.hf.surgery import NATIVE_ATTENTION, supported
from lit_growattn.optimization import GrowthOptimization, default_optimizer


def build_model(pretrained: str | None, config: dict[str, Any] | None, attn_implementation: str):
    """The AutoModelForCausalLM of a local folder or a config mapping; the model type is checked before any weight
    is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (pretrained is None) == (config is None):
        raise ValueError("give exactly one of `pretrained` (a local model folder) or `config` (a mapping with "
                         "`model_type`, to train from scratch)")
    if pretrained is not None:
        if not os.path.isfile(os.path.join(pretrained, "config.json")):
            raise FileNotFoundError(f"pretrained={pretrained!r} is not a model folder (no config.json there); give a "
                                    "local folder written by save_pretrained (models are never downloaded here)")
        hf_config = AutoConfig.from_pretrained(pretrained)
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
                         f"(and their DINT conversions, {', '.join(DINT_MODEL_TYPES)})")
    if pretrained is not None:
        return AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32, attn_implementation=attn_implementation)
    return AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)


class HFCausalLM(GrowthOptimization, L.LightningModule):
    """Args:
        pretrained: a local model folder (config.json and weights), e.g. one downloaded beforehand.
        config: or a config mapping with `model_type` (llama, mistral, qwen2, qwen3, gpt2), for training from scratch.
        vocab_size, block_size: linked from the data module by the CLI; a tokenizer with more tokens than the model's
            vocabulary, or blocks longer than its positions, are refused before training.
        rotary_dim: with `config` only, the rotary query/key columns per head: the RoPE of a model of head_dim =
            rotary_dim (every head_dim/rotary_dim-th frequency pair) while v keeps head_dim; to start growth from a
            query/key width below head_dim. None: head_dim rotary columns, as the model has.
        head_sizes: query/key head size per layer (recorded after growth, so that a grown checkpoint rebuilds).
        attn_implementation: transformers' attention interface (sdpa | eager | …).
        growable: convert the attention into growable attention (for GrowAttentionCallback); false keeps the
            model's attention as loaded, e.g. a DINT model written by `convert --pretrained` (seed 001), which the
            growth callback cannot grow.
        optimizer, scheduler, lr_schedule, warmup_steps, min_lr_ratio: as on GrowAttentionLM.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        block_size: int | None = None,
        rotary_dim: int | None = None,
        head_sizes: list[int] | None = None,
        attn_implementation: str = "sdpa",
        growable: bool = True,
        optimizer: OptimizerCallable = default_optimizer,
        scheduler: LRSchedulerCallable | None = None,
        lr_schedule: Literal["cosine", "constant"] = "cosine",
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        if config is not None and vocab_size is not None:
            config = {"vocab_size": vocab_size, **config}  # from scratch: the tokenizer's size unless given
        self.model = build_model(pretrained, config, attn_implementation)
        self._check_data_fits(vocab_size, block_size)
        if growable and self.model.config.model_type in DINT_MODEL_TYPES:
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
        if head_sizes is not None:
            if len(head_sizes) != len(self.growable_forms()):
                raise ValueError(f"head_sizes has {len(head_sizes)} entries for {len(self.growable_forms())} layers")
            for named, d in zip(self.growable_forms(), head_sizes):
                named.form.resize(d)
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self._total_steps = 1

    def _check_data_fits(self, vocab_size: int | None, block_size: int | None) -> None:
        cfg = self.model.config
        if vocab_size is not None and vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {vocab_size} tokens but the model's vocabulary has {cfg.vocab_size}: "
                             "use the model's own tokenizer (--data.init_args.tokenizer <model folder>)")
        positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if block_size is not None and positions is not None and block_size > positions:
            raise ValueError(f"blocks of {block_size} tokens exceed the model's {positions} positions: lower block_size")

    # -- what GrowAttentionCallback needs (lit_growattn.contract.GrowableModule) ------------------
    def growable_forms(self) -> list[NamedForm]:
        return [NamedForm(m.layer_idx, f"model.{name}", m) for name, m in self.model.named_modules()
                if isinstance(m, GrowableAttention)]

    def head_sizes(self) -> list[int]:
        return [named.form.d_head for named in self.growable_forms()]

    def record_head_sizes(self) -> None:
        self.hparams["head_sizes"] = self.head_sizes()

    def batch_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, labels = batch
        return F.cross_entropy(self(inputs).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        resize_to_checkpoint(self, state_dict)
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.record_head_sizes()
        return result

    # -- steps ---------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.batch_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        loss = self.batch_loss(batch)
        names = getattr(self.trainer.datamodule, "val_names", None) if self._trainer else None
        name = names[dataloader_idx] if names else ""  # "" is the main held-out set: `val/loss`
        prefix = f"val/{name}" if name else "val"
        self.log(f"{prefix}/loss", loss, prog_bar=not name, add_dataloader_idx=False, sync_dist=True)
        return loss
