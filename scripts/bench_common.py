"""What scripts/bench.py (CPU) and scripts/bench_gpu.py (GPU, bf16) share: the model and the data they time, a
step timer under Lightning, the same steps in a plain PyTorch loop, and a stdout that holds only the JSON result."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lit_growattn.module import GrowAttentionLM  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels are asynchronous: time the work, not the launch


def make_lm(seed: int = 0, cls: type[GrowAttentionLM] = GrowAttentionLM, **sizes) -> GrowAttentionLM:
    """The timed model (`sizes`: GrowAttentionLM's arguments). A constant schedule without warm-up, so that the
    plain loop can run the module's own LambdaLR without a trainer."""
    torch.manual_seed(seed)
    return cls(lr_schedule="constant", warmup_steps=0, **sizes)


def token_data(vocab: int, seq_len: int, batch: int, n_batches: int, seed: int = 0) -> TensorDataset:
    """Random next-token data, labels the inputs shifted by one: the cost of a step does not depend on the values."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (n_batches * batch, seq_len + 1), generator=g)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


class StepTimer(Callback):
    """Wall time of each step of epoch `epoch` (None: of every epoch), from one batch start to the next (the last to
    the epoch's end): the whole Lightning loop per step (hooks, training_step with its logging and metrics,
    backward, optimizer, scheduler, fetch of the next batch)."""

    def __init__(self, device: torch.device, epoch: int | None = None):
        self.device, self.epoch, self.stamps = device, epoch, []

    def stamp(self, trainer) -> None:
        if self.epoch in (None, trainer.current_epoch):
            sync(self.device)
            self.stamps.append(time.perf_counter())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.stamp(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self.stamp(trainer)

    def step_times(self, skip: int = 0) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])][skip:]


def plain_step_times(lm: GrowAttentionLM, loader: DataLoader, device: torch.device, bf16: bool, skip: int) -> list[float]:
    """The steps of `lm` in a plain PyTorch loop: the module's own loss, optimizer, parameter groups and schedule,
    no Lightning; the time of each step after the first `skip`."""
    lm.to(device)
    config = lm.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    stamps = []
    for inputs, labels in loader:
        sync(device)
        stamps.append(time.perf_counter())
        inputs, labels = inputs.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = lm.loss(lm(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
    sync(device)
    stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])][skip:]


@contextlib.contextmanager
def json_only_stdout() -> Iterator[None]:
    """Only the JSON result goes to stdout: Lightning's banners and warnings are silenced or sent to stderr."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.redirect_stdout(sys.stderr):
        yield
