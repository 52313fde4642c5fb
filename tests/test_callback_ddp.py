"""GrowAttentionCallback under 2-rank CPU DDP (gloo): statistics equal to one rank, replicas identical, resume."""

import sys

import lightning as L
import pytest
import torch

from lit_growattn import AtEpochs, AutoSchedule, GrowAttentionCallback, GrowthSettings, StatisticsSettings, StepSearch

from callback_helpers import params, recall_data, tiny_module, trainer

from conftest import REPO, launch


class StatsRecorder(GrowAttentionCallback):
    """Saves the reduced statistics of the growth event and every rank's final parameters."""

    def __init__(self, out: str, **kwargs):
        super().__init__(**kwargs)
        self.out = out

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self.rank = trainer.global_rank

    def _grow(self, trainer, pl_module, point, batch_idx):
        stats = self.window.stats  # reduced when the window closed
        torch.save([s.means() for s in stats], f"{self.out}/stats_{len(stats)}_{self.rank}.pt")
        super()._grow(trainer, pl_module, point, batch_idx)

    def on_train_end(self, trainer, pl_module):
        torch.save(params(pl_module), f"{self.out}/params_{self.rank}.pt")


class SketchSumsRecorder(StatsRecorder):
    """Also saves the reduced sketch sums of the growth event, each with its test matrices."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        torch.save([({name: getattr(s, name) for name in s.names}, dict(s.tests.matrices)) for s in self.window.stats],
                   f"{self.out}/sketch_{self.rank}.pt")
        super()._grow(trainer, pl_module, point, batch_idx)


def _stats_run(out, devices, batch_size, accumulate, grow, recorder=StatsRecorder, **statistics):
    L.seed_everything(0)
    data = recall_data(batch_size=batch_size, examples=16)
    micro_batches = 16 // (batch_size * devices)
    values = dict(value_columns=2) if grow != "query_key" else {}
    recorder = recorder(str(out), schedule=AtEpochs([1]),
                        growth=GrowthSettings(grow=grow, columns=2, method="gradient", **values),
                        statistics=StatisticsSettings(batches=micro_batches, **statistics))
    strategy = "ddp_spawn" if devices > 1 else "auto"
    trainer(out, [recorder], max_epochs=4, devices=devices, strategy=strategy, precision="64-true",
            accumulate_grad_batches=accumulate).fit(tiny_module(data, dropout=0.0), data)


@pytest.mark.parametrize("grow", ["query_key", "both"])
def test_ddp_statistics_equal_single_rank_and_replicas_stay_identical(tmp_path, grow):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    single.mkdir(), ddp.mkdir()
    _stats_run(single, devices=1, batch_size=16, accumulate=1, grow=grow)
    _stats_run(ddp, devices=2, batch_size=4, accumulate=2, grow=grow)
    units = 4 if grow == "both" else 2  # the query/key forms, then the value maps, of the 2 layers
    reference = torch.load(single / f"stats_{units}_0.pt", weights_only=False)
    # Each mean sums the window's 16 sequences, under DDP in another order (2 ranks × 2 micro-batches of 4): a
    # reordered sum of 16 terms is off by at most 16 rounding errors of its largest value (measured: 1.8).
    sequences = 16
    for rank in (0, 1):
        for ref, got in zip(reference, torch.load(ddp / f"stats_{units}_{rank}.pt", weights_only=False), strict=True):
            for name in ("c", "n"):
                want = getattr(ref, name)
                tolerance = sequences * torch.finfo(want.dtype).eps * want.abs().max().item()
                torch.testing.assert_close(getattr(got, name), want, atol=tolerance, rtol=0,
                                           msg=lambda m: f"rank {rank}, {name}: {m}")
    p0, p1 = (torch.load(ddp / f"params_{r}.pt") for r in (0, 1))
    assert p0["model.blocks.0.attn.qk.w_q"].shape[-1] == 4
    assert p0["model.blocks.0.attn.value.w_v"].shape[-1] == (10 if grow == "both" else 8)
    assert all(torch.equal(p0[k], p1[k]) and torch.isfinite(p0[k]).all() for k in p0)


def test_sketch_accumulation_and_ddp(tmp_path):
    """2 ranks × 2 accumulated micro-batches of 4 sequences gather the sketch of one rank's batch of 16: every rank
    draws the same test matrices from the window's seed, the one all-reduce sums the sketches and leaves the test
    matrices as drawn. Fails if the test matrices differ per rank or are all-reduced, or if a rank's sums are
    merged twice or not at all."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    single.mkdir(), ddp.mkdir()
    sketch = dict(recorder=SketchSumsRecorder, sketch="on", sketch_size=4)
    _stats_run(single, devices=1, batch_size=16, accumulate=1, grow="both", **sketch)
    _stats_run(ddp, devices=2, batch_size=4, accumulate=2, grow="both", **sketch)
    reference = torch.load(single / "sketch_0.pt", weights_only=False)
    assert len(reference) == 4 and all("y_sum" in sums for sums, _ in reference)  # 2 forms, 2 value maps
    for rank in (0, 1):
        for (want, want_tests), (got, got_tests) in zip(reference, torch.load(ddp / f"sketch_{rank}.pt",
                                                                              weights_only=False), strict=True):
            assert got_tests.keys() == want_tests.keys()
            assert all(torch.equal(got_tests[name], want_tests[name]) for name in want_tests)
            assert int(got["instances"]) == int(want["instances"]) == 16
            for name in want.keys() - {"instances", "weight"}:
                # The input covariance's sums per sequence, the others per unit of weight (the loss's share, which
                # a rank's mean over 4 sequences and accumulation change), as `means` divides them.
                per = "instances" if name in ("c_sum", "f_sum") else "weight"
                a, b = got[name] / got[per], want[name] / want[per]
                # A sum over the window's 16 sequences, taken in another order: as in the test above.
                tolerance = 16 * torch.finfo(b.dtype).eps * b.abs().max().item()
                torch.testing.assert_close(a, b, atol=tolerance, rtol=0, msg=lambda m: f"rank {rank}, {name}: {m}")


def test_cli_growth_under_ddp_from_the_command_line(tmp_path):
    """With EMA weight averaging too, whose copy of the module must survive DDP's setup and follow each growth."""
    cmd = [sys.executable, "-m", "lit_growattn", "fit", "--config", str(REPO / "configs/mqar_grow.yaml"),
           "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.max_epochs=3",
           "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
           "--trainer.callbacks.init_args.schedule.init_args.epochs=[1, 2]", "--trainer.callbacks.init_args.statistics.batches=2",
           f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.num_train_examples=512",
           "--data.init_args.num_val_examples=64",
           "--trainer.callbacks+=lightning.pytorch.callbacks.EMAWeightAveraging", "--trainer.callbacks.init_args.decay=0.5"]
    done = launch(cmd, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = torch.load(next(tmp_path.rglob("last.ckpt")), map_location="cpu", weights_only=False)
    history = ckpt["callbacks"][next(k for k in ckpt["callbacks"] if k.startswith("GrowAttentionCallback"))]["history"]
    assert [e["epoch"] for e in history] == [1, 2]
    assert ckpt["hyper_parameters"]["d_head"] == [6, 6]  # 2, grown by 2 twice
    # EMA stores its average as the state dict and the live weights beside it: both at the grown size, different.
    live, average = ckpt["current_model_state"], ckpt["state_dict"]
    w_q = next(k for k in live if k.endswith("w_q"))
    assert live[w_q].shape == average[w_q].shape and live[w_q].shape[-1] == 6
    assert not torch.equal(live[w_q], average[w_q])


class SaveParams(L.Callback):
    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        torch.save(params(pl_module), f"{self.out}/params_{trainer.global_rank}.pt")


def _ddp_resume_run(out, ckpt_path=None):
    L.seed_everything(0)
    data = recall_data(batch_size=8)  # 2 ranks × 8 batches of 8 an epoch: the window is batches 5, 6, 7
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=2),
                                 statistics=StatisticsSettings(batches=3))
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(out / "ckpt", filename="{step}", save_top_k=-1,
                                                      every_n_train_steps=1)
    trainer(out, [grow, checkpoints, SaveParams(str(out))], max_epochs=2, devices=2, strategy="ddp_spawn").fit(
        tiny_module(data), data, ckpt_path=ckpt_path)


@pytest.fixture(scope="module")
def ddp_full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_full")
    _ddp_resume_run(out)
    return out


@pytest.mark.parametrize("checkpoint", [
    "step=7.ckpt",  # inside the statistics window: each rank has its own partial sums
    "step=8.ckpt",  # the last batch of the epoch before the growth: the window has closed and been reduced
])
def test_ddp_resume_gives_the_uninterrupted_weights(ddp_full_run, tmp_path, checkpoint):
    _ddp_resume_run(tmp_path, ckpt_path=ddp_full_run / "ckpt" / checkpoint)
    for rank in (0, 1):
        expected, got = (torch.load(d / f"params_{rank}.pt") for d in (ddp_full_run, tmp_path))
        assert got["model.blocks.0.attn.qk.w_q"].shape[-1] == 4
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


# It resumes with a bare trainer on purpose: the refusal comes before any callback state matters.
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning")
def test_per_rank_statistics_refuse_another_world_size(ddp_full_run, tmp_path):
    L.seed_everything(0)
    data = recall_data(batch_size=8)
    with pytest.raises(RuntimeError, match="taken inside the statistics window of growth 'epoch 1' by 2 ranks"):
        trainer(tmp_path, [GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=2),
                                                 statistics=StatisticsSettings(batches=3))], max_epochs=2).fit(
            tiny_module(data), data, ckpt_path=ddp_full_run / "ckpt" / "step=7.ckpt")


class HistorySaver(GrowAttentionCallback):
    def __init__(self, out: str, **kwargs):
        super().__init__(**kwargs)
        self.out = out

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        torch.save(self.history, f"{self.out}/history_{trainer.global_rank}.pt")


def test_resume_on_more_ranks_than_kept_batches_rates_every_candidate(tmp_path):
    """One rank closes its window keeping a single batch; resumed on 2 ranks, rank 1 holds no kept batch and the
    candidates' losses must still be the mean over the kept batch (not 0/0), on both ranks alike."""
    L.seed_everything(0)
    data = recall_data(batch_size=8)  # 1 rank: 16 batches an epoch, checkpoint after the last one (step 16)
    grow = dict(schedule=AtEpochs([1]), growth=GrowthSettings(columns=2), statistics=StatisticsSettings(batches=3),
                step_search=StepSearch(batches=1, alphas=[0.0, 1.0]))
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", filename="{step}", save_top_k=-1,
                                                      every_n_train_steps=16)
    trainer(tmp_path / "one", [HistorySaver(str(tmp_path), **grow), checkpoints], max_epochs=2).fit(
        tiny_module(data), data)
    (tmp_path / "two").mkdir()
    L.seed_everything(0)
    trainer(tmp_path / "two", [HistorySaver(str(tmp_path / "two"), **grow)], max_epochs=2, devices=2,
            strategy="ddp_spawn").fit(tiny_module(data), data, ckpt_path=tmp_path / "ckpt" / "step=16.ckpt")
    uninterrupted = torch.load(tmp_path / "history_0.pt", weights_only=False)[0]
    for rank in (0, 1):
        (event,) = torch.load(tmp_path / "two" / f"history_{rank}.pt", weights_only=False)
        assert event["event"] == "epoch 1"
        assert event["loss_before"] == pytest.approx(uninterrupted["loss_before"], rel=1e-5)
        assert event["alpha"] == uninterrupted["alpha"]


class DecisionRecorder(GrowAttentionCallback):
    """Saves every rank's growth history and final parameters."""

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        torch.save({"history": [{k: v for k, v in e.items() if k not in ("seconds", "timings")} for e in self.history],
                    "params": params(pl_module)}, f"{self.out}/auto_{trainer.global_rank}.pt")


def test_auto_schedule_decides_the_same_on_every_rank_and_stays_within_budget(tmp_path):
    L.seed_everything(0)
    # 2 ranks × 8 batches of 32 an epoch: 16 steps in 2 epochs, a check every 4 from a window of 4 batches a rank;
    # both sides grow from 2 within a KV-cache budget of mean head size 4.
    data = recall_data(batch_size=32, examples=512)
    recorder = DecisionRecorder(AutoSchedule(budget=4, check_every=4, spend_until=1.0),
                                growth=GrowthSettings(grow="both"), statistics=StatisticsSettings(batches=4))
    recorder.out = str(tmp_path)
    trainer(tmp_path, [recorder], max_epochs=2, devices=2, strategy="ddp_spawn").fit(tiny_module(data, d_v=2), data)
    r0, r1 = (torch.load(tmp_path / f"auto_{rank}.pt", weights_only=False) for rank in (0, 1))
    assert r0["history"] == r1["history"] and [e["step"] for e in r0["history"]] == [4, 8, 12]
    assert r0["params"].keys() == r1["params"].keys() and all(torch.equal(r0["params"][k], r1["params"][k])
                                                               for k in r0["params"])
    last = r0["history"][-1]
    sizes = last["d_head"] + last["d_v"]  # every layer has as many key heads as value heads
    assert max(sizes) > 2 and sum(sizes) <= 4 * len(sizes), r0["history"]  # it grew, within a mean head size of 4
    assert {d["side"] for e in r0["history"] for d in e["decisions"]} == {"d_head", "d_v"}
