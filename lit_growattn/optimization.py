"""GrowAttentionLM's default optimizer and its built-in learning-rate schedule."""

from __future__ import annotations

import math
from typing import Literal

import torch


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def lr_factor(step: int, warmup: int, total: int, floor: float, shape: Literal["cosine", "constant"]) -> float:
    """The learning rate at optimizer `step` as a share of the peak: linear warmup over `warmup` steps, then constant
    or a cosine decay to `floor` at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if shape == "constant":
        return 1.0
    total = max(total, warmup + 1)
    progress = min((step - warmup) / (total - warmup), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
