"""Every file in configs/ as a user runs it. Each is parsed by the command line (`--print_config`), an overlay on the
base config its comment names, and every setting the file makes reaches the parsed config. The CPU ones train a few
steps through the command line's entry point, in process (`python -m lit_growattn fit`). The automatic schedule decides at its
first check with its shipped settings. Text comes from a generated file and model folders are tiny and random, so
nothing here needs the hub or files beside the clone."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_growattn import GrowAttentionCallback
from lit_growattn.__main__ import main as command_line
from lit_growattn.commands.cli import main
from lit_growattn.data.arithmetic import make_rows, write_jsonl

from conftest import REPO, needs_transformers

CONFIGS = REPO / "configs"


def documented_base(overlay: Path) -> Path:
    """The base config that the overlay's own comment runs it on: `--config configs/X.yaml --config <overlay>`."""
    named = re.search(rf"--config (configs/\S+\.yaml) --config configs/variants/{overlay.name}", overlay.read_text())
    assert named, f"{overlay.relative_to(REPO)}: its comment shows no `--config BASE --config` command to run it with"
    return REPO / named[1]


# Each as its --config files, in order: every config, and every overlay on its documented base.
SHIPPED = [[path] for path in sorted(CONFIGS.glob("*.yaml"))] + [
    [documented_base(overlay), overlay] for overlay in sorted((CONFIGS / "variants").glob("*.yaml"))]


def named(runs: list[list[Path]]) -> dict:
    return {"argvalues": runs, "ids": ["+".join(path.stem for path in files) for files in runs]}


def test_every_file_in_configs_is_one_of_them():
    assert {p for p in CONFIGS.rglob("*") if p.is_file()} == {path for files in SHIPPED for path in files}


def merged(files: list[Path]) -> dict:
    """The settings of the config files, each later one over the earlier (as the command line applies them)."""
    settings: dict = {}
    for path in files:
        settings = overlaid(settings, yaml.safe_load(path.read_text()))
    return settings


def overlaid(base: dict, top: dict) -> dict:
    both = dict(base)
    for key, value in top.items():
        both[key] = overlaid(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return both


def assert_reaches(parsed, shipped, where: str = "") -> None:
    """Every setting in `shipped` is in `parsed` with its value (the parser adds the defaults of the rest)."""
    if isinstance(shipped, dict):
        assert isinstance(parsed, dict), where
        for key, value in shipped.items():
            assert key in parsed, f"{where}{key} is not in the parsed config"
            assert_reaches(parsed[key], value, f"{where}{key}.")
    elif isinstance(shipped, list) and shipped and isinstance(shipped[0], dict):
        assert isinstance(parsed, list) and len(parsed) == len(shipped), where
        for i, (got, value) in enumerate(zip(parsed, shipped)):
            assert_reaches(got, value, f"{where.rstrip('.')}[{i}].")
    else:
        assert parsed == shipped, f"{where}: parsed {parsed!r}, shipped {shipped!r}"


def uses_hugging_face(settings: dict) -> bool:
    return settings["model"]["class_path"].startswith("lit_growattn.hf.")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Generated text: sentences of 12 words drawn from 300 made-up words, enough for the configs' windows and a
    BPE vocabulary of 1024."""
    rng = random.Random(0)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(300)]
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("".join(" ".join(rng.choices(words, k=12)).capitalize() + ".\n" for _ in range(3000)))
    return path


@pytest.fixture(scope="module")
def local_files(tmp_path_factory, corpus) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("local")
    rows = write_jsonl(folder / "rows.jsonl", make_rows(64, seed=0))
    hub = folder / "hub"  # a dataset folder, where a hub name would go
    hub.mkdir()
    write_jsonl(hub / "train_1M.jsonl", make_rows(64, seed=1))
    return {"text": corpus, "rows": Path(rows), "hub": hub, "folder": folder}


@pytest.fixture(scope="module")
def pretrained(local_files) -> Path:
    """A tiny random Llama folder with an instruction tokenizer, as save_pretrained writes a downloaded one, converted
    to low-rank DINT as the DINT configs' comments do it (convert copies the tokenizer in)."""
    needs_transformers()
    from hf_helpers import instruct_tokenizer, saved_tiny_model

    llama, dint = local_files["folder"] / "llama", local_files["folder"] / "llama-lowrank-dint"
    tokenizer = instruct_tokenizer(llama, chat_template=False)
    saved_tiny_model("llama", llama, vocab=len(tokenizer))
    assert command_line(["convert", "--pretrained", str(llama), "--to", "lowrank_dint", "--rank", "2",
                         "--out", str(dint)]) == 0
    return dint


def local_settings(settings: dict, local_files: dict[str, Path], request) -> dict[str, str]:
    """The command-line settings that replace the config's files, model folders and hub names with local ones."""
    data = settings["data"]
    local = {}
    if data["class_path"].endswith("TextDataModule"):
        local["data.init_args.path"] = str(local_files["text"])
    if data["class_path"].endswith("InstructDataModule"):
        hub = (data.get("init_args") or {}).get("hf_dataset")
        local["data.init_args.hf_dataset" if hub else "data.init_args.path"] = str(local_files["hub" if hub else "rows"])
    if uses_hugging_face(settings) and "pretrained" in settings["model"]["init_args"]:
        local["model.init_args.pretrained"] = str(request.getfixturevalue("pretrained"))
    return local


def config_args(files: list[Path], local: dict[str, str]) -> list[str]:
    return [*(arg for path in files for arg in ("--config", str(path))), *(f"--{k}={v}" for k, v in local.items())]


def with_settings(settings: dict, dotted: dict[str, str]) -> dict:
    """`settings` with the given `a.b.c` keys set, as the command line sets them over the config files."""
    for key, value in dotted.items():
        for part in reversed(key.split(".")):
            value = {part: value}
        settings = overlaid(settings, value)
    return settings


def prepared(files, local_files, request) -> tuple[dict, dict]:
    """The config's merged settings and the local files that replace its paths (skipping without transformers where
    it needs it)."""
    settings = merged(files)
    if uses_hugging_face(settings):
        needs_transformers()
    return settings, local_settings(settings, local_files, request)


@pytest.mark.parametrize("files", **named(SHIPPED))
def test_the_command_line_parses_every_setting_of_a_shipped_config(files, local_files, request, capsys):
    settings, local = prepared(files, local_files, request)
    capsys.readouterr()  # what building the local files printed
    with pytest.raises(SystemExit) as done:
        command_line(["fit", *config_args(files, local), "--print_config"])
    assert done.value.code in (0, None)
    parsed = yaml.safe_load(capsys.readouterr().out)
    assert_reaches(parsed, with_settings(settings, local))  # what the test replaced, as replaced


def logged(log_dir: Path, tag: str) -> dict[int, float]:
    """The scalar `tag` written under log_dir, by step."""
    values = {}
    for event_file in log_dir.rglob("events.out.tfevents.*"):
        events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            values |= {e.step: e.value for e in events.Scalars(tag)}
    return values


# A few optimizer steps, the first validation batch, a log line per step; the rest as shipped.
FEW_STEPS = ["--trainer.max_steps=3", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
             "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
ON_CPU = [files for files in SHIPPED if merged(files)["trainer"].get("accelerator") != "gpu"]


@pytest.mark.parametrize("files", **named(ON_CPU))
# Three steps hold no check of the automatic schedule (its own tests run it): the warning says so, as it should.
@pytest.mark.filterwarnings("ignore:AutoSchedule checks every .* no check fits:UserWarning")
def test_a_shipped_cpu_config_trains_a_few_steps(files, local_files, request, tmp_path):
    _, local = prepared(files, local_files, request)
    assert command_line(["fit", *config_args(files, local), *FEW_STEPS,
                         f"--trainer.logger.init_args.save_dir={tmp_path}"]) == 0
    losses = logged(tmp_path, "train/loss")
    assert sorted(losses) == [0, 1, 2] and all(math.isfinite(v) for v in losses.values()), losses
    (last,) = tmp_path.rglob("last.ckpt")
    assert torch.load(last, weights_only=False)["global_step"] == 3


def auto_fit(config: str, tmp_path: Path, *overrides: str) -> tuple[GrowAttentionCallback, list[int]]:
    """`fit --config configs/<config>` with its AutoSchedule settings as shipped: the growth callback and the head
    sizes of the trained model."""
    cli = main(["fit", "--config", str(CONFIGS / config), "--trainer.limit_val_batches=1",
                "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                f"--trainer.logger.init_args.save_dir={tmp_path}", *overrides])
    (callback,) = (c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback))
    return callback, cli.model.model.head_sizes()


def assert_spent_within_the_shipped_budget(callback: GrowAttentionCallback, step: int, layers: int) -> dict:
    """The run's one check happened at `step` and is recorded per layer; it bought the columns above the noise floor
    first and, when it is the run's last check, the rest toward the budget (`filled`), within its allowance, and the
    K cache stays within the shipped budget; returns the record."""
    (check,) = callback.history
    assert (check["event"], check["step"], check["d_head_before"]) == (f"step {step}", step, [1] * layers)
    assert [d["layer"] for d in check["decisions"]] == list(range(layers))
    spent = 0
    for decision, before, after in zip(check["decisions"], check["d_head_before"], check["d_head"]):
        assert after == before + decision["columns"]
        assert decision["columns"] - decision.get("filled", 0) <= decision["above_floor"]
        spent += decision["cost"] * decision["columns"]
    assert spent <= check["allowance"]
    schedule = callback.schedule
    assert schedule.cache({"d_head": check["d_head"]}) <= schedule.budget * schedule.heads()
    if "fill_to" in check:  # the last check spends all but less than the cheapest column a layer still has room for
        room = [d["cost"] for d, after in zip(check["decisions"], check["d_head"]) if after < schedule.limits["d_head"]]
        assert not room or check["allowance"] - spent < min(room)
    return check


def test_text_auto_as_shipped_spends_at_its_first_check(corpus, tmp_path):
    # check_every 50 until half the run: 101 steps hold one check, which may spend the whole budget.
    callback, head_sizes = auto_fit("text_auto.yaml", tmp_path, f"--data.init_args.path={corpus}",
                                    "--trainer.max_steps=101")
    check = assert_spent_within_the_shipped_budget(callback, step=50, layers=2)
    assert check["d_head"] == head_sizes and sum(head_sizes) > 2  # text at d_head 1 gains from width


def test_recall_auto_as_shipped_decides_at_its_first_check(tmp_path):
    # check_every 100 until three quarters of the run: 136 steps hold one check.
    callback, head_sizes = auto_fit("recall_auto.yaml", tmp_path, "--trainer.max_steps=136")
    check = assert_spent_within_the_shipped_budget(callback, step=100, layers=1)
    assert check["d_head"] == head_sizes
