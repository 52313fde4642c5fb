"""The README's quick starts run as written: the Python block with a plain lightning.Trainer, and the config."""

import re

import yaml

from lit_growattn.commands.cli import main

from conftest import REPO

README = (REPO / "README.md").read_text()


def fenced(section: str, language: str) -> str:
    """The first ```language block after the heading `## section`."""
    start = README.index(f"## {section}\n")
    return re.search(rf"```{language}\n(.*?)```", README[start:], re.S).group(1)


def test_the_readme_is_a_front_door():
    assert len(README.encode()) <= 15_000


def test_the_python_quick_start_grows_under_a_plain_trainer(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the Trainer's default logs and checkpoints land here
    scope: dict = {}
    exec(compile(fenced("Python quick start", "python"), "README.md", "exec"), scope)
    assert scope["model"].head_sizes() == [15]
    assert [event["d_head"] for event in scope["grow"].history] == [[8], [15]]
    assert "[15]" in capsys.readouterr().out


def test_the_config_quick_start_builds_model_data_and_callback(tmp_path):
    config = tmp_path / "quick.yaml"
    config.write_text(fenced("Config quick start", "yaml"))
    yaml.safe_load(config.read_text())
    cli = main(["--config", str(config), f"--trainer.logger.init_args.save_dir={tmp_path}"], run=False)
    (grow,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "GrowAttentionCallback"]
    assert grow.settings.columns == 7 and grow.statistics.batches == 16
    assert cli.model.head_sizes() == [1]
