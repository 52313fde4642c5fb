"""Tokenizers of the text data: raw bytes, or a Hugging Face `tokenizers` model (trained BPE, a file, the hub).

Both kinds answer the same four questions: the vocabulary size, how to encode a batch of texts, how many
bytes of text each token stands for (for bits per byte), and a fingerprint that changes when the tokenizer
does (for the token-file cache).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np


class ByteTokenizer:
    """Tokens are the UTF-8 bytes of the text: vocabulary 256, one byte per token, nothing to train."""

    vocab_size = 256
    fingerprint = "bytes"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=np.int64)


class HFTokenizer:
    """A `tokenizers.Tokenizer`; special tokens are never added, so a text's tokens are its content only."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast leaves out the character offsets, which nothing here reads (a quarter faster).
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """Bytes per token id: exact for byte-level tokenizers (one character of a token string per byte),
        the UTF-8 length of the decoded token otherwise (a leading-space marker may make that one off)."""
        byte_level = (json.loads(self.tokenizer.to_str()).get("decoder") or {}).get("type") == "ByteLevel"
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            token = self.tokenizer.id_to_token(i)
            if token is not None:
                lengths[i] = len(token) if byte_level else len(self.tokenizer.decode([i]).encode("utf-8"))
        return lengths

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        self.tokenizer.save(str(tmp))
        os.replace(tmp, path)  # never a half-written tokenizer under the final name


def train_bpe(texts: Iterator[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenisation): every byte is in the alphabet, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True
    )
    tokenizer.train_from_iterator(texts, trainer)
    return HFTokenizer(tokenizer)


def load_tokenizer(spec: str) -> HFTokenizer:
    """A `tokenizer.json` file (or a folder holding one), else a name on the Hugging Face hub (needs the network)."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer={spec!r} is a directory without a tokenizer.json; give the tokenizer.json file")
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            return HFTokenizer(Tokenizer.from_file(str(path)))
        except Exception as error:
            raise ValueError(f"tokenizer={spec!r} is not a tokenizers JSON file: {error}") from error
    if spec.endswith(".json") or spec.startswith((".", "/", "~")):
        raise FileNotFoundError(f"tokenizer file not found: {spec!r}; give an existing tokenizer.json, 'bytes' or 'bpe'")
    try:
        return HFTokenizer(Tokenizer.from_pretrained(spec))
    except Exception as error:
        raise ValueError(
            f"tokenizer={spec!r} is neither 'bytes', 'bpe', a tokenizer.json file nor a tokenizer loadable from the "
            f"Hugging Face hub ({error})"
        ) from error


def vocabulary(tokenizer) -> dict[str, int] | None:
    """Token → id: what ties a model's embedding rows to a tokenizer, of a ByteTokenizer (None: raw bytes have no
    table), an HFTokenizer or a transformers tokenizer (as InstructDataModule loads it)."""
    if isinstance(tokenizer, ByteTokenizer):
        return None
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    return tokenizer.get_vocab()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 2**8 else np.uint16 if vocab_size <= 2**16 else np.uint32)
