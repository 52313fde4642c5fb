"""`python -m lit_growattn fit|validate|test --config cfg.yaml` through LightningCLI."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from lit_growattn.checkpoint import read_checkpoint
from lit_growattn.legacy import refuse_flat_config

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "logs", "name": "lit_growattn"},
    },
}


class GrowAttentionCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # No `predict`: the data modules have no prediction data, and nothing would write the predictions.
        commands = LightningCLI.subcommands()
        del commands["predict"]
        return commands

    def parse_arguments(self, parser, args) -> None:
        if args is None or isinstance(args, list):
            refuse_flat_config(sys.argv[1:] if args is None else args)
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
        """LightningCLI builds a resumed model from the checkpoint's hyperparameters: read the file the project's way
        (a damaged or unsafe file is named), and say which model settings of the command differ from it."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).is_file():
            stored = read_checkpoint(ckpt_path).get("hyper_parameters", {})
            given = (self.config[subcommand].get("model") or {}).get("init_args") or {}
            warn_changed_settings(ckpt_path, stored, given.as_dict() if hasattr(given, "as_dict") else dict(given))
        super()._parse_ckpt_path()

    def _instantiate_trainer(self, config: dict, callbacks: list[Callback]):
        # The default `ModelCheckpoint(save_last=True)` only when the user configured none: Lightning refuses two
        # stateful callbacks of one type, and a user who configures checkpointing wants exactly theirs.
        configured = config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        wanted = config.get("enable_checkpointing") is not False
        if wanted and not any(isinstance(c, ModelCheckpoint) for c in [*configured, *callbacks]):
            callbacks = [*callbacks, ModelCheckpoint(save_last=True)]
        return super()._instantiate_trainer(config, callbacks)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            self._remove_logs_of_failed_start()
            raise

    def _remove_logs_of_failed_start(self) -> None:
        """A run that fails before logging anything leaves no `version_N` folder behind (only its own files go)."""
        trainer = self.trainer
        if trainer.callback_metrics or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            log_dir = Path(logger.log_dir) if logger.log_dir else None
            if log_dir is not None and log_dir.is_dir() and _written_by_this_start(log_dir):
                shutil.rmtree(log_dir, ignore_errors=True)


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


def warn_changed_settings(ckpt_path: str, stored: dict, given: dict) -> None:
    """One warning naming every model setting whose value on the command line differs from the checkpoint's (plain
    values only: nested settings such as the optimizer are recorded in another form than the command gives them)."""
    changed = {k: (given[k], v) for k, v in stored.items()
               if not k.startswith("_") and k not in DERIVED_SETTINGS and k in given and given[k] is not None
               and isinstance(v, (int, float, str, bool, list))
               and given[k] != v and not (k == "d_head" and isinstance(v, list))}
    if changed:
        listed = "; ".join(f"{k}: {new!r} given, the checkpoint's {old!r} used" for k, (new, old) in changed.items())
        weights = " (or use init_from for the weights)" if "init_from" in given else ""
        warnings.warn(f"resuming from {ckpt_path}, whose model settings win over the command's: {listed}. Start a "
                      f"new run{weights} to change them", stacklevel=2)


def _written_by_this_start(log_dir: Path) -> bool:
    """Whether log_dir holds only the config files and this process's (empty) event files: nothing from an earlier
    run that used the same folder, and no checkpoint."""
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
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
