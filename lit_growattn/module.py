"""The LightningModule: a GPT with pluggable attention, trained on (inputs, labels) batches.

The optimizer and scheduler are callables (not a top-level `optimizer:` block of LightningCLI), because a
growth event resizes parameters and has to build them again (docs/design.md, "Lightning mechanics").
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from lit_growattn.attention.sdpa import SdpaPad
from lit_growattn.contract import NamedForm
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT, Block
from lit_growattn.training.divergence import MAX_NONFINITE_STEPS
from lit_growattn.training.fsdp2 import FsdpParamDtype
from lit_growattn.training.lightning_private import accumulation_open_after_this_batch, should_update_logs
from lit_growattn.training.lm import NOT_HPARAMS, GrowableLM
from lit_growattn.training.optimization import LR_SCHEDULE, MIN_LR_RATIO, WARMUP_STEPS, LrSchedule, default_optimizer


class GrowAttentionLM(GrowableLM):
    """Args:
        vocab_size, block_size: normally linked from the data module by the CLI.
        n_layer, n_head, n_embd: transformer size.
        d_head: query/key head size (int, or one per layer: a grown checkpoint records its per-layer sizes).
        d_v: value head size (int, or one per layer: a checkpoint whose value side grew records its per-layer
            sizes; None → n_embd // n_head); independent of d_head.
        bias: biases in attention and MLP (the query/key bias is grown with its columns).
        dropout: residual and embedding dropout.
        attention: registered attention name (see `lit_growattn.attention.ATTENTIONS`).
        attention_args: extra keyword arguments of the attention variant.
        optimizer: optimizer callable, given the parameter groups (no weight decay on <2-D tensors and temperatures).
        scheduler: LR scheduler callable; None → linear warmup then cosine decay to `min_lr_ratio`.
        warmup_steps, min_lr_ratio: the built-in schedule (used when `scheduler` is None).
        init_from: start from the weights of this checkpoint (a fresh run: optimizer, steps and schedule start anew).
        sdpa_pad: pad attention head sizes to what the fused SDPA kernels accept (exact): auto (on CUDA only) | on | off.
        compile: run training steps through `torch.compile`d transformer blocks, recompiled after each growth.
        max_nonfinite_steps: stop with an error once the training loss has been NaN/inf for this many consecutive
            steps (one alone is tolerated: a 16-mixed overflow, which the gradient scaler skips).
        fsdp_param_dtype: under ModelParallelStrategy, FSDP2's mixed precision: 'bfloat16' all-gathers the weights in
            bfloat16 for forward and backward and reduces gradients in float32, while the sharded weights and the
            optimizer state stay float32 (with precision '32-true' or 'bf16-mixed'); null computes in float32.
            A setting of the module because Lightning leaves FSDP2's sharding, and so its policy, to the module's
            configure_model; refused under other strategies.
    """

    def __init__(
        self,
        vocab_size: int = GPTConfig.vocab_size,
        block_size: int = GPTConfig.block_size,
        n_layer: int = GPTConfig.n_layer,
        n_head: int = GPTConfig.n_head,
        n_embd: int = GPTConfig.n_embd,
        d_head: int | list[int] = GPTConfig.d_head,
        d_v: int | list[int] | None = GPTConfig.d_v,
        bias: bool = GPTConfig.bias,
        dropout: float = GPTConfig.dropout,
        attention: str = GPTConfig.attention,
        attention_args: dict[str, Any] | None = None,
        optimizer: OptimizerCallable = default_optimizer,
        scheduler: LRSchedulerCallable | None = None,
        lr_schedule: LrSchedule = LR_SCHEDULE,
        warmup_steps: int = WARMUP_STEPS,
        min_lr_ratio: float = MIN_LR_RATIO,
        init_from: str | None = None,
        sdpa_pad: SdpaPad | bool = GPTConfig.sdpa_pad,
        compile: bool = False,
        max_nonfinite_steps: int = MAX_NONFINITE_STEPS,
        fsdp_param_dtype: FsdpParamDtype | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=NOT_HPARAMS)
        self.cfg = GPTConfig(
            vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
            d_head=d_head, d_v=d_v, bias=bias, dropout=dropout, attention=attention,
            attention_args=dict(attention_args or {}), sdpa_pad=sdpa_pad,
        )
        if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"need warmup_steps ≥ 0 and 0 ≤ min_lr_ratio ≤ 1, got {warmup_steps}, {min_lr_ratio}")
        self._init_training(optimizer, scheduler, max_nonfinite_steps, fsdp_param_dtype)
        self.model = GPT(self.cfg)
        if compile:
            self.model.compile_blocks()
        self.train_acc = MulticlassAccuracy(vocab_size, average="micro", ignore_index=-100)
        self.eval_metrics = nn.ModuleDict()  # filled in `setup`, one set per evaluation loader
        # Compute seen so far, so that grown and static runs can be compared on tokens and FLOPs.
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("flops_seen", torch.zeros((), dtype=torch.float64))
        self._load_init(init_from)

    # -- model ---------------------------------------------------------------------------------
    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    # -- what GrowAttentionCallback needs (lit_growattn.contract.GrowableModule) ------------------
    def growable_forms(self) -> list[NamedForm]:
        return [NamedForm(i, f"model.{name}", form) for i, name, form in self.model.named_qk_forms()]

    def head_sizes(self) -> list[int]:
        return self.model.head_sizes()

    def growable_values(self) -> list[NamedForm]:
        return [NamedForm(i, f"model.{name}", values) for i, name, values in self.model.named_value_maps()]

    def value_sizes(self) -> list[int]:
        return self.model.value_sizes()

    # -- what growth under FSDP2 needs (lit_growattn.contract.ShardableModule) ---------------------
    def blocks(self) -> nn.ModuleList:
        return self.model.blocks

    def build_block(self, layer: int) -> Block:
        return Block(self.cfg, layer)

    def configure_model(self) -> None:
        if self.device_mesh is not None and self.model.compiled is not None:
            raise ValueError("compile: true does not run under ModelParallelStrategy yet (the compiled blocks would "
                             "not follow the blocks a growth re-shards): set compile: false, or use strategy='ddp'")
        super().configure_model()

    def batch_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, labels = batch
        return self.loss(self(inputs), labels)

    def _former_value_layout(self) -> tuple[str, str]:
        return ".attn.v.weight", "`v` and `o` (nn.Linear)"

    def _per_layer(self, name: str) -> list[int]:
        """The per-layer sizes that hparams[name] (d_head or d_v: one value, one per layer, or None) describe."""
        value = self.hparams[name]
        if isinstance(value, list):
            return value
        return [self.cfg.n_embd // self.cfg.n_head if value is None else value] * self.cfg.n_layer

    def record_head_sizes(self) -> None:
        """Keeps hparams in step with the grown shapes (query/key and value), so that `load_from_checkpoint` builds
        the right sizes; hparams that already describe them are left as they are."""
        for name, sizes in (("d_head", self.head_sizes()), ("d_v", self.value_sizes())):
            if self._per_layer(name) != sizes:
                self.hparams[name] = sizes

    # -- steps ---------------------------------------------------------------------------------
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        logits = self(inputs)
        loss = self.loss(logits, labels)
        self.observe_loss(loss, batch_idx)
        tokens = inputs.numel() * self.trainer.world_size
        self.tokens_seen += tokens
        self.flops_seen += tokens * self.model.flops_per_token(inputs.shape[1])
        self.log("train/loss", loss, prog_bar=True)
        # The other step scalars only at the logger's cadence (as Lightning's LearningRateMonitor reads it): each
        # self.log costs about a millisecond, which adds up to several percent of a fast GPU step.
        if should_update_logs(self.trainer):
            self._log_step_scalars(logits, labels, loss)
        return loss

    def _log_step_scalars(self, logits: Tensor, labels: Tensor, loss: Tensor) -> None:
        self.train_acc(logits.detach().argmax(-1), labels)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False)
        self.log("train/tokens_seen", self.tokens_seen.float(), on_step=True, on_epoch=False)
        self.log("train/flops_seen", self.flops_seen.float(), on_step=True, on_epoch=False)
        self._log_against_compute(loss)
        for i, forms in enumerate(self.model.qk_forms()):
            if forms:
                tau = torch.cat([f.tau.detach() for f in forms]).mean()
                self.log(f"attention/temperature/layer_{i}", tau, on_step=True, on_epoch=False)

    def _log_against_compute(self, loss: Tensor) -> None:
        """TensorBoard curves of the training loss with tokens and FLOPs as the x-axis."""
        trainer = self.trainer
        if not (trainer.is_global_zero and isinstance(self.logger, TensorBoardLogger)):
            return
        # Once per logged optimizer step: on the last micro-batch of an accumulation window.
        if accumulation_open_after_this_batch(trainer):
            return
        writer = self.logger.experiment
        writer.add_scalar("compute/loss_vs_tokens", loss.item(), int(self.tokens_seen))
        writer.add_scalar("compute/loss_vs_flops", loss.item(), int(self.flops_seen))

    def _eval_name(self, dataloader_idx: int) -> str:
        names = getattr(self.trainer.datamodule, "val_names", None)
        return names[dataloader_idx] if names else ""

    def setup(self, stage: str) -> None:
        super().setup(stage)  # GrowableLM: fsdp_param_dtype's refusals; DivergenceGuard: refuses 16-true
        # Metrics must exist before the first `self.log` of a metric: Lightning looks up their attribute names once.
        names = getattr(self.trainer.datamodule, "val_names", None) or [""]
        for split in ("val", "test"):
            for name in names:
                key = self._metrics_key(split, name)
                if key not in self.eval_metrics:
                    self.eval_metrics[key] = nn.ModuleDict(
                        {
                            "acc": MulticlassAccuracy(self.cfg.vocab_size, average="micro", ignore_index=-100),
                            "ppl": Perplexity(ignore_index=-100),
                        }
                    )

    @staticmethod
    def _metrics_key(split: str, name: str) -> str:
        return f"{split}_{name}" if name else split

    def _eval_step(self, batch: tuple[Tensor, Tensor], split: str, dataloader_idx: int) -> Tensor:
        """Logs `<split>/loss|acc|ppl` for the primary set and `<split>/<name>/…` for named extra sets."""
        inputs, labels = batch
        logits = self(inputs)
        loss = self.loss(logits, labels)
        name = self._eval_name(dataloader_idx)
        prefix = f"{split}/{name}" if name else split
        metrics = self.eval_metrics[self._metrics_key(split, name)]
        metrics["acc"](logits.argmax(-1), labels)
        metrics["ppl"](logits.float(), labels)
        self.log(f"{prefix}/loss", loss, prog_bar=prefix == "val", add_dataloader_idx=False, sync_dist=True)
        self.log(f"{prefix}/acc", metrics["acc"], prog_bar=prefix == "val", add_dataloader_idx=False)
        self.log(f"{prefix}/ppl", metrics["ppl"], add_dataloader_idx=False)
        self._log_bits_per_byte(prefix, loss, dataloader_idx)
        return loss

    def _log_bits_per_byte(self, prefix: str, loss: Tensor, dataloader_idx: int) -> None:
        """`<prefix>/bpb` = nats per token ÷ (ln 2 × bytes per token): comparable across tokenizers."""
        bytes_per_token = getattr(self.trainer.datamodule, "bytes_per_token", None)
        if bytes_per_token:
            bpb = loss / (math.log(2) * bytes_per_token[dataloader_idx])
            self.log(f"{prefix}/bpb", bpb, add_dataloader_idx=False, sync_dist=True)
