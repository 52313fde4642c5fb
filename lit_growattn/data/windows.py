"""Token arrays read from files, fixed-length windows over them, and the sampler that draws training windows."""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler


class FileTokens:
    """Tokens [start, stop) of a flat token file, read on demand with positional reads (`os.pread`): nothing of
    the file is held by the process (the OS page cache does the caching), any corpus size costs the same memory,
    and it pickles as its path, so a DataLoader worker started by spawn or forkserver opens the file again.

    Not `np.memmap`, although it reads the same bytes: the pages a mapping touches count towards the process's
    resident memory, and a recent kernel maps a whole large folio (up to 2 MB) for each random window, so the
    peak RSS of a 200-step run grew with its corpus (548 MB at 100 MB, 1378 MB at 1 GB; read: 459, 461 MB).
    """

    def __init__(self, path: str, dtype: str, start: int = 0, stop: int | None = None) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self.start, self.stop = start, os.path.getsize(path) // self.dtype.itemsize if stop is None else stop
        self._file = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("FileTokens supports contiguous slices only")
        if self._file is None:
            self._file = open(self.path, "rb", buffering=0)
        size = self.dtype.itemsize
        data = os.pread(self._file.fileno(), max(stop - start, 0) * size, (self.start + start) * size)
        return np.frombuffer(data, dtype=self.dtype)

    def split(self, cut: int) -> tuple[FileTokens, FileTokens]:
        return (FileTokens(self.path, self.dtype, self.start, self.start + cut),
                FileTokens(self.path, self.dtype, self.start + cut, self.stop))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None}

    def __del__(self) -> None:
        if self._file is not None:
            self._file.close()


class Windows(Dataset):
    """Windows of block_size+1 tokens starting every `stride` tokens; item = (window[:-1], window[1:]).

    `tokens` is anything 1-D that slices: `FileTokens` (only the windows read are read), a numpy array or
    a tensor; a window is copied out as int64 when it is read.
    """

    def __init__(self, tokens, block_size: int, stride: int) -> None:
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return max((len(self.tokens) - self.block_size - 1) // self.stride + 1, 0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        window = torch.as_tensor(np.asarray(self.tokens[start : start + self.block_size + 1], dtype=np.int64))
        return window[:-1], window[1:]


class RandomWindowSampler(DistributedSampler):
    """`samples_per_epoch` random window starts (with replacement), drawn from seed + epoch alone.

    Being a DistributedSampler, Lightning calls its set_epoch every epoch and does not wrap it again
    under DDP; every rank makes the same draw and keeps its own slice of it, so ranks never share a draw.
    """

    def __init__(self, dataset: Dataset, samples_per_epoch: int, seed: int, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, seed=seed)
        self.num_samples = math.ceil(samples_per_epoch / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        starts = torch.randint(len(self.dataset), (self.total_size,), generator=g)
        return iter(starts[self.rank :: self.num_replicas].tolist())


class Concatenated:
    """Several 1-D arrays read as one (length and slices), without copying them together."""

    def __init__(self, parts: list) -> None:
        self.parts = [p for p in parts if len(p)]
        self.ends = np.cumsum([len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.parts) else 0

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("Concatenated supports contiguous slices only")
        pieces, part = [], int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            begin = self.ends[part] - len(self.parts[part])
            end = min(stop, self.ends[part])
            pieces.append(self.parts[part][start - begin : end - begin])
            start, part = end, part + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces or [np.zeros(0, np.uint8)])
