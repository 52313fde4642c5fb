"""Checkpoints: read without running code from the file, and fit the score maps to a checkpoint's head sizes."""

from __future__ import annotations

import os
import pathlib
import pickle
import re
import warnings
import zipfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from lit_growattn.contract import Resizable


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's content, loaded with `weights_only=True`: tensors and plain containers only, so a file from
    elsewhere cannot run code. Checkpoints written by this project's CLI and by `convert` load this way.

    A distributed checkpoint folder (`is_distributed_checkpoint`) gives the same dictionary: its module state as
    whole tensors under "state_dict", beside its `meta.pt` (hyper_parameters, epoch, …). Its optimizer state is left
    out: the readers (init_from, export, convert) need the weights only.

    torch's own messages for a file it will not load this way advise loading it with `weights_only=False`, which
    would run the file's code: none of them is passed on (no `from error`), whatever the refusal."""
    if is_distributed_checkpoint(path):
        return {**_read_lightning_meta(path), "state_dict": _read_distributed_state_dict(path)}
    if os.path.isdir(path):
        raise ValueError(f"{str(path)!r} is a folder without a .metadata file, so neither a checkpoint file nor a "
                         "distributed checkpoint: give a .ckpt file, or a checkpoint folder written by "
                         "ModelParallelStrategy")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {str(path)!r}; give the path of a .ckpt file")
    return _read_dictionary(path)


def read_hyperparameters(path: str | os.PathLike) -> dict[str, Any]:
    """The hyperparameters a checkpoint (a file or a distributed checkpoint folder) records; of a folder, only its
    `meta.pt` is read, not its shards."""
    content = _read_lightning_meta(path) if is_distributed_checkpoint(path) else read_checkpoint(path)
    return content.get("hyper_parameters", {})


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder holding torch's distributed checkpoint (its `.metadata` beside one `.distcp` file
    per rank), as ModelParallelStrategy writes by default, with Lightning's `meta.pt`."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def module_shapes(path: str | os.PathLike) -> dict[str, Tensor]:
    """The module's tensors in a checkpoint (a file or a distributed checkpoint folder) as meta tensors of their
    shapes and dtypes, by state-dict name, read without their values: from a folder's `.metadata`, or from a file
    mapped into memory."""
    if is_distributed_checkpoint(path):
        return _module_tensors(_CheckedMetadataReader(path), torch.device("meta"))
    state = _read_dictionary(path, mmap=True).get("state_dict", {})
    return {name: torch.empty_like(value, device="meta") for name, value in state.items() if torch.is_tensor(value)}


def _read_dictionary(path: str | os.PathLike, mmap: bool = False) -> dict[str, Any]:
    """The dictionary torch.save wrote at `path`, loaded with `weights_only=True` (mapped into memory with `mmap`,
    its tensors read only where used); a refusal or damage is named."""
    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, zipfile.BadZipFile) as error:
        if unsafe_load_refused(error):
            raise refusal(str(path), error) from None
        raise damaged(path) from error
    if not isinstance(content, dict):
        raise ValueError(f"{str(path)!r} holds a {type(content).__name__}, not a checkpoint (the dictionary of "
                         "state_dict, hyper_parameters, … that Lightning writes): give a checkpoint written by "
                         "`python -m lit_growattn fit` or `convert`")
    return content


def _read_lightning_meta(folder: str | os.PathLike) -> dict[str, Any]:
    """What Lightning saves of a distributed checkpoint beside the shards, in `meta.pt`: everything but the module
    and optimizer state."""
    meta = os.path.join(folder, "meta.pt")
    if not os.path.isfile(meta):
        raise FileNotFoundError(f"the distributed checkpoint {str(folder)!r} has no meta.pt, where Lightning keeps "
                                "its hyperparameters, epoch and step: it is incomplete (copied in part?); use another "
                                "checkpoint, e.g. an earlier one of the same run")
    return _read_dictionary(meta)


# Lightning saves a distributed checkpoint's module state under "state_dict", which torch's writer flattens.
MODULE_PREFIX = "state_dict."

# What a distributed checkpoint's `.metadata` pickle names: torch's classes describing the shards, tensor sizes,
# dtypes and layouts (and the folder's path: PICKLED_PATHS).
METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict")}
# The path of the folder where it was written, as the Python that wrote it pickled it (module "pathlib._local" from
# Python 3.13 on), read as a pure path: nothing here uses it, and a WindowsPath cannot be built on POSIX.
PICKLED_PATHS = {"PosixPath": pathlib.PurePosixPath, "PurePosixPath": pathlib.PurePosixPath,
                 "WindowsPath": pathlib.PureWindowsPath, "PureWindowsPath": pathlib.PureWindowsPath}


def _read_distributed_state_dict(folder: str | os.PathLike) -> dict[str, Tensor]:
    """The module state of a distributed checkpoint, each tensor whole on the CPU, read in this process alone."""
    reader = _CheckedMetadataReader(folder)
    state = _module_tensors(reader, torch.device("cpu"))
    try:
        with warnings.catch_warnings():
            # torch notes that it loads in one process: no_dist asks for that.
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
            dcp.load({"state_dict": state}, storage_reader=reader, no_dist=True)
    except dcp.CheckpointException as error:
        raise damaged(folder) from error
    return state


def _module_tensors(reader: dcp.FileSystemReader, device: torch.device) -> dict[str, Tensor]:
    """An empty tensor on `device` for each module tensor a distributed checkpoint's metadata lists, at its global
    shape and dtype, by state-dict name."""
    stored = reader.read_metadata().state_dict_metadata
    return {key.removeprefix(MODULE_PREFIX): torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
            for key, meta in stored.items()
            if key.startswith(MODULE_PREFIX) and isinstance(meta, dcp.TensorStorageMetadata)}


class _UnsafeMetadata(Exception):
    """A `.metadata` pickle names an object beyond those of METADATA_GLOBALS."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a distributed checkpoint's `.metadata` with only the objects such a file holds (METADATA_GLOBALS,
    PICKLED_PATHS, the classes of torch.distributed.checkpoint.metadata, dtypes), checked before their module is
    imported."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("pathlib", "pathlib._local") and name in PICKLED_PATHS:
            return PICKLED_PATHS[name]
        defined = getattr(dcp.metadata, name, None) if module == dcp.metadata.__name__ else None
        metadata_class = isinstance(defined, type) and defined.__module__ == module  # not a class it imports
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not (metadata_class or dtype or (module, name) in METADATA_GLOBALS):
            raise _UnsafeMetadata(f"{module}.{name}")
        return super().find_class(module, name)


class _CheckedMetadataReader(dcp.FileSystemReader):
    """torch's reader of a distributed checkpoint folder, but reading its `.metadata` with _MetadataUnpickler: torch
    unpickles it unrestricted, which would run any code a `.metadata` from elsewhere holds."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        path = os.path.join(self.path, ".metadata")
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except _UnsafeMetadata as unsafe:
            raise ValueError(f"{path} holds Python objects such as {unsafe} beyond a distributed checkpoint's "
                             "description of its shards; loading them could run code from the file, so it is "
                             "refused: use a checkpoint written by ModelParallelStrategy") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            raise damaged(os.path.dirname(path)) from error
        if not isinstance(metadata, dcp.Metadata):
            raise damaged(os.path.dirname(path))
        return metadata


def load_weights(module: nn.Module, path: str) -> None:
    """`init_from`: `module` takes the weights of the checkpoint at `path` (a file or a distributed checkpoint
    folder; a new run: nothing else is taken)."""
    if not os.path.exists(path):
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
