"""Instruction (prompt → response) data for supervised fine-tuning of Hugging Face causal LMs.

Each example becomes `prompt tokens + response tokens + EOS`:
- the prompt is rendered by the tokenizer's chat template (one user turn, `add_generation_prompt=True`) when the
  tokenizer has one, else by PLAIN_TEMPLATE (with the tokenizer's BOS, if it adds one);
- the response follows as plain tokens, then the tokenizer's EOS: exactly what generation after the prompt
  should produce, and where it should stop.
Labels are -100 on the prompt and on padding and equal the input ids on the response and its EOS.

Batch convention: the project's (inputs, labels) pairs, (B, T) each, right-padded, labels ALREADY SHIFTED —
labels[:, t] is the target of inputs[:, t], i.e. token t+1 — so the loss is a plain cross-entropy (HFCausalLM's).
Never pass them as `labels=` to a Hugging Face model: its loss (`ForCausalLMLoss`) shifts once more. No attention
mask is needed: padding only follows the real tokens, and causal attention (DINT's running mean A3 included)
never looks ahead, so the real positions never see it.

Local files are read by `instruct_files.py`, not by the datasets loaders, and only their prompt and response
fields: JSON Lines line by line, Parquet by those two columns. Each row is checked as it is read and encoded, in the one pass over
the data: a line that is not UTF-8 or not a JSON object, a field that is missing, null, not a string or empty,
a file without rows, stops `prepare_data` with the file, the line (JSON Lines; the row from 0 for Parquet, a JSON
array or a hub dataset), the field and what to do.

An example longer than `max_length` loses the end of its response (and its EOS); one whose prompt alone fills
`max_length` keeps no response token and is dropped. Both are counted and logged.

Tokenized examples are cached (`datasets.save_to_disk`, written under a temporary name and renamed when
complete) in a directory named by a hash of everything that decides them: `prepare_data` (one process per node)
builds it, `setup` on every rank only reads it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_growattn.data.base import BaseDataModule
from lit_growattn.data.corpus import HubDataset, text_source
from lit_growattn.data.instruct_files import (
    BadInstructionData, file_format, json_rows, not_text, parquet_rows, refuse_missing_fields)
from lit_growattn.data.token_file import fingerprint_files

PLAIN_TEMPLATE = "Problem:\n{prompt}\n\nSolution:\n"
DEFAULT_CACHE = os.environ.get("LIT_GROWATTN_CACHE", "~/.cache/lit_growattn")
CHARS_PER_TOKEN_CAP = 16  # text read per wanted validation token, at most: far above any tokenizer's mean (≈ 4)


def load_hf_tokenizer(spec: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {spec!r} has no EOS token: instruction data ends every response with it")
    return tokenizer


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's tokens: the chat template's user turn and generation prompt, else PLAIN_TEMPLATE."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer(PLAIN_TEMPLATE.format(prompt=prompt), add_special_tokens=True)["input_ids"]


def encode_example(tokenizer, prompt: str, response: str, max_length: int) -> tuple[list[int], int, bool]:
    """(ids, number of prompt tokens, truncated) of one example: prompt + response + EOS, cut at max_length."""
    head = prompt_ids(tokenizer, prompt)
    ids = head + tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids[:max_length], len(head), len(ids) > max_length


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True))
    text += repr(tokenizer.chat_template) + repr(tokenizer.eos_token_id) + PLAIN_TEMPLATE
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pad_batch(examples: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Examples (`input_ids`, unshifted `labels`) → (inputs, shifted labels), right-padded to the longest
    (inputs with pad_id, labels with -100)."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = torch.as_tensor(e["input_ids"])
        labels[row, :n] = torch.as_tensor(e["labels"])
    return ids[:, :-1], labels[:, 1:]


class InstructDataModule(BaseDataModule):
    """Prompt/response pairs from a hub dataset or local JSONL/Parquet files; extra cross-domain validation sets.

    Args:
        tokenizer: A tokenizer folder or hub name, loaded with `AutoTokenizer.from_pretrained`. None: the model's; the
            CLI gives a pretrained model's folder (or the tokenizer a checkpoint recorded).
        hf_dataset, hf_config, hf_split: a hub dataset (`datasets.load_dataset`); give this or `path`.
        path: Local `.jsonl`/`.json` or `.parquet` file(s), one example per row.
        prompt_field, response_field: the columns holding the prompt and the response.
        max_examples: Use only the first this many rows (None: all; OpenMathInstruct-2 has 14 M).
        val_size: The last this many examples are held out for validation (`val/…`).
        max_length: Tokens per example at most (longer ones are truncated and counted).
        val_texts: Cross-domain validation sets, name -> an existing text file, else a hub dataset: its name (split
            `train`, field `text`) or a dict `{hf_dataset, hf_config, hf_split, hf_text_field}` (TextDataModule's
            spelling; all but hf_dataset optional). Read from the start as consecutive language-modelling windows
            of `max_length` inputs (loss on every token; a dataset's rows are documents, each followed by a
            blank line; a hub split is downloaded whole, in `prepare_data`); logged as `val/<name>/…`.
        val_text_windows: At most this many windows per `val_texts` set.
        cache_dir: Where tokenized examples are kept ($LIT_GROWATTN_CACHE or ~/.cache/lit_growattn).
        batch_size: Examples per batch, per device.
        seed: Seeds the training order, which depends on (seed, epoch) only.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        tokenizer: str | None = None,
        hf_dataset: str | None = None,
        hf_config: str | None = None,
        hf_split: str = "train",
        path: str | list[str] | None = None,
        prompt_field: str = "problem",
        response_field: str = "generated_solution",
        max_examples: int | None = None,
        val_size: int = 200,
        max_length: int = 512,
        val_texts: dict[str, str | dict[str, str | None]] | None = None,
        val_text_windows: int = 64,
        cache_dir: str | None = None,
        batch_size: int = 8,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if (path is None) == (hf_dataset is None):
            raise ValueError("give exactly one of local files (--data.path) or a hub dataset (--data.hf_dataset)")
        for name, value in dict(max_examples=max_examples, val_size=val_size, max_length=max_length,
                                batch_size=batch_size, val_text_windows=val_text_windows).items():
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.paths = [path] if isinstance(path, str) else list(path or [])
        for p in self.paths:
            if os.path.isdir(p):
                raise ValueError(f"instruction file {p!r} is a directory: list its files, e.g. --data.path "
                                 f"'[{p}/a.jsonl, {p}/b.jsonl]'")
            if not os.path.isfile(p):
                raise FileNotFoundError(f"instruction file not found: {p!r} (--data.path)")
            if file_format(p) is None:
                raise ValueError(f"{p!r}: instruction files must be .jsonl, .json or .parquet")
            if os.path.getsize(p) == 0:
                raise ValueError(f"instruction file {p!r} is empty: it needs one example per row, with text in "
                                 f"{prompt_field!r} and {response_field!r}")
        if prompt_field == response_field:
            raise ValueError(f"prompt_field and response_field are both {prompt_field!r}: name the two fields that "
                             "hold the prompt and the response")
        if len({file_format(p) for p in self.paths}) > 1:
            raise ValueError(f"instruction files {self.paths} mix JSON and Parquet: give files of one format")
        if "" in (val_texts or {}):
            raise ValueError(f"val_texts has an empty name (for {val_texts['']!r}): each set is logged as "
                             "val/<name>/…")
        self.val_sources = {name: text_source(v, f"val_texts[{name!r}]") for name, v in (val_texts or {}).items()}
        if tokenizer is None:
            raise ValueError("instruction data needs a tokenizer: give the model's folder (--data.init_args.tokenizer), "
                             "or a pretrained model (--model.init_args.pretrained), whose folder the CLI then uses")
        self.tokenizer_spec, self.tokenizer = tokenizer, load_hf_tokenizer(tokenizer)
        self.tokenizer_source = tokenizer  # what a model records as its tokenizer
        self.hf_dataset, self.hf_config, self.hf_split = hf_dataset, hf_config, hf_split
        self.prompt_field, self.response_field = prompt_field, response_field
        self.max_examples, self.val_size, self.max_length = max_examples, val_size, max_length
        self.val_texts, self.val_text_windows = dict(val_texts or {}), val_text_windows  # as given, for messages
        self.cache_dir = Path(cache_dir or DEFAULT_CACHE).expanduser()
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.num_truncated = self.num_dropped = 0

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def max_seq_len(self) -> int:
        return self.max_length

    @property
    def val_names(self) -> list[str]:
        return ["", *self.val_sources]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

    # -- rows and their cache -------------------------------------------------------------------------------
    def _rows(self) -> Iterator[tuple[str, object, object]]:
        """(where, prompt, response) of each row, in order; `where` names the file and line (JSON Lines) or the row
        (Parquet, a JSON array, a hub dataset). Files are read here, only their two fields, and a file that cannot
        be read as rows raises BadInstructionData naming where."""
        fields = (self.prompt_field, self.response_field)
        if self.hf_dataset is None:
            for p in self.paths:
                yield from (parquet_rows if file_format(p) == "parquet" else json_rows)(p, fields)
            return
        from datasets import load_dataset

        rows = load_dataset(self.hf_dataset, self.hf_config, split=self.hf_split)
        refuse_missing_fields(f"{self.hf_dataset} (split {self.hf_split!r})", fields, rows.column_names)
        batches = rows.select_columns(list(fields)).iter(batch_size=1000)  # 100× faster than row by row
        pairs = itertools.chain.from_iterable(zip(b[fields[0]], b[fields[1]]) for b in batches)
        for index, (prompt, response) in enumerate(pairs):
            yield f"{self.hf_dataset} (split {self.hf_split!r}) row {index} (from 0)", prompt, response

    def _cache_path(self) -> Path:
        source = [self.hf_dataset, self.hf_config, self.hf_split] if self.hf_dataset else fingerprint_files(self.paths)
        settings = dict(format=2, source=source, tokenizer=tokenizer_fingerprint(self.tokenizer), fields=[
            self.prompt_field, self.response_field], max_examples=self.max_examples, max_length=self.max_length)
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
        return self.cache_dir / f"instruct-{digest}"

    def prepare_data(self) -> None:
        for name in self.val_sources:
            self._download_val_set(name)  # a hub set: here once per node; every rank's setup reads the copy
        path = self._cache_path()
        if path.is_dir():
            return
        from datasets import Dataset
        from datasets.exceptions import DatasetGenerationError

        def examples():
            for where, prompt, response in itertools.islice(self._rows(), self.max_examples):
                for field, value in ((self.prompt_field, prompt), (self.response_field, response)):
                    if (problem := not_text(value)) is not None:
                        raise BadInstructionData(f"{where}: {field!r} {problem}: every row needs text in "
                                                 f"{self.prompt_field!r} and {self.response_field!r}; fix or remove "
                                                 "the row")
                ids, n_prompt, truncated = encode_example(self.tokenizer, prompt, response, self.max_length)
                yield {"input_ids": ids, "labels": [-100] * min(n_prompt, len(ids)) + ids[n_prompt:],
                       "truncated": truncated, "num_labels": max(len(ids) - n_prompt, 0)}

        # datasets' working copy, removed once saved; the fingerprint spares it hashing the generator and tokenizer
        build = path.with_name(path.name + f".build-{os.getpid()}")
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        try:
            Dataset.from_generator(examples, cache_dir=str(build), fingerprint=path.name).save_to_disk(str(tmp))
        except DatasetGenerationError as err:
            if isinstance(err.__cause__, BadInstructionData):
                raise err.__cause__ from None  # the user's problem in the user's terms, without datasets' wrapper
            raise
        finally:
            shutil.rmtree(build, ignore_errors=True)
        try:
            os.replace(tmp, path)  # complete or absent: a build that was interrupted is built again
        except OSError:
            if not path.is_dir():
                raise
            shutil.rmtree(tmp)  # another node sharing cache_dir finished the same build first

    def setup(self, stage: str | None = None) -> None:
        from datasets import load_from_disk

        path = self._cache_path()
        if not path.is_dir():
            if self._replicas()[0] > 1:
                raise FileNotFoundError(f"no tokenized examples at {path}: under DDP prepare_data builds them on one "
                                        f"process per node, so every rank must see cache_dir={str(self.cache_dir)!r}")
            self.prepare_data()
        examples = load_from_disk(str(path))
        has_response = np.asarray(examples["num_labels"]) > 0
        self.num_truncated, self.num_dropped = int(np.sum(examples["truncated"])), int((~has_response).sum())
        rank_zero_info(f"instruction data: {len(examples)} examples, {self.num_truncated} truncated to max_length="
                       f"{self.max_length}, {self.num_dropped} dropped (no response token left)")
        kept = examples.select(np.flatnonzero(has_response)).select_columns(["input_ids", "labels"])
        if len(kept) <= self.val_size:
            raise ValueError(f"{len(kept)} usable examples cannot hold out val_size={self.val_size}: lower val_size")
        self.train_set = kept.select(range(len(kept) - self.val_size))
        self.val_sets = [kept.select(range(len(kept) - self.val_size, len(kept)))]
        self.val_sets += [self._text_windows(name) for name in self.val_sources]

    def _download_val_set(self, name: str) -> None:
        """Download a hub set (a file needs nothing), or name what the value could have been and why it failed."""
        source, value = self.val_sources[name], self.val_texts[name]
        if not isinstance(source, HubDataset):
            return
        try:
            source.rows(str(self.cache_dir))
        except Exception as err:
            neither = " is not an existing text file, and as a hub dataset" if isinstance(value, str) else ""
            raise ValueError(f"val_texts[{name!r}] = {value!r}{neither}: {type(err).__name__}: {err}") from err

    def _text_windows(self, name: str) -> list[dict]:
        """Consecutive windows of the set's first tokens, every token a label (the language-modelling loss)."""
        source, width = self.val_sources[name], self.max_length + 1  # inputs and their shifted targets
        wanted, ids = width * self.val_text_windows, []
        for texts in source.sample(wanted * CHARS_PER_TOKEN_CAP, train_fraction=1.0):
            ids += self.tokenizer("".join(t + source.suffix for t in texts), add_special_tokens=False)["input_ids"]
            if len(ids) >= wanted:
                break
        if len(ids) < width:
            raise ValueError(f"val_texts[{name!r}] has {len(ids)} tokens, fewer than one window of max_length + 1 = "
                             f"{width}")
        n = min(len(ids) // width, self.val_text_windows)
        return [{"input_ids": w, "labels": w} for w in (ids[i * width:(i + 1) * width] for i in range(n))]

    def collate(self, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_batch(examples, self.pad_id)
