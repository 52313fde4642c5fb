"""`python -m lit_growattn export`: an HFCausalLM checkpoint as a Hugging Face model folder (`save_pretrained`
layout, `lit_growattn.hf.export`), with the tokenizer the model was trained with, written safely (`writing.py`)."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
from pathlib import Path

from lit_growattn.hf.export import registered_here, save_export
from lit_growattn.hf.loading import write_loading_files
from lit_growattn.hf.module import HFCausalLM
from lit_growattn.training.checkpoint import read_checkpoint
from lit_growattn.training.divergence import ADVICE, TrainingDiverged, first_names, non_finite
from lit_growattn.training.writing import check_output, new_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def training_tokenizer(hparams: dict, pretrained: str | None = None, given: str | None = None) -> str | None:
    """Where the tokenizer the checkpoint's model was trained with is now (a folder or a tokenizer.json file), or
    None for raw bytes. `pretrained`: `--pretrained`, where the model folder is now if it moved (None: where it was
    recorded); `given`: `--tokenizer`, a copy of that tokenizer kept elsewhere, which then wins."""
    if given is not None:
        if not os.path.exists(given):
            raise FileNotFoundError(f"--tokenizer {given} does not exist: give the folder (or tokenizer.json) of the "
                                    "tokenizer the model was trained with")
        return given
    recorded_folder = hparams.get("pretrained")
    recorded = hparams.get("tokenizer") or recorded_folder  # recorded since fit names it; before, the folder's own
    if recorded in (None, "bytes"):
        return None
    path = Path(recorded).resolve()
    if recorded_folder is None or Path(recorded_folder).resolve() not in (path, path.parent):
        if os.path.exists(recorded):
            return recorded
        raise FileNotFoundError(f"the model was trained with the tokenizer of {recorded}, which is not a folder or "
                                "file here (moved?): put it there, or give --tokenizer, where a copy of it is now "
                                "(export copies the tokenizer the model was trained with, never another)")
    # The model folder's own tokenizer (or its tokenizer.json), wherever the folder is now.
    folder = pretrained or recorded_folder
    whole_folder = path == Path(recorded_folder).resolve()
    tokenizer = folder if whole_folder else os.path.join(folder, path.name)
    # A folder named by fit held the tokenizer then: one without tokenizer files has lost it.
    held = os.path.isfile(tokenizer) or os.path.isdir(tokenizer) and (
        hparams.get("tokenizer") is None or any(os.path.isfile(os.path.join(tokenizer, n)) for n in TOKENIZER_FILES))
    if held:
        return tokenizer
    if pretrained is not None:
        raise FileNotFoundError(f"--pretrained {pretrained} holds no {'tokenizer files' if whole_folder else path.name}"
                                f", and the model was trained with the tokenizer of {recorded}: give --tokenizer "
                                "PATH, where a copy of that tokenizer is now")
    where = "holds no tokenizer files" if os.path.isdir(tokenizer) else "is not a folder or file here (moved?)"
    raise FileNotFoundError(f"the model was trained with the tokenizer of {recorded}, which {where}: give "
                            "--pretrained DIR, the folder's new place, or --tokenizer DIR, a copy of its tokenizer "
                            "kept elsewhere")


def copy_tokenizer(source: str | None, folder: Path) -> list[str]:
    """Copies the tokenizer at `source` (a folder's tokenizer files, or a tokenizer.json file) into folder; returns
    the names written."""
    if source is None:
        return []
    # A tokenizer folder's own tokenizer.json is that folder's tokenizer: its tokenizer_config.json names the special
    # tokens (eos, bos, pad), which tokenizer.json alone does not.
    if os.path.basename(source) == "tokenizer.json" and os.path.isfile(
            os.path.join(os.path.dirname(source), "tokenizer_config.json")):
        source = os.path.dirname(source)
    if os.path.isfile(source):
        shutil.copy(source, folder / "tokenizer.json")
        copied = ["tokenizer.json"]
    else:
        copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
        for name in copied:
            shutil.copy(os.path.join(source, name), folder / name)
    if "tokenizer.json" in copied and "tokenizer_config.json" not in copied:
        # tokenizer.json without a tokenizer_config.json: AutoTokenizer would pick the tokenizer class by the model
        # type, which a growattn_<type> folder loaded without this package does not name.
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        copied.append("tokenizer_config.json")
    return copied


def main(argv: list[str]) -> None:
    """`python -m lit_growattn export --ckpt CKPT --out DIR [--pretrained DIR] [--tokenizer DIR] [--overwrite]`: an HFCausalLM
    checkpoint (as `fit` writes it) as a save_pretrained folder, with the tokenizer the model was trained with."""
    parser = argparse.ArgumentParser(prog="python -m lit_growattn export", description=main.__doc__)
    parser.add_argument("--ckpt", required=True, help="a checkpoint of lit_growattn.hf.HFCausalLM written by fit (a file, or the "
                        "distributed checkpoint folder ModelParallelStrategy writes)")
    parser.add_argument("--out", required=True, help="the folder to write (save_pretrained); written beside, then "
                        "renamed into place")
    parser.add_argument("--pretrained", help="where the model's pretrained folder is now, if it moved since training "
                        "(its tokenizer, and the model's architecture)")
    parser.add_argument("--tokenizer", help="where the tokenizer the model was trained with is now (a folder or its "
                        "tokenizer.json), if neither the recorded place nor --pretrained holds it any more")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    ckpt = read_checkpoint(args.ckpt)
    hparams = dict(ckpt.get("hyper_parameters", {}))
    if "pretrained" not in hparams or "config" not in hparams:
        raise ValueError(f"{args.ckpt} is not a checkpoint of lit_growattn.hf.HFCausalLM (its hyperparameters have "
                         "no pretrained/config); for GrowAttentionLM checkpoints use `python -m lit_growattn convert`")
    if args.pretrained is not None:
        if hparams["pretrained"] is None:
            raise ValueError(f"{args.ckpt} was trained from a config, not a pretrained folder: leave out --pretrained")
        if not os.path.isfile(os.path.join(args.pretrained, "config.json")):
            problem = "holds no config.json" if os.path.isdir(args.pretrained) else "does not exist"
            raise FileNotFoundError(f"--pretrained {args.pretrained} {problem}: give the model folder the checkpoint "
                                    f"was trained from ({hparams['pretrained']} then), where it is now")
        hparams["pretrained"] = args.pretrained
    tokenizer = training_tokenizer(ckpt["hyper_parameters"], args.pretrained, args.tokenizer)
    recorded = ckpt["hyper_parameters"]["pretrained"]
    out = check_output(args.out, "folder", {"the checkpoint": args.ckpt, "the model's pretrained folder": hparams[
        "pretrained"], "the pretrained folder the checkpoint names": recorded, "the model's tokenizer": tokenizer},
        args.overwrite)
    if names := non_finite(ckpt["state_dict"].items()):
        raise TrainingDiverged(f"{args.ckpt} holds non-finite weights ({len(names)} tensors: {first_names(names)}), "
                               f"so it is not exported: its run had diverged. Export an earlier checkpoint, or train "
                               f"again: {ADVICE}")
    # The model's own settings; others recorded beside them (e.g. the data's tokenizer) do not build it.
    module = HFCausalLM(**{k: v for k, v in hparams.items() if k in inspect.signature(HFCausalLM).parameters})
    module.load_state_dict(ckpt["state_dict"])
    with new_folder(out, args.overwrite) as folder:
        written = save_export(module.model, folder)
        copied = copy_tokenizer(tokenizer, folder)
        if registered_here(written):
            write_loading_files(folder, written, str(out), f"`python -m lit_growattn export` of {args.ckpt}")
    if copied:
        tokens = f"tokenizer files {', '.join(copied)}"
    elif hparams.get("tokenizer") == "bytes":
        tokens = "no tokenizer files: the model was trained on raw bytes (token ids 0–255, the bytes of UTF-8 text)"
    else:
        tokens = f"no tokenizer files ({tokenizer} has none)" if tokenizer else "no tokenizer (the checkpoint names none)"
    loading = (f"; load it after `import lit_growattn.hf` ({out / 'README.md'})"
               if registered_here(written) else "")
    sizes = (f", query/key head sizes {module.head_sizes()}, value head sizes {module.value_sizes()}"
             if module.head_sizes() else "")  # none: DINT, not growable
    print(f"wrote {out}: model type {written}{sizes}, {tokens}{loading}")
