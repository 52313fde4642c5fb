"""A pretrained Hugging Face folder on the user's path (`python -m lit_growattn fit`, folders written by
save_pretrained): it fine-tunes in train mode with its own tokenizer, a diverged run stops, 16-true is refused, and
its checkpoints outlive the folder. What a fit logs (each held-out set under its name, the loss over the labels kept),
and how a state dict loads (strict, copied)."""

from __future__ import annotations

import copy
import re
import shutil
import warnings

import pytest

from conftest import REPO, needs_transformers

needs_transformers()

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lit_growattn.__main__ import main as command_line  # noqa: E402
from lit_growattn.commands.cli import main  # noqa: E402
from lit_growattn.hf import HFCausalLM  # noqa: E402
from lit_growattn.training.divergence import TrainingDiverged  # noqa: E402

from hf_helpers import saved_tiny_model, saved_tokenizer, tiny_config  # noqa: E402

CONFIG = str(REPO / "configs" / "hf_llama_grow.yaml")
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n"


@pytest.fixture
def fit_args(tmp_path):
    """hf_llama_grow.yaml on a small text: 2 steps per epoch, growth at the second of 2 epochs, everything written
    under tmp_path."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 150)
    return ["--config", CONFIG, f"--data.init_args.path={corpus}", "--data.init_args.batch_size=8",
            "--data.init_args.block_size=32", "--data.init_args.samples_per_epoch=16", "--trainer.max_epochs=2",
            "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
            "--model.init_args.warmup_steps=2", "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
            "--trainer.callbacks.init_args.statistics.batches=2"]


def pretrained(folder, model_type: str = "llama", **settings) -> list[str]:
    """A tiny random model with its own byte-level BPE saved together in `folder` (its vocabulary has room for the
    300 tokens); the arguments that fine-tune it with hf_llama_grow.yaml."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(model_type, vocab=320)
    for name, value in settings.items():
        setattr(config, name, value)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    saved_tokenizer(folder, [TEXT] * 20, vocab_size=300)
    return ["--model.init_args.config=null", f"--model.init_args.pretrained={folder}"]


def last_checkpoint(tmp_path) -> dict:
    (path,) = (tmp_path / "logs").rglob("last.ckpt")
    return torch.load(path, weights_only=True)


# -- train mode ----------------------------------------------------------------------------------

class DropoutModes(Callback):
    """Records, before each training and validation batch, whether each dropout module is in training mode."""

    def __init__(self):
        self.train, self.val, self.rates = [], [], set()

    def _modes(self, pl_module) -> list[bool]:
        dropouts = [m for m in pl_module.modules() if isinstance(m, torch.nn.Dropout)]
        self.rates |= {m.p for m in dropouts}
        return [m.training for m in dropouts]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train.append(self._modes(pl_module))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.val.append(self._modes(pl_module))


def test_a_pretrained_model_fine_tunes_in_train_mode_and_validates_in_eval_mode(tmp_path, fit_args):
    dropout = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=None, eos_token_id=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(["fit", *fit_args, *pretrained(tmp_path / "gpt2", "gpt2", **dropout),
                    "--trainer.callbacks+=test_hf_reliability.DropoutModes"])
    (watch,) = [c for c in cli.trainer.callbacks if isinstance(c, DropoutModes)]
    assert watch.rates == {0.1} and len(watch.train[0]) == 7  # GPT-2's: embeddings, and 3 per layer
    assert cli.model.head_sizes() == [16, 16]  # grown at epoch 1
    assert len(watch.train) == 4 and all(all(modes) for modes in watch.train)
    assert len(watch.val) >= 2 and not any(any(modes) for modes in watch.val)
    assert not [w for w in caught if "eval mode" in str(w.message)]


# -- what a fit logs -----------------------------------------------------------------------------

class TwoHeldOutSets(L.LightningDataModule):
    """(inputs, labels) rows to train on and two held-out sets: the main one (`val/loss`) and one named `second`."""

    val_names = ["", "second"]

    def __init__(self, train, first, second):
        super().__init__()
        self.train, self.first, self.second = train, first, second

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.train), batch_size=4)

    def val_dataloader(self):
        return [DataLoader(TensorDataset(*held), batch_size=4) for held in (self.first, self.second)]


def masked_rows(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows of 10 input tokens and 10 labels, the first 4 labels -100 (as instruction data masks a prompt)."""
    inputs, labels = (torch.randint(0, 96, (n, 10), generator=generator) for _ in range(2))
    labels[:, :4] = -100
    return inputs, labels


def kept_cross_entropy(module: HFCausalLM, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """The cross-entropy of the model's logits over the positions whose label is not -100."""
    with torch.no_grad():
        logits = module.model(input_ids=inputs).logits
    kept = labels != -100
    return F.cross_entropy(logits[kept], labels[kept]).item()


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny Llama folder fine-tuned for 2 steps (one epoch) on TwoHeldOutSets, validated at the end: the trainer,
    the module and the data."""
    root = tmp_path_factory.mktemp("fitted")
    g = torch.Generator().manual_seed(5)
    data = TwoHeldOutSets(masked_rows(8, g), masked_rows(4, g), masked_rows(4, g))
    torch.manual_seed(0)
    module = HFCausalLM(pretrained=saved_tiny_model("llama", root / "llama"), lr_schedule="constant", warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=root)
    trainer.fit(module, datamodule=data)
    return trainer, module, data


def test_a_fit_logs_each_held_out_set_under_its_name_and_shows_the_main_losses(fitted):
    trainer, _, _ = fitted
    # No `/dataloader_idx_N` suffix: the second set is named by the data module's val_names.
    assert sorted(trainer.logged_metrics) == ["train/loss", "val/loss", "val/second/loss"]
    assert sorted(trainer.callback_metrics) == ["train/loss", "val/loss", "val/second/loss"]
    # The progress bar shows the training loss and the main held-out set's, not the other sets'.
    assert sorted(trainer.progress_bar_metrics) == ["train/loss", "val/loss"]


def test_the_logged_losses_are_the_cross_entropy_over_the_labels_kept(fitted):
    trainer, module, data = fitted
    # Validated after the last step: each set's loss is that of the final weights, labels -100 left out.
    for name, (inputs, labels) in (("val/loss", data.first), ("val/second/loss", data.second)):
        expected = kept_cross_entropy(module, inputs, labels)
        assert trainer.logged_metrics[name].item() == pytest.approx(expected, rel=1e-6)
    inputs, labels = data.train[0][:4], data.train[1][:4]
    assert module.batch_loss((inputs, labels)).item() == pytest.approx(kept_cross_entropy(module, inputs, labels),
                                                                       rel=1e-6)


def test_held_out_data_without_names_logs_val_loss_and_test_loss(fitted, tmp_path):
    _, module, data = fitted
    inputs, labels = data.first
    expected = kept_cross_entropy(module, inputs, labels)
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    (validated,) = trainer.validate(module, dataloaders=loader, verbose=False)  # no data module, so no val_names
    (tested,) = trainer.test(module, dataloaders=loader, verbose=False)
    assert validated == {"val/loss": pytest.approx(expected, rel=1e-6)}
    assert tested == {"test/loss": pytest.approx(expected, rel=1e-6)}
    # Called by hand, outside any Trainer (a copy holds none): the loss, and Lightning's note that nothing is logged.
    with pytest.warns(UserWarning, match="the `self.trainer` reference is not registered on the model yet"):
        loss = copy.deepcopy(module).validation_step((inputs, labels), 0)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


# -- divergence ----------------------------------------------------------------------------------

EVERY_STEP = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              "--trainer.callbacks.init_args.every_n_train_steps=1", "--trainer.callbacks.init_args.save_last=true"]


@pytest.mark.parametrize("guard, settings", [
    ("non-finite for 2 consecutive steps, the last nan at step", ["--model.init_args.max_nonfinite_steps=2"]),
    ("parameter tensors are non-finite at step", ["--model.init_args.max_nonfinite_steps=100", *EVERY_STEP]),
])
def test_a_diverged_hf_run_stops_without_checkpointing_non_finite_weights(tmp_path, fit_args, capsys, guard, settings):
    rc = command_line(["fit", *fit_args, *pretrained(tmp_path / "llama"), "--model.init_args.optimizer.init_args.lr=1e6",
                       "--trainer.gradient_clip_val=null", "--data.init_args.samples_per_epoch=160", *settings])
    assert rc == 1
    assert re.search(rf"error: TrainingDiverged: training diverged: .*{guard}", capsys.readouterr().err)
    checkpoints = list((tmp_path / "logs").rglob("*.ckpt"))
    if "--trainer.callbacks.init_args.every_n_train_steps=1" in settings:
        assert checkpoints  # one a step until the weights went non-finite: the loop below checks them
    for path in checkpoints:
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path


def test_a_diverged_loss_is_reported_at_its_step_epoch_and_batch(tmp_path):
    torch.manual_seed(0)
    module = HFCausalLM(config=tiny_config("llama").to_dict(), max_nonfinite_steps=2)
    with torch.no_grad():
        module.model.lm_head.weight[0] = float("nan")  # every loss is NaN, from the first batch on
    inputs, labels = masked_rows(8, torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=tmp_path)
    with pytest.raises(TrainingDiverged) as error:
        trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    assert str(error.value) == ("training diverged: the training loss has been non-finite for 2 consecutive steps, the "
                                "last nan at step 1 (epoch 0, batch 1). Lower the learning rate, or raise warmup_steps "
                                "or gradient clipping; max_nonfinite_steps (now 2) sets how many such steps are "
                                "tolerated")


def test_16_true_is_refused_for_a_hf_model(tmp_path, fit_args):
    with pytest.raises(ValueError, match="precision='16-true' is not supported.*use '16-mixed'"):
        main(["fit", *fit_args, "--trainer.precision=16-true"])


# -- tokenizer -----------------------------------------------------------------------------------

def test_a_pretrained_model_trains_on_its_folders_tokenizer(tmp_path, fit_args, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(["fit", *fit_args, *pretrained("llama")])  # a relative folder, as a user types it
    assert cli.datamodule.tokenizer.vocab_size == 300  # the folder's BPE, not bytes
    assert cli.trainer.global_step == 4
    # Recorded absolute: export or a resumed run may start from another working directory.
    assert last_checkpoint(tmp_path)["hyper_parameters"]["tokenizer"] == str(tmp_path / "llama")


@pytest.mark.parametrize("other", ["bytes", "another BPE"])
def test_a_tokenizer_that_is_not_the_models_is_refused_before_training(tmp_path, fit_args, other):
    from tokenizers import Tokenizer

    folder = tmp_path / "llama"
    tokenizer = "bytes" if other == "bytes" else saved_tokenizer(tmp_path / "other", ["0123456789 " * 50], 280)
    args = pretrained(folder)
    own = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
    if other == "bytes":
        differs = "raw bytes against a vocabulary of 300 tokens"
    else:
        given = Tokenizer.from_file(f"{tokenizer}/tokenizer.json").get_vocab()
        # The tokens that only one side has, or that the two give different ids: both BPEs hold the same <eos> and 256
        # bytes, then merges of their own (digits learn few: 267 tokens in all, not 280).
        changed = {t for t in own.keys() | given.keys() if own.get(t) != given.get(t)}
        assert 0 < len(changed) < len(own) and len(given) < len(own)
        differs = f"vocabularies of {len(given)} and {len(own)} tokens, {len(changed)} of them differing"
    with pytest.raises(ValueError) as error:
        main(["fit", *fit_args, *args, f"--data.init_args.tokenizer={tokenizer}"])
    assert str(error.value) == (f"the data's tokenizer {tokenizer!r} does not match the model's, {folder} ({differs}): "
                                f"train with the model's, --data.init_args.tokenizer={folder}")
    assert not list(tmp_path.rglob("*.ckpt"))


# -- checkpoints outlive the pretrained folder ---------------------------------------------------

def test_a_checkpoint_resumes_rebuilds_and_exports_after_its_folder_moved(tmp_path, fit_args, cli):
    folder, moved = tmp_path / "llama", tmp_path / "moved"
    main(["fit", *fit_args, *pretrained(folder)])
    (ckpt,) = (tmp_path / "logs").rglob("last.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    shutil.move(folder, moved)

    # As `export --ckpt` builds it, and as Lightning loads it: the weights are the checkpoint's.
    module = HFCausalLM(**{k: v for k, v in saved["hyper_parameters"].items() if not k.startswith("_")})
    module.load_state_dict(saved["state_dict"])
    loaded = HFCausalLM.load_from_checkpoint(ckpt)
    for rebuilt in (module, loaded):
        state = rebuilt.state_dict()
        assert all(torch.equal(state[k], v) for k, v in saved["state_dict"].items())

    # Resuming names the moved tokenizer folder, then resumes with the new one.
    resume = ["fit", *fit_args, "--model.init_args.config=null", f"--ckpt_path={ckpt}", "--trainer.max_epochs=3"]
    with pytest.raises(ValueError, match=f"its folder {folder} does not exist \\(moved\\?\\): name the tokenizer"):
        main(resume)
    resumed = main([*resume, f"--data.init_args.tokenizer={moved}"])
    assert resumed.trainer.global_step == 6

    # Exported from the checkpoint, with --pretrained naming the folder's new place: the folder loads with
    # transformers (after `import lit_growattn.hf`) as the grown model the checkpoint holds, with its tokenizer.
    from transformers import AutoTokenizer

    import lit_growattn.hf  # noqa: F401  (registers the grown architecture with transformers)
    from hf_helpers import load

    out = tmp_path / "export"
    done = cli("export", "--ckpt", ckpt, "--out", out, "--pretrained", moved)
    assert done.returncode == 0, done.stderr[-2000:]
    exported = load(out)
    assert exported.config.qk_head_sizes == loaded.head_sizes() == [16, 16]  # grown from the folder's 8 at epoch 1
    ids = torch.tensor([AutoTokenizer.from_pretrained(out)(TEXT)["input_ids"][:24]])
    assert ids.shape[1] == 24
    with torch.no_grad():
        expected = loaded.eval().model(ids).logits
        # float32 logits of a 2-layer model: both sides run the same operations, up to the kernel's round-off.
        torch.testing.assert_close(exported(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_state_dict_loads_strictly_by_default_and_its_values_are_copied():
    torch.manual_seed(0)
    trained = HFCausalLM(config=tiny_config("llama").to_dict(), head_sizes=[10, 10])
    state = trained.state_dict()
    torch.manual_seed(1)
    module = HFCausalLM(config=tiny_config("llama").to_dict())
    lacking = {k: v for k, v in state.items() if k != "model.lm_head.weight"}
    with pytest.raises(RuntimeError, match=re.escape('Missing key(s) in state_dict: "model.lm_head.weight".')):
        module.load_state_dict(lacking)
    # strict=False (e.g. load_from_checkpoint(..., strict=False)) loads the rest and lists what was missing.
    result = module.load_state_dict(lacking, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["model.lm_head.weight"], [])
    assert module.head_sizes() == [10, 10] and all(torch.equal(module.state_dict()[k], v) for k, v in lacking.items())
    # The values are copied: the state dict (here the trained module's own tensors) stays apart from the module.
    module.load_state_dict(state)
    with torch.no_grad():
        trained.model.lm_head.weight.add_(1.0)
    assert torch.equal(module.model.lm_head.weight + 1.0, trained.model.lm_head.weight)
    # assign=True, torch's option to keep the given tensors instead of copying them (e.g. into a module built on the
    # meta device), is passed on.
    module.load_state_dict(state, assign=True)
    assert module.model.lm_head.weight.data_ptr() == trained.model.lm_head.weight.data_ptr()


def test_init_from_starts_a_new_run_from_a_checkpoints_weights_as_the_resume_warning_advises(tmp_path, fit_args):
    model = pretrained(tmp_path / "llama")
    main(["fit", *fit_args, *model])
    (ckpt,) = (tmp_path / "logs").rglob("last.ckpt")
    with pytest.warns(UserWarning, match=r"attn_implementation: 'eager' given, the checkpoint's 'sdpa' used\. "
                                         r"Start a new run \(or use init_from for the weights\)"):
        main(["fit", *fit_args, *model, f"--ckpt_path={ckpt}", "--model.init_args.attn_implementation=eager"])
    cli = main([*fit_args, *model, f"--model.init_args.init_from={ckpt}",
                "--model.init_args.attn_implementation=eager"], run=False)
    state = cli.model.state_dict()
    assert cli.model.model.config._attn_implementation == "eager"
    assert all(torch.equal(state[k], v) for k, v in torch.load(ckpt, weights_only=True)["state_dict"].items())


# -- damaged folders -----------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 2])
def test_a_truncated_safetensors_file_is_named(tmp_path, shards):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    folder = tmp_path / "llama"
    sharded = {"max_shard_size": "60KB"} if shards > 1 else {}
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(folder, **sharded)
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == shards
    weights = files[-1]  # of several shards, only the damaged one is named
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError) as error:
        HFCausalLM(pretrained=str(folder))
    assert str(error.value) == (f"{weights} is damaged (truncated or overwritten?) and cannot be read "
                                f"({error.value.__cause__}); save or download the model folder again")
    assert str(error.value.__cause__).startswith("Error while deserializing header")


def test_instruction_data_takes_the_pretrained_folders_tokenizer(tmp_path):
    from lit_growattn.data.arithmetic import make_rows, write_jsonl

    from hf_helpers import instruct_tokenizer

    folder = tmp_path / "llama"
    saved_tiny_model("llama", folder, vocab=len(instruct_tokenizer(folder, chat_template=True)))
    rows = write_jsonl(tmp_path / "rows.jsonl", make_rows(20, seed=0))
    tiny = ["--config", str(REPO / "configs" / "hf_llama_dint_sft_tiny.yaml"), f"--data.init_args.path={rows}"]
    cli = main([*tiny, f"--model.init_args.pretrained={folder}"], run=False)
    assert cli.datamodule.tokenizer_spec == str(folder) and cli.datamodule.tokenizer.chat_template
    with pytest.raises(ValueError, match="instruction data needs a tokenizer"):
        main([*tiny, "--model.init_args.config={model_type: llama, hidden_size: 32}"], run=False)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])  # max_position_embeddings | GPT-2's n_positions
def test_blocks_longer_than_the_models_positions_are_refused_and_blocks_of_exactly_its_positions_fit(tmp_path,
                                                                                                    model_type):
    folder = saved_tiny_model(model_type, tmp_path)  # 64 positions
    with pytest.raises(ValueError) as refused:
        HFCausalLM(pretrained=folder, block_size=65)
    assert str(refused.value) == "blocks of 65 tokens exceed the model's 64 positions: lower block_size"
    assert HFCausalLM(pretrained=folder, block_size=64).hparams.block_size == 64


@pytest.mark.parametrize("given", [{}, "both"])
def test_a_model_needs_exactly_one_of_a_folder_and_a_config(tmp_path, given):
    if given == "both":
        given = {"pretrained": saved_tiny_model("llama", tmp_path), "config": tiny_config("llama").to_dict()}
    with pytest.raises(ValueError) as refused:
        HFCausalLM(**given)
    assert str(refused.value) == ("give exactly one of `pretrained` (a local model folder) or `config` (a mapping with "
                                  "`model_type`, to train from scratch)")
