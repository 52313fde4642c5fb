"""What a growth event does through a running Trainer: rate candidate growths on the kept batches, and resize
parameters (DDP unwrapped and wrapped again, averaged copies grown alike, optimizer and scheduler rebuilt with
their state carried over; docs/design.md, "Lightning mechanics")."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lit_growattn.callback.averaging import callback_schedulers, grow_averaged
from lit_growattn.callback.window import NamedForms
from lit_growattn.growth import Carry, Growth, GrownValue, installed
from lit_growattn.training.fsdp2 import GatheredBlocks, is_sharded, rating_precision
from lit_growattn.training.optim_state import carry_state, snapshot_state


class WindowCollectives:
    """What the statistics window needs of the strategy (`callback.window`): the strategy's sum-reduce, and an
    all-gather by torch.distributed itself, since the strategy's goes through `torch.distributed.nn.functional
    .all_gather`, which torch 2.13 deprecates with a warning at every window a run closes."""

    def __init__(self, strategy: Strategy):
        self.strategy = strategy

    def reduce(self, tensor: Tensor, reduce_op: str) -> Tensor:
        return self.strategy.reduce(tensor, reduce_op=reduce_op)

    @staticmethod
    def all_gather(tensor: Tensor) -> Tensor:
        """(world, *tensor.shape): every rank's `tensor`, by rank."""
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)


def kept_batch_losses(
    trainer: L.Trainer, pl_module: L.LightningModule, forms: NamedForms, kept: list[Any],
    candidates: Sequence[dict[str, Growth | GrownValue] | None],
) -> Tensor:
    """Mean loss over the kept batches of all ranks (`kept`, every rank's; each rank rates its share, possibly none) of
    each candidate (name → Growth installed; None: the forms as they are), forward only, so that every rank makes the
    same choice. Sums and counts are reduced, not per-rank means: a run resumed on more ranks than there are kept
    batches leaves some ranks without any. The forms are restored after. `pl_module.batch_loss` rates a batch."""
    named = {name: form for _, name, form in forms}
    rank, world = trainer.global_rank, trainer.world_size
    share = kept[rank::world]
    # Under FSDP2 every forward is a collective (the sharded blocks gather their weights): a rank with a smaller share
    # runs as many forwards as the others, on batches whose loss it does not count.
    uncounted = kept[: -(-len(kept) // world) - len(share)] if is_sharded(pl_module) else []
    was_training = pl_module.training
    pl_module.eval()
    losses = []
    try:
        with torch.no_grad(), trainer.precision_plugin.forward_context(), rating_precision(pl_module):
            for grown in candidates:
                total = torch.zeros((), device=pl_module.device)
                with installed(named, grown):
                    for batch in share:
                        total += pl_module.batch_loss(move_data_to_device(batch, pl_module.device)).float()
                    for batch in uncounted:
                        pl_module.batch_loss(move_data_to_device(batch, pl_module.device))
                losses.append(total)
    finally:
        pl_module.train(was_training)
    count = torch.tensor([float(len(share))], device=pl_module.device)
    totals = trainer.strategy.reduce(torch.cat([torch.stack(losses), count]), reduce_op="sum")
    return totals[:-1] / totals[-1]


def loss_terms(batches: list[Any]) -> int:
    """The values that the mean loss over `batches` averages, which set its round-off (`growth.loss_rounding`):
    one per token, counted as the elements of each batch's largest integer tensor (its (b, s) token ids or labels;
    1 for a batch without one)."""
    def tokens(batch: Any) -> int:
        counts: list[int] = []
        apply_to_collection(batch, Tensor, lambda t: counts.append(0 if t.is_floating_point() else t.numel()))
        return max(counts, default=0) or 1

    return sum(tokens(batch) for batch in batches)


def install_growth(
    trainer: L.Trainer, pl_module: L.LightningModule, forms: NamedForms, grown: dict[str, Growth | GrownValue],
    new_second_moment: str, gathered: GatheredBlocks,
) -> None:
    """Puts the grown tensors in the forms (named as in `pl_module.named_parameters()`), grows the averaged copies
    of weight-averaging callbacks alike, and rebuilds what follows. Under FSDP2 the forms are those of `gathered`'s
    plain copies of their blocks, which are then sharded in place of the old blocks."""

    def resize() -> dict[str, Carry]:
        carries, before = {}, {}
        for _, name, form in forms:
            before[name] = {tensor: getattr(form, tensor) for tensor in form.tensor_names()}
            grown[name].install(form)
            carries |= {f"{name}.{param}": carry for param, carry in grown[name].carries.items()}
        gathered.reshard()
        grow_averaged(trainer, forms, before, carries)
        return carries

    gathered.restore()  # the optimizer's state is read from the parameters it knows: the sharded blocks'
    resize_parameters(trainer, pl_module, resize, new_second_moment)


def resize_parameters(
    trainer: L.Trainer, pl_module: L.LightningModule, resize: Callable[[], dict[str, Carry]], new_second_moment: str
) -> None:
    """Runs `resize()`, which replaces parameters of `pl_module` and returns a Carry per changed parameter
    name, then re-wraps DDP and rebuilds optimizer and scheduler with Adam state, lrs and schedule position."""
    strategy = trainer.strategy
    (old_optimizer,) = trainer.optimizers
    old_configs = list(trainer.lr_scheduler_configs)
    old_states = [cfg.scheduler.state_dict() for cfg in old_configs]
    held = callback_schedulers(trainer)
    old_state = snapshot_state(old_optimizer, pl_module)
    if isinstance(strategy, DDPStrategy):
        strategy.model = strategy.lightning_module  # unwrap: DDP cannot follow resized parameters
    carries = resize()
    if isinstance(strategy, DDPStrategy):
        strategy.configure_ddp()
    strategy.setup_optimizers(trainer)
    (new_optimizer,) = trainer.optimizers
    for new_group, old_group in zip(new_optimizer.param_groups, old_optimizer.param_groups):
        # lr, and whatever else a scheduler moves (betas, momentum), as they were.
        new_group.update({k: v for k, v in old_group.items() if k != "params"})
    carry_state(old_state, new_optimizer, pl_module, carries, new_second_moment)
    configs = trainer.lr_scheduler_configs
    for i, (old, state) in enumerate(zip(old_configs, old_states)):
        if any(old.scheduler is s for s in held):
            # A callback's scheduler (SWA's SWALR) stood in for configure_optimizers' one, or was added to its
            # list: it stays, stepping the new optimizer, and the one configure_optimizers just made goes.
            old.scheduler.optimizer = new_optimizer
            configs[i : i + 1] = [old]
        else:
            configs[i].scheduler.load_state_dict(state)
