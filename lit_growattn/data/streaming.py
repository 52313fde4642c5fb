"""Training windows packed on the fly from a streamed `datasets.IterableDataset`, for corpora too large to download.

An epoch is `num_windows` windows (the stream is read again from its start when it runs out). Each epoch
reshuffles the stream (`set_epoch`: new shard order and shuffle buffer); under DDP and in DataLoader workers the
rows are split with `split_dataset_by_node`, so no two ranks or workers read the same row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


class StreamingWindows(IterableDataset):
    """(inputs, labels) windows of block_size tokens; consecutive windows share their boundary token."""

    def __init__(self, rows, field: str, suffix: str, tokenizer, block_size: int, num_windows: int,
                 epoch: Callable[[], int]) -> None:
        self.rows, self.field, self.suffix, self.tokenizer = rows, field, suffix, tokenizer
        self.block_size, self.num_windows, self.epoch = block_size, num_windows, epoch

    def __len__(self) -> int:
        return self.num_windows

    def _worker_share(self):
        from datasets.distributed import split_dataset_by_node

        worker = get_worker_info()
        if worker is None or worker.num_workers == 1:
            return self.rows, self.num_windows
        rows = split_dataset_by_node(self.rows, rank=worker.id, world_size=worker.num_workers)
        return rows, len(range(worker.id, self.num_windows, worker.num_workers))

    def __iter__(self):
        rows, num_windows = self._worker_share()
        rows.set_epoch(self.epoch())
        block, produced, buffer = self.block_size, 0, np.zeros(0, dtype=np.int64)
        while produced < num_windows:
            produced_before = produced
            for batch in rows.iter(batch_size=64):
                ids = self.tokenizer.encode_batch([text + self.suffix for text in batch[self.field]])
                buffer = np.concatenate([buffer, *(np.asarray(i, dtype=np.int64) for i in ids)])
                ready = min((len(buffer) - 1) // block, num_windows - produced)
                for i in range(max(ready, 0)):
                    window = torch.from_numpy(buffer[i * block : i * block + block + 1].copy())
                    yield window[:-1], window[1:]
                produced += max(ready, 0)
                buffer = buffer[max(ready, 0) * block :]
                if produced == num_windows:
                    return
            if produced == produced_before:
                raise ValueError(f"the stream has fewer than {block + 1} tokens: no window of block_size={block} fits")
