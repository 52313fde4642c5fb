"""studies/hf_growth/hf_experiment.py (issue 21's small experiment): a smoke run writes its table and results, the small
models start at 4 rotary columns with v at head_dim, growth appends NoPE columns, and the probe measures them."""

from __future__ import annotations

import json
import sys

from conftest import REPO, needs_transformers

needs_transformers()

sys.path.insert(0, str(REPO / "studies" / "hf_growth"))
import hf_experiment  # noqa: E402


def test_smoke_run_writes_table_and_results(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n" * 150)
    tiny = ["--data.init_args.batch_size=8", "--data.init_args.block_size=32", "--data.init_args.samples_per_epoch=64",
            "--trainer.max_epochs=3", "--trainer.limit_val_batches=1", "--model.init_args.warmup_steps=2",
            "--trainer.callbacks.init_args.statistics.batches=2", f"--data.init_args.cache_dir={tmp_path / 'cache'}"]
    hf_experiment.main(["--text", str(corpus), "--seeds", "0", "--only", "static small", "grow fixed",
                        "--check-every", "4", "--probe-batches", "1", "--out", str(tmp_path),
                        *[f"--override={o}" for o in tiny]])
    results = json.loads((tmp_path / "hf_experiment.json").read_text())
    assert list(results) == ["static small", "grow fixed"]
    (small,), (grown,) = results["static small"], results["grow fixed"]
    assert small["final"]["d_head"] == [4, 4] and grown["final"]["d_head"] == [8, 8]
    assert [e["d_head"] for e in grown["events"]] == [[6, 6], [8, 8]]
    assert small["params"] < grown["params"]  # only q/k are narrower: 2 layers × (4 + 2 heads) × 64 × 4 weights
    assert grown["params"] - small["params"] == 2 * 6 * 64 * 4
    probe = grown["probe"]
    assert all(x > 0 for x in probe["rms_extra"]) and small["probe"]["rms_extra"] == [0.0, 0.0]
    assert probe["loss_without_extra"] != probe["loss"]
    table = (tmp_path / "hf_experiment.md").read_text()
    assert "| static small | 1 |" in table and "| grow fixed | 0 |" in table


def test_every_growth_schedule_of_the_experiment_builds():
    from lightning.pytorch.cli import instantiate_class

    for name, callback in hf_experiment.schedules(check_every=4, budget=8.0).items():
        schedule = instantiate_class((), callback["init_args"]["schedule"])
        assert type(schedule).__name__ == callback["init_args"]["schedule"]["class_path"].rpartition(".")[2], name
