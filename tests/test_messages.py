"""Messages as a user meets them through `python -m lit_growattn`: each names the problem and a fix that works as
written (issue 52)."""

import warnings

import pytest
import torch

from lit_growattn.callback.window import StatsWindow

from conftest import REPO, needs_transformers

# One layer, growth at epochs 1 and 2 of 3 (4 steps each) from one statistics batch.
TWO_EVENTS = ["--config", str(REPO / "configs/mqar_grow.yaml"), "--trainer.max_epochs=3",
              "--trainer.callbacks.init_args.schedule.init_args.epochs=[1,2]",
              "--trainer.callbacks.init_args.statistics.batches=1", "--model.init_args.n_layer=1",
              "--model.init_args.n_embd=32", "--model.init_args.d_v=8", "--data.init_args.num_train_examples=128",
              "--data.init_args.num_val_examples=32", "--data.init_args.batch_size=32",
              "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
              "--trainer.callbacks.init_args.growth.value_columns=3", "--trainer.callbacks.init_args.growth.max_d_v=11"]


@pytest.fixture
def gathered(monkeypatch):
    """Per event, the names of the units that gathered statistics for it."""
    seen: dict[str, set[str]] = {}
    begin = StatsWindow.begin_step

    def spy(self, event, forms, *args, **kwargs):
        seen.setdefault(event, set()).update(name for _, name, _ in forms)
        return begin(self, event, forms, *args, **kwargs)

    monkeypatch.setattr(StatsWindow, "begin_step", spy)
    return seen


def test_a_value_event_capped_by_max_d_v_is_skipped_without_gathering_statistics(tmp_path, cli, gathered):
    with pytest.warns(UserWarning, match=r"growth at epoch 2 skipped: nothing has room left to grow"):
        done = cli("fit", *TWO_EVENTS, "--trainer.callbacks.init_args.growth.grow=value",
                   "--trainer.callbacks.init_args.growth.columns=null", f"--trainer.logger.init_args.save_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "growth at step 4 (epoch 1): d_v 8→11 per layer" in done.stdout
    assert ("growth at step 8 (epoch 2): skipped, nothing has room left to grow (d_v at growth.max_d_v=11 in layers "
            "[0]); d_head stays [2], d_v stays [11]") in done.stdout
    assert set(gathered) == {"epoch 1"}


def test_a_cap_the_user_did_not_set_is_named_by_its_size(tmp_path, cli, gathered):
    # Without growth.max_d_v the value side stops at its rank bound (n_embd 32): the line must not name a setting.
    with pytest.warns(UserWarning, match=r"growth at epoch 2 skipped: nothing has room left to grow"):
        done = cli("fit", *TWO_EVENTS, "--trainer.callbacks.init_args.growth.grow=value",
                   "--trainer.callbacks.init_args.growth.columns=null", "--trainer.callbacks.init_args.growth.max_d_v=null",
                   "--trainer.callbacks.init_args.growth.value_columns=24", f"--trainer.logger.init_args.save_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "growth at step 4 (epoch 1): d_v 8→32 per layer" in done.stdout
    assert "skipped, nothing has room left to grow (d_v at its largest possible size 32 in layers [0])" in done.stdout
    assert set(gathered) == {"epoch 1"}


def test_a_capped_side_of_a_growth_of_both_is_skipped_and_the_other_grows(tmp_path, cli, gathered):
    done = cli("fit", *TWO_EVENTS, "--trainer.callbacks.init_args.growth.grow=both",
               f"--trainer.logger.init_args.save_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("growth at step 8")]
    assert line.startswith("growth at step 8 (epoch 2): d_head 4→6 per layer, α=")
    assert line.endswith("; skipped: d_v at growth.max_d_v=11 in layers [0]")
    assert {name.endswith(".value") for name in gathered["epoch 1"]} == {True, False}
    assert gathered["epoch 2"] and not any(name.endswith(".value") for name in gathered["epoch 2"])


def test_export_prints_the_value_head_sizes_too(tmp_path, cli):
    needs_transformers()
    ckpt = _hf_checkpoint(tmp_path / "grown.ckpt", head_sizes=[9, 9], v_head_sizes=[10, 11])
    done = cli("export", "--ckpt", ckpt, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "query/key head sizes [9, 9], value head sizes [10, 11]" in done.stdout


def _hf_checkpoint(path, **sizes):
    """A checkpoint of a tiny HFCausalLM (llama), as fit writes its model."""
    from hf_helpers import tiny_config
    from lit_growattn.hf import HFCausalLM

    module = HFCausalLM(config=tiny_config("llama").to_dict(), **sizes)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


def test_converting_a_hugging_face_checkpoint_names_what_works(tmp_path, cli):
    needs_transformers()
    ckpt = _hf_checkpoint(tmp_path / "hf.ckpt")
    what = f"{ckpt} is a checkpoint of a Hugging Face model (lit_growattn.hf.HFCausalLM)"
    done = cli("convert", "--ckpt", ckpt, "--to", "mha", "--d_v", "4", "--out", tmp_path / "small.ckpt")
    assert done.returncode != 0
    assert done.stderr.splitlines()[0] == (f"error: ValueError: {what}: export it (python -m lit_growattn export), "
                                           "then shrink the exported folder with `python -m lit_growattn convert "
                                           "--pretrained <folder> --to mha --kv_budget …`")
    done = cli("convert", "--ckpt", ckpt, "--to", "dint", "--out", tmp_path / "dint.ckpt")
    assert done.returncode != 0
    assert done.stderr.splitlines()[0] == (f"error: ValueError: {what}: export it (python -m lit_growattn export), "
                                           "then convert the exported folder with --pretrained. That converts llama, "
                                           "mistral, qwen2 and qwen3 models whose head sizes did not grow: a grown "
                                           "one exports as growattn_<type>, which has no DINT conversion")
    # The advice, followed as written, converts it.
    assert cli("export", "--ckpt", ckpt, "--out", tmp_path / "folder").returncode == 0
    done = cli("convert", "--pretrained", tmp_path / "folder", "--to", "dint", "--out", tmp_path / "dint")
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_mismatched_init_from_names_the_settings_that_make_it_fit(tmp_path, cli):
    from lit_growattn.module import GrowAttentionLM

    small = GrowAttentionLM(vocab_size=128, block_size=64, n_layer=1, n_head=2, n_embd=32, d_head=16, d_v=32)
    torch.save({"state_dict": small.state_dict(),
                "hyper_parameters": {**small.hparams, "_class_path": "lit_growattn.GrowAttentionLM"}},
               tmp_path / "small.ckpt")
    run = ["fit", "--config", REPO / "configs/mqar.yaml", "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false",
           "--data.init_args.num_train_examples=64", "--data.init_args.num_val_examples=64",
           f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.init_args.init_from={tmp_path / 'small.ckpt'}"]
    done = cli(*run)
    assert done.returncode != 0
    assert "holds the weights of another model (" in done.stderr and "Missing key" not in done.stderr
    fix = "--model.init_args.n_layer=1, --model.init_args.n_embd=32;"
    assert fix in done.stderr
    done = cli(*run, *fix.rstrip(";").split(", "))  # the fix, as written
    assert done.returncode == 0, done.stderr[-3000:]


def test_init_from_a_checkpoint_of_another_model_class_names_it(tmp_path, cli):
    needs_transformers()
    ckpt = _hf_checkpoint(tmp_path / "hf.ckpt")
    checkpoint = torch.load(ckpt)
    checkpoint["hyper_parameters"]["_class_path"] = "lit_growattn.hf.HFCausalLM"
    torch.save(checkpoint, ckpt)
    done = cli("fit", "--config", REPO / "configs/mqar.yaml", f"--trainer.logger.init_args.save_dir={tmp_path}",
               f"--model.init_args.init_from={ckpt}")
    assert done.returncode != 0
    assert "it is a checkpoint of lit_growattn.hf.HFCausalLM, not of GrowAttentionLM" in done.stderr


def test_bytes_of_a_corpus_that_are_not_utf8_are_counted_in_one_warning(tmp_path, cli):
    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes("Café, naïve façade.\n".encode("latin-1") * 200)  # é, ï, ç: 3 bytes per line that are not UTF-8
    with pytest.warns(UserWarning) as caught:
        done = cli("fit", "--config", REPO / "configs/text_bpe.yaml", f"--data.init_args.path={corpus}",
                   "--data.init_args.bpe_vocab_size=300", "--data.init_args.block_size=16",
                   "--data.init_args.batch_size=8", "--data.init_args.samples_per_epoch=8", "--trainer.max_epochs=1",
                   "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    (warning,) = [str(w.message) for w in caught if "not UTF-8" in str(w.message)]
    assert warning.startswith(f"{corpus}: 600 bytes are not UTF-8, and are read as the replacement character U+FFFD: "
                              "re-encode the file as UTF-8")


def test_a_utf8_corpus_is_read_without_that_warning(tmp_path):
    from lit_growattn.data.corpus import warn_if_not_utf8

    corpus = tmp_path / "utf8.txt"
    corpus.write_text("Café, naïve façade, and U+FFFD itself: \ufffd.\n" * 200, encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_not_utf8(str(corpus))


def test_a_setting_the_shipped_config_gives_is_unset_as_the_message_says(tmp_path, cli):
    """configs/mqar_grow.yaml sets growth.columns, which a value growth refuses: leaving it off the command line
    keeps it, null removes it."""
    run = [*TWO_EVENTS, "--trainer.max_epochs=2", "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
           "--trainer.callbacks.init_args.growth.grow=value",
           f"--trainer.logger.init_args.save_dir={tmp_path}"]
    done = cli("fit", *run)
    assert done.returncode != 0
    fix = "--trainer.callbacks.init_args.growth.columns=null"
    assert ("growth.columns sizes the query/key side, which does not grow with growth.grow='value': set "
            f"growth.columns to null ({fix})") in done.stderr
    done = cli("fit", *run, fix)
    assert done.returncode == 0, done.stderr[-3000:]
