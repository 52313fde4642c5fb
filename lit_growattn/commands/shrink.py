"""`convert --to mha --kv_budget B [--sides both|query_key|value] [--calibration FILE …]`: a model shrunk to a mean
head size B over its KV cache (`growth.shrink.shrink_to_budget`), for this project's GPT (`--ckpt`, through
`convert.convert_checkpoint`) and Hugging Face folders (`--pretrained`, `shrink_pretrained`).

Without a calibration text the sizes and factors are the weights' truncated SVD; with one, the activations weigh
both: the covariances of every form's inputs and every value head's attention-mixed inputs on that text
(`callback.calibration`), which should be the training distribution (its training split). The text is read with
the tokenizer given (else raw bytes for a GPT, which records none, and a folder's own for `--pretrained`) and cut
into `sequences` windows of `length + 1` tokens evenly spaced from its start, so a conversion is reproducible
without a seed.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lit_growattn.callback.calibration import calibration_layers_per_pass, calibration_moments
from lit_growattn.contract import growable_units
from lit_growattn.data.tokenizer import load_tokenizer
from lit_growattn.growth.shrink import BudgetShrink, budget_values, check_budget, shrink_items, shrink_to_budget
from lit_growattn.training.writing import check_output, new_folder

SIDES = {"both": ("d_head", "d_v"), "query_key": ("d_head",), "value": ("d_v",)}
ENERGY = {"d_head": "score energy", "d_v": "value output energy"}
NOPE_ENERGY = "NoPE score energy (the rotary columns are kept whole)"  # a rotary model's: RoPE columns never shrink
BATCH = 16  # calibration sequences per forward and backward pass
PRETRAINED_LENGTH = 512  # a Hugging Face model's calibration windows (at most its positions)


@dataclass(frozen=True)
class Budget:
    """What `--kv_budget` asks for: the mean head size over the cache heads of `sides`, and the calibration text
    (None: the weights alone) with its tokenizer (None: raw bytes for a GPT, a folder's own), windows, window length
    (None: the model's block size) and the device it runs on. `cli`: the messages name the command's options
    (`--sides`), else the Python arguments (`sides`)."""

    kv_budget: float
    sides: str = "both"
    calibration: str | os.PathLike | None = None
    sequences: int = 256
    length: int | None = None
    tokenizer: str | None = None
    device: str = "cpu"
    cli: bool = False

    def name(self, option: str) -> str:
        return f"--{option}" if self.cli else option

    def check(self) -> None:
        """Refuses settings that cannot work, before anything is read."""
        number = isinstance(self.kv_budget, numbers.Real) and not isinstance(self.kv_budget, bool)
        if not (number and math.isfinite(self.kv_budget) and self.kv_budget > 0):
            shown = f"{self.kv_budget:g}" if number else repr(self.kv_budget)
            raise ValueError(f"{self.name('kv_budget')} {shown} is not a mean head size: give a finite number of "
                             "columns above 0, the mean head size over the cache heads to shrink to (e.g. 4)")
        if self.sides not in SIDES:
            raise ValueError(f"{self.name('sides')}={self.sides!r}: choose {', '.join(SIDES)}")
        for option, value in (("calibration_sequences", self.sequences), ("calibration_length", self.length)):
            if value is not None and value < 1:
                raise ValueError(f"{self.name(option)} must be at least 1, not {value}")
        if self.calibration is not None and not os.path.isfile(self.calibration):
            raise FileNotFoundError(f"{self.name('calibration')} {self.calibration} is not a file: give a text of "
                                    "the model's training distribution (its training split)")
        if self.tokenizer is not None and not os.path.exists(self.tokenizer):
            raise FileNotFoundError(f"{self.name('tokenizer')} {self.tokenizer} does not exist: give the "
                                    "tokenizer.json (or its folder) the model was trained with")
        if (problem := device_problem(self.device)) is not None:
            raise ValueError(f"{self.name('device')} {self.device} {problem}: give cpu, or a device this machine has "
                             "(e.g. cuda:0)")


def device_problem(name: str) -> str | None:
    """Why the calibration cannot run on the device `name` here (None: it can)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        return "is not a device name"
    if device.type == "cpu":
        return None
    try:
        module = torch.get_device_module(device)
    except RuntimeError:
        return "holds no tensors to compute with"
    count = module.device_count() if module.is_available() else 0
    if count == 0:
        return f"is not available here (no {device.type} device)"
    if device.index is not None and device.index >= count:
        return (f"is not available here ({count} {device.type} device{'s' if count > 1 else ''}: "
                f"{', '.join(f'{device.type}:{i}' for i in range(count))})")
    return None


def free_memory(name: str) -> int | None:
    """Bytes free on the device `name` (None: unknown), for `calibration_layers_per_pass`."""
    device = torch.device(name)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # not a POSIX system that reports it
            return None
    return None


def calibration_tokens(path: str | os.PathLike, tokenizer: str | None) -> Tensor:
    """The text at `path` as token ids (int64): raw bytes without a tokenizer, else its `tokenizer.json`'s tokens."""
    if tokenizer is None:
        return torch.from_numpy(np.fromfile(path, dtype=np.uint8).astype(np.int64))
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return torch.tensor(load_tokenizer(tokenizer).encode_batch([text])[0], dtype=torch.int64)


def calibration_batches(tokens: Tensor, budget: Budget, length: int,
                        vocab_size: int) -> list[tuple[Tensor, Tensor]]:
    """`budget.sequences` windows of length + 1 tokens evenly spaced from the start, as (inputs, next tokens) batches
    of BATCH; refuses a text shorter than one window, or tokens the model has no embedding for."""
    if len(tokens) < length + 1:
        raise ValueError(f"{budget.calibration} holds {len(tokens)} tokens, fewer than one window of {length + 1}: "
                         f"give a longer file or a smaller {budget.name('calibration_length')}")
    if int(tokens.max()) >= vocab_size:
        raise ValueError(f"{budget.calibration} read with the tokenizer given has token id {int(tokens.max())}, and "
                         f"the model's vocabulary has {vocab_size}: give the tokenizer the model was trained with "
                         f"({budget.name('tokenizer')})")
    last = len(tokens) - length - 1
    starts = [round(k * last / max(budget.sequences - 1, 1)) for k in range(budget.sequences)]
    windows = torch.stack([tokens[s:s + length + 1] for s in starts])
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(BATCH)]


def shrink_module(module, budget: Budget, what: str, tokenizer: str | None, lengths: tuple[int, int],
                  vocab_size: int) -> str:
    """Shrinks the units of `budget.sides` of a GrowableModule in place to the budget and records its head sizes;
    returns what was done, for the result line. `what` names the model in messages; `lengths`: the default
    calibration length and the longest the model takes. `budget` is checked (`Budget.check`)."""
    sides = SIDES[budget.sides]
    units = [named for named in growable_units(module) if named.form.side in sides]
    forms = [form for _, _, form in units if form.side == "d_head"]
    if forms and all(getattr(form, "rotary", 0) >= form.width for form in forms):
        raise ValueError(f"the query/key columns of {what} are all rotary (RoPE rotates them by position, so they "
                         f"are not one bilinear form of X′ and cannot be truncated): {budget.name('sides')} value "
                         "shrinks its V cache; the K cache shrinks only by NoPE columns appended by growth")
    check_budget(shrink_items(units), budget.kv_budget)
    moments, weighed = None, ""
    if budget.calibration is not None:
        length = budget.length or lengths[0]
        if length > lengths[1]:
            raise ValueError(f"{budget.name('calibration_length')} {length} exceeds the {lengths[1]} positions "
                             f"{what} takes: give at most {lengths[1]}")
        batches = calibration_batches(calibration_tokens(budget.calibration, tokenizer), budget, length, vocab_size)
        module.to(budget.device)
        per_pass = calibration_layers_per_pass(units, free_memory(budget.device))
        moments = calibration_moments(module, batches, set(sides), layers_per_pass=per_pass)
        weighed = f"{budget.sequences * length:,} tokens of {budget.calibration}"
        if per_pass is not None:
            weighed += f", {per_pass} layer{'s' if per_pass > 1 else ''} per pass to fit {budget.device}'s memory"
    result = shrink_to_budget(units, budget.kv_budget, moments)
    module.cpu()
    module.record_head_sizes()
    return result_text(result, budget, weighed)


def result_text(result: BudgetShrink, budget: Budget, weighed: str) -> str:
    """e.g. `d_head [6, 2] (mean 4), …: 64 of 64 values per token (budget 4); allocation by … (kept 97.1 % of the
    score energy, …)`; `weighed`: the calibration tokens (empty: by the weights)."""
    sizes = ", ".join(f"{side} {result.per_layer(side)} (mean {result.mean(side):.3g})" for side in result.sides())
    allowed = budget_values(budget.kv_budget, result.items)
    rotary = any(i.side == "d_head" and i.held > 1 for i in result.items)  # held: its rotary columns
    energy = ENERGY | ({"d_head": NOPE_ENERGY} if rotary else {})
    kept = ", ".join(f"{100 * result.kept_share(side):.1f} % of the {energy[side]}" for side in result.sides())
    how = (f"activation-whitened energy on {weighed} (kept {kept})" if weighed else
           f"weight SVD energy (kept {kept}; give {budget.name('calibration')} FILE to weigh it by the activations)")
    return (f"{sizes}: {result.values_per_token()} of {allowed} values per token (budget {budget.kv_budget:g}); "
            f"allocation by {how}")


def shrink_pretrained(pretrained: str | os.PathLike, out: str | os.PathLike, budget: Budget,
                      overwrite: bool = False):
    """The Hugging Face model folder `pretrained` (llama, mistral, qwen2, qwen3 or gpt2, grown here or not) shrunk to
    `budget` and written whole to the folder `out` with its tokenizer, in the dtype its weights are stored in, as
    `export` writes (`hf.export.save_export` records the head sizes, so the folder loads back after
    `import lit_growattn.hf`; one whose widths all end at the original ones is written as the original type);
    returns the shrunk HFCausalLM (in that dtype) and the result line."""
    from transformers import AutoConfig

    from lit_growattn.commands.export import copy_tokenizer  # these need transformers
    from lit_growattn.hf.export import registered_here, save_export
    from lit_growattn.hf.loading import write_loading_files
    from lit_growattn.hf.module import HFCausalLM

    budget.check()
    source = budget.tokenizer or str(pretrained)  # copied into the folder: whichever tokenizer files it holds
    # Reading the calibration text takes a tokenizer.json (`data.tokenizer.load_tokenizer`).
    tokenizer = source if budget.tokenizer or os.path.isfile(os.path.join(pretrained, "tokenizer.json")) else None
    if budget.calibration is not None and tokenizer is None:
        raise ValueError(f"{pretrained} holds no tokenizer.json to read the calibration text with: give "
                         f"{budget.name('tokenizer')}, the tokenizer the model was trained with")
    read = {f"the model folder {budget.name('pretrained')}": pretrained,
            f"the calibration text {budget.name('calibration')}": budget.calibration,
            f"the tokenizer {budget.name('tokenizer')}": budget.tokenizer}
    out = check_output(out, "folder", read, overwrite, option=budget.name("out"))
    stored = stored_dtype(AutoConfig.from_pretrained(pretrained))
    module = HFCausalLM(pretrained=str(pretrained))  # float32, as the shrink computes
    config = module.model.config
    positions = config.max_position_embeddings
    done = shrink_module(module, budget, str(pretrained), tokenizer, (min(PRETRAINED_LENGTH, positions), positions),
                         config.vocab_size)
    module.to(stored)
    with new_folder(out, overwrite, option=budget.name("out")) as folder:
        written = save_export(module.model, folder)
        copied = copy_tokenizer(source, folder)
        if registered_here(written):
            write_loading_files(folder, written, str(out), f"`python -m lit_growattn convert --kv_budget` of "
                                f"{pretrained}")
    tokens = f"tokenizer files {', '.join(copied)}" if copied else f"no tokenizer ({source} has none)"
    return module, (f"wrote {out} (model type {written}, {tokens}): {done}; load it after `import lit_growattn.hf`, "
                    f"and fine-tune it with --model.init_args.pretrained={out}")


def stored_dtype(config) -> torch.dtype:
    """The floating dtype a folder's config says its weights are stored in (float32 when it names none)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32
