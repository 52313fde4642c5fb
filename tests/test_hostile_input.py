"""Hostile input through the command line: each case is refused with the project's own message naming the problem
and its fix, or handled, before any training is lost. The error reports run `python -m lit_growattn` as a subprocess;
the other cases call its `main` in this process (the same code path, without the seconds of a fresh import)."""

import json
import os
import socket

import pytest
import torch

from lit_growattn.__main__ import main as command_line

from conftest import REPO, run_command


RECALL = ["fit", "--config", REPO / "configs/recall_grow.yaml", "--trainer.enable_progress_bar=false",
          "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
          "--data.init_args.num_train_examples=256", "--data.init_args.num_val_examples=64"]
TEXT = ["fit", "--config", REPO / "configs/text.yaml", "--trainer.enable_progress_bar=false", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
        "--data.init_args.block_size=16", "--data.init_args.batch_size=4", "--data.init_args.samples_per_epoch=8"]


def logs(tmp_path):
    return [f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}", f"--trainer.default_root_dir={tmp_path}"]


def growth_callback(tmp_path, schedule: str, *settings: str):
    """A config file that replaces the config's growth callback by one with these settings (YAML lines)."""
    path = tmp_path / "callback.yaml"
    lines = ["trainer:", "  callbacks:", "    - class_path: lit_growattn.GrowAttentionCallback", "      init_args:",
             f"        schedule: {schedule}", *(f"        {line}" for line in settings)]
    path.write_text("\n".join(lines) + "\n")
    return path


def refused(done, *phrases):
    """Exit code 1, a few lines starting with the project's `error:`, naming every phrase; no traceback."""
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    report = done.stderr[done.stderr.index("error:"):]
    assert "Traceback" not in done.stderr and len(report.splitlines()) <= 4, report
    for phrase in phrases:
        assert str(phrase) in report, (phrase, report)
    return report


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n" * 60)
    return path


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory):
    """A fixed-schedule run of two epochs that grew at epoch 1: its last checkpoint."""
    out = tmp_path_factory.mktemp("fixed")
    assert command_line([str(a) for a in (*RECALL, *logs(out), "--trainer.max_epochs=2", "--trainer.limit_train_batches=4",
                         "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]", "--trainer.callbacks.init_args.statistics.batches=2")]) == 0
    (last,) = out.rglob("last.ckpt")
    return last


# 1. The project's message first, the root cause on one more line.
def test_a_malformed_tokenizer_file_is_named_with_its_setting(tmp_path, corpus):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0" "model": }')
    report = refused(run_command(*TEXT, *logs(tmp_path), f"--data.init_args.path={corpus}",
                                 f"--data.init_args.tokenizer={bad}"), "tokenizer=", bad, "is not a tokenizers JSON file")
    assert "caused by" in report


class RunsCode:
    def __reduce__(self):
        return os.getcwd, ()


def test_a_checkpoint_holding_objects_is_refused_without_unsafe_advice(tmp_path, corpus):
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"attention": RunsCode()}}, foreign)
    for done in (run_command("convert", "--ckpt", foreign, "--to", "dint", "--out", tmp_path / "out.ckpt"),
                 run_command(*RECALL, *logs(tmp_path), f"--model.init_args.init_from={foreign}")):
        refused(done, foreign, "refused", "posix.getcwd")
        assert "weights_only=False" not in done.stderr and "set to `False`" not in done.stderr


# 4. A damaged checkpoint is named as damaged.
def test_a_truncated_checkpoint_is_named_as_damaged(tmp_path, fixed_run, cli):
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(fixed_run.read_bytes()[: fixed_run.stat().st_size // 2])
    for where in (["convert", "--ckpt", cut, "--to", "dint", "--out", tmp_path / "out.ckpt"],
                  [*RECALL, *logs(tmp_path), f"--model.init_args.init_from={cut}"],
                  [*RECALL, *logs(tmp_path), f"--ckpt_path={cut}"]):
        refused(cli(*where), cut, "is damaged")


# 2. Step sizes that are not finite numbers fail at setup. (On the command line the parser already refuses a
# non-finite float inside the nested settings; a config file hands them to the settings' own check.)
@pytest.mark.parametrize("alphas", ["[.nan]", "[0, .inf]", "[0, .nan]"])
def test_non_finite_step_sizes_fail_before_training(tmp_path, alphas, cli):
    done = cli(*RECALL, *logs(tmp_path), "--config", growth_callback(tmp_path, "{class_path: lit_growattn.AtEpochs, "
               "init_args: {epochs: [1]}}", f"step_search: {{alphas: {alphas}}}"))
    refused(done, "step-size candidates must be a non-empty list of finite values")
    assert not list(tmp_path.rglob("*.ckpt"))


# 3. The model's vocabulary is the one the tokenizer learned.
def test_the_model_takes_the_vocabulary_the_bpe_learned(tmp_path, corpus, cli):
    done = cli(*TEXT, *logs(tmp_path), f"--data.init_args.path={corpus}", "--data.init_args.tokenizer=bpe",
                       "--data.init_args.bpe_vocab_size=1000000", f"--data.init_args.cache_dir={tmp_path / 'cache'}")
    assert done.returncode == 0, done.stderr[-3000:]
    (last,) = tmp_path.rglob("last.ckpt")
    vocab_size = torch.load(last, weights_only=True)["hyper_parameters"]["vocab_size"]
    assert 256 < vocab_size < 1000  # a 90-byte line repeated holds few merges


# 5 and 6. Resuming with another schedule kind is refused; changed model settings are named.
def test_resuming_a_fixed_schedule_as_auto_is_refused(tmp_path, fixed_run, cli):
    auto = "{class_path: lit_growattn.AutoSchedule, init_args: {budget: 8}}"  # the resumed model is at d_head 8
    done = cli(*RECALL, *logs(tmp_path), "--trainer.max_epochs=3", f"--ckpt_path={fixed_run}",
                       "--config", growth_callback(tmp_path, auto, "growth: {columns: null}"))
    refused(done, "a fixed schedule (AtEpochs or AtSteps)", "the automatic schedule (AutoSchedule)", "init_from")


def test_resuming_with_changed_model_settings_names_them(tmp_path, fixed_run, cli):
    with pytest.warns(UserWarning, match="n_embd: 48 given, the checkpoint's 64 used; d_v: 48 given") as caught:
        done = cli(*RECALL, *logs(tmp_path), "--trainer.max_epochs=2", "--trainer.limit_train_batches=4",
                   f"--ckpt_path={fixed_run}", "--model.init_args.n_embd=48", "--model.init_args.d_v=48")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sum("given, the checkpoint's" in str(w.message) for w in caught) == 1


@pytest.fixture(scope="module")
def in_window_run(tmp_path_factory):
    """A run stopped inside the statistics window of its growth at epoch 1 (window: the last 3 micro-batches of
    epoch 0; stopped after the first optimizer step of 2 micro-batches): its last checkpoint."""
    out = tmp_path_factory.mktemp("window")
    assert command_line([str(a) for a in (*RECALL, *logs(out), "--trainer.max_epochs=2", "--trainer.max_steps=1",
                         "--trainer.limit_train_batches=4", "--trainer.accumulate_grad_batches=2",
                         "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                         "--trainer.callbacks.init_args.statistics.batches=3")]) == 0
    (last,) = out.rglob("last.ckpt")
    return last


@pytest.mark.parametrize("changed, named", [
    ("--trainer.accumulate_grad_batches=1", "accumulate_grad_batches=2 in the checkpoint but 1 now"),
    ("--trainer.callbacks.init_args.statistics.batches=2", "statistics.batches=3 in the checkpoint but 2 now"),
    # A cap decides which units the window holds sums of (a capped one gathers none).
    ("--trainer.callbacks.init_args.growth.max_d_head=4", "growth.max_d_head=64 in the checkpoint but 4 now"),
])
def test_resuming_inside_a_statistics_window_with_other_window_settings_is_refused(tmp_path, in_window_run, cli,
                                                                                  changed, named):
    done = cli(*RECALL, *logs(tmp_path), "--trainer.max_epochs=2", "--trainer.limit_train_batches=4",
               "--trainer.accumulate_grad_batches=2", "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
               "--trainer.callbacks.init_args.statistics.batches=3", changed, f"--ckpt_path={in_window_run}")
    refused(done, "inside the statistics window of growth 'epoch 1'", named, "resume with", "outside the window")


def test_a_window_cut_short_by_a_resume_warns_and_grows_at_alpha_zero(tmp_path, in_window_run, cli):
    """The checkpoint was written after the window's first micro-batch, before the batches it keeps for the step-size
    search; the resumed run starts epoch 1, where the growth is due, so the window never sees the rest. The growth
    goes ahead from what was gathered, says so, and installs at α = 0 instead of rating candidates on no batch."""
    with pytest.warns(UserWarning, match="its statistics window was cut short") as caught:
        done = cli(*RECALL, *logs(tmp_path), "--trainer.max_epochs=2", "--trainer.limit_train_batches=4",
                   "--trainer.accumulate_grad_batches=2", "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                   "--trainer.callbacks.init_args.statistics.batches=3", f"--ckpt_path={in_window_run}")
    assert done.returncode == 0, done.stderr[-3000:]
    (warning,) = [str(w.message) for w in caught if "cut short" in str(w.message)]
    assert "the new columns go in at α = 0 (the function unchanged)" in warning
    assert "growth at step 1 (epoch 1): d_head 1→8 per layer, α=0, no kept batches to rate it on" in done.stdout
    assert "nan" not in done.stdout.split("growth summary")[0]


def test_a_growth_whose_window_a_resume_skipped_is_skipped_with_a_warning(tmp_path, cli):
    """Stopped after the first optimizer step, before the window (the last 2 micro-batches of epoch 0); the resumed
    run starts epoch 1, where the growth is due, without a batch of statistics: the event is skipped and says why."""
    common = [*RECALL, "--trainer.max_epochs=2", "--trainer.limit_train_batches=4", "--trainer.accumulate_grad_batches=2",
              "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
              "--trainer.callbacks.init_args.statistics.batches=2"]
    assert cli(*common, *logs(tmp_path / "first"), "--trainer.max_steps=1").returncode == 0
    (last,) = (tmp_path / "first").rglob("last.ckpt")
    with pytest.warns(UserWarning, match="growth at epoch 1 skipped: no statistics were gathered for it"):
        done = cli(*common, *logs(tmp_path / "resumed"), f"--ckpt_path={last}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "growth at step 1 (epoch 1): skipped, no statistics were gathered for it (as when a run resumes" in done.stdout
    (state,) = [v for k, v in torch.load(next((tmp_path / "resumed").rglob("last.ckpt")), weights_only=False)[
        "callbacks"].items() if k.startswith("GrowAttentionCallback")]
    assert [(e["skipped"], e["d_head"]) for e in state["history"]] == [(True, [1])]


@pytest.mark.parametrize("saved_by", ["this version", "a version without the sketch settings"])
def test_resuming_a_full_statistics_window_with_the_sketch_on_is_refused(tmp_path, in_window_run, cli, saved_by):
    """The window's sums are full statistics: going on under statistics.sketch: on would fold sketches into them. A
    checkpoint of a version before the sketch saved no statistics.sketch nor statistics.sketch_size among the window's
    settings; that version kept the statistics in full, and the refusal says so instead of failing later."""
    checkpoint = in_window_run
    if saved_by != "this version":
        state = torch.load(in_window_run, map_location="cpu", weights_only=False)
        (key,) = [k for k in state["callbacks"] if k.startswith("GrowAttentionCallback")]
        began = state["callbacks"][key]["window"]["gathered_with"]
        assert (began.pop("statistics.sketch"), began.pop("statistics.sketch_size")) == ("off", None)
        checkpoint = tmp_path / "before_the_sketch.ckpt"
        torch.save(state, checkpoint)
    done = cli(*RECALL, *logs(tmp_path), "--trainer.max_epochs=2", "--trainer.limit_train_batches=4",
               "--trainer.accumulate_grad_batches=2", "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
               "--trainer.callbacks.init_args.statistics.batches=3", "--trainer.callbacks.init_args.growth.method=natural",
               "--trainer.callbacks.init_args.statistics.sketch=on", f"--ckpt_path={checkpoint}")
    refused(done, "inside the statistics window of growth 'epoch 1'",
            "statistics.sketch=off in the checkpoint but on now, statistics.sketch_size=None in the checkpoint but 24 now",
            "resume with statistics.sketch=off and statistics.sketch_size=None", "outside the window")


# 7. A token file overwritten in place is rebuilt, not read.
def test_a_token_file_overwritten_in_place_is_rebuilt(tmp_path, corpus, cli):
    args = [*TEXT, *logs(tmp_path), f"--data.init_args.path={corpus}", "--data.init_args.tokenizer=bpe",
            "--data.init_args.bpe_vocab_size=300", f"--data.init_args.cache_dir={tmp_path / 'cache'}"]
    assert cli(*args).returncode == 0
    (tokens,) = (tmp_path / "cache").rglob("tokens.bin")
    size = tokens.stat().st_size
    with open(tokens, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 64)  # ids far outside the vocabulary, same size
    done = cli(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert b"\xff" * 64 not in tokens.read_bytes()


# 8. A growth step past the end of an epoch-bounded run warns.
def test_a_growth_step_past_the_end_of_the_epochs_warns(tmp_path, cli):
    with pytest.warns(UserWarning, match="AtSteps has step 50 but the run ends after about 4 optimizer steps"):
        done = cli(*RECALL, *logs(tmp_path), "--trainer.max_epochs=1", "--trainer.limit_train_batches=4",
                   "--trainer.callbacks.init_args.schedule=lit_growattn.AtSteps", "--trainer.callbacks.init_args.schedule.init_args.steps=[50]",
                   "--trainer.callbacks.init_args.statistics.batches=2")
    assert done.returncode == 0, done.stderr[-3000:]


# 9. A conversion rank beyond what the form can hold.
def test_a_lowrank_dint_rank_beyond_the_embedding_is_refused(tmp_path, fixed_run, cli):
    done = cli("convert", "--ckpt", fixed_run, "--to", "lowrank_dint", "--rank", 100, "--out", tmp_path / "o.ckpt")
    refused(done, "rank=100 exceeds n_embd = 64", "use rank ≤ 64")
    assert not (tmp_path / "o.ckpt").exists()


# 10. Build folders of killed builds are removed by the next build; a live build's are kept.
def test_build_folders_of_dead_builds_are_removed(tmp_path, corpus, cli):
    cache, host = tmp_path / "cache", socket.gethostname()
    dead, live = cache / f"tmp-{host}-999999999-abcd1234", cache / f"tmp-{host}-{os.getpid()}-abcd1234"
    for folder in (dead, live):
        folder.mkdir(parents=True)
        (folder / "tokens-0.arrow").write_bytes(b"x" * 100)
    done = cli(*TEXT, *logs(tmp_path), f"--data.init_args.path={corpus}", "--data.init_args.tokenizer=bpe",
                       "--data.init_args.bpe_vocab_size=300", f"--data.init_args.cache_dir={cache}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not dead.exists() and live.exists()
    assert [p.name for p in cache.glob("tmp-*")] == [live.name]


# Minor: settings that could not mean what they say.
def test_a_static_head_wider_than_the_embedding_is_refused(tmp_path, cli):
    refused(cli(*RECALL, *logs(tmp_path), "--model.init_args.d_head=65"), "d_head=65 exceeds n_embd = 64")


def test_the_same_file_twice_in_path_is_refused(tmp_path, corpus, cli):
    refused(cli(*TEXT, *logs(tmp_path), f"--data.init_args.path=[{corpus}, {corpus}]"),
            "more than once", corpus.name)


def test_token_metadata_whose_dtype_cannot_hold_its_vocabulary_is_refused(tmp_path):
    from lit_growattn.data.token_file import CacheError, open_token_file

    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint8", "vocab_size": 1000, "num_train": 4, "num_val": 4}))
    (tmp_path / "tokens.bin").write_bytes(bytes(8))
    with pytest.raises(CacheError, match="dtype uint8 cannot hold its vocabulary of 1000"):
        open_token_file(tmp_path, {})
