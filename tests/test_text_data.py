"""Text data at scale: tokenizers, the token-file cache, memory-mapped windows, streaming, DDP shares, bits per byte."""

import json
import math
import pickle
import random
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from lit_growattn.commands.cli import main
from lit_growattn.data import TextDataModule
from lit_growattn.data.token_file import CacheError
from lit_growattn.data.tokenizer import load_tokenizer
from lit_growattn.data.windows import Windows

from conftest import REPO, scalar_tags

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "élan", "naïve", "東京", "—", "x=1;"]


def write_corpus(path, lines=400, seed=0):
    """Lines of words (some non-ASCII, some blank lines): a few kB of text BPE has something to merge in."""
    rng = random.Random(seed)
    text = "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12))) + "\n" * rng.choice([1, 1, 2])
                   for _ in range(lines))
    path.write_text(text, encoding="utf-8")
    return text


def bpe_module(path, cache, **kwargs):
    kwargs = dict(path=path if isinstance(path, list) else str(path), tokenizer="bpe", bpe_vocab_size=300, block_size=16, batch_size=4, cache_dir=str(cache)) | kwargs
    return TextDataModule(**kwargs)


def as_list(tokens):
    return np.asarray(tokens[:]).tolist()


def windows(dataset):
    return [torch.cat([x, y[-1:]]) for x, y in (dataset[i] for i in range(len(dataset)))]


def test_bpe_round_trip_and_token_file_equals_direct_tokenisation(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    texts = [write_corpus(first, seed=0), write_corpus(second, lines=300, seed=1)]
    dm = bpe_module([str(first), str(second)], tmp_path / "cache")
    assert dm.vocab_size == 300
    dm.prepare_data()
    dm.setup("fit")
    tokenizer = dm.tokenizer
    assert 256 < tokenizer.vocab_size <= 300
    assert tokenizer.decode(tokenizer.encode_batch(["naïve 東京 fox\n"])[0]) == "naïve 東京 fox\n"

    # Direct tokenisation: line by line, each file's last tenth of tokens held out, training parts first.
    direct = [sum(tokenizer.encode_batch(t.splitlines(keepends=True)), []) for t in texts]
    cuts = [len(d) - int(len(d) * 0.1) for d in direct]
    assert as_list(dm.train_set.tokens) == direct[0][: cuts[0]] + direct[1][: cuts[1]]
    assert as_list(dm.val_sets[0].tokens) == direct[0][cuts[0] :] + direct[1][cuts[1] :]
    assert dm.train_set.tokens.dtype == np.uint16
    # The token file decodes back to the corpus: nothing lost, nothing reordered within a file.
    decoded = [tokenizer.decode(d[:c]) + tokenizer.decode(d[c:]) for d, c in zip(direct, cuts)]
    assert decoded == texts
    held_out_bytes = sum(len(tokenizer.decode(d[c:]).encode()) for d, c in zip(direct, cuts))
    assert dm.bytes_per_token[0] == pytest.approx(held_out_bytes / len(dm.val_sets[0].tokens))


def test_windows_read_from_the_file_equal_memory_mapped_and_in_memory_windows(tmp_path):
    path = tmp_path / "corpus.txt"
    write_corpus(path)
    for tokenizer in ("bytes", "bpe"):
        dm = bpe_module(path, tmp_path / "cache", tokenizer=tokenizer)
        dm.setup("fit")
        for dataset in [dm.train_set, *dm.val_sets]:
            tokens = dataset.tokens.parts[0] if hasattr(dataset.tokens, "parts") else dataset.tokens
            mapped = np.memmap(tokens.path, dtype=tokens.dtype, mode="r")[tokens.start : tokens.stop]
            in_memory = torch.tensor(np.array(mapped).tolist())
            expected = [Windows(t, dataset.block_size, dataset.stride) for t in (mapped, in_memory)]
            assert len(dataset) == len(expected[0]) == len(expected[1]) > 0
            for other in expected:
                assert all(torch.equal(a, b) for a, b in zip(windows(dataset), windows(other), strict=True))
            assert windows(dataset)[0].dtype == torch.long
            assert len(pickle.dumps(dataset)) < 1000  # a worker started by spawn opens the file, it gets no copy
            assert all(torch.equal(a, b) for a, b in zip(windows(pickle.loads(pickle.dumps(dataset))), windows(dataset)))


def test_hub_dataset_rows_become_documents_of_the_token_file(tmp_path):
    folder = tmp_path / "hub"
    folder.mkdir()
    rows = [{"body": f"document {i}: " + "words " * (i % 7), "id": i} for i in range(60)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = TextDataModule(hf_dataset=str(folder), hf_text_field="body", block_size=16, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    dm.setup("fit")
    text = "".join(r["body"] + "\n\n" for r in rows).encode()
    cut = len(text) - int(len(text) * 0.1)
    assert bytes(as_list(dm.train_set.tokens)) == text[:cut] and bytes(as_list(dm.val_sets[0].tokens)) == text[cut:]
    with pytest.raises(ValueError, match=r"hf_text_field='text' is not a column of .*\['body', 'id'\]"):
        TextDataModule(hf_dataset=str(folder), block_size=16, cache_dir=str(tmp_path / "cache")).prepare_data()


def test_token_file_is_reused_rebuilt_when_stale_or_corrupt(tmp_path, monkeypatch):
    import lit_growattn.data.text as text

    calls = []
    tokenize = text.tokenize
    monkeypatch.setattr(text, "tokenize", lambda *a: calls.append(1) or tokenize(*a))
    path, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    write_corpus(path)

    def tokens():
        dm = bpe_module(path, cache)
        dm.setup("fit")
        return as_list(dm.train_set.tokens), dm

    first, dm = tokens()
    assert len(calls) == 1
    assert tokens()[0] == first and len(calls) == 1  # reused: nothing tokenized again
    (directory,) = [d for d in cache.iterdir() if (d / "meta.json").exists()]

    write_corpus(path, seed=5)  # changed source: stale, rebuilt with the new text
    changed, dm = tokens()
    assert len(calls) == 2 and changed != first
    assert changed == sum(dm.tokenizer.encode_batch(path.read_text().splitlines(keepends=True)), [])[: len(changed)]

    with open(directory / "tokens.bin", "r+b") as f:  # truncated token file: detected, rebuilt
        f.truncate(10)
    assert tokens()[0] == changed and len(calls) == 3
    (directory / "meta.json").write_text("{not json")  # corrupt metadata: detected, rebuilt
    assert tokens()[0] == changed and len(calls) == 4

    # A DDP rank other than the first never builds: it says why the cache is unusable and what to check.
    (directory / "meta.json").unlink()
    dm = bpe_module(path, cache)
    dm.trainer = SimpleNamespace(world_size=2, global_rank=1, lightning_module=None)
    with pytest.raises(CacheError, match=r"no token file .* interrupted.*every rank must see cache_dir"):
        dm.setup("fit")
    bpe_module(path, cache).prepare_data()  # what the first process does
    dm.setup("fit")
    assert as_list(dm.train_set.tokens) == changed and len(calls) == 5


def test_ddp_ranks_see_disjoint_training_windows(tmp_path):
    path = tmp_path / "corpus.txt"
    write_corpus(path, lines=2000)
    for tokenizer in ("bytes", "bpe"):
        dm = bpe_module(path, tmp_path / "cache", tokenizer=tokenizer, samples_per_epoch=64, batch_size=8)
        dm.prepare_data()
        dm.setup("fit")
        single = list(dm.train_dataloader().sampler)
        assert len(set(single)) == len(single)  # a draw without repeats, so disjointness is visible
        shares = []
        for rank in (0, 1):
            dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, lightning_module=None)
            dm.setup("fit")
            shares.append(set(dm.train_dataloader().sampler))
        assert not shares[0] & shares[1] and shares[0] | shares[1] == set(single)


class WindowRecorder(L.LightningModule):
    """Saves the training windows each rank was given."""

    def __init__(self, out):
        super().__init__()
        self.out, self.seen, self.w = out, [], torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0])
        return self.w.sum() * 0

    def on_train_end(self):
        torch.save(torch.cat(self.seen), f"{self.out}/windows_{self.global_rank}.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# The probe module checks the data split across ranks; it has no validation step of its own.
@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`:UserWarning")
def test_under_real_ddp_the_first_process_tokenizes_and_the_ranks_share_out_the_windows(tmp_path):
    path = tmp_path / "corpus.txt"
    write_corpus(path, lines=2000)
    for devices in (1, 2):
        out = tmp_path / f"run_{devices}"
        out.mkdir()
        data = bpe_module(path, out / "cache", samples_per_epoch=48, batch_size=8)
        L.Trainer(max_epochs=1, accelerator="cpu", devices=devices, strategy="ddp_spawn" if devices > 1 else "auto",
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0).fit(WindowRecorder(str(out)), data)
        assert len(list((out / "cache").glob("*/meta.json"))) == 1  # one token file, built once
    windows_of = lambda run, rank: {tuple(w) for w in torch.load(tmp_path / f"run_{run}/windows_{rank}.pt").tolist()}
    single, rank0, rank1 = windows_of(1, 0), windows_of(2, 0), windows_of(2, 1)
    assert len(single) == 48 and len(rank0) == len(rank1) == 24
    assert not rank0 & rank1 and rank0 | rank1 == single  # the single-process draw, shared out


def test_streaming_reshuffles_per_epoch_and_splits_rows_across_ranks(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"row {i:04d} " + "abc " * 5 + "\n" for i in range(400)))

    def stream(rank=0, world_size=1, epoch=0):
        dm = TextDataModule(path=str(path), streaming=True, samples_per_epoch=20, val_rows=10, block_size=32, batch_size=5)
        dm.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, current_epoch=epoch, lightning_module=None)
        dm.setup("fit")
        batches = list(dm.train_dataloader())
        rows = {int(t.split()[1]) for x, _ in batches for t in bytes(x.flatten().tolist()).decode().split("\n")
                if t.startswith("row ") and len(t.split()) > 2}
        return batches, rows, dm

    batches, rows, dm = stream()
    assert len(batches) == 4 and batches[0][0].shape == (5, 32) and torch.equal(batches[0][0][:, 1:], batches[0][1][:, :-1])
    assert min(rows) >= 10  # the first val_rows rows are the held-out split
    assert bytes(as_list(dm.val_sets[0].tokens)).decode().startswith("row 0000 ")
    assert dm.bytes_per_token == [1.0]
    again, _, _ = stream()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))  # same (seed, epoch): same stream
    assert not torch.equal(stream(epoch=1)[0][0][0], batches[0][0])  # set_epoch reshuffles
    (b0, rows0, _), (b1, rows1, _) = stream(0, 2), stream(1, 2)
    assert len(b0) == len(b1) == 2 and not rows0 & rows1


def test_clear_errors_for_short_corpora_directories_and_vocabulary(tmp_path):
    path, short = tmp_path / "corpus.txt", tmp_path / "short.txt"
    path.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(1000)))
    short.write_text("tiny text here\n")
    # 900 training and 100 held-out bytes: the advice fits both splits, not only the one that failed.
    with pytest.raises(ValueError, match=r"training split .* has 900 bytes: use block_size <= 99 or more text"):
        TextDataModule(path=str(path), block_size=950)
    with pytest.raises(ValueError, match=r"val_paths\['x'\] .* has 15 bytes: use block_size <= 14"):
        TextDataModule(path=str(path), block_size=16, val_paths={"x": str(short)})
    with pytest.raises(IsADirectoryError, match=r"is a directory, not a text file; give one file .*--data\.path"):
        TextDataModule(path=str(tmp_path))
    with pytest.raises(IsADirectoryError, match=r"--data\.val_paths"):
        TextDataModule(path=str(path), block_size=16, val_paths={"x": str(tmp_path)})

    dm = bpe_module(short, tmp_path / "cache", val_fraction=0.5, block_size=8)  # 15 bytes, 10 BPE tokens
    with pytest.raises(ValueError, match=r"block_size=8 .* the training split has 5 tokens after tokenisation: use block_size <= 4"):
        dm.setup("fit")
    with pytest.raises(FileNotFoundError, match=r"tokenizer file not found: .*missing/tokenizer.json"):
        TextDataModule(path=str(path), tokenizer=str(tmp_path / "missing/tokenizer.json"))  # a path, never a hub name
    with pytest.raises(ValueError, match="streaming needs samples_per_epoch"):
        TextDataModule(path=str(path), streaming=True)

    write_corpus(path)
    dm = bpe_module(path, tmp_path / "cache")
    dm.trainer = SimpleNamespace(world_size=1, global_rank=0, lightning_module=SimpleNamespace(hparams={"vocab_size": 256}))
    with pytest.raises(ValueError, match=r"the tokenizer has 300 tokens but the model's vocab_size is 256"):
        dm.setup("fit")


def test_tokenizer_json_file_is_used_as_given(tmp_path):
    path = tmp_path / "corpus.txt"
    write_corpus(path)
    trained = bpe_module(path, tmp_path / "cache")
    trained.setup("fit")
    trained.tokenizer.save(tmp_path / "tokenizer.json")
    for spec in (tmp_path / "tokenizer.json", tmp_path):
        dm = TextDataModule(path=str(path), tokenizer=str(spec), block_size=16, cache_dir=str(tmp_path / "cache2"))
        assert dm.vocab_size == trained.tokenizer.vocab_size
        dm.setup("fit")
        assert as_list(dm.train_set.tokens) == as_list(trained.train_set.tokens)


def tensorboard_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_file,) = log_dir.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def test_bits_per_byte_of_a_byte_level_run_is_the_loss_over_ln2(tmp_path, tiny_cli_args):
    path, other = tmp_path / "corpus.txt", tmp_path / "other.txt"
    write_corpus(path)
    write_corpus(other, seed=3)
    main(["fit", "--config", str(REPO / "configs/text.yaml"), *tiny_cli_args, f"--data.init_args.path={path}",
          f"--data.init_args.val_paths={{code: {other}}}", "--data.init_args.block_size=32",
          "--data.init_args.batch_size=8", "--data.init_args.samples_per_epoch=32"])
    for prefix in ("val", "val/code"):
        (loss,), (bpb,) = tensorboard_scalars(tmp_path, f"{prefix}/loss"), tensorboard_scalars(tmp_path, f"{prefix}/bpb")
        assert bpb == pytest.approx(loss / math.log(2), rel=1e-6)


def test_text_bpe_config_trains_from_the_command_line(tmp_path, tiny_cli_args):
    path = tmp_path / "corpus.txt"
    text = write_corpus(path, lines=1500)
    args = ["fit", "--config", str(REPO / "configs/text_bpe.yaml"), *tiny_cli_args, f"--data.init_args.path={path}",
            f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--data.init_args.bpe_vocab_size=320",
            "--data.init_args.block_size=16", "--data.init_args.batch_size=8", "--data.init_args.samples_per_epoch=32"]
    main(args)
    assert {"train/loss", "val/loss", "val/bpb"} <= scalar_tags(tmp_path)
    (ckpt,) = [p for p in tmp_path.rglob("last.ckpt")]
    (learned,) = (tmp_path / "cache" / "tokenizers").glob("bpe-*.json")
    tokenizer = load_tokenizer(str(learned))
    assert 256 < tokenizer.vocab_size <= 320  # the model takes the size the BPE learned
    # Bytes per held-out token, from the text: tokenized line by line, the last tenth of the tokens held out.
    tokens = sum(tokenizer.encode_batch(text.splitlines(keepends=True)), [])
    held_out = tokens[len(tokens) - int(len(tokens) * 0.1) :]
    bytes_per_token = len(tokenizer.decode(held_out).encode()) / len(held_out)
    assert bytes_per_token > 1.5  # a BPE token stands for several bytes
    (loss,), (bpb,) = tensorboard_scalars(tmp_path, "val/loss"), tensorboard_scalars(tmp_path, "val/bpb")
    # Both logged in float32, bpb as the mean of its batches' values: a few units of float32 round-off apart.
    assert bpb == pytest.approx(loss / (math.log(2) * bytes_per_token), rel=8 * torch.finfo(torch.float32).eps)
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["vocab_size"] == tokenizer.vocab_size
