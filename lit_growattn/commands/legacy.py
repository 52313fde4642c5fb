"""Configs in an old spelling are refused with the new one, ready to paste: GrowAttentionCallback's flat arguments
(before the settings were grouped), and class paths of modules that moved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import re

import yaml

from lit_growattn.callback.budget import CHECK_EVERY, SPEND_UNTIL

GROUP_OF = {
    "grow_by": ("growth", "columns"), "dynamic_rank": ("growth", "rank_threshold"),
    "max_d_head": ("growth", "max_d_head"), "layers": ("growth", "layers"), "method": ("growth", "method"),
    "mode": ("growth", "mode"), "temperature": ("growth", "temperature"), "truncation": ("growth", "truncation"),
    "new_second_moment": ("growth", "new_second_moment"),
    "stats_batches": ("statistics", "batches"), "layers_per_step": ("statistics", "layers_per_step"),
    "capture": ("statistics", "capture"),
    "alphas": ("step_search", "alphas"), "line_search_batches": ("step_search", "batches"),
    "line_search": ("step_search", "line_search"), "step_size": ("step_search", "rule"),
}
FLAT = {*GROUP_OF, "check_every", "patience", "auto_threshold", "grow_at_epochs", "grow_at_steps"}
# The automatic schedule's settings before its K-cache budget.
OLD_AUTO = {"first_check", "patience", "threshold", "agreement", "pool", "min_fall", "spare_below"}
# What a rewritten AutoSchedule is given for its budget, which has no default: a quarter of static d_head 16's K cache.
EXAMPLE_BUDGET = 4
EXAMPLE_NOTE = f"budget {EXAMPLE_BUDGET} is an example: give the mean query/key head size you can afford"
MOVED = {"lit_growattn.hf.entropy": "lit_growattn.dint.entropy"}  # a class a config names, in its old module


def is_flat(init_args: dict[str, Any]) -> bool:
    """Whether the callback's init_args use the old flat names (`schedule: auto` is one of them)."""
    return bool(FLAT & set(init_args)) or init_args.get("schedule") in ("auto", "fixed")


def grouped(init_args: dict[str, Any]) -> dict[str, Any]:
    """The flat init_args in the grouped spelling."""
    auto = init_args.get("schedule") == "auto"
    if auto:  # the flat form's rule (patience, auto_threshold) is gone: the automatic schedule spends a budget now
        schedule = {"class_path": "lit_growattn.AutoSchedule",
                    "init_args": {"budget": EXAMPLE_BUDGET, "check_every": init_args.get("check_every", CHECK_EVERY),
                                  "spend_until": SPEND_UNTIL}}
    elif init_args.get("grow_at_steps") is not None:
        schedule = {"class_path": "lit_growattn.AtSteps", "init_args": {"steps": init_args["grow_at_steps"]}}
    else:
        schedule = {"class_path": "lit_growattn.AtEpochs", "init_args": {"epochs": init_args.get("grow_at_epochs")}}
    out: dict[str, Any] = {"schedule": schedule}
    for key, value in init_args.items():
        if key in GROUP_OF:
            group, name = GROUP_OF[key]
            if key == "grow_by" and auto:
                continue  # a cap of the old rule: the budget bounds the widths now
            if key == "grow_by" and init_args.get("dynamic_rank") is not None:
                name = "max_columns"  # grow_by was a cap there
            out.setdefault(group, {})[name] = value
    return out


def refuse_old_config(args: list[str]) -> None:
    """Raises ValueError when a `--config` file in `args` gives GrowAttentionCallback flat arguments, or `args`
    set one on the command line (`--trainer.callbacks.init_args.grow_at_epochs=…`), or either names a class in a
    module it has moved from."""
    for i, arg in enumerate(args):
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else args[i + 1] if arg == "--config" and i + 1 < len(args) \
            else None
        _refuse_moved(arg, "the command line")
        if path is not None and Path(path).is_file():
            text = Path(path).read_text()
            _refuse_moved(text, path)
            for init_args in _callback_init_args(yaml.safe_load(text) or {}):
                if is_flat(init_args):
                    example = f" ({EXAMPLE_NOTE})" if init_args.get("schedule") == "auto" else ""
                    raise ValueError(
                        f"{path} gives GrowAttentionCallback its settings in the old flat form, which is no longer "
                        f"read; they are grouped now{example}. Write its init_args as:\n"
                        + yaml.safe_dump(grouped(init_args), sort_keys=False, default_flow_style=None)
                    )
                _refuse_old_auto(init_args.get("schedule"), path)
        prefix = "--trainer.callbacks.init_args."
        option = arg.removeprefix(prefix).split("=", 1)[0]
        name = option.rsplit(".", 1)[-1]
        if arg.startswith(prefix) and (option in ("patience", "auto_threshold") or option.startswith(
                "schedule.init_args.") and name in OLD_AUTO):
            raise ValueError(f"{arg}: {_auto_rewrite({name})}")
        if arg.startswith(prefix) and option in FLAT:
            raise ValueError(f"{arg}: GrowAttentionCallback's settings are grouped now; write "
                             f"{prefix}{_new_option(option)}=… (`fit --print_config=comments` lists them all)")


def _refuse_old_auto(schedule: Any, where: str) -> None:
    if isinstance(schedule, dict) and str(schedule.get("class_path", "")).endswith("AutoSchedule"):
        if old := OLD_AUTO & set(schedule.get("init_args") or {}):
            kept = {k: v for k, v in schedule["init_args"].items() if k not in OLD_AUTO}
            raise ValueError(f"{where}: {_auto_rewrite(old)}. Write its init_args as:\n"
                             + yaml.safe_dump({"budget": EXAMPLE_BUDGET, **kept, "spend_until": SPEND_UNTIL},
                                              sort_keys=False, default_flow_style=None))


def _auto_rewrite(old: set[str]) -> str:
    return (f"AutoSchedule no longer takes {', '.join(sorted(old))}: it now spends a K-cache budget (budget: the "
            "mean query/key head size the growing layers may reach; check_every; spend_until: the share of the run "
            "the budget is spread over), and growth.max_columns goes with the old rule too (docs/capacity.md); "
            f"{EXAMPLE_NOTE}")


def _refuse_moved(text: str, where: str) -> None:
    for old, new in MOVED.items():
        if found := re.search(rf"{re.escape(old)}\.(\w+)", text):
            raise ValueError(f"{where} names {found.group(0)}, which moved: write {new}.{found.group(1)}")


def _new_option(option: str) -> str:
    if option in GROUP_OF:
        return ".".join(GROUP_OF[option])
    if option == "check_every":
        return "schedule.init_args.check_every"
    return "schedule.init_args.epochs" if option == "grow_at_epochs" else "schedule.init_args.steps"


def _callback_init_args(config: dict) -> list[dict]:
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    return [c.get("init_args") or {} for c in callbacks
            if isinstance(c, dict) and str(c.get("class_path", "")).endswith("GrowAttentionCallback")]
