"""The token-file cache: a corpus tokenized once into one flat file, whose windows are read back on demand.

A cache directory holds `tokens.bin` (every source's training tokens, then every source's held-out tokens,
uint8/16/32 as the vocabulary needs) and `meta.json` (the key it was built for: format, source fingerprint,
tokenizer fingerprint, held-out fraction; and the split sizes in tokens and bytes). `meta.json` is written
last, so a build that was interrupted leaves no metadata and is built again. A source or tokenizer that
changed makes the key differ: the cache is stale and built again. Bytes overwritten in place are caught by a
hash of blocks sampled across `tokens.bin` (and a check that no sampled token lies outside the vocabulary).
A build works in `tmp-{host}-{pid}-*` folders of the cache; the next build removes those of dead processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lightning.pytorch.utilities import rank_zero_info

from lit_growattn.data.tokenizer import token_dtype
from lit_growattn.data.windows import FileTokens

FORMAT = 2  # 2: meta.json holds `content`, the hash of sampled blocks of tokens.bin
_SAMPLE = 1 << 16  # bytes hashed at each end of a file for its fingerprint, and per sampled block of tokens.bin
_BLOCKS = 16  # blocks of tokens.bin hashed for its content check: 1 MB read, whatever the corpus size
_FOREIGN_BUILD_AGE = 7 * 24 * 3600  # a build folder of another host (shared cache) is stale after a week


class CacheError(ValueError):
    """The cache is missing, stale or corrupt (the message says which)."""


def fingerprint_files(paths: list[str]) -> list[dict]:
    """Path, size, modification time and a hash of both ends of each file: cheap on a 100 GB corpus."""
    prints = []
    for path in paths:
        stat = os.stat(path)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            digest.update(f.read(_SAMPLE))
            f.seek(max(stat.st_size - _SAMPLE, 0))
            digest.update(f.read(_SAMPLE))
        prints.append(dict(path=os.path.abspath(path), size=stat.st_size, mtime_ns=stat.st_mtime_ns, sample=digest.hexdigest()[:16]))
    return prints


def sampled_blocks(path: Path, itemsize: int) -> list[bytes]:
    """_BLOCKS blocks of _SAMPLE bytes spread evenly over the file (whole tokens each), the file if smaller."""
    size, block = path.stat().st_size, _SAMPLE - _SAMPLE % itemsize
    starts = sorted({(size - block) * i // (_BLOCKS - 1) // itemsize * itemsize for i in range(_BLOCKS)}) if size > block else [0]
    with open(path, "rb") as f:
        return [os.pread(f.fileno(), block, start) for start in starts]


def content_digest(blocks: list[bytes]) -> str:
    digest = hashlib.sha256()
    for block in blocks:
        digest.update(block)
    return digest.hexdigest()[:16]


def build_folder_prefix() -> str:
    return f"tmp-{socket.gethostname()}-{os.getpid()}-"


def remove_stale_builds(cache_dir: Path) -> None:
    """Removes the build folders of killed builds: this host's whose process is gone, other hosts' after a week."""
    host = socket.gethostname()
    for folder in cache_dir.glob("tmp-*"):
        owner, _, pid = folder.name[4:].rpartition("-")[0].rpartition("-")
        if owner == host and pid.isdigit():
            stale = not _alive(int(pid))
        else:  # another host's build (or an unnamed one): only its age tells
            stale = time.time() - folder.stat().st_mtime > _FOREIGN_BUILD_AGE
        if stale and folder.is_dir():
            rank_zero_info(f"removing {folder}, left behind by an interrupted token-file build")
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cache_directory(cache_dir: str | os.PathLike, name: str, settings: dict) -> Path:
    """One directory per (name, settings); what it was built from is checked against its metadata."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / f"{name}-{digest}"


@dataclass
class TokenFile:
    directory: Path
    meta: dict

    def tokens(self) -> tuple[FileTokens, FileTokens]:
        """(training tokens, held-out tokens): nothing is read until a window is."""
        tokens = FileTokens(str(self.directory / "tokens.bin"), self.meta["dtype"])
        return tokens.split(self.meta["num_train"])

    def bytes_per_token(self, split: str) -> float:
        return self.meta[f"bytes_{split}"] / max(self.meta[f"num_{split}"], 1)


def open_token_file(directory: Path, key: dict) -> TokenFile:
    """The cache built for `key`, or CacheError saying why it cannot be used."""
    meta_path, tokens_path = directory / "meta.json", directory / "tokens.bin"
    if not meta_path.exists():
        raise CacheError(f"no token file in {directory}" + (" (an earlier build was interrupted)" if tokens_path.exists() else ""))
    try:
        meta = json.loads(meta_path.read_text())
        expected_size = (meta["num_train"] + meta["num_val"]) * np.dtype(meta["dtype"]).itemsize
        dtype, vocab_size = np.dtype(meta["dtype"]), int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as error:
        raise CacheError(f"corrupt metadata {meta_path}: {error!r}") from error
    if dtype.kind != "u" or vocab_size > np.iinfo(dtype).max + 1:
        raise CacheError(f"corrupt metadata {meta_path}: dtype {dtype.name} cannot hold its vocabulary of {vocab_size}")
    changed = sorted(k for k in key if meta.get(k) != key[k])
    if changed:
        raise CacheError(f"stale token file in {directory}: {', '.join(changed)} changed since it was built")
    size = tokens_path.stat().st_size if tokens_path.exists() else 0
    if size != expected_size:
        raise CacheError(f"corrupt token file {tokens_path}: {size} bytes where its metadata says {expected_size}")
    blocks = sampled_blocks(tokens_path, dtype.itemsize)
    if content_digest(blocks) != meta.get("content"):
        raise CacheError(f"corrupt token file {tokens_path}: its content changed since it was built")
    if max(int(np.frombuffer(b, dtype).max(initial=0)) for b in blocks) >= vocab_size:
        raise CacheError(f"corrupt token file {tokens_path}: a token id outside the vocabulary of {vocab_size}")
    return TokenFile(directory, meta)


def tokenize(rows, field: str, tokenizer, num_proc: int | None, suffix: str, cache_file_name: str):
    """A `datasets.Dataset` of rows → one of token ids per row (`ids`) and their count (`n`), by batched `map`."""
    from datasets import Features, Sequence, Value

    def encode(batch):
        ids = tokenizer.encode_batch([text + suffix for text in batch[field]])
        return {"ids": ids, "n": [len(i) for i in ids]}

    fingerprint = hashlib.sha256(f"{rows._fingerprint} {tokenizer.fingerprint} {suffix!r}".encode()).hexdigest()[:16]
    features = Features({"ids": Sequence(Value("int32")), "n": Value("int64")})
    return rows.map(
        encode, batched=True, batch_size=1000, num_proc=num_proc, remove_columns=rows.column_names,
        features=features, desc="tokenizing", cache_file_name=cache_file_name, new_fingerprint=fingerprint,
    )


def _token_chunks(tokenized):
    """The token ids of a tokenized dataset, in order, as flat numpy chunks (read from its Arrow files)."""
    for chunk in tokenized.data.column("ids").chunks:
        values = chunk.flatten().to_numpy()
        if len(values):
            yield values


def _write_splits(fd: int, tokenized: list, counts: list[int], held_out: list[int], num_train: int, dtype: np.dtype,
                  tokenizer) -> dict[str, int]:
    """Each source's tokens to the training region [0, num_train) or, its last `held_out`, to the held-out region
    after it (positional writes, so nothing of the file is held in memory); returns the bytes of text of each."""
    lengths, total = tokenizer.token_bytes(), sum(counts)
    position, num_bytes = {"train": 0, "val": num_train}, {"train": 0, "val": 0}
    written, next_report, start = 0, total // 10, time.monotonic()
    for count, held, source in zip(counts, held_out, tokenized):
        seen = 0
        for chunk in _token_chunks(source):
            if chunk.max() >= tokenizer.vocab_size or chunk.min() < 0:
                raise ValueError(f"the tokenizer produced id {chunk.max()} outside its vocabulary of {tokenizer.vocab_size}")
            take = min(max(count - held - seen, 0), len(chunk))
            for split, part in (("train", chunk[:take]), ("val", chunk[take:])):
                os.pwrite(fd, part.astype(dtype).tobytes(), position[split] * dtype.itemsize)
                position[split] += len(part)
                num_bytes[split] += int(lengths[part].sum())
            seen += len(chunk)
            written += len(chunk)
            if written >= next_report:
                rank_zero_info(f"token file: {written:,} / {total:,} tokens written ({time.monotonic() - start:.0f} s)")
                next_report = written + total // 10
    return num_bytes


def write_token_file(directory: Path, key: dict, tokenized: list, val_fraction: float, tokenizer) -> TokenFile:
    """Writes the tokens of each tokenized source, its last `val_fraction` of tokens held out; returns the cache."""
    import pyarrow.compute as pc

    counts = [pc.sum(t.data.column("n")).as_py() or 0 for t in tokenized]
    held_out = [int(n * val_fraction) for n in counts]
    num_train, total = sum(counts) - sum(held_out), sum(counts)
    if total == 0:
        raise ValueError("the corpus has no tokens after tokenisation: every source is empty")
    dtype = token_dtype(tokenizer.vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "meta.json").unlink(missing_ok=True)  # from here on the old cache is gone
    tmp, start = directory / "tokens.bin.tmp", time.monotonic()
    with open(tmp, "wb", buffering=0) as out:
        out.truncate(total * dtype.itemsize)
        num_bytes = _write_splits(out.fileno(), tokenized, counts, held_out, num_train, dtype, tokenizer)
    os.replace(tmp, directory / "tokens.bin")
    meta = dict(key, content=content_digest(sampled_blocks(directory / "tokens.bin", dtype.itemsize)),
                vocab_size=tokenizer.vocab_size, dtype=dtype.name, num_train=num_train, num_val=total - num_train,
                bytes_train=num_bytes["train"], bytes_val=num_bytes["val"])
    (directory / "meta.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(directory / "meta.tmp", directory / "meta.json")
    rank_zero_info(f"token file: {total:,} tokens ({dtype.name}) in {directory} after {time.monotonic() - start:.0f} s")
    return TokenFile(directory, meta)
