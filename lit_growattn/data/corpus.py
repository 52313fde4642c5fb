"""Where the text comes from: local files or a hub dataset, as `datasets` rows, with their fingerprints.

Local files are read with `load_dataset("text", keep_linebreaks=True)`, so the rows joined give the file's
text back; the rows of a hub dataset are documents, each followed by a blank line (`suffix`).
"""

from __future__ import annotations

import codecs
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from lit_growattn.data.token_file import fingerprint_files


def check_file(path: str, flag: str) -> int:
    """The file's size in bytes, or a clear error for a missing, directory or empty path."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path!r} is a directory, not a text file; give one file (or a list of files) with {flag}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file not found: {path!r}; pass an existing file with {flag}")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"text file is empty: {path!r} ({flag})")
    return size


# surrogateescape decodes each byte that is not UTF-8 to one of these lone surrogates, which valid UTF-8 never yields.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def warn_if_not_utf8(path: str) -> None:
    """One warning naming `path` if some of its bytes are not UTF-8: reading it replaces them by U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    count = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            count += len(_ESCAPED_BYTE.findall(decoder.decode(block)))
    count += len(_ESCAPED_BYTE.findall(decoder.decode(b"", final=True)))
    if count:
        warnings.warn(f"{path}: {count} bytes are not UTF-8, and are read as the replacement character U+FFFD: "
                      f"re-encode the file as UTF-8 from its encoding, e.g. `iconv -f CP1252 -t UTF-8 {path} > "
                      f"{os.path.splitext(path)[0]}.utf8.txt` for Windows-1252, and train on that file", stacklevel=2)


@dataclass
class LocalFiles:
    paths: list[str]
    field = "text"
    suffix = ""

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.paths[0]))[0]

    @property
    def identity(self) -> list[str]:
        return [os.path.abspath(p) for p in self.paths]

    def fingerprint(self) -> list[dict]:
        return fingerprint_files(self.paths)

    def rows(self, cache_dir: str) -> list:
        """One `datasets.Dataset` of lines per file, so that each file's tail can be held out."""
        from datasets import load_dataset

        for path in self.paths:
            warn_if_not_utf8(path)
        return [
            load_dataset("text", data_files=p, split="train", keep_linebreaks=True, encoding_errors="replace",
                         cache_dir=cache_dir)
            for p in self.paths
        ]

    def stream(self):
        from datasets import load_dataset

        return load_dataset("text", data_files=self.paths, split="train", keep_linebreaks=True,
                            encoding_errors="replace", streaming=True)

    def sample(self, num_bytes: int, train_fraction: float) -> Iterator[list[str]]:
        """Up to `num_bytes` of text, split evenly over the files, from the training part of each (its start)."""
        for path in self.paths:
            budget = min(int(os.path.getsize(path) * train_fraction), num_bytes // len(self.paths))
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character cut by a block stays whole
            with open(path, "rb") as f:
                while budget > 0:
                    block = f.read(min(budget, 1 << 20))
                    if not block:
                        break
                    budget -= len(block)
                    yield decoder.decode(block).splitlines(keepends=True)


@dataclass
class HubDataset:
    dataset: str
    config: str | None
    split: str
    field: str
    suffix = "\n\n"

    @property
    def name(self) -> str:
        return self.dataset.replace("/", "--")

    @property
    def identity(self) -> list:
        return [self.dataset, self.config, self.split, self.field]

    def _load(self, streaming: bool = False):
        from datasets import load_dataset

        rows = load_dataset(self.dataset, self.config, split=self.split, streaming=streaming)
        columns = rows.column_names if rows.column_names is not None else list(rows.features or [])
        if columns and self.field not in columns:  # a stream may not know its columns before its first row
            raise ValueError(f"hf_text_field={self.field!r} is not a column of {self.dataset}: {columns}")
        return rows

    def fingerprint(self) -> list:
        return [*self.identity, self._load()._fingerprint]

    def rows(self, cache_dir: str) -> list:
        return [self._load()]

    def stream(self):
        return self._load(streaming=True)

    def sample(self, num_bytes: int, train_fraction: float) -> Iterator[list[str]]:
        rows = self._load()
        yield from texts_up_to(rows.select(range(int(len(rows) * train_fraction))), self.field, num_bytes)


HUB_KEYS = ("hf_dataset", "hf_config", "hf_split", "hf_text_field")


def text_source(value: str | dict, flag: str) -> LocalFiles | HubDataset:
    """An existing text file, else a hub dataset: its name (split `train`, field `text`) or a dict of HUB_KEYS
    spelled as TextDataModule's arguments, e.g. `{hf_dataset: openai/gsm8k, hf_config: main, hf_split: test,
    hf_text_field: question}`."""
    if isinstance(value, str) and os.path.isfile(value):
        check_file(value, flag)
        return LocalFiles([value])
    settings = {"hf_dataset": value} if isinstance(value, str) else dict(value)
    unknown = sorted(set(settings) - set(HUB_KEYS))
    if unknown or not settings.get("hf_dataset"):
        raise ValueError(f"{flag} = {value!r}: give a text file, a hub dataset name, or a dict with hf_dataset and "
                         f"optionally {', '.join(HUB_KEYS[1:])}" + (f" (unknown keys {unknown})" if unknown else ""))
    return HubDataset(settings["hf_dataset"], settings.get("hf_config"), settings.get("hf_split", "train"),
                      settings.get("hf_text_field", "text"))


def texts_up_to(rows, field: str, num_bytes: int) -> Iterator[list[str]]:
    """Batches of the rows' texts until about `num_bytes` characters have been given."""
    for batch in rows.iter(batch_size=1000):
        texts = batch[field]
        yield texts
        num_bytes -= sum(len(t) for t in texts)
        if num_bytes <= 0:
            return


def first_rows(rows, field: str, count: int) -> list[str]:
    return [row[field] for row in islice(iter(rows), count)]
