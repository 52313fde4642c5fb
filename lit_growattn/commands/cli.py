"""`python -m lit_growattn fit|validate|test --config cfg.yaml` through LightningCLI."""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import shutil
import sys
import warnings
from enum import Enum
from pathlib import Path

import lightning as L
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from jsonargparse import Namespace, _typehints, set_dumper

from lit_growattn.training.checkpoint import is_distributed_checkpoint, read_hyperparameters
from lit_growattn.commands.legacy import refuse_old_config

# Every run writes into a folder of its own, logs/lit_growattn/version_N: TensorBoard's, or with the logger off
# the trainer's root folder (`_instantiate_trainer`).
LOG_DIR, RUN_NAME = "logs", "lit_growattn"
TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": LOG_DIR, "name": RUN_NAME},
    },
}


def _pass_nested_values_as_json(adapt_class_type):
    """jsonargparse (up to 4.53 at least) hands a dotted override inside a class's arguments, such as
    `--trainer.callbacks.init_args.growth.columns=null`, on to that class's own parser as the text
    f"--growth.columns={value}". Scalars are still the text the user typed, but null, lists and mappings have been
    parsed by then, and their str() is Python's: null arrives as "None", which no type accepts, and [null] as
    ["None"]. Their JSON is what the user meant, and valid YAML."""

    @functools.wraps(adapt_class_type)
    def adapt(value, *args, **kwargs):
        nested = value.get("init_args") if isinstance(value, (dict, Namespace)) else None
        if isinstance(nested, _typehints.NestedArg) and not isinstance(nested.val, str):
            value["init_args"] = _typehints.NestedArg(nested.key, json.dumps(nested.val))
        return adapt_class_type(value, *args, **kwargs)

    return adapt


# A private hook: without it (another jsonargparse) a nested null is refused as before, and
# tests/test_cli_overrides.py says so. Listed in lit_growattn/training/lightning_private.py.
if hasattr(_typehints, "adapt_class_type") and hasattr(_typehints, "NestedArg"):
    _typehints.adapt_class_type = _pass_nested_values_as_json(_typehints.adapt_class_type)


class _ConfigDumper(yaml.SafeDumper):
    """yaml's safe dumper that also writes an enum whose values are strings as that string: Lightning's `Timer`
    defaults its `str` argument `interval` to one (`Interval.step`), and saving the run's config would fail on it."""


_ConfigDumper.add_multi_representer(
    Enum, lambda dumper, data: dumper.represent_str(data.value) if isinstance(data, str) else dumper.represent_undefined(data))
set_dumper("yaml", lambda data: yaml.dump(data, Dumper=_ConfigDumper, default_flow_style=False, allow_unicode=True,
                                          sort_keys=False))  # jsonargparse's own yaml settings

# jsonargparse's report of an option of one callback that went to another: `--trainer.callbacks.init_args.…` always
# goes to the callback listed last at that point of the command line.
_OPTION_OF_ANOTHER_CALLBACK = re.compile(
    r'Parser key "trainer\.callbacks".*?Problem with given class_path \'([\w.]+)\':\s*unrecognized arguments: --(\S+?)(=|\s|$)',
    re.DOTALL)


class GrowAttentionParser(LightningArgumentParser):
    def error(self, message: str, ex: Exception | None = None):
        if match := _OPTION_OF_ANOTHER_CALLBACK.search(message):
            callback, option = match[1].rsplit(".", 1)[-1], match[2]
            message = (f"--trainer.callbacks.init_args.{option} went to {callback}, the callback listed last at that "
                       f"point, which has no such argument: give a callback's options before any --trainer.callbacks+=… "
                       f"that adds another (in a config, list the callback you set from the command line last)")
        super().error(message, ex)


class GrowAttentionCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # No `predict`: the data modules have no prediction data, and nothing would write the predictions.
        commands = LightningCLI.subcommands()
        del commands["predict"]
        return commands

    def parse_arguments(self, parser, args) -> None:
        if args is None or isinstance(args, list):
            refuse_old_config(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--extensions", type=list[str], default=[],
            help="Modules imported before the model and callbacks are built, e.g. [my_growth]: a growth direction or "
                 "attention variant of your own registers there (growth.register_direction, "
                 "attention.register_attention). Each must be importable: from the working directory or PYTHONPATH.")
        # The vocabulary and the longest sequence come from the data, so the model cannot disagree with it.
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.max_seq_len", "model.init_args.block_size", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        for name in config.get("extensions") or []:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as error:
                raise ModuleNotFoundError(f"extensions: cannot import {name!r} ({error}); run from the folder that "
                                          "holds it, or add that folder to PYTHONPATH") from None
        fill_data_tokenizer(config)

    def _parse_ckpt_path(self) -> None:
        """LightningCLI builds a resumed model from the checkpoint's hyperparameters: read them the project's way
        (a damaged or unsafe file is named), and say which model settings of the command differ from them.
        LightningCLI reads a checkpoint file only; the hyperparameters of a distributed checkpoint folder are
        applied here the same way."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        folder = bool(ckpt_path) and is_distributed_checkpoint(ckpt_path)
        if ckpt_path and (Path(ckpt_path).is_file() or folder):
            stored = read_hyperparameters(ckpt_path)
            given = (self.config[subcommand].get("model") or {}).get("init_args") or {}
            warn_changed_settings(ckpt_path, stored, given.as_dict() if hasattr(given, "as_dict") else dict(given),
                                  subcommand)
            if folder:
                self._apply_checkpoint_settings(subcommand, dict(stored))
        super()._parse_ckpt_path()

    def _apply_checkpoint_settings(self, subcommand: str, hparams: dict) -> None:
        """The model config takes the checkpoint's hyperparameters, as LightningCLI's `_parse_ckpt_path` does for a
        checkpoint file: its body for a file, repeated (compare it after a Lightning upgrade)."""
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def _instantiate_trainer(self, config: dict, callbacks: list[Callback]):
        # Without a logger Lightning writes the config and checkpoints/ into the working directory, and a second run
        # writes last-v1.ckpt beside the first: give such a run the folder the logger would have had.
        if config.get("logger") is False and config.get("default_root_dir") is None:
            config = {**config, "default_root_dir": str(next_version(Path(LOG_DIR) / RUN_NAME))}
        # The default `ModelCheckpoint(save_last=True)` only when the user configured none: Lightning refuses two
        # stateful callbacks of one type, and a user who configures checkpointing wants exactly theirs.
        configured = config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        wanted = config.get("enable_checkpointing") is not False
        if wanted and not any(isinstance(c, ModelCheckpoint) for c in [*configured, *callbacks]):
            callbacks = [*callbacks, ModelCheckpoint(save_last=True)]
        return super()._instantiate_trainer(config, callbacks)

    def _run_subcommand(self, subcommand: str) -> None:
        run_dirs = self._run_dirs()
        new_dirs = {d for run_dir in run_dirs for d in (run_dir, *run_dir.parents) if not d.exists()}
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            self._remove_logs_of_failed_start(run_dirs, new_dirs)
            raise

    def _run_dirs(self) -> list[Path]:
        """The folders this run writes into: each logger's, or without one the trainer's root folder."""
        trainer = self.trainer
        return [Path(d) for d in [logger.log_dir for logger in trainer.loggers] or [trainer.default_root_dir] if d]

    def _remove_logs_of_failed_start(self, run_dirs: list[Path], new_dirs: set[Path]) -> None:
        """A run that fails before logging anything leaves none of the folders it created behind: its run folder
        (when it holds only what this start wrote) and the empty folders above it."""
        trainer = self.trainer
        if trainer.callback_metrics or not trainer.is_global_zero:
            return
        for run_dir in run_dirs:
            if run_dir in new_dirs and run_dir.is_dir() and _written_by_this_start(run_dir):
                shutil.rmtree(run_dir, ignore_errors=True)
        for folder in sorted(new_dirs, key=lambda d: len(d.parts), reverse=True):  # the deepest first
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def fill_data_tokenizer(config) -> None:
    """A data tokenizer left out (null) is the model's: the one it recorded (a resumed run), else its pretrained
    folder's. Other data modules and models are left as they are."""
    data, model = ((config.get(key) or {}).get("init_args") or {} for key in ("data", "model"))
    if "tokenizer" not in data or data["tokenizer"] is not None:
        return
    folder = model.get("pretrained")
    source = model.get("tokenizer") or folder
    if source is None:
        return
    if source == folder and not any(
            os.path.isfile(os.path.join(folder, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        where = "holds no tokenizer" if os.path.isdir(folder) else "does not exist (moved?)"
        raise ValueError(f"--data.init_args.tokenizer is left out, so the model's tokenizer is used, but its folder "
                         f"{folder} {where}: name the tokenizer the model was trained with, "
                         "--data.init_args.tokenizer=<tokenizer folder or file>")
    data["tokenizer"] = source


# Set from the data (linked) or recorded by growth (a grown checkpoint's per-layer d_head): not the user's choice.
DERIVED_SETTINGS = {"vocab_size", "block_size"}


# How the model trains, not what it computes: nothing for validate or test to warn about.
TRAINING_ONLY_SETTINGS = {"warmup_steps", "min_lr_ratio", "lr_schedule", "max_nonfinite_steps", "init_from", "compile"}


def warn_changed_settings(ckpt_path: str, stored: dict, given: dict, subcommand: str) -> None:
    """One warning naming every model setting whose value in the command's config differs from the checkpoint's
    (plain values only: nested settings such as the optimizer are recorded in another form than the command gives
    them). fit resumes the checkpoint; validate and test evaluate it, where only what the model computes counts."""
    ignored = DERIVED_SETTINGS | (TRAINING_ONLY_SETTINGS if subcommand != "fit" else set())
    changed = {k: (given[k], v) for k, v in stored.items()
               if not k.startswith("_") and k not in ignored and k in given and given[k] is not None
               and isinstance(v, (int, float, str, bool, list))
               and given[k] != v and not (k in ("d_head", "d_v") and isinstance(v, list))}  # grown sizes
    if not changed:
        return
    listed = "; ".join(f"{k}: {new!r} given, the checkpoint's {old!r} used" for k, (new, old) in changed.items())
    if subcommand != "fit":
        warnings.warn(f"{subcommand} evaluates {ckpt_path} with the model settings it was trained with, not the "
                      f"command's: {listed}. To evaluate other settings, give a checkpoint trained with them",
                      stacklevel=2)
        return
    weights = " (or use init_from for the weights)" if "init_from" in given else ""
    warnings.warn(f"resuming from {ckpt_path}, whose model settings win over the command's: {listed}. Start a "
                  f"new run{weights} to change them", stacklevel=2)


def next_version(folder: Path) -> Path:
    """folder/version_N with N one past the largest there, as TensorBoard's logger numbers its runs."""
    versions = [int(p.name[len("version_"):]) for p in folder.glob("version_*")
                if p.is_dir() and p.name[len("version_"):].isdigit()]
    return folder / f"version_{max(versions, default=-1) + 1}"


def _written_by_this_start(log_dir: Path) -> bool:
    """Whether log_dir holds only the config files and this process's (empty) event files: no checkpoint."""
    pid = str(os.getpid())
    for path in log_dir.rglob("*"):
        name = path.name
        own_events = name.startswith("events.out.tfevents.") and name.split(".")[-2] == pid  # …{host}.{pid}.{n}
        if not (path.is_dir() or own_events or name in ("config.yaml", "hparams.yaml")):
            return False
    return True


def main(args: list[str] | None = None, run: bool = True) -> GrowAttentionCLI:
    """The CLI with the project's defaults; `run=False` builds model, data and trainer without a subcommand."""
    return GrowAttentionCLI(
        L.LightningModule,  # lit_growattn.GrowAttentionLM, lit_growattn.hf.HFCausalLM, or a module of your own
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=GrowAttentionParser,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
