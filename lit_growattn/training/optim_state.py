"""Carry an optimizer's state over to a new optimizer whose parameters were resized or replaced.

Adam keeps per-parameter moments keyed by the Parameter object; a growth event creates new Parameter
objects, so the state is matched by parameter name and copied slice by slice. Under FSDP2 the moments of a grown
parameter are DTensors: grown on their full tensor, then sharded as the new parameter.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_growattn.growth import SECOND_MOMENT_POLICIES, Carry, SecondMoment, check_choice

SECOND_MOMENT_KEYS = ("exp_avg_sq", "max_exp_avg_sq")  # Adam, AdamW (amsgrad)


def snapshot_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, dict]:
    """The optimizer state of each named parameter of `module` that has one."""
    return {name: optimizer.state[p] for name, p in module.named_parameters() if p in optimizer.state}


def carry_state(
    old_state: dict[str, dict],
    new_optimizer: torch.optim.Optimizer,
    module: nn.Module,
    carries: dict[str, Carry],
    new_second_moment: SecondMoment = "mean",
) -> None:
    """Fills `new_optimizer.state` for the parameters of `module` from `old_state` (see `snapshot_state`).

    A carry (`lit_growattn.growth.Carry`) says where the old values sit in the new tensor, or that they rotated
    (state reset), and how to scale the old moments. Parameters without a carry are unchanged and keep their
    state as is. New slices get zero first moments
    and, for second moments, zero or the mean of the old slice (`new_second_moment`): zero second moments
    with a large `step` give the new columns an effective learning rate several times larger.
    """
    check_choice("new_second_moment", new_second_moment, SECOND_MOMENT_POLICIES)
    for name, param in module.named_parameters():
        state = old_state.get(name)
        if state is None:
            continue
        carry = carries.get(name)
        if carry is None:
            new_optimizer.state[param] = state
            continue
        if carry.old_index is None:
            continue  # reset: the optimizer initialises this tensor's state on its next step
        new_optimizer.state[param] = {
            key: _grow_moment(key, value, param, carry, new_second_moment) for key, value in state.items()
        }


def _grow_moment(key: str, value, param: Tensor, carry: Carry, new_second_moment: str):
    if not torch.is_tensor(value) or value.ndim == 0:
        return value  # `step` and other scalars are kept
    if isinstance(value, DTensor):
        # FSDP2: grown whole, then sharded as the new parameter is. Every rank holds the same full tensor, so each
        # keeps its own shard without communication (src_data_rank=None).
        grown = _grow_moment(key, value.full_tensor(), param, carry, new_second_moment)
        return distribute_tensor(grown, param.device_mesh, param.placements, src_data_rank=None)
    second = key in SECOND_MOMENT_KEYS
    old = value * (carry.second_scale if second else carry.first_scale)
    fill = old.mean() if second and new_second_moment == "mean" else 0.0
    grown = torch.full(param.shape, fill, dtype=value.dtype, device=param.device)
    grown[carry.old_index] = old
    return grown
