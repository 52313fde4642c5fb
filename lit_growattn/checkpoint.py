"""Checkpoints: read without running code from the file, and fit the score maps to a checkpoint's head sizes."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
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
        found = re.search(r"GLOBAL (\S+)", str(error))  # "Unsupported global: GLOBAL x" or "unsupported GLOBAL x"
        if found is None:
            raise damaged(path) from error
        # From None: torch's own message advises loading with the unsafe setting, for exactly this file.
        raise ValueError(
            f"{path} holds Python objects such as {found.group(1)} beyond tensors and plain containers; loading "
            "them could run code from the file, so it is refused. If you trust the file, save only its "
            "'state_dict' and 'hyper_parameters' (tensors and plain values) to a new file."
        ) from None
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise damaged(path) from error


def load_weights(module: nn.Module, path: str) -> None:
    """`init_from`: `module` takes the weights of the checkpoint at `path` (a new run: nothing else is taken)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"init_from={path!r} does not exist; give the path of a checkpoint file")
    module.load_state_dict(read_checkpoint(path)["state_dict"])


def damaged(path: str | os.PathLike) -> ValueError:
    return ValueError(f"checkpoint {str(path)!r} is damaged (truncated or overwritten?) and cannot be read; "
                      "use another checkpoint, e.g. an earlier one of the same run")


def resize_to_checkpoint(model: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Gives every score map of `model` the head size its tensors have in state_dict (placeholder values, which
    the state dict then fills): the one resize path for `fit --ckpt_path`, `load_from_checkpoint`, `init_from`."""
    for name, module in model.named_modules():
        if isinstance(module, ScoreMap):
            module.resize_to(state_dict, f"{name}.")
