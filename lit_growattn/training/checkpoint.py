"""Checkpoints: read without running code from the file, and fit the score maps to a checkpoint's head sizes."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from typing import Any

import torch
from torch import Tensor, nn

from lit_growattn.contract import Resizable


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's content, loaded with `weights_only=True`: tensors and plain containers only, so a file from
    elsewhere cannot run code. Checkpoints written by this project's CLI and by `convert` load this way.

    torch's own messages for a file it will not load this way advise loading it with `weights_only=False`, which
    would run the file's code: none of them is passed on (no `from error`), whatever the refusal."""
    refuse_distributed_checkpoint(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {str(path)!r}; give the path of a .ckpt file")
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, zipfile.BadZipFile) as error:
        if unsafe_load_refused(error):
            raise refusal(str(path), error) from None
        raise damaged(path) from error
    if not isinstance(content, dict):
        raise ValueError(f"{str(path)!r} holds a {type(content).__name__}, not a checkpoint (the dictionary of "
                         "state_dict, hyper_parameters, … that Lightning writes): give a checkpoint written by "
                         "`python -m lit_growattn fit` or `convert`")
    return content


def refuse_distributed_checkpoint(path: str | os.PathLike) -> None:
    """Refuses a folder holding torch's distributed checkpoint (its `.metadata` beside one `.distcp` file per rank),
    which ModelParallelStrategy writes by default and which these readers cannot read yet. (torch's
    `dcp_to_torch_save` makes one file of it, but without the hyperparameters, which Lightning keeps in `meta.pt`.)"""
    if os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(
            f"{str(path)!r} is a sharded (distributed) checkpoint, a folder of one shard per rank, which cannot be "
            "read here yet: train with ModelParallelStrategy(..., save_distributed_checkpoint=False), which writes "
            "the checkpoint as one file"
        )


def load_weights(module: nn.Module, path: str) -> None:
    """`init_from`: `module` takes the weights of the checkpoint at `path` (a new run: nothing else is taken)."""
    refuse_distributed_checkpoint(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"init_from={path!r} does not exist; give the path of a checkpoint file")
    checkpoint = read_checkpoint(path)
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:  # torch's message lists every key; the differing settings say what to do
        raise ValueError(f"init_from={path!r} holds the weights of another model ({_mismatch(module, checkpoint)}): "
                         f"{_settings_fix(module, checkpoint)}") from error


def _mismatch(module: nn.Module, checkpoint: dict) -> str:
    """e.g. `3 weights missing, 1 of another shape, such as model.wte.weight (128, 32) there, (128, 64) here`."""
    ours = module.state_dict()
    theirs = checkpoint["state_dict"]
    missing, unexpected = ours.keys() - theirs.keys(), theirs.keys() - ours.keys()
    shaped = sorted(k for k in ours.keys() & theirs.keys() if ours[k].shape != theirs[k].shape)
    counts = [f"{len(keys)} {what}" for keys, what in [(missing, "weights missing"), (unexpected, "weights unknown here"),
                                                        (shaped, "of another shape")] if keys]
    example = (f", such as {shaped[0]} {tuple(theirs[shaped[0]].shape)} there, {tuple(ours[shaped[0]].shape)} here"
               if shaped else f", such as {min(missing or unexpected)}" if missing or unexpected else "")
    return ", ".join(counts) + example


# Settings that do not shape the weights, and the sizes a growth recorded (taken from the checkpoint as it loads).
NOT_SHAPING = {"lr_schedule", "warmup_steps", "min_lr_ratio", "max_nonfinite_steps", "compile", "sdpa_pad",
               "fsdp_param_dtype", "attn_implementation", "tokenizer", "d_head", "d_v", "head_sizes", "v_head_sizes"}
FROM_DATA = {"vocab_size": "vocabulary (its tokenizer)", "block_size": "sequence length"}


def _settings_fix(module: nn.Module, checkpoint: dict) -> str:
    """What builds a model the checkpoint's weights fit: its class, or the settings of its that differ."""
    theirs = checkpoint.get("hyper_parameters", {})
    name = type(module).__name__
    if theirs.get("_class_path", name).rsplit(".", 1)[-1] != name:  # recorded by the CLI
        return f"it is a checkpoint of {theirs['_class_path']}, not of {name}: give a checkpoint of {name}"
    ours = dict(getattr(module, "hparams", {}))
    differ = {k: v for k, v in theirs.items() if k in ours and k not in NOT_SHAPING and not k.startswith("_")
              and isinstance(v, (int, float, str, bool)) and ours[k] != v}
    fixes = [f"--model.init_args.{k}={v}" for k, v in differ.items() if k not in FROM_DATA]
    fixes += [f"data of its {FROM_DATA[k]} ({k}={v}, here {ours[k]})" for k, v in differ.items() if k in FROM_DATA]
    if not fixes:
        return "give a checkpoint of a model built like this one (the same model class and settings)"
    return f"build this model as the checkpoint's was, {', '.join(fixes)}; or give a checkpoint of a model built like it"


def unsafe_load_refused(error: BaseException) -> bool:
    """Whether `error` is torch refusing to load a file with weights_only=True (its message then advises loading it
    with weights_only=False, which could run code from the file)."""
    return isinstance(error, (pickle.UnpicklingError, RuntimeError)) and "weights_only" in str(error)


def refusal(name: str, error: BaseException) -> ValueError:
    """Why the file `name` is not loaded, for torch's refusal `error` to load it with weights_only=True; torch's own
    message is left out, since it advises loading the file with weights_only=False, which could run its code."""
    if not isinstance(error, pickle.UnpicklingError):  # e.g. a TorchScript archive, or torch's legacy .tar format
        return ValueError(f"{name} is not a file of tensors and plain containers (a TorchScript archive?); it is "
                          "refused, since loading it could run code from the file")
    found = re.search(r"GLOBAL (\S+)", str(error))  # "Unsupported global: GLOBAL x" or "unsupported GLOBAL x"
    if found is None:  # e.g. a plain pickle (not torch.save) or a damaged file: torch names no object then
        return ValueError(
            f"{name} cannot be read as a file of tensors and plain containers: it is damaged (truncated or "
            "overwritten?) or not written by torch.save (a plain pickle could run code when loaded, so it is refused); "
            "use another file, e.g. an earlier checkpoint of the same run")
    return ValueError(
        f"{name} holds Python objects such as {found.group(1)} beyond tensors and plain containers; loading them "
        "could run code from the file, so it is refused. If you trust the file, save only its tensors and plain "
        "values (a checkpoint's 'state_dict' and 'hyper_parameters') to a new file.")


def damaged(path: str | os.PathLike) -> ValueError:
    return ValueError(f"checkpoint {str(path)!r} is damaged (truncated or overwritten?) and cannot be read; "
                      "use another checkpoint, e.g. an earlier one of the same run")


def resize_to_checkpoint(model: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Gives every score map of `model` the head size its tensors have in state_dict (placeholder values, which
    the state dict then fills): the one resize path for `fit --ckpt_path`, `load_from_checkpoint`, `init_from`."""
    for name, module in model.named_modules():
        if isinstance(module, Resizable):
            module.resize_to(state_dict, f"{name}.")


def refuse_resuming_former_value_layout(module: Any, checkpoint: dict, former_key: str,
                                        former: str) -> None:
    """Raises, when `module` is being fitted from `checkpoint` (a resume), if the checkpoint stores the value and
    output projections as the modules `former` (a state-dict key ends in `former_key`): their weights load exactly
    into the per-head value maps (`attention.value`), but Adam's state is laid out for those parameters and would be
    applied to others."""
    if module._trainer is None or module.trainer.state.fn != "fit":
        return
    if any(key.endswith(former_key) for key in checkpoint.get("state_dict", {})):
        raise ValueError(
            f"this checkpoint stores the attention's value and output projections as the modules {former}, which "
            "this version keeps per head (W_V, W_O) so that the value side can grow: its weights load, but its "
            "optimizer state cannot resume. Continue from its weights with `--model.init_args.init_from=<ckpt>` "
            "(a new optimizer), or resume it with the version that wrote it"
        )
