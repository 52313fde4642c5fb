"""GrowableLM: what the LightningModules that GrowAttentionCallback grows (GrowAttentionLM, hf.HFCausalLM) share, so
that it is written once: the training setup of their __init__, loading (a grown checkpoint's shapes first), the loss
over the data modules' shifted labels, and the evaluation steps."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy

from lit_growattn.contract import check_shardable
from lit_growattn.training import fsdp2
from lit_growattn.training.checkpoint import (is_distributed_checkpoint, load_weights, module_shapes,
                                             refuse_resuming_former_value_layout, resize_to_checkpoint)
from lit_growattn.training.divergence import DivergenceGuard
from lit_growattn.training.lightning_private import resume_checkpoint
from lit_growattn.training.optimization import GrowthOptimization

# Arguments kept out of the hyperparameters: callables, a checkpoint that only starts a run, and how a run computes
# under FSDP2, which each run sets anew (a checkpoint of a sharded run resumes, validates or exports anywhere).
NOT_HPARAMS = ["optimizer", "scheduler", "init_from", "fsdp_param_dtype"]


class GrowableLM(DivergenceGuard, GrowthOptimization, L.LightningModule):
    """Base of the modules that grow. A subclass's __init__ calls `save_hyperparameters(ignore=NOT_HPARAMS)` itself
    (Lightning reads the caller's frame), then `_init_training`, builds its model, and calls `_load_init` last. The
    subclass provides the GrowableModule methods (`lit_growattn.contract`), `record_head_sizes`, `_eval_step` and
    `_former_value_layout`; this class the loading, the loss and the evaluation steps built on them."""

    def _init_training(self, optimizer: OptimizerCallable, scheduler: LRSchedulerCallable | None,
                       max_nonfinite_steps: int, fsdp_param_dtype: fsdp2.FsdpParamDtype | None) -> None:
        self.guard_divergence(max_nonfinite_steps)
        fsdp2.check_param_dtype(fsdp_param_dtype)
        self.fsdp_param_dtype = fsdp_param_dtype
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self._total_steps = 1  # set at train start; the schedule is only evaluated at step 0 before that

    def _load_init(self, init_from: str | None) -> None:
        if init_from is not None:
            load_weights(self, init_from)

    @staticmethod
    def loss(logits: Tensor, labels: Tensor) -> Tensor:
        """Labels come shifted (labels[:, t] is the target at t); -100 marks a position without one."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def setup(self, stage: str) -> None:
        if stage == "fit":
            fsdp2.check_mixed_precision_applies(self.fsdp_param_dtype, self.device_mesh, self.trainer.precision)
        super().setup(stage)

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        # A setting of the module, not a reading of the Trainer's precision: under ModelParallelStrategy Lightning
        # leaves sharding, policy included, to configure_model, and its precisions mean something else there
        # (bf16-mixed: autocast over float32 all-gathers; bf16-true: bfloat16 master weights).
        return fsdp2.mixed_precision_policy(self.fsdp_param_dtype)

    def configure_model(self) -> None:
        """Under ModelParallelStrategy, FSDP2 on its data-parallel mesh: one group per transformer block, the rest in
        the root's (`training.fsdp2`); nothing under other strategies. Lightning calls it again for validate or test
        after fit, when the module is already sharded.

        Then, when the run loads a checkpoint (`fit`, `validate`, `test` with `ckpt_path`), the blocks take its head
        sizes: under ModelParallelStrategy Lightning loads it after this hook and after the optimizer is made, into
        the shapes the module has, where other strategies load it before and `load_state_dict` resizes."""
        # `load_from_checkpoint` calls this hook too, with no trainer: there is nothing to shard or load then.
        path = None if self._trainer is None else resume_checkpoint(self._trainer)
        if self.device_mesh is None:
            if path is not None and is_distributed_checkpoint(path):
                raise ValueError(
                    f"{path} is a distributed checkpoint (a folder of shards), which Lightning loads under "
                    "ModelParallelStrategy only: run with strategy=ModelParallelStrategy(data_parallel_size=N, "
                    "tensor_parallel_size=1) on N devices (one device: data_parallel_size=1), or start from its weights "
                    "with --model.init_args.init_from=<folder>, which reads it under any strategy")
            return
        if not fsdp2.is_sharded(self):
            check_shardable(self)
            fsdp2.check_data_parallel_only(self.device_mesh)
            # Here, not only in the growth callback's setup: a weight-averaging callback listed before it calls this
            # method from its own setup, then deep-copies the sharded module, which FSDP2 refuses with no hint.
            fsdp2.check_no_weight_averaging(self.trainer.callbacks)
            fsdp2.shard_model(self, self.device_mesh[fsdp2.DATA_PARALLEL])
        if path is not None and fsdp2.resize_to_shapes(self, module_shapes(path)):
            # A single file loads parameter by parameter, and only a root with parameters of its own through
            # load_state_dict, which records the sizes.
            self.record_head_sizes()
            if self.trainer.state.fn != TrainerFn.FITTING:
                # The optimizer a fit on this trainer left knows the parameters just replaced, and Lightning would
                # load the checkpoint's Adam state into it; validate and test need none.
                self.trainer.strategy.optimizers = []

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # Every form of loading (`fit --ckpt_path`, `load_from_checkpoint`, `init_from`) comes here. A grown
        # checkpoint has other Q/K widths than the hparams the module was built from: resize to the checkpoint's
        # shapes first, then record them, so that checkpoints saved from now on describe their weights.
        resize_to_checkpoint(self, state_dict)
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.record_head_sizes()
        return result

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if (former := self._former_value_layout()) is not None:
            refuse_resuming_former_value_layout(self, checkpoint, *former)
        super().on_load_checkpoint(checkpoint)

    def _former_value_layout(self) -> tuple[str, str] | None:
        """(the end of a state-dict key, the modules' names) by which a checkpoint from before the per-head value
        maps is recognised and named; None for a model that still has those modules."""
        raise NotImplementedError

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._eval_step(batch, "val", dataloader_idx)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._eval_step(batch, "test", dataloader_idx)
