import math
import random
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from conftest import SHAKESPEARE, needs_shakespeare
from lit_growattn.data import FusedRecallDataModule, MQARDataModule, TextDataModule


def check_mqar(inputs, labels, vocab_size, num_kv_pairs, noise):
    context = 2 * num_kv_pairs
    half = vocab_size // 2
    keys, values = inputs[:, 0:context:2], inputs[:, 1:context:2]
    assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < vocab_size)).all()
    assert (labels[:, :context] == -100).all()
    for x, y, k, v in zip(inputs.tolist(), labels.tolist(), keys.tolist(), values.tolist()):
        assert len(set(k)) == num_kv_pairs
        bound = dict(zip(k, v))
        queried = [t for t in range(context, len(x)) if y[t] != -100]
        assert all((t - context) % 2 == 0 for t in queried)
        assert sorted(x[t] for t in queried) == sorted(k)  # every key queried exactly once
        assert all(y[t] == bound[x[t]] for t in queried)
        if not noise:
            assert all(x[t] == 0 for t in range(context, len(x)) if y[t] == -100)


def tensors(dm):
    return [dm.train_set.tensors] + [ds.tensors for ds in dm.val_sets]


@pytest.mark.parametrize("noise", [False, True])
def test_mqar_labels_are_the_bound_values(noise):
    dm = MQARDataModule(num_train_examples=300, num_val_examples=100, random_non_queries=noise)
    dm.setup("fit")
    inputs, labels = next(iter(dm.train_dataloader()))
    assert inputs.shape == labels.shape == (64, 64) and inputs.dtype == labels.dtype == torch.long
    check_mqar(*dm.train_set.tensors, 256, 8, noise)
    check_mqar(*dm.val_sets[0].tensors, 256, 8, noise)


def test_mqar_power_law_favours_short_gaps():
    dm = MQARDataModule(num_train_examples=2000, power_a=0.01)
    dm.setup()
    first_slot = (dm.train_set.tensors[1][:, 16] != -100).float().mean()
    last_slot = (dm.train_set.tensors[1][:, 62] != -100).float().mean()
    assert first_slot > 3 * last_slot


def test_mqar_deterministic_per_seed_and_splits_differ():
    a, b, c = (MQARDataModule(num_train_examples=200, num_val_examples=200, seed=s) for s in (0, 0, 1))
    for dm in (a, b, c):
        dm.setup("fit")
    for (xa, ya), (xb, yb), (xc, _) in zip(tensors(a), tensors(b), tensors(c)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
    (train_x, _), (val_x, _) = tensors(a)
    assert not (train_x[:, None] == val_x[None]).all(-1).any()  # no validation sequence in training


def test_mqar_eval_length_loader():
    dm = MQARDataModule(num_train_examples=100, num_val_examples=50, batch_size=16, eval_seq_len=128, eval_num_kv_pairs=16)
    assert dm.max_seq_len == 128 and dm.vocab_size == 256 and dm.val_names == ["", "long"]
    dm.setup("fit")
    loaders = dm.val_dataloader()
    assert len(loaders) == 2
    assert next(iter(loaders[0]))[0].shape == (16, 64)
    assert next(iter(loaders[1]))[0].shape == (16, 128)
    check_mqar(*dm.val_sets[1].tensors, 256, 16, noise=True)

    single = MQARDataModule(num_train_examples=100, num_val_examples=50)
    assert single.max_seq_len == 64 and single.val_names == [""]
    single.setup("fit")
    assert isinstance(single.val_dataloader(), torch.utils.data.DataLoader)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_kv_pairs=17), r"seq_len >= 4\*num_kv_pairs = 68; use num_kv_pairs <= 16"),
        (dict(vocab_size=16), r"vocab_size=16 has only 7 .* use num_kv_pairs <= 7 or vocab_size >= 18"),
        (dict(eval_seq_len=20), r"eval_num_kv_pairs=8 does not fit in eval_seq_len=20.*eval_num_kv_pairs <= 5"),
        (dict(eval_num_kv_pairs=200, eval_seq_len=1024), r"eval_num_kv_pairs=200 needs that many distinct keys"),
        (dict(seq_len=0), "seq_len must be positive"),
        (dict(num_kv_pairs=0), "num_kv_pairs must be positive"),
        (dict(num_train_examples=-1), "num_train_examples must be positive"),
        (dict(batch_size=0), "batch_size must be positive"),
        (dict(power_a=0.0), "power_a must be positive"),
        (dict(num_workers=-1), "num_workers must be >= 0"),
    ],
)
def test_mqar_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MQARDataModule(**kwargs)


def epoch_batches(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return [x for x, _ in loader]


def test_mqar_train_order_depends_on_seed_and_epoch_only():
    a, b = MQARDataModule(num_train_examples=256), MQARDataModule(num_train_examples=256)
    a.setup("fit"), b.setup("fit")
    la, lb = a.train_dataloader(), b.train_dataloader()
    assert len(epoch_batches(la, 3)) == len(la) > 0
    assert all(torch.equal(x, y) for x, y in zip(epoch_batches(la, 3), epoch_batches(lb, 3), strict=True))
    assert not torch.equal(epoch_batches(la, 0)[0], epoch_batches(la, 1)[0])

    # Under DDP each rank keeps its own half, deterministically.
    orders = []
    for rank in (0, 1):
        a.trainer = SimpleNamespace(world_size=2, global_rank=rank)
        orders.append(list(a.train_dataloader().sampler))
    assert len(orders[0]) == len(orders[1]) == 128 and sorted(orders[0] + orders[1]) == list(range(256))


def write_text(tmp_path, name="corpus.txt", seed=0):
    """900 bytes below 128 then 100 bytes from 128 up (not valid UTF-8), so each split is recognisable."""
    rng = random.Random(seed)
    data = bytes(rng.randrange(128) for _ in range(900)) + bytes(rng.randrange(128, 256) for _ in range(100))
    path = tmp_path / name
    path.write_bytes(data)
    return path, data


def test_text_windows_and_held_out_split(tmp_path):
    path, data = write_text(tmp_path)
    dm = TextDataModule(path=str(path), block_size=16, batch_size=8)
    assert dm.vocab_size == 256 and dm.max_seq_len == 16 and dm.val_names == [""]
    dm.setup("fit")

    train = list(dm.train_dataloader())
    assert len(train) == math.ceil((900 // 16) / 8)
    for x, y in train:
        assert x.shape == y.shape and x.shape[1] == 16 and x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert (x < 128).all() and (y < 128).all()  # training never reads held-out bytes
        for xi, yi in zip(x.tolist(), y.tolist()):
            assert bytes(xi + yi[-1:]) in data[:900]

    val = list(dm.val_dataloader())
    x, y = torch.cat([b[0] for b in val]), torch.cat([b[1] for b in val])
    assert len(x) == 99 // 16
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert bytes(x.flatten().tolist()) == data[900 : 900 + 16 * len(x)]  # consecutive, non-overlapping
    assert (x >= 128).all() and (y >= 128).all()


def test_text_several_files_and_extra_val_sets(tmp_path):
    path, data = write_text(tmp_path)
    extra = tmp_path / "extra.bin"
    extra.write_bytes(bytes(range(256)) * 2)
    second, second_data = write_text(tmp_path, "second.txt", seed=1)
    dm = TextDataModule(path=[str(path), str(second)], block_size=16, val_paths={"extra": str(extra)})
    assert dm.val_names == ["", "extra"]
    dm.setup("fit")
    # Each file's tail is held out, not only the last file's.
    assert bytes(np.asarray(dm.train_set.tokens[:]).tolist()) == data[:900] + second_data[:900]
    assert bytes(np.asarray(dm.val_sets[0].tokens[:]).tolist()) == data[900:] + second_data[900:]
    loaders = dm.val_dataloader()
    assert len(loaders) == 2
    x = torch.cat([b[0] for b in loaders[1]])
    assert len(x) == (512 - 1) // 16
    assert bytes(x.flatten().tolist()) == extra.read_bytes()[: 16 * len(x)]


def test_text_train_windows_depend_on_seed_and_epoch_only(tmp_path):
    path, _ = write_text(tmp_path)
    a, b, c = (TextDataModule(path=str(path), block_size=16, samples_per_epoch=40, seed=s) for s in (0, 0, 1))
    for dm in (a, b, c):
        dm.setup("fit")
    la, lb, lc = a.train_dataloader(), b.train_dataloader(), c.train_dataloader()
    assert len(list(la.sampler)) == 40
    assert all(torch.equal(x, y) for x, y in zip(epoch_batches(la, 2), epoch_batches(lb, 2), strict=True))
    assert not torch.equal(epoch_batches(la, 0)[0], epoch_batches(la, 1)[0])
    assert not torch.equal(epoch_batches(la, 0)[0], epoch_batches(lc, 0)[0])

    # Under DDP every rank makes the same draw and takes every other window of it.
    single = list(la.sampler)
    ranks = []
    for rank in (0, 1):
        a.trainer = SimpleNamespace(world_size=2, global_rank=rank)
        ranks.append(list(a.train_dataloader().sampler))
    assert ranks[0] == single[0::2] and ranks[1] == single[1::2]


def test_text_bad_inputs(tmp_path):
    path, _ = write_text(tmp_path)
    path = str(path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    short = tmp_path / "short.txt"
    short.write_bytes(b"0123456789")
    cases = [
        (dict(path=str(tmp_path / "missing.txt")), FileNotFoundError, r"missing\.txt.*--data\.path"),
        (dict(path=str(empty)), ValueError, "text file is empty"),
        (dict(), ValueError, "exactly one of"),
        (dict(path=path, hf_dataset="tiny_shakespeare"), ValueError, "exactly one of"),
        (dict(path=path, block_size=100), ValueError, r"validation split .* has 100 bytes: use block_size <= 99"),
        (dict(path=path, val_fraction=0.95, block_size=60), ValueError, r"training split .* has 50 bytes"),
        (dict(path=path, block_size=16, val_fraction=0.0), ValueError, r"val_fraction must be in \(0, 1\)"),
        (dict(path=path, block_size=16, val_fraction=1.0), ValueError, r"val_fraction must be in \(0, 1\)"),
        (dict(path=path, block_size=0), ValueError, "block_size must be positive"),
        (dict(path=path, block_size=16, samples_per_epoch=0), ValueError, "samples_per_epoch must be positive"),
        (dict(path=path, block_size=16, val_paths={"x": str(tmp_path / "nope")}), FileNotFoundError, "--data.val_paths"),
        (dict(path=path, block_size=16, val_paths={"x": str(empty)}), ValueError, "text file is empty"),
        (dict(path=path, block_size=16, val_paths={"x": str(short)}), ValueError, r"val_paths\['x'\].* 10 bytes"),
        (dict(path=path, block_size=16, val_paths={"": str(path)}), ValueError, "names must be non-empty"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            TextDataModule(**kwargs)


@needs_shakespeare
def test_text_tinyshakespeare():
    dm = TextDataModule(path=str(SHAKESPEARE), block_size=128, batch_size=32)
    dm.setup("fit")
    num_val = int(1_115_394 * 0.1)
    assert len(dm.train_set.tokens) == 1_115_394 - num_val
    assert len(dm.train_dataloader()) == math.ceil(((1_115_394 - num_val) // 128) / 32)
    assert len(dm.val_sets[0]) == (num_val - 1) // 128
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (32, 128)


class Recorder(L.LightningModule):
    """Records the training batches seen in each epoch."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).append(batch[0].clone())
        return (self.w - 1).pow(2).sum()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dm, epochs, ckpt_path=None):
    model = Recorder()
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, trainer


@pytest.mark.parametrize("make", [lambda p: MQARDataModule(num_train_examples=192), lambda p: TextDataModule(path=p, block_size=16)])
def test_resumed_run_sees_the_same_batches(tmp_path, make):
    path, _ = write_text(tmp_path)
    full, _ = fit(make(str(path)), epochs=2)
    assert not torch.equal(full[0][0], full[1][0])

    _, trainer = fit(make(str(path)), epochs=1)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed, _ = fit(make(str(path)), epochs=2, ckpt_path=tmp_path / "epoch1.ckpt")
    assert list(resumed) == [1]
    assert all(torch.equal(a, b) for a, b in zip(full[1], resumed[1], strict=True))


# -- fused-pair recall ------------------------------------------------------------------------------


def test_fused_recall_labels_are_the_values_bound_to_the_queried_keys():
    dm = FusedRecallDataModule(num_keys=10, num_values=6, num_kv_pairs=5, num_train_examples=200, num_val_examples=50)
    dm.setup("fit")
    inputs, labels = dm.train_set.tensors
    K, V, P = 10, 6, 5
    assert inputs.shape == labels.shape == (200, 2 * P) and dm.max_seq_len == 2 * P
    assert int(inputs.max()) < dm.vocab_size and int(labels.max()) < dm.vocab_size
    assert (labels[:, :P] == -100).all()
    for row_in, row_lab in zip(inputs, labels):
        pairs = {int(t) // V: int(t) % V for t in row_in[:P]}
        assert len(pairs) == P and (row_in[:P] < K * V).all()
        queried = [int(q) - K * V for q in row_in[P:]]
        assert sorted(queried) == sorted(pairs)
        assert [int(a) - K * V - K for a in row_lab[P:]] == [pairs[k] for k in queried]


def test_fused_recall_is_deterministic_and_rejects_impossible_settings():
    a, b = FusedRecallDataModule(num_train_examples=64), FusedRecallDataModule(num_train_examples=64)
    a.setup("fit"), b.setup("fit")
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert not torch.equal(a.train_set.tensors[0][:50], a.val_sets[0].tensors[0][:50])
    with pytest.raises(ValueError, match="num_kv_pairs=9 needs that many distinct keys but num_keys=8"):
        FusedRecallDataModule(num_keys=8, num_kv_pairs=9)
    with pytest.raises(ValueError, match="num_values must be positive"):
        FusedRecallDataModule(num_values=0)
