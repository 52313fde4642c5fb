"""GrowAttentionCallback end to end on CPU: growth events, optimizer carry-over, DDP, resume, bad input."""

import math
import subprocess
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import FSDPStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_growattn.attention import ATTENTIONS, QKForm
from lit_growattn.callbacks import GrowAttentionCallback
from lit_growattn.data import FusedRecallDataModule
from lit_growattn.module import GrowAttentionLM

from conftest import REPO, scalar_tags

GROWTH_TAGS = {
    "growth/d_head/layer_0", "growth/d_head/layer_1", "growth/alpha", "growth/sign_fallbacks",
    "growth/predicted_decrease", "growth/realised_decrease", "growth/seconds",
    "growth/discarded_energy/layer_0", "growth/discarded_energy/layer_1",
    "compute/loss_vs_tokens", "compute/loss_vs_flops",
}


def recall_data(batch_size=16, examples=128, seed=0) -> FusedRecallDataModule:
    return FusedRecallDataModule(num_keys=8, num_values=4, num_kv_pairs=4, num_train_examples=examples,
                                 num_val_examples=32, batch_size=batch_size, seed=seed)


def tiny_module(data, **kwargs) -> GrowAttentionLM:
    args = dict(n_layer=2, n_head=2, n_embd=16, d_head=2, d_v=8, warmup_steps=0, lr_schedule="cosine")
    return GrowAttentionLM(vocab_size=data.vocab_size, block_size=data.max_seq_len, **{**args, **kwargs})


def trainer(tmp_path, callbacks, max_epochs=3, **kwargs) -> L.Trainer:
    args = dict(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=TensorBoardLogger(tmp_path, name="run"),
                enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
                deterministic=True)
    return L.Trainer(callbacks=callbacks, **{**args, **kwargs})


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


# -- a growth run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["natural", "pinv", "gradient", "zero"])
def test_growth_run_grows_logs_and_never_raises_the_eval_loss(tmp_path, method):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(grow_at_epochs=[1, 2], grow_by=[2, 1], method=method, stats_batches=4)
    trainer(tmp_path, [grow]).fit(module, data)
    assert module.model.head_sizes() == [6, 4] and module.hparams.d_head == [6, 4]
    assert [e["epoch"] for e in grow.history] == [1, 2] and not any(e["skipped"] for e in grow.history)
    # α = 0 is a candidate and keeps the function, so the chosen step never raises the loss it was chosen on.
    assert all(e["realised_decrease"] >= -1e-6 for e in grow.history)
    assert GROWTH_TAGS <= scalar_tags(tmp_path)
    acc = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*"))), size_guidance={"images": 0})
    acc.Reload()
    assert {"growth/spectrum/epoch_1", "growth/spectrum/epoch_2"} <= set(acc.Tags()["images"])
    assert all(math.isfinite(trainer_metric) for trainer_metric in [e["predicted_decrease"] for e in grow.history])


def test_growth_checkpoint_loads_for_validate_and_test(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    grow = GrowAttentionCallback(grow_at_epochs=[1], grow_by=3, stats_batches=2)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, [grow, checkpoint], max_epochs=2).fit(tiny_module(data), data)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    loaded = GrowAttentionLM.load_from_checkpoint(ckpt)
    assert loaded.model.head_sizes() == [5, 5]
    t = trainer(tmp_path / "eval", [])
    assert "val/loss" in t.validate(tiny_module(data), data, ckpt_path=ckpt)[0]
    assert "test/loss" in t.test(loaded, data)[0]


# -- optimizer and scheduler carry-over ---------------------------------------------------------------
class CarryProbe(GrowAttentionCallback):
    """Keeps the optimizer state just before and just after the rebuild."""

    def _apply(self, trainer, pl_module, forms, grown):
        opt = trainer.optimizers[0]
        self.before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in pl_module.named_parameters()}
        self.sched_before = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        self.lrs_before = [g["lr"] for g in opt.param_groups]
        super()._apply(trainer, pl_module, forms, grown)
        new = trainer.optimizers[0]
        self.after = {n: {k: v.clone() for k, v in new.state[p].items()} if p in new.state else None
                      for n, p in pl_module.named_parameters()}
        self.param_groups = new.param_groups
        self.names = {id(p): n for n, p in pl_module.named_parameters()}
        self.sched_after = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        self.lrs_after = [g["lr"] for g in new.param_groups]


@pytest.mark.parametrize("temperature", ["keep", "rescale"])
def test_append_carries_adam_moments_step_and_schedule(tmp_path, temperature):
    L.seed_everything(0)
    data = recall_data()
    probe = CarryProbe(grow_at_epochs=[1], grow_by=2, mode="append", temperature=temperature, stats_batches=2)
    trainer(tmp_path, [probe], max_epochs=2).fit(tiny_module(data), data)
    c = (4 / 2) ** 0.25 if temperature == "rescale" else 1.0  # τ′ = τ√(d/d′) → old columns × (τ/τ′)^½
    for name in ("model.blocks.0.attn.qk.w_q", "model.blocks.1.attn.qk.w_k"):
        old, new = probe.before[name], probe.after[name]
        torch.testing.assert_close(new["exp_avg"][..., :2], old["exp_avg"] / c)
        torch.testing.assert_close(new["exp_avg_sq"][..., :2], old["exp_avg_sq"] / c**2)
        assert torch.equal(new["step"], old["step"])
        assert (new["exp_avg"][..., 2:] == 0).all()
    assert probe.sched_after["last_epoch"] == probe.sched_before["last_epoch"]
    assert probe.lrs_after == probe.lrs_before
    no_decay = {probe.names[id(p)] for g in probe.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert {"model.blocks.0.attn.qk.log_tau", "model.blocks.1.attn.qk.log_tau"} <= no_decay


def test_replace_resets_the_rotated_tensors(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    probe = CarryProbe(grow_at_epochs=[1], grow_by=2, mode="replace", stats_batches=2)
    trainer(tmp_path, [probe], max_epochs=2).fit(tiny_module(data), data)
    assert probe.after["model.blocks.0.attn.qk.w_q"] is None  # Adam starts these afresh, step included
    assert probe.after["model.blocks.0.attn.v.weight"] is not None


# -- DDP ----------------------------------------------------------------------------------------------
class StatsRecorder(GrowAttentionCallback):
    """Saves the reduced statistics of the growth event and every rank's final parameters."""

    def __init__(self, out: str, **kwargs):
        super().__init__(**kwargs)
        self.out = out

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self.rank = trainer.global_rank

    def _plan(self, forms, stats, epoch):
        torch.save([s.means() for s in stats], f"{self.out}/stats_{len(stats)}_{self.rank}.pt")
        return super()._plan(forms, stats, epoch)

    def on_train_end(self, trainer, pl_module):
        torch.save(params(pl_module), f"{self.out}/params_{self.rank}.pt")


def _stats_run(out, devices, batch_size, accumulate):
    L.seed_everything(0)
    data = recall_data(batch_size=batch_size, examples=16)
    micro_batches = 16 // (batch_size * devices)
    recorder = StatsRecorder(str(out), grow_at_epochs=[1], grow_by=2, method="gradient", stats_batches=micro_batches)
    strategy = "ddp_spawn" if devices > 1 else "auto"
    trainer(out, [recorder], max_epochs=4, devices=devices, strategy=strategy, precision="64-true",
            accumulate_grad_batches=accumulate).fit(tiny_module(data, dropout=0.0), data)


def test_ddp_statistics_equal_single_rank_and_replicas_stay_identical(tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    single.mkdir(), ddp.mkdir()
    _stats_run(single, devices=1, batch_size=16, accumulate=1)
    _stats_run(ddp, devices=2, batch_size=4, accumulate=2)
    reference = torch.load(single / "stats_2_0.pt", weights_only=False)
    for rank in (0, 1):
        for ref, got in zip(reference, torch.load(ddp / f"stats_2_{rank}.pt", weights_only=False)):
            torch.testing.assert_close(got.c, ref.c, atol=1e-6, rtol=0)
            torch.testing.assert_close(got.n, ref.n, atol=1e-6, rtol=0)
    p0, p1 = (torch.load(ddp / f"params_{r}.pt") for r in (0, 1))
    assert p0["model.blocks.0.attn.qk.w_q"].shape[-1] == 4
    assert all(torch.equal(p0[k], p1[k]) and torch.isfinite(p0[k]).all() for k in p0)


def test_cli_growth_under_ddp_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "lit_growattn", "fit", "--config", str(REPO / "configs/mqar_grow.yaml"),
           "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.max_epochs=3",
           "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
           "--trainer.callbacks.init_args.grow_at_epochs=[1, 2]", "--trainer.callbacks.init_args.stats_batches=2",
           f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.num_train_examples=512",
           "--data.init_args.num_val_examples=64"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = torch.load(next(tmp_path.rglob("last.ckpt")), map_location="cpu", weights_only=False)
    history = ckpt["callbacks"][next(k for k in ckpt["callbacks"] if k.startswith("GrowAttentionCallback"))]["history"]
    assert [e["epoch"] for e in history] == [1, 2]
    assert ckpt["hyper_parameters"]["d_head"] == [6, 6]  # 2, grown by 2 twice


# -- resume -------------------------------------------------------------------------------------------
def _resume_run(tmp_path, max_epochs, ckpt_path=None):
    L.seed_everything(0)
    data = recall_data()  # 8 batches an epoch: the statistics window is batches 5, 6, 7 of epoch 0
    grow = GrowAttentionCallback(grow_at_epochs=[1], grow_by=2, stats_batches=3)
    every_epoch = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    inside_window = L.pytorch.callbacks.ModelCheckpoint(
        tmp_path / "ckpt", filename="{step}", save_top_k=-1, every_n_train_steps=7
    )
    callbacks = [grow, every_epoch, inside_window]
    module = tiny_module(data)
    trainer(tmp_path, callbacks, max_epochs=max_epochs).fit(module, data, ckpt_path=ckpt_path)
    return params(module), grow


@pytest.mark.parametrize(
    "checkpoint", ["step=7.ckpt", "epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "step=21.ckpt"],
    ids=["inside_statistics_window", "between_window_and_growth", "after_growth", "mid_epoch_after_growth"],
)
def test_resume_gives_the_uninterrupted_weights_and_grows_once(tmp_path, checkpoint):
    full, grow_full = _resume_run(tmp_path / "full", max_epochs=4)
    ckpt = tmp_path / "full" / "ckpt" / checkpoint
    resumed, grow_resumed = _resume_run(tmp_path / "resumed", max_epochs=4, ckpt_path=ckpt)
    assert [e["epoch"] for e in grow_resumed.history] == [1]
    assert full.keys() == resumed.keys()
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], atol=1e-6, rtol=0)


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(grow_at_epochs=[0, 2]), "growth at epoch 0"),
        (dict(grow_at_epochs=[2, 2]), "repeats an epoch"),
        (dict(grow_at_epochs=[1], grow_by=0), "grow_by must be positive"),
        (dict(grow_at_epochs=[1], grow_by=[1, -1]), "grow_by must be positive"),
        (dict(grow_at_epochs=[1], method="svd"), "method must be one of"),
        (dict(grow_at_epochs=[1], method="random", mode="replace"), "needs mode='append'"),
        (dict(grow_at_epochs=[1], alphas=[-1.0]), "non-empty list of values ≥ 0"),
        (dict(grow_at_epochs=[1], alphas=[]), "non-empty list of values ≥ 0"),
        (dict(grow_at_epochs=[1], stats_batches=0), "stats_batches must be positive"),
        (dict(grow_at_epochs=[1], stats_batches=2, line_search_batches=3), "line_search_batches ≤ stats_batches"),
        (dict(grow_at_epochs=[1], dynamic_rank=1.5), "dynamic_rank is a fraction"),
        (dict(grow_at_epochs=[1], layers=[]), "layers must list each layer to grow once"),
        (dict(grow_at_epochs=[1], layers=[0, 0]), "layers must list each layer to grow once"),
        (dict(grow_at_epochs=[1], layers_per_step=0), "layers_per_step must be positive"),
    ],
)
def test_bad_callback_arguments_fail_with_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GrowAttentionCallback(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_d_head=1), r"max_d_head=1 must lie between the current head size \(2\)"),
        (dict(max_d_head=17), r"max_d_head=17 must lie between .* input size \(16"),
        (dict(layers=[5]), r"layers \[5\] do not exist"),
        (dict(grow_by=[1, 1, 1]), "grow_by has 3 entries but the model has 2 layers"),
        (dict(stats_batches=100), "stats_batches=100 is more than an epoch"),
    ],
)
def test_impossible_schedules_fail_before_training(tmp_path, kwargs, message):
    data = recall_data()
    module = tiny_module(data)
    before = params(module)
    with pytest.raises(ValueError, match=message):
        trainer(tmp_path, [GrowAttentionCallback(grow_at_epochs=[1], **kwargs)]).fit(module, data)
    assert all(torch.equal(before[k], v) for k, v in params(module).items())


def test_step_sizes_without_zero_warn():
    with pytest.warns(UserWarning, match="has no 0: a growth may then raise the loss"):
        GrowAttentionCallback(grow_at_epochs=[1], alphas=[0.5, 1.0])


def test_dynamic_rank_chooses_the_growth_from_the_spectrum(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(grow_at_epochs=[1], dynamic_rank=0.05, max_d_head=10, stats_batches=3)
    trainer(tmp_path, [grow], max_epochs=2).fit(module, data)
    sizes = module.model.head_sizes()
    assert all(3 <= d <= 10 for d in sizes), sizes  # at least one new column, at most max_d_head
    assert max(sizes) > 3, sizes  # more than one column somewhere: grow_by does not cap a dynamic growth


def test_epoch_past_max_epochs_warns(tmp_path):
    data = recall_data()
    with pytest.warns(UserWarning, match="grow_at_epochs has epoch 5 but max_epochs=2"):
        trainer(tmp_path, [GrowAttentionCallback(grow_at_epochs=[1, 5], stats_batches=2)], max_epochs=2).fit(
            tiny_module(data), data)


class NoQK(torch.nn.Module):
    """An attention variant without a growable query/key pair."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.proj = torch.nn.Linear(cfg.n_embd, cfg.n_embd)

    def qk_forms(self):
        return []

    def forward(self, x):
        return self.proj(x)


def test_growth_on_attention_without_qk_pair_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(ATTENTIONS, "noqk", NoQK)
    data = recall_data()
    with pytest.raises(ValueError, match="attention 'noqk' has no growable query/key pair"):
        trainer(tmp_path, [GrowAttentionCallback(grow_at_epochs=[1])]).fit(tiny_module(data, attention="noqk"), data)


def test_sharded_strategies_are_refused_at_setup():
    fake = SimpleNamespace(strategy=FSDPStrategy.__new__(FSDPStrategy), global_rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="not FSDPStrategy: FSDP and DeepSpeed shard parameters"):
        GrowAttentionCallback(grow_at_epochs=[1]).setup(fake, None, "fit")


def test_nonfinite_statistics_skip_the_growth_and_training_goes_on(tmp_path, monkeypatch):
    record = QKForm._record
    monkeypatch.setattr(QKForm, "_record", lambda self, xa, gx: record(self, xa, gx * float("nan")))
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(grow_at_epochs=[1], stats_batches=2)
    with pytest.warns(UserWarning, match="growth at epoch 1 skipped"):
        trainer(tmp_path, [grow], max_epochs=2).fit(module, data)
    assert grow.history == [{"epoch": 1, "skipped": True}]
    assert module.model.head_sizes() == [2, 2]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert "growth/skipped" in scalar_tags(tmp_path)


# -- 16-mixed: the GradScaler's factor is taken out of the statistics, overflowed steps are dropped -----
class WindowRecorder(GrowAttentionCallback):
    """The statistics handed to the growth (means and how many instances and steps they hold)."""

    def _plan(self, forms, stats, epoch):
        self.seen = [(s.means(), int(s.instances), float(s.weight)) for s in stats]
        return super()._plan(forms, stats, epoch)


def _window_run(tmp_path, init_scale=None, batches=4):
    L.seed_everything(0)
    data = recall_data(batch_size=16, examples=16 * batches)
    recorder = WindowRecorder(grow_at_epochs=[1], grow_by=2, method="gradient", stats_batches=batches)
    plugins = [] if init_scale is None else [
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]
    module = tiny_module(data, dropout=0.0)
    trainer(tmp_path, [recorder], max_epochs=2, plugins=plugins).fit(module, data)
    return recorder, module


def test_16_mixed_statistics_are_unscaled(tmp_path):
    reference, _ = _window_run(tmp_path / "fp32")
    scaled, module = _window_run(tmp_path / "fp16", init_scale=2.0**12)
    for (ref, _, _), (got, instances, weight) in zip(reference.seen, scaled.seen):
        assert (instances, weight) == (64, 4.0)  # no step overflowed at this scale
        # fp16 rounding moves single entries; a scale left in would be off by the factor 4096.
        assert (got.n - ref.n).norm() < 0.01 * ref.n.norm()
    assert module.model.head_sizes() == [4, 4]


def test_16_mixed_overflowed_steps_are_dropped_not_poisoning(tmp_path):
    # Starting at 2^30 the scaler overflows and halves its scale for several steps before the gradients fit.
    recorder, module = _window_run(tmp_path / "partial", init_scale=2.0**30, batches=24)
    for means, instances, weight in recorder.seen:
        assert 0 < weight < 24 and instances == 16 * weight
        assert all(torch.isfinite(m).all() for m in means if m is not None)
    assert module.model.head_sizes() == [4, 4]
    # A window made only of overflowed steps leaves nothing to grow from: the growth is skipped, training goes on.
    recorder, module = _window_run(tmp_path / "all", init_scale=2.0**60, batches=2)
    assert recorder.history == [{"epoch": 1, "skipped": True}] and module.model.head_sizes() == [2, 2]


def test_16_mixed_layer_without_finite_statistics_keeps_its_size_and_the_others_grow(tmp_path, monkeypatch):
    L.seed_everything(0)
    data = recall_data(batch_size=16, examples=64)
    module = tiny_module(data, dropout=0.0)
    overflowing = module.model.blocks[0].attn.qk
    record = QKForm._record
    monkeypatch.setattr(QKForm, "_record", lambda self, xa, gx: record(self, xa, gx * float("inf") if self is overflowing else gx))
    grow = GrowAttentionCallback(grow_at_epochs=[1], grow_by=2, stats_batches=2)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))]
    with pytest.warns(UserWarning, match=r"layers \[0\] have no finite statistics"):
        trainer(tmp_path, [grow], max_epochs=2, plugins=plugins).fit(module, data)
    assert module.model.head_sizes() == [2, 4] and not grow.history[0]["skipped"]


# -- round-robin layers: each statistics step captures only some layers ---------------------------------
def _round_robin_run(tmp_path, stats_batches, layers_per_step):
    L.seed_everything(0)
    data = recall_data(batch_size=16, examples=64)
    recorder = WindowRecorder(grow_at_epochs=[1], grow_by=2, method="natural", stats_batches=stats_batches,
                              layers_per_step=layers_per_step)
    module = tiny_module(data, dropout=0.0)
    trainer(tmp_path, [recorder], max_epochs=2, precision="64-true").fit(module, data)
    return recorder, module


def test_round_robin_captures_each_layer_on_its_own_steps(tmp_path):
    # Window of 2 steps, one layer per step: layer 0 from the second-to-last batch, layer 1 from the last.
    turns, module = _round_robin_run(tmp_path / "turns", stats_batches=2, layers_per_step=1)
    every, _ = _round_robin_run(tmp_path / "every", stats_batches=1, layers_per_step=None)
    assert [(instances, weight) for _, instances, weight in turns.seen] == [(16, 1.0), (16, 1.0)]
    layer_1_turn, layer_1_last = turns.seen[1][0], every.seen[1][0]
    torch.testing.assert_close(layer_1_turn.n, layer_1_last.n, rtol=1e-9, atol=0)
    torch.testing.assert_close(layer_1_turn.c, layer_1_last.c, rtol=1e-9, atol=0)
    assert not torch.allclose(turns.seen[0][0].n, every.seen[0][0].n)  # layer 0 saw the batch before
    assert module.model.head_sizes() == [4, 4]


def test_round_robin_window_too_short_for_every_layer_fails_at_setup(tmp_path):
    with pytest.raises(ValueError, match="2 growing layers need at least 2 statistics batches"):
        _round_robin_run(tmp_path, stats_batches=1, layers_per_step=1)


# -- every attention variant grows ---------------------------------------------------------------------
class PreservationProbe(GrowAttentionCallback):
    """Model outputs on a fixed batch just before and just after the growth event."""

    def _grow(self, trainer, pl_module, epoch):
        inputs = self._eval_batches[0][0]
        pl_module.eval()
        with torch.no_grad():
            self.out_before = pl_module(inputs)
        super()._grow(trainer, pl_module, epoch)
        with torch.no_grad():
            self.out_after = pl_module(inputs)
        pl_module.train()


@pytest.mark.parametrize("attention, args", [("mha", {}), ("diff", {}), ("dint", {}), ("lowrank_dint", {"rank": 2})])
@pytest.mark.parametrize("mode, temperature", [("append", "keep"), ("replace", "rescale")])
def test_growth_at_step_zero_preserves_every_variant(tmp_path, attention, args, mode, temperature):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data, attention=attention, attention_args=args, bias=True)
    n_forms = len(module.model.qk_forms()[0])
    probe = PreservationProbe(grow_at_epochs=[1], grow_by=2, alphas=[0.0], mode=mode, temperature=temperature,
                              stats_batches=2)
    trainer(tmp_path, [probe], max_epochs=2, precision="64-true").fit(module, data)
    assert module.model.head_sizes() == [4, 4]
    assert all(f.d_head == 4 for forms in module.model.qk_forms() for f in forms) and n_forms >= 1
    torch.testing.assert_close(probe.out_after, probe.out_before, atol=1e-10, rtol=0)


@pytest.mark.parametrize("attention", ["diff", "dint"])
def test_searched_growth_of_two_map_variants_never_raises_the_eval_loss(tmp_path, attention):
    L.seed_everything(0)
    data = recall_data()
    grow = GrowAttentionCallback(grow_at_epochs=[1], grow_by=2, stats_batches=3)
    trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data, attention=attention), data)
    (event,) = grow.history
    assert event["d_head"] == [4, 4] and event["realised_decrease"] >= -1e-6


def test_full_rank_line_search_never_installs_a_growth_that_raises_the_eval_loss(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    grow = GrowAttentionCallback(grow_at_epochs=[1, 2], grow_by=2, method="gradient", line_search="full_rank",
                                 stats_batches=3)
    trainer(tmp_path, [grow], max_epochs=3).fit(tiny_module(data), data)
    assert [e["d_head"] for e in grow.history] == [[4, 4], [6, 6]]
    assert all(e["realised_decrease"] >= -1e-6 for e in grow.history)


class SaveParams(L.Callback):
    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        torch.save(params(pl_module), f"{self.out}/params_{trainer.global_rank}.pt")


def _ddp_resume_run(out, ckpt_path=None):
    L.seed_everything(0)
    data = recall_data(batch_size=8)  # 2 ranks × 8 batches of 8 an epoch: the window is batches 5, 6, 7
    grow = GrowAttentionCallback(grow_at_epochs=[1], grow_by=2, stats_batches=3)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(out.parent / "ckpt", filename="{step}", save_top_k=-1,
                                                      every_n_train_steps=7)
    trainer(out, [grow, checkpoints, SaveParams(str(out))], max_epochs=3, devices=2, strategy="ddp_spawn").fit(
        tiny_module(data), data, ckpt_path=ckpt_path)


def test_ddp_resume_inside_the_statistics_window_gives_the_uninterrupted_weights(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    full.mkdir(), resumed.mkdir()
    _ddp_resume_run(full)
    _ddp_resume_run(resumed, ckpt_path=tmp_path / "ckpt" / "step=7.ckpt")  # each rank has its own partial sums
    for rank in (0, 1):
        expected, got = (torch.load(d / f"params_{rank}.pt") for d in (full, resumed))
        assert got["model.blocks.0.attn.qk.w_q"].shape[-1] == 4
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0)
