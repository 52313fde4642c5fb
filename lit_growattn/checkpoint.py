"""Checkpoints: read without running code from the file, and fit the score maps to a checkpoint's head sizes."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch
from torch import Tensor, nn

from lit_growattn.contract import ScoreMap


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's content, loaded with `weights_only=True`: tensors and plain containers only, so a file from
    elsewhere cannot run code. Checkpoints written by this project's CLI and by `convert` load this way."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {str(path)!r}; give the path of a .ckpt file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        what = f" such as {found.group(1)}" if found else ""
        raise ValueError(
            f"{path} holds Python objects{what} beyond tensors and plain containers; loading them could run code "
            "from the file, so it is refused. If you trust the file, keep only its weights and hyperparameters: "
            "ckpt = torch.load(path, weights_only=False); torch.save({k: ckpt[k] for k in ('state_dict', "
            "'hyper_parameters')}, new_path)"
        ) from error


def resize_to_checkpoint(model: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Gives every score map of `model` the head size its tensors have in state_dict (placeholder values, which
    the state dict then fills): the one resize path for `fit --ckpt_path`, `load_from_checkpoint`, `init_from`."""
    for name, module in model.named_modules():
        if isinstance(module, ScoreMap):
            module.resize_to(state_dict, f"{name}.")
