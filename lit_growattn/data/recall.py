"""Fused-pair associative recall: the synthetic task where the query/key head size is the bottleneck.

Each key-value pair is ONE token, key·num_values + value, so recall needs no induction head: a query token
(one per key) must attend to the pair token holding its key, and the value is read from that token.
The query/key form then has to separate `num_keys` keys by their scores; a rank-d form can place at most
d keys orthogonally, so a small static d_head stays clearly below a large one (studies/growth_pays/README.md, "Where d_k matters").
Without attention the readout has to decode the value from a bag of all pairs, which fails once the pairs
outnumber what the embedding can superpose.

    inputs:  (k3,v1) (k0,v7) (k5,v2) … | q5  q3  q0 …
    labels:     -       -       -    … | v2  v1  v7 …      (- is -100)

Token ids: pair tokens 0..K·V-1, query tokens K·V..K·V+K-1, value (label) tokens K·V+K..K·V+K+V-1.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from lit_growattn.data.base import BaseDataModule
from lit_growattn.data.mqar import _distinct_uniform, _generator


def fused_recall(num_examples: int, num_keys: int, num_values: int, num_kv_pairs: int, g: torch.Generator):
    """Returns (inputs, labels), both (num_examples, 2·num_kv_pairs) int64; every pair is queried once."""
    keys = _distinct_uniform(num_examples, num_keys, num_kv_pairs, g)
    values = torch.randint(num_values, (num_examples, num_kv_pairs), generator=g)
    order = torch.rand(num_examples, num_kv_pairs, generator=g).argsort(1)
    pairs = keys * num_values + values
    queries = num_keys * num_values + keys.gather(1, order)
    answers = num_keys * num_values + num_keys + values.gather(1, order)
    inputs = torch.cat([pairs, queries], dim=1)
    labels = torch.cat([torch.full_like(pairs, -100), answers], dim=1)
    return inputs, labels


class FusedRecallDataModule(BaseDataModule):
    """Fused-pair associative recall, generated once in `setup` from `seed`.

    Args:
        num_keys: distinct keys; the query/key form must tell this many apart.
        num_values: distinct values.
        num_kv_pairs: pairs per sequence (distinct keys), each queried once; sequences have 2·num_kv_pairs tokens.
        num_train_examples, num_val_examples: sequences per split.
        batch_size: sequences per batch, per device.
        seed: seeds the data and the training order (which also depends on the epoch only).
        num_workers: DataLoader worker processes.
    """

    val_names = [""]

    def __init__(
        self,
        num_keys: int = 32,
        num_values: int = 16,
        num_kv_pairs: int = 16,
        num_train_examples: int = 50_000,
        num_val_examples: int = 2_000,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        sizes = dict(num_keys=num_keys, num_values=num_values, num_kv_pairs=num_kv_pairs,
                     num_train_examples=num_train_examples, num_val_examples=num_val_examples, batch_size=batch_size)
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if num_kv_pairs > num_keys:
            raise ValueError(
                f"num_kv_pairs={num_kv_pairs} needs that many distinct keys but num_keys={num_keys}: "
                f"use num_kv_pairs <= {num_keys} or raise num_keys"
            )
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.num_keys, self.num_values, self.num_kv_pairs = num_keys, num_values, num_kv_pairs
        self.num_train_examples, self.num_val_examples = num_train_examples, num_val_examples
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers

    @property
    def vocab_size(self) -> int:
        return self.num_keys * self.num_values + self.num_keys + self.num_values

    @property
    def max_seq_len(self) -> int:
        return 2 * self.num_kv_pairs

    def _generate(self, num_examples: int, stream: int) -> TensorDataset:
        args = (self.num_keys, self.num_values, self.num_kv_pairs, _generator(self.seed, stream))
        return TensorDataset(*fused_recall(num_examples, *args))

    def setup(self, stage: str | None = None) -> None:
        self.train_set = self._generate(self.num_train_examples, stream=0)
        self.val_sets = [self._generate(self.num_val_examples, stream=1)]
