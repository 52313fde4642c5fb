"""Loaders shared by the data modules."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lit_growattn.training.lightning_private import batches_done_in_epoch


class ResumableLoader(DataLoader):
    """A training DataLoader that Lightning saves in checkpoints and restores (it has `state_dict` and
    `load_state_dict`), so a run resumed from a mid-epoch checkpoint continues with the next unseen batch
    instead of replaying the epoch from its start: a growth's statistics window may span such a checkpoint.

    The sampler must have `epoch` and `set_epoch` (a DistributedSampler). `position()` is (epoch, batches of
    it the trainer has finished); it comes from the trainer, not from this loader, because Lightning fetches one
    batch ahead. An epoch whose batches are all done is given as the start of the next one, where a resumed run
    continues (Lightning does not call `set_epoch` again when it resumes from an epoch's last batch).
    """

    def __init__(self, *args, position, **kwargs):
        super().__init__(*args, **kwargs)
        self._position, self._skip = position, 0

    def __iter__(self):
        iterator = super().__iter__()
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            next(iterator)
        return iterator

    def state_dict(self) -> dict:
        epoch, done = self._position()
        return {"epoch": epoch, "batches_done": done}

    def load_state_dict(self, state: dict) -> None:
        # Lightning creates the resumed iterator before it sets the sampler's epoch: set it here.
        self.sampler.set_epoch(state["epoch"])
        self._skip = state["batches_done"]


class BaseDataModule(L.LightningDataModule):
    """Subclasses fill `self.train_set` and `self.val_sets` (one dataset per name in `val_names`) in `setup`
    and set `batch_size`, `num_workers` and `seed`. The held-out sets serve validation and test alike.
    `collate` (None: the default collation) builds batches from lists of examples."""

    collate = None

    def train_dataloader(self) -> DataLoader:
        # A DistributedSampler shuffles with a generator seeded by seed + epoch, so the order depends on
        # (seed, epoch) alone and a resumed run replays it; Lightning calls its set_epoch every epoch and,
        # seeing a DistributedSampler, does not wrap it again under DDP.
        world_size, rank = self._replicas()
        sampler = DistributedSampler(self.train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=self.seed)
        return self._train_loader(sampler)

    def _replicas(self) -> tuple[int, int]:
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)

    def _train_loader(self, sampler: Sampler) -> ResumableLoader:
        return ResumableLoader(
            self.train_set, self.batch_size, sampler=sampler, num_workers=self.num_workers,
            collate_fn=self.collate, position=self._position,
        )

    def _position(self) -> tuple[int, int]:
        if not self.trainer:
            return 0, 0
        epoch, done = self.trainer.current_epoch, batches_done_in_epoch(self.trainer)
        return (epoch + 1, 0) if done >= self.trainer.num_training_batches else (epoch, done)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        loaders = [DataLoader(ds, self.batch_size, num_workers=self.num_workers, collate_fn=self.collate)
                   for ds in self.val_sets]
        return loaders if len(loaders) > 1 else loaders[0]

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        return self.val_dataloader()
