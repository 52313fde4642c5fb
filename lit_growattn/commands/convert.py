"""Converting a trained mha checkpoint, to fine-tune instead of training from scratch.

`--to dint | lowrank_dint` (seed 001): DINT attention with outputs identical to the mha model at step 0.
`--to mha --d_head r`: every head's query/key form shrunk to its closest rank-r form (truncated SVD of
τ W_Q W_Kᵀ, temperature kept), exact when r ≥ the form's rank: the shrink-then-fine-tune peer of growth.
`--to mha --d_v r` (with or without --d_head): every head's value map W_M = W_V W_O shrunk the same way.
`--to mha --kv_budget B [--calibration FILE]`: the sizes chosen for a mean head size B over the KV cache, by the
weights' energy or by the activations on FILE (`commands/shrink.py`); for `--pretrained` folders too.

The DINT conversions are `lit_growattn.dint`'s (`gpt.py` for `--ckpt`, `models.py` for `--pretrained`); this module
is the command: it reads the source, checks the options and writes the result safely.

`--pretrained DIR` instead of `--ckpt`: a Hugging Face Llama/Mistral/Qwen2/Qwen3 folder becomes a DINT model
folder (registered `dint_<family>` model classes, λ = 0, outputs unchanged), which `fit` fine-tunes with
`lit_growattn.hf.HFCausalLM` (`pretrained: DIR`, `growable: false`); with `--to mha --kv_budget B` it becomes a
shrunk model folder instead (`shrink.shrink_pretrained`).

The result of `--ckpt` is a weights-only checkpoint (state_dict + hyper_parameters), readable by
`GrowAttentionLM.load_from_checkpoint`. It is not meant for `fit --ckpt_path`, which resumes a run: optimizer
state, step counters and the LR schedule's position. Fine-tuning starts a new run from these weights instead:
`main` writes the model's CLI config next to the checkpoint, whose `init_from` names the weights to start from.
The checkpoint is put in place first, then its config; should the second step fail (the config appeared meanwhile,
or its rename failed), the new checkpoint stays beside the old config (or none), and the error says so.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import lightning as L
import torch
import yaml

from lit_growattn.commands.shrink import PRETRAINED_LENGTH, SIDES, Budget, shrink_module, shrink_pretrained
from lit_growattn.dint.gpt import to_dint
from lit_growattn.growth.shrink import shrink_form, shrink_values
from lit_growattn.module import GrowAttentionLM
from lit_growattn.training.checkpoint import read_checkpoint
from lit_growattn.training.writing import check_output, new_file

TARGETS = ("dint", "lowrank_dint", "mha")
CALIBRATION_OPTIONS = ("calibration_sequences", "calibration_length", "tokenizer", "device")


def convert_checkpoint(
    src_path: str | Path,
    dst_path: str | Path,
    to: str = "lowrank_dint",
    seed: int = 0,
    d_head: int | list[int] | None = None,
    d_v: int | list[int] | None = None,
    overwrite: bool = False,
    *,
    kv_budget: float | None = None,
    sides: str | None = None,
    calibration: str | Path | None = None,
    calibration_sequences: int | None = None,
    calibration_length: int | None = None,
    tokenizer: str | None = None,
    device: str | None = None,
    **variant_args,
) -> GrowAttentionLM:
    """Converts the `mha` checkpoint at src_path and saves it at dst_path; returns the converted module.

    to="mha" shrinks every layer's query/key head size to d_head and/or its value head size to d_v (each one int,
    or one per layer), or, with kv_budget, to the sizes a mean head size kv_budget over the cache heads of `sides`
    (both, the default | query_key | value) allows: chosen by the weights' SVD energy, or by the activations on the
    text file `calibration` (calibration_sequences windows, default 256, of calibration_length tokens, default
    block_size, read with `tokenizer`, default raw bytes; computed on `device`, default cpu), `commands/shrink.py`;
    sides goes with kv_budget and the calibration_* settings with calibration, as on the command line. Otherwise
    variant_args go to
    the new attention (`rank`, `d2_ratio` for lowrank_dint) and the second map is initialised from `seed`, without
    touching the global RNG.

    dst_path is written whole or not at all (`lit_growattn.training.writing`): never onto src_path, and in place
    of an existing file only with overwrite=True.
    """
    if kv_budget is None and calibration is not None:
        raise ValueError("calibration weighs the allocation of kv_budget; with d_head/d_v the sizes are given")
    if kv_budget is None and sides is not None:
        raise ValueError("sides chooses what kv_budget shrinks")
    calibration_settings = {"calibration_sequences": calibration_sequences, "calibration_length": calibration_length,
                            "tokenizer": tokenizer, "device": device}
    if calibration is None and (given := [name for name, v in calibration_settings.items() if v is not None]):
        raise ValueError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with calibration: give the text "
                         "to calibrate on, or leave them out")
    budget = None if kv_budget is None else Budget(
        kv_budget, sides or "both", calibration, 256 if calibration_sequences is None else calibration_sequences,
        calibration_length, tokenizer, device or "cpu")
    if budget is not None:
        budget.check()
    read = {"the checkpoint src_path": src_path, "the calibration text": calibration, "the tokenizer": tokenizer}
    dst_path = check_output(dst_path, "file", read, overwrite, option="dst_path")
    module, _ = converted(src_path, to, seed, d_head, d_v, budget, **variant_args)
    with new_file(dst_path, overwrite, option="dst_path") as partial:
        save_weights(module, partial)
    return module


def converted(src_path: str | Path, to: str, seed: int, d_head: int | list[int] | None, d_v: int | list[int] | None,
              budget: Budget | None = None, **variant_args) -> tuple[GrowAttentionLM, str]:
    """convert_checkpoint's module, not written (the command writes it together with its model config), and what
    a shrink to `budget` did (empty without one)."""
    if to not in TARGETS:
        raise ValueError(f"can convert mha to {', '.join(TARGETS)}, not {to!r}")
    if budget is not None and (d_head is not None or d_v is not None):
        raise ValueError("give the sizes (d_head/d_v) or a budget (kv_budget), not both")
    if (to == "mha") != (d_head is not None or d_v is not None or budget is not None):
        raise ValueError("give d_head, d_v or kv_budget exactly when shrinking (to='mha'): the other targets keep the "
                         "head sizes")
    if budget is not None:
        budget.check()
    ckpt = read_checkpoint(src_path)
    if "pretrained" in ckpt.get("hyper_parameters", {}):
        what = f"{src_path} is a checkpoint of a Hugging Face model (lit_growattn.hf.HFCausalLM)"
        if to == "mha":
            raise ValueError(f"{what}: export it (python -m lit_growattn export), then shrink the exported folder with "
                             "`python -m lit_growattn convert --pretrained <folder> --to mha --kv_budget …`")
        raise ValueError(f"{what}: export it (python -m lit_growattn export), then convert the exported folder with "
                         f"--pretrained. That converts llama, mistral, qwen2 and qwen3 models whose head sizes did not "
                         "grow: a grown one exports as growattn_<type>, which has no DINT conversion")
    if "hyper_parameters" not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"{src_path} is not a checkpoint of lit_growattn's GrowAttentionLM (it has no "
                         "hyper_parameters and state_dict): give a checkpoint written by `python -m lit_growattn fit`")
    # LightningCLI records how it built the model (`_class_path`, `_instantiator`): not arguments of the model.
    hparams = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}
    state = ckpt["state_dict"]
    if hparams.get("attention", "mha") != "mha":
        raise ValueError(f"{src_path} is a {hparams['attention']!r} checkpoint; only mha can be converted")
    with torch.random.fork_rng(devices=[]):  # building a module draws from the global RNG
        # d_head as stored, in case the run grew without recording it: both maps of a layer must share it.
        forms = GrowAttentionLM(**hparams).model.named_qk_forms()  # mha: one form per layer
    hparams["d_head"] = [state[f"model.{name}.w_q"].shape[-1] for _, name, _ in forms]
    if budget is not None:
        return _shrunk_to_budget(src_path, hparams, state, budget)
    if to == "mha":
        return _shrunk(src_path, hparams, state, d_head, d_v), ""
    return to_dint(src_path, hparams, state, to, seed, variant_args), ""


def save_weights(module: GrowAttentionLM, path: Path) -> None:
    """`module` as a weights-only checkpoint that load_from_checkpoint reads."""
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": L.__version__,
        },
        path,
    )


def _loaded(hparams: dict, state: dict) -> GrowAttentionLM:
    with torch.random.fork_rng(devices=[]):  # building a module draws from the global RNG
        module = GrowAttentionLM(**hparams)
    module.load_state_dict(state)
    return module


def _shrunk(src_path, hparams: dict, state: dict, d_head: int | list[int] | None,
            d_v: int | list[int] | None) -> GrowAttentionLM:
    module = _loaded(hparams, state)
    for name, sizes, current in (("d_head", d_head, module.head_sizes()), ("d_v", d_v, module.value_sizes())):
        sizes = sizes if isinstance(sizes, list) or sizes is None else [sizes] * hparams["n_layer"]
        if sizes is not None and len(sizes) != hparams["n_layer"]:
            raise ValueError(f"{name} has {len(sizes)} entries but {src_path} has {hparams['n_layer']} layers")
        for layer, (size, now) in enumerate(zip(sizes or [], current)):
            if size > now:
                what = "head size" if name == "d_head" else "value head size"
                raise ValueError(f"layer {layer} has {what} {now}; shrinking cannot widen it to {size} (grow it instead)")
        if sizes is not None and name == "d_head":
            for forms, size in zip(module.model.qk_forms(), sizes):
                for form in forms:
                    w_q, w_k, _ = shrink_form(form.w_q, form.w_k, form.log_tau, size)
                    form.set_weights(w_q, w_k, form.log_tau)
        elif sizes is not None:
            for (_, _, values), size in zip(module.model.named_value_maps(), sizes):
                w_v, w_o, _ = shrink_values(values.w_v, values.w_o, size)
                values.set_weights(w_v, w_o)
    module.record_head_sizes()
    return module


def _shrunk_to_budget(src_path, hparams: dict, state: dict, budget: Budget) -> tuple[GrowAttentionLM, str]:
    module = _loaded(hparams, state)
    # A GPT checkpoint records no tokenizer: raw bytes unless one is given.
    if budget.calibration is not None and budget.tokenizer is None and module.cfg.vocab_size != 256:
        raise ValueError(f"{src_path} has a vocabulary of {module.cfg.vocab_size} tokens, not the 256 of raw bytes: "
                         f"give {budget.name('tokenizer')}, the tokenizer.json (or its folder) the model was trained "
                         "with, to read the calibration text")
    done = shrink_module(module, budget, str(src_path), budget.tokenizer, (module.cfg.block_size,) * 2,
                         module.cfg.vocab_size)
    return module, done


def main(argv: list[str] | None = None) -> None:
    """`python -m lit_growattn convert --ckpt mha.ckpt --to lowrank_dint --rank 8 --out new.ckpt`
    or `… --to mha --d_head 4 [4 …] [--d_v 8 [8 …]] --out small.ckpt`
    or `… --to mha --kv_budget 4 [--sides query_key] [--calibration train.txt] --out small.ckpt`
    or `… --pretrained path/to/llama --to lowrank_dint --rank 8 --out DIR` (a Hugging Face model folder)
    or `… --pretrained path/to/llama --to mha --kv_budget 4 [--calibration train.txt] --out DIR`"""
    parser = argparse.ArgumentParser(prog="python -m lit_growattn convert", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="trained mha checkpoint of this project's GPT (a file, or the distributed "
                        "checkpoint folder ModelParallelStrategy writes)")
    source.add_argument("--pretrained", help="Hugging Face model folder (llama, mistral, qwen2, qwen3) to convert to "
                        "DINT, or (any supported type) to shrink with --to mha --kv_budget")
    parser.add_argument("--to", choices=TARGETS, default="lowrank_dint",
                        help="dint or lowrank_dint (outputs unchanged), or mha to shrink the head sizes")
    parser.add_argument("--rank", type=int, help="rank of the second map (lowrank_dint)")
    parser.add_argument("--d2_ratio", type=float, help="d₂ / d_head of the second map (lowrank_dint; default 1/9)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the second map's initialisation")
    parser.add_argument("--d_head", type=int, nargs="+", help="head size to shrink to (mha): one, or one per layer")
    parser.add_argument("--d_v", type=int, nargs="+", help="value head size to shrink to (mha): one, or one per layer")
    parser.add_argument("--kv_budget", type=float, metavar="B", help="shrink (mha) to this mean head size over the "
                        "KV cache heads of --sides, sizes chosen per layer (the unit of AutoSchedule's budget)")
    parser.add_argument("--sides", choices=list(SIDES), help="what --kv_budget shrinks: both (default), query_key "
                        "(the K cache) or value (the V cache)")
    parser.add_argument("--calibration", metavar="FILE", help="a text of the training distribution whose activations "
                        "weigh --kv_budget's sizes and factors (default: the weights' SVD energy)")
    parser.add_argument("--calibration_sequences", type=int, metavar="N", help="windows of --calibration read "
                        "(default 256)")
    parser.add_argument("--calibration_length", type=int, metavar="L", help="tokens per window (default: the model's "
                        f"block size; {PRETRAINED_LENGTH} for --pretrained, at most its positions)")
    parser.add_argument("--tokenizer", metavar="PATH", help="the tokenizer.json (or its folder) the model was trained "
                        "with, to read --calibration (default: raw bytes; --pretrained: the folder's own)")
    parser.add_argument("--device", help="where the calibration runs (default cpu)")
    parser.add_argument("--out", required=True, help="converted checkpoint (its model config goes beside it, .yaml); "
                        "with --pretrained, the model folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out (never the source)")
    args = parser.parse_args(argv)
    variant_args = {k: v for k in ("rank", "d2_ratio") if (v := getattr(args, k)) is not None}
    if args.to == "lowrank_dint" and "rank" not in variant_args:
        parser.error("--rank is required for lowrank_dint")
    if args.to != "lowrank_dint" and variant_args:
        parser.error("--rank and --d2_ratio belong to lowrank_dint")
    sized = args.d_head is not None or args.d_v is not None
    if args.kv_budget is not None and sized:
        parser.error("give the sizes (--d_head/--d_v) or a budget (--kv_budget), not both")
    if args.calibration is not None and args.kv_budget is None:
        parser.error("--calibration weighs the allocation of --kv_budget; with --d_head/--d_v the sizes are given")
    if args.sides is not None and args.kv_budget is None:
        parser.error("--sides chooses what --kv_budget shrinks")
    if args.calibration is None and any(getattr(args, name) is not None for name in CALIBRATION_OPTIONS):
        parser.error(f"{', '.join('--' + name for name in CALIBRATION_OPTIONS)} go with --calibration")
    if (args.to == "mha") != (sized or args.kv_budget is not None):
        parser.error("--d_head, --d_v or --kv_budget is required for --to mha (shrinking) and belongs to it alone")
    budget = None if args.kv_budget is None else Budget(
        args.kv_budget, args.sides or "both", args.calibration,
        256 if args.calibration_sequences is None else args.calibration_sequences, args.calibration_length,
        args.tokenizer, args.device or "cpu", cli=True)
    if budget is not None:
        budget.check()  # before anything is read or written
    if args.pretrained is not None:
        _convert_pretrained(parser, args, variant_args, budget)
        return
    read = {"the checkpoint --ckpt": args.ckpt, "the calibration text --calibration": args.calibration,
            "the tokenizer --tokenizer": args.tokenizer}
    out = check_output(args.out, "file", read, args.overwrite)
    config_path = out.with_suffix(".yaml")
    if config_path == out:
        raise ValueError(f"--out {out} ends in .yaml, the name of the model config written beside the checkpoint: "
                         "give the checkpoint's name, e.g. converted.ckpt")
    check_output(config_path, "file", read, args.overwrite, option="--out's model config")
    one_or_list = lambda sizes: None if sizes is None else sizes[0] if len(sizes) == 1 else sizes  # noqa: E731
    module, done = converted(args.ckpt, args.to, args.seed, one_or_list(args.d_head), one_or_list(args.d_v), budget,
                             **variant_args)
    # Both partial files are complete before either is put in place, the checkpoint first: the config names it
    # (init_from), and a new config beside the old checkpoint would describe weights that are not there. A failure
    # to put the config in place after the checkpoint is not undone (the old checkpoint is gone): it is reported.
    checkpoint_placed = False
    try:
        with new_file(config_path, args.overwrite, option="--out's model config") as partial_config:
            with new_file(out, args.overwrite) as partial_ckpt:
                save_weights(module, partial_ckpt)
                # vocab_size and block_size are linked from the data by the CLI, so they stay out of the model config.
                init_args = {k: v for k, v in module.hparams.items() if k not in ("vocab_size", "block_size")}
                init_args["init_from"] = str(out.resolve())
                config = {"class_path": "lit_growattn.module.GrowAttentionLM", "init_args": init_args}
                partial_config.write_text(yaml.safe_dump(config, sort_keys=False))
            checkpoint_placed = True
    except OSError as error:
        if not checkpoint_placed:
            raise
        raise OSError(f"{out} is the new checkpoint, but its model config could not be put in place, so {config_path} "
                      f"is not its config ({error}): run the conversion again with --overwrite") from error
    print(
        f"wrote {out} and {config_path}{': ' + done if done else ''}; fine-tune with\n"
        f"  python -m lit_growattn fit --config <your run config> --model {config_path}"
    )


def _convert_pretrained(parser: argparse.ArgumentParser, args: argparse.Namespace, variant_args: dict,
                        budget: Budget | None) -> None:
    if args.to == "mha" and budget is None:
        parser.error("--pretrained shrinks to a budget, --kv_budget (the sizes --d_head/--d_v are for --ckpt)")
    if budget is not None:
        print(shrink_pretrained(args.pretrained, args.out, budget, args.overwrite)[1])
        return
    from lit_growattn.hf.dint import DintSettings
    from lit_growattn.dint.models import convert_pretrained  # needs transformers

    kind = "lowrank" if args.to == "lowrank_dint" else "full"
    settings = DintSettings(kind, rank=variant_args.get("rank"), d2_ratio=variant_args.get("d2_ratio"))
    out = check_output(args.out, "folder", {"the model folder --pretrained": args.pretrained}, args.overwrite)
    convert_pretrained(args.pretrained, out, settings, seed=args.seed, overwrite=args.overwrite)
    has_tokenizer = (out / "tokenizer_config.json").is_file()
    # Every run config takes these: the model class and the folder replace the config's model, its tokenizer the data's.
    command = ["python", "-m", "lit_growattn", "fit", "--config", "<run config>", "--model=lit_growattn.hf.HFCausalLM",
               "--model.init_args.config=null", f"--model.init_args.pretrained={out}", "--model.init_args.growable=false"]
    command += [f"--data.init_args.tokenizer={out}"] if has_tokenizer else []
    print(f"wrote {out} ({args.to} of {args.pretrained}; load it after `import lit_growattn.hf`, see "
          f"{out / 'README.md'});\n"
          "fine-tune with a run config that has no growth callback (a DINT model does not grow), e.g. "
          "configs/hf_llama_dint_sft.yaml:\n  " + shlex.join(command).replace("'<run config>'", "<run config>")
          + ("" if has_tokenizer else f"\n  {args.pretrained} has no tokenizer: add --data.init_args.tokenizer=<the "
             "model's tokenizer>"))
