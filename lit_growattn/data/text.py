"""Byte-level language modelling: tokens are raw bytes (vocabulary 256), so any file works, UTF-8 or not."""

import math
import os

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit_growattn.data.base import BaseDataModule


class _Windows(Dataset):
    """Windows of block_size+1 bytes starting every `stride` bytes; item = (window[:-1], window[1:])."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int) -> None:
        self.data, self.block_size, self.stride = data, block_size, stride

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[i * self.stride : i * self.stride + self.block_size + 1].long()
        return window[:-1], window[1:]


class _RandomWindowSampler(DistributedSampler):
    """`samples_per_epoch` random window starts (with replacement), drawn from seed + epoch alone.

    Being a DistributedSampler, Lightning calls its set_epoch every epoch and does not wrap it again
    under DDP; every rank makes the same draw and keeps its own slice of it.
    """

    def __init__(self, dataset: Dataset, samples_per_epoch: int, seed: int, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, seed=seed)
        self.num_samples = math.ceil(samples_per_epoch / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        starts = torch.randint(len(self.dataset), (self.total_size,), generator=g)
        return iter(starts[self.rank :: self.num_replicas].tolist())


def _check_file(path: str, flag: str) -> int:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file not found: {path!r}; pass an existing file with {flag}")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"text file is empty: {path!r} ({flag})")
    return size


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor; a single part stays a view (no copy of a large corpus)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _read(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


class TextDataModule(BaseDataModule):
    """Byte-level text: random training windows, consecutive validation windows.

    The last `val_fraction` of the bytes of each file is held out.
    Validation walks the held-out bytes in consecutive windows
    (every byte predicted once); each file in `val_paths` is evaluated whole the same way, as its
    own loader named by its key. Training draws `samples_per_epoch` windows at random offsets,
    the same ones for the same (seed, epoch).

    Args:
        path: Local text file, or several files read one after another. Give this or `hf_dataset`.
        hf_dataset: Hub dataset name for `datasets.load_dataset`, used instead of `path`.
        hf_split: Split of `hf_dataset` to load.
        hf_text_field: Column holding the text in `hf_dataset`; rows are joined with blank lines.
        block_size: Tokens per sequence.
        val_fraction: Fraction of each file's bytes, taken from its end, held out for validation.
        val_paths: Extra validation sets, name -> local file; logged as val/<name>/loss.
        batch_size: Sequences per batch, per device.
        samples_per_epoch: Training windows per epoch (None: training bytes // block_size).
        seed: Seeds the training windows, which depend on (seed, epoch) only.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        path: str | list[str] | None = None,
        hf_dataset: str | None = None,
        hf_split: str = "train",
        hf_text_field: str = "text",
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
        for name, value in dict(block_size=block_size, batch_size=batch_size, samples_per_epoch=samples_per_epoch).items():
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.paths = [path] if isinstance(path, str) else path
        self.hf_dataset, self.hf_split, self.hf_text_field = hf_dataset, hf_split, hf_text_field
        self.block_size = block_size
        self.val_fraction = val_fraction
        self.val_paths = dict(val_paths or {})
        self.batch_size = batch_size
        self.samples_per_epoch = samples_per_epoch
        self.seed = seed
        self.num_workers = num_workers

        if self.paths is not None:
            self._held_out([_check_file(p, "--data.path") for p in self.paths])
        for name, val_path in self.val_paths.items():
            if not name:
                raise ValueError('val_paths names must be non-empty: "" is the held-out split of the training text')
            self._check_block_fits(_check_file(val_path, "--data.val_paths"), f"val_paths[{name!r}] ({val_path})")

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def max_seq_len(self) -> int:
        return self.block_size

    @property
    def val_names(self) -> list[str]:
        return ["", *self.val_paths]

    def _check_block_fits(self, num_bytes: int, what: str) -> None:
        if num_bytes < self.block_size + 1:
            raise ValueError(
                f"block_size={self.block_size} needs windows of {self.block_size + 1} bytes but {what} has "
                f"{num_bytes} bytes: use block_size <= {num_bytes - 1} or more text"
            )

    def _held_out(self, sizes: list[int]) -> list[int]:
        """Held-out bytes per file (or hub dataset), checked to leave a window's worth on both sides in total."""
        num_val = [int(n * self.val_fraction) for n in sizes]
        what = f"of the {sum(sizes)} bytes with val_fraction={self.val_fraction}"
        self._check_block_fits(sum(sizes) - sum(num_val), f"the training split {what}")
        self._check_block_fits(sum(num_val), f"the validation split {what}")
        return num_val

    def _load_hf(self) -> torch.Tensor:
        from datasets import load_dataset

        ds = load_dataset(self.hf_dataset, split=self.hf_split)
        if self.hf_text_field not in ds.column_names:
            raise ValueError(f"hf_text_field={self.hf_text_field!r} is not a column of {self.hf_dataset}: {ds.column_names}")
        text = "\n\n".join(ds[self.hf_text_field]).encode("utf-8")
        if not text:
            raise ValueError(f"{self.hf_dataset} (split {self.hf_split!r}) has no text in column {self.hf_text_field!r}")
        return torch.frombuffer(bytearray(text), dtype=torch.uint8)

    def prepare_data(self) -> None:
        if self.hf_dataset is not None:
            self._load_hf()  # download once, on one process; setup reads the cache on every rank

    def setup(self, stage: str | None = None) -> None:
        texts = [self._load_hf()] if self.hf_dataset is not None else [_read(p) for p in self.paths]
        cuts = [len(t) - n for t, n in zip(texts, self._held_out([len(t) for t in texts]))]
        self.train_set = _Windows(_join([t[:c] for t, c in zip(texts, cuts)]), self.block_size, stride=1)
        held_out = _join([t[c:] for t, c in zip(texts, cuts)])
        self.val_sets = [_Windows(held_out, self.block_size, stride=self.block_size)]
        self.val_sets += [_Windows(_read(p), self.block_size, stride=self.block_size) for p in self.val_paths.values()]

    def train_dataloader(self) -> DataLoader:
        world_size, rank = self._replicas()
        samples = self.samples_per_epoch or len(self.train_set.data) // self.block_size
        return self._train_loader(_RandomWindowSampler(self.train_set, samples, self.seed, num_replicas=world_size, rank=rank))
