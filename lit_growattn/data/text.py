"""Language modelling on text: local files or a hub dataset, as bytes or through a tokenizer, in windows.

Three ways the tokens reach the windows, each window read when it is needed, so the corpus never has to fit in RAM:
- `tokenizer: bytes` on local files: windows are read from the files as they are (their bytes are the tokens).
- another tokenizer, or a hub dataset: tokenized once into a cached token file, windows read from it (token_file.py).
- `streaming: true`: windows packed on the fly from a streamed dataset (streaming.py).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_growattn.data.base import BaseDataModule
from lit_growattn.data.corpus import HubDataset, LocalFiles, check_file, first_rows, texts_up_to
from lit_growattn.data.streaming import StreamingWindows
from lit_growattn.data.token_file import (
    FORMAT, CacheError, build_folder_prefix, cache_directory, open_token_file, remove_stale_builds, tokenize, write_token_file,
)
from lit_growattn.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from lit_growattn.data.windows import Concatenated, FileTokens, RandomWindowSampler, Windows

DEFAULT_CACHE = os.environ.get("LIT_GROWATTN_CACHE", "~/.cache/lit_growattn")


class TextDataModule(BaseDataModule):
    """Random training windows, consecutive validation windows (every held-out token predicted once).

    The last `val_fraction` of the tokens of each file (or of the hub split) is held out; each file in
    `val_paths` is evaluated whole, as its own loader named by its key. Training draws `samples_per_epoch`
    windows at random offsets, the same ones for the same (seed, epoch). `bytes_per_token` (one value per
    validation set) lets the model log bits per byte.

    Args:
        path: Local text file, or several files read one after another. Give this or `hf_dataset`.
        hf_dataset, hf_config, hf_split, hf_text_field: a hub dataset (`datasets.load_dataset`), used instead of
            `path`; its rows are documents, each followed by a blank line.
        tokenizer: `bytes` (vocabulary 256, no tokenizer), `bpe` (a byte-level BPE trained on the training
            text), a `tokenizer.json` file or a folder holding one, or a tokenizer name on the Hugging Face hub.
            None: the model's; the CLI gives a pretrained model's folder (or the tokenizer a checkpoint recorded),
            and `bytes` otherwise.
        bpe_vocab_size: Largest vocabulary of the trained BPE (the model takes the size it learned, at most this).
        bpe_sample_mb: MB of training text the BPE is trained on, taken from the start of each source.
        streaming: Stream `hf_dataset` (or `path`) instead of tokenizing it into a file; needs `samples_per_epoch`.
        val_rows: With `streaming`, the first rows of the stream held out for validation.
        cache_dir: Where token files and trained tokenizers are kept ($LIT_GROWATTN_CACHE or ~/.cache/lit_growattn).
        num_proc: Tokenizing processes of `datasets.map` (None: one, whose tokenizer already uses every core).
        block_size: Tokens per sequence.
        val_fraction: Fraction of each file's tokens, taken from its end, held out for validation.
        val_paths: Extra validation sets, name -> local file; logged as val/<name>/loss.
        batch_size: Sequences per batch, per device.
        samples_per_epoch: Training windows per epoch (None: training tokens // block_size).
        seed: Seeds the training windows, which depend on (seed, epoch) only.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        path: str | list[str] | None = None,
        hf_dataset: str | None = None,
        hf_config: str | None = None,
        hf_split: str = "train",
        hf_text_field: str = "text",
        tokenizer: str | None = None,
        bpe_vocab_size: int = 4096,
        bpe_sample_mb: float = 64.0,
        streaming: bool = False,
        val_rows: int = 1000,
        cache_dir: str | None = None,
        num_proc: int | None = None,
        block_size: int = 128,
        val_fraction: float = 0.1,
        val_paths: dict[str, str] | None = None,
        batch_size: int = 32,
        samples_per_epoch: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if (path is None) == (hf_dataset is None):
            raise ValueError("give exactly one of a local file (--data.path) or a hub dataset (--data.hf_dataset)")
        tokenizer = tokenizer or "bytes"
        positive = dict(block_size=block_size, batch_size=batch_size, samples_per_epoch=samples_per_epoch,
                        val_rows=val_rows, bpe_sample_mb=bpe_sample_mb, num_proc=num_proc)
        for name, value in positive.items():
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if tokenizer == "bpe" and bpe_vocab_size < 256:
            raise ValueError(f"bpe_vocab_size must be >= 256 (every byte is a token), got {bpe_vocab_size}")
        if streaming and samples_per_epoch is None:
            raise ValueError("streaming needs samples_per_epoch: a stream has no length to define an epoch by")
        paths = [path] if isinstance(path, str) else list(path or [])
        if twice := sorted({p for p in paths if [os.path.realpath(q) for q in paths].count(os.path.realpath(p)) > 1}):
            raise ValueError(f"path lists {twice} more than once: list each file once (its text would be trained on twice "
                             "and could also land in the held-out split)")
        self.source = LocalFiles(paths) if path is not None else HubDataset(hf_dataset, hf_config, hf_split, hf_text_field)
        self.tokenizer_spec, self.bpe_vocab_size, self.bpe_sample_mb = tokenizer, bpe_vocab_size, bpe_sample_mb
        # What a model records as its tokenizer: the spec, or a trained BPE's file (set where it is read or trained).
        self.tokenizer_source = tokenizer
        # A trained BPE is made (or read from the cache) when the model asks for vocab_size, or in prepare_data.
        self.tokenizer = ByteTokenizer() if tokenizer == "bytes" else None if tokenizer == "bpe" else load_tokenizer(tokenizer)
        self._token_files: dict = {}  # filled by `_prepare`: the corpus's under None, each val file's under its path
        self.streaming, self.val_rows, self.num_proc = streaming, val_rows, num_proc
        self.cache_dir = Path(cache_dir or DEFAULT_CACHE).expanduser()
        self.block_size = block_size
        self.val_fraction = val_fraction
        self.val_paths = dict(val_paths or {})
        self.batch_size = batch_size
        self.samples_per_epoch = samples_per_epoch
        self.seed = seed
        self.num_workers = num_workers
        self.bytes_per_token: list[float] = []

        sizes = {}
        if path is not None:
            file_sizes = [check_file(p, "--data.path") for p in self.source.paths]
            num_val = sum(int(n * val_fraction) for n in file_sizes)
            what = f"of the {sum(file_sizes)} bytes with val_fraction={val_fraction}"
            sizes = {f"the training split {what}": sum(file_sizes) - num_val, f"the validation split {what}": num_val}
        for name, val_path in self.val_paths.items():
            if not name:
                raise ValueError('val_paths names must be non-empty: "" is the held-out split of the training text')
            sizes[f"val_paths[{name!r}] ({val_path})"] = check_file(val_path, "--data.val_paths")
        if self.byte_files and not streaming:
            self._check_block_fits(sizes, "bytes")  # other tokenizers are checked once their token counts are known

    @property
    def vocab_size(self) -> int:
        """The tokenizer's own size: a BPE is trained (or read from the cache) here, since a small text may hold
        fewer merges than bpe_vocab_size and the model must not carry embeddings for tokens that never occur."""
        return self._tokenizer(build=True).vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.block_size

    @property
    def val_names(self) -> list[str]:
        return ["", *self.val_paths]

    @property
    def byte_files(self) -> bool:
        """Local files read as bytes: windows read from them directly, nothing to tokenize or cache."""
        return self.tokenizer_spec == "bytes" and isinstance(self.source, LocalFiles)

    def _check_block_fits(self, sizes: dict[str, int], unit: str) -> None:
        """Every split must hold one window; the suggested block_size fits all of them at once."""
        fits = min(sizes.values()) - 1
        for what, size in sizes.items():
            if size < self.block_size + 1:
                advice = f"use block_size <= {fits} or more text" if fits > 0 else "use more text"
                raise ValueError(
                    f"block_size={self.block_size} needs windows of {self.block_size + 1} tokens but {what} has "
                    f"{size} {unit}: {advice}"
                )

    # -- tokenizer and token files ---------------------------------------------------------------------------
    def _bpe(self, build: bool, stream=None) -> HFTokenizer:
        """The BPE trained on this corpus with these settings: from the cache, else trained (when `build`)."""
        fingerprint = self.source.identity if stream is not None else self.source.fingerprint()
        settings = dict(source=fingerprint, vocab=self.bpe_vocab_size, sample_mb=self.bpe_sample_mb, val_fraction=self.val_fraction)
        path = cache_directory(self.cache_dir / "tokenizers", f"bpe-{self.source.name}", settings).with_suffix(".json")
        self.tokenizer_source = str(path)
        if path.is_file():
            return load_tokenizer(str(path))
        if not build:
            raise CacheError(f"no trained BPE at {path}; {self._shared_cache_hint()}")
        num_bytes = int(self.bpe_sample_mb * 2**20)
        rank_zero_info(f"training a byte-level BPE of {self.bpe_vocab_size} tokens on up to {self.bpe_sample_mb} MB of text")
        texts = texts_up_to(stream, self.source.field, num_bytes) if stream is not None else \
            self.source.sample(num_bytes, 1 - self.val_fraction)
        tokenizer = train_bpe(texts, self.bpe_vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(path)
        return tokenizer

    def _shared_cache_hint(self) -> str:
        return (f"under DDP the first process builds it in prepare_data: every rank must see cache_dir={str(self.cache_dir)!r} "
                "(a shared filesystem), or prepare once on one device")

    def _token_file(self, source, held_out: float, build: bool):
        directory = cache_directory(self.cache_dir, source.name, dict(source=source.identity, tokenizer=self.tokenizer_spec,
                                                                     bpe_vocab_size=self.bpe_vocab_size, held_out=held_out))
        key = dict(format=FORMAT, source=source.fingerprint(), tokenizer=self.tokenizer.fingerprint, held_out=held_out)
        try:
            return open_token_file(directory, key)
        except CacheError as why:
            if not build:
                raise CacheError(f"{why}; {self._shared_cache_hint()}") from why
            rank_zero_info(f"{why}: tokenizing {source.identity} with {self.tokenizer_spec!r}")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_builds(self.cache_dir)
        with tempfile.TemporaryDirectory(dir=self.cache_dir, prefix=build_folder_prefix()) as tmp:
            tokenized = [
                tokenize(rows, source.field, self.tokenizer, self.num_proc, source.suffix, os.path.join(tmp, f"tokens-{i}.arrow"))
                for i, rows in enumerate(source.rows(tmp))
            ]
            return write_token_file(directory, key, tokenized, held_out, self.tokenizer)

    def _tokenizer(self, build: bool) -> HFTokenizer:
        if self.tokenizer is None:
            self.tokenizer = self._bpe(build, stream=self.source.stream().skip(self.val_rows) if self.streaming else None)
        return self.tokenizer

    def _prepare(self, build: bool) -> None:
        """The tokenizer and the token files, checked (and built when `build`) and kept for `setup` to read from."""
        self._tokenizer(build)
        self._token_files = {}
        if not self.streaming and not self.byte_files:
            self._token_files[None] = self._token_file(self.source, self.val_fraction, build)
        if self.tokenizer_spec != "bytes":
            for val_path in self.val_paths.values():
                self._token_files[val_path] = self._token_file(LocalFiles([val_path]), 1.0, build)

    def prepare_data(self) -> None:
        # One process per node: trains the BPE and writes the token files that every rank then reads in `setup`.
        self._prepare(build=True)

    # -- datasets -----------------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        world_size, rank = self._replicas()
        self._prepare(build=world_size == 1)
        self._check_model_vocabulary()
        if self.streaming:
            self.train_set, held_out = self._streamed(world_size, rank)
            sizes = {}
        else:
            train, held_out = self._from_files()
            self.train_set = Windows(train, self.block_size, stride=1)
            sizes = {"the training split": len(train)}
        held = [held_out, *(self._val_file(p) for p in self.val_paths.values())]
        names = ["the validation split", *(f"val_paths[{name!r}]" for name in self.val_paths)]
        unit = "bytes" if self.tokenizer_spec == "bytes" else "tokens after tokenisation"
        self._check_block_fits(sizes | {name: len(tokens) for name, (tokens, _) in zip(names, held)}, unit)
        self.val_sets = [Windows(tokens, self.block_size, stride=self.block_size) for tokens, _ in held]
        self.bytes_per_token = [bytes_per_token for _, bytes_per_token in held]

    def _from_files(self):
        """Training tokens and (held-out tokens, bytes per token), read on demand from the files or the token file."""
        if self.byte_files:
            sizes = [os.path.getsize(p) for p in self.source.paths]
            parts = [FileTokens(p, "uint8").split(n - int(n * self.val_fraction)) for p, n in zip(self.source.paths, sizes)]
            return Concatenated([train for train, _ in parts]), (Concatenated([held for _, held in parts]), 1.0)
        token_file = self._token_files[None]
        train, held_out = token_file.tokens()
        return train, (held_out, token_file.bytes_per_token("val"))

    def _val_file(self, path: str):
        """A whole validation file's (tokens, bytes per token)."""
        if self.tokenizer_spec == "bytes":
            return FileTokens(path, "uint8"), 1.0
        token_file = self._token_files[path]
        return token_file.tokens()[1], token_file.bytes_per_token("val")

    def _streamed(self, world_size: int, rank: int):
        """This rank's share of the stream after its first `val_rows` rows, and those rows tokenized in memory."""
        from datasets.distributed import split_dataset_by_node

        rows, field, suffix = self.source.stream(), self.source.field, self.source.suffix
        ids = self.tokenizer.encode_batch([text + suffix for text in first_rows(rows, field, self.val_rows)])
        held_out = np.concatenate([np.asarray(i, dtype=np.int64) for i in ids] or [np.zeros(0, np.int64)])
        bytes_per_token = self.tokenizer.token_bytes()[held_out].sum() / max(len(held_out), 1)
        train_rows = split_dataset_by_node(rows.skip(self.val_rows).shuffle(seed=self.seed, buffer_size=10_000),
                                           rank=rank, world_size=world_size)
        train = StreamingWindows(train_rows, field, suffix, self.tokenizer, self.block_size,
                                 math.ceil(self.samples_per_epoch / world_size), epoch=self._epoch)
        return train, (held_out, float(bytes_per_token))

    def _epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer else 0

    def _check_model_vocabulary(self) -> None:
        module = getattr(self.trainer, "lightning_module", None) if self.trainer else None
        model_vocab = getattr(module, "hparams", {}).get("vocab_size")
        if model_vocab is not None and self.tokenizer.vocab_size > model_vocab:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is {model_vocab}: "
                "build the model with the data module's vocab_size (the CLI links them) or use a smaller tokenizer"
            )

    def train_dataloader(self) -> DataLoader:
        if self.streaming:
            return DataLoader(self.train_set, self.batch_size, num_workers=self.num_workers)
        world_size, rank = self._replicas()
        samples = self.samples_per_epoch or len(self.train_set.tokens) // self.block_size
        return self._train_loader(RandomWindowSampler(self.train_set, samples, self.seed, num_replicas=world_size, rank=rank))
