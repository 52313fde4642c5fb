"""Value growth (growth.grow: value | both) through GrowAttentionCallback on the project's GPT: the function kept at
α = 0, what is logged, resume, DDP, 16-mixed and compile, the optimizer's state, bad settings (docs/value.md)."""

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings, StepSearch
from lit_growattn.module import GrowAttentionLM

from callback_helpers import (HeldOutProbe, PreservationProbe, assert_never_raises_the_held_out_loss, params, recall_data,
                              tiny_module, trainer)
from conftest import required_args
from test_growth_schedule import assert_same_run, cli_fit, growth_history

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}\n" for i in range(400))


@pytest.mark.parametrize("attention", ["mha", "dint", "lowrank_dint"])
@pytest.mark.parametrize("grow", ["value", "both"])
def test_growth_at_step_zero_keeps_the_function(tmp_path, attention, grow):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data, attention=attention, attention_args=required_args(attention), bias=True)
    columns = dict(columns=2) if grow == "both" else {}
    probe = PreservationProbe(AtEpochs([1]), growth=GrowthSettings(grow=grow, value_columns=3, **columns),
                              statistics=StatisticsSettings(batches=2), step_search=StepSearch(alphas=[0.0]))
    trainer(tmp_path, [probe], max_epochs=2, precision="64-true").fit(module, data)
    assert module.value_sizes() == [11, 11] and module.hparams["d_v"] == [11, 11]
    assert module.head_sizes() == ([4, 4] if grow == "both" else [2, 2])
    torch.testing.assert_close(probe.out_after, probe.out_before, atol=1e-10, rtol=0)
    (event,) = probe.history
    assert (event["d_v_before"], event["d_v"]) == ([8, 8], [11, 11])


def test_a_searched_value_growth_never_raises_the_loss_and_is_logged(tmp_path, capsys):
    L.seed_everything(1)
    data = recall_data(batch_size=32, examples=256, val_examples=512)  # 8 steps an epoch, 4 × 32 kept sequences
    module = tiny_module(data)
    grow = HeldOutProbe(AtEpochs([1, 2]), growth=GrowthSettings(grow="value", value_columns=[2, 1]),
                        statistics=StatisticsSettings(batches=4), step_search=StepSearch(batches=4))
    trainer(tmp_path, [grow], max_epochs=3).fit(module, data)
    assert module.value_sizes() == [12, 10]
    for event in grow.history:  # on the kept batches the steps were rated on: α = 0 is a candidate
        assert event["loss_after"] <= event["loss_before"]
    assert_never_raises_the_held_out_loss(grow)  # and on held-out ones, with a step α > 0 taken
    out = capsys.readouterr().out
    assert "growth at step 8 (epoch 1): d_v [8, 8]→[10, 9]" in out
    assert "growth summary" in out and "d_v" in out.split("growth summary")[1]
    (events,) = (tmp_path / "run").rglob("events.out.tfevents.*")
    tags = set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    assert {"growth/d_v/layer_0", "growth/d_v/layer_1", "growth/discarded_energy_v/layer_0"} <= tags


def test_adam_moments_of_the_old_value_columns_are_carried(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)

    class Snapshot(GrowAttentionCallback):
        def _grow(self, trainer, pl_module, point, batch_idx):
            (opt,) = trainer.optimizers
            names = {p: n for n, p in pl_module.named_parameters()}
            self.before = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
            super()._grow(trainer, pl_module, point, batch_idx)
            (opt,) = trainer.optimizers
            names = {p: n for n, p in pl_module.named_parameters()}
            self.after = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}

    grow = Snapshot(AtEpochs([1]), growth=GrowthSettings(grow="value", value_columns=2),
                    statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2).fit(module, data)
    for name, old in [("model.blocks.0.attn.value.w_v", (slice(None), slice(None), slice(0, 8))),
                      ("model.blocks.0.attn.value.w_o", (slice(None), slice(0, 8), slice(None)))]:
        before, after = grow.before[name], grow.after[name]
        assert torch.equal(after["exp_avg"][old], before["exp_avg"]) and after["step"] == before["step"]
        assert torch.equal(after["exp_avg_sq"][old], before["exp_avg_sq"])
        new = torch.ones_like(after["exp_avg"], dtype=torch.bool)
        new[old] = False
        assert not after["exp_avg"][new].any()  # new columns start with empty first moments
        # and second moments at the old ones' mean (new_second_moment: mean)
        torch.testing.assert_close(after["exp_avg_sq"][new], before["exp_avg_sq"].mean().expand(int(new.sum())))


@pytest.mark.parametrize("growth, message", [
    (dict(value_columns=2), "growth.value_columns sizes the value side, which does not grow"),
    (dict(grow="value", columns=2), "growth.columns sizes the query/key side"),
    (dict(grow="both", method="pinv"), "the value side grows by natural, gradient, random, zero, not method 'pinv'"),
    (dict(grow="both", mode="replace"), "the value side only appends columns"),
    (dict(grow="value", truncation="whitened"), "truncation='whitened' applies to query/key forms only"),
    (dict(grow="value", temperature="rescale"), "rescales the query/key temperature, which does not grow"),
])
def test_settings_the_value_side_cannot_apply_are_refused(growth, message):
    with pytest.raises(ValueError, match=message):
        GrowthSettings(**growth)


def test_a_cap_without_rank_threshold_names_the_value_sides_count():
    with pytest.raises(ValueError, match="AtEpochs grows by growth.value_columns: set growth.rank_threshold"):
        GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="value", max_columns=2))


def test_diff_attention_cannot_grow_its_value_side(tmp_path):
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="value"))
    with pytest.raises(ValueError, match=r"has no growable value map in layers \[0, 1\]"):
        trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data, attention="diff"), data)


def test_a_value_head_wider_than_the_rank_of_w_m_is_refused_naming_it(tmp_path):
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="value"))
    with pytest.raises(ValueError, match=r"the value head size \(20\) already exceeds the smaller of input size and "
                                         r"width \(16: W_V·W_O has rank ≤ 16\): it cannot grow"):
        trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data, d_v=20), data)


def test_max_d_v_beyond_the_rank_of_w_m_is_refused(tmp_path):
    data = recall_data()
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="value", max_d_v=17))
    with pytest.raises(ValueError, match=r"max_d_v=17 must lie between the current value head size \(8\) and"):
        trainer(tmp_path, [grow], max_epochs=2).fit(tiny_module(data), data)


def test_a_grown_checkpoint_loads_with_its_value_sizes(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="both", columns=1, value_columns=2),
                                 statistics=StatisticsSettings(batches=2))
    fit = trainer(tmp_path, [grow], max_epochs=2)
    fit.fit(module, data)
    fit.save_checkpoint(tmp_path / "grown.ckpt")
    loaded = GrowAttentionLM.load_from_checkpoint(tmp_path / "grown.ckpt")
    assert loaded.value_sizes() == [10, 10] and loaded.head_sizes() == [3, 3]
    inputs = next(iter(data.val_dataloader()))[0]
    module.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs), module(inputs))


# -- the command line: a shipped config that grows both sides ------------------------------------------
BOTH = [
    "--trainer.max_epochs=3", "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=1",
    "--trainer.callbacks.init_args.statistics.batches=3", "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=16", "--data.init_args.batch_size=4", "--data.init_args.block_size=16",
    "--data.init_args.samples_per_epoch=40",
]


@pytest.fixture(scope="module")
def both_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("both")
    corpus = out / "corpus.txt"
    corpus.write_text(CORPUS)
    args = [*BOTH, f"--data.init_args.path={corpus}"]
    return out, args, cli_fit(out, args, config="configs/text_grow_both.yaml", data_args=False)


def test_the_shipped_config_grows_both_sides(both_run):
    _, _, full = both_run
    assert full["hyper_parameters"]["d_head"] == [16] and full["hyper_parameters"]["d_v"] == [16]


@pytest.mark.parametrize("checkpoint", ["step=3.ckpt", "step=8.ckpt"])  # inside the first and second windows
def test_resume_inside_a_window_is_bit_equal(both_run, tmp_path, checkpoint):
    out, args, full = both_run
    resumed = cli_fit(tmp_path, args, ckpt_path=out / "ckpt" / checkpoint, config="configs/text_grow_both.yaml",
                      data_args=False)
    assert_same_run(resumed, full)
    assert resumed["hyper_parameters"]["d_v"] == full["hyper_parameters"]["d_v"]


# The same run with sketched statistics of k 8 (< e′ = 16: a sketch, not the exact reconstruction of k ≥ e′).
SKETCHED = ["--trainer.callbacks.init_args.statistics.sketch=on", "--trainer.callbacks.init_args.statistics.sketch_size=8"]


@pytest.fixture(scope="module")
def sketched_both_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sketched_both")
    corpus = out / "corpus.txt"
    corpus.write_text(CORPUS)
    args = [*BOTH, *SKETCHED, f"--data.init_args.path={corpus}"]
    with pytest.warns(UserWarning, match="statistics.sketch_size=8 keeps k \\+ l = 20 columns per head"):
        return out, args, cli_fit(out, args, config="configs/text_grow_both.yaml", data_args=False)


@pytest.mark.filterwarnings("ignore:statistics.sketch_size=8 keeps k \\+ l = 20 columns per head")
@pytest.mark.parametrize("checkpoint", ["step=3.ckpt", "step=8.ckpt"])  # inside the first and second windows
def test_sketch_checkpoint_inside_window_resumes_bit_equal(sketched_both_run, tmp_path, checkpoint):
    """A sketched window resumed from a checkpoint inside it ends where the uninterrupted run does, bit for bit: its
    test matrices are drawn again from the window's seed, not from the global generator, and the saved partial sums
    are the sketch's. Fails if Ω is redrawn otherwise, or if the resumed window starts from fresh sums."""
    out, args, full = sketched_both_run
    history = growth_history(full)
    assert [e["sketch"] for e in history] == [{"k": 8, "l": 12, "k_c": 8}] * 2
    assert not any(e["skipped"] for e in history) and full["hyper_parameters"]["d_v"] == [16]
    resumed = cli_fit(tmp_path, args, ckpt_path=out / "ckpt" / checkpoint, config="configs/text_grow_both.yaml",
                      data_args=False)
    assert_same_run(resumed, full)
    assert resumed["hyper_parameters"]["d_v"] == full["hyper_parameters"]["d_v"]


def test_bf16_mixed_value_growth_grows_and_stays_finite(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(grow="both", columns=2, value_columns=2),
                                 statistics=StatisticsSettings(batches=2))
    trainer(tmp_path, [grow], max_epochs=2, precision="bf16-mixed").fit(module, data)
    (event,) = grow.history
    assert not event["skipped"] and module.value_sizes() == [10, 10]
    assert all(torch.isfinite(p).all() for p in params(module).values())


# -- the model side: capture and checkpoints of the value map ----------------------------------------------
def tiny_gpt(attention="mha", bias=True, d_v=3):
    from lit_growattn.model.config import GPTConfig
    from lit_growattn.model.gpt import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=16, d_head=2, d_v=d_v, bias=bias, attention=attention,
                    attention_args=required_args(attention))
    return GPT(cfg).double()


@pytest.mark.parametrize("capture", ["extend", "explicit"])
@pytest.mark.parametrize("attention, bias", [("mha", False), ("mha", True), ("dint", True), ("lowrank_dint", False)])
def test_captured_p_is_the_attention_applied_to_x_and_g_y_the_output_gradient(attention, bias, capture):
    """The SDPA call over [V | X′] captures P = A·X′ as an explicit map gives it, while the output is unchanged."""
    from lit_growattn.analysis import attention_maps

    attn = tiny_gpt(attention, bias).blocks[1].attn
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    plain = attn(x)
    target = torch.randn_like(plain)
    grads = torch.autograd.grad((plain - target).square().sum(), [x, *attn.parameters()])
    attn.value.capture, attn.qk.capture = True, capture  # the query/key capture path shares the call
    y = attn(x)
    captured_grads = torch.autograd.grad((y - target).square().sum(), [x, *attn.parameters()])
    attn.value.capture, attn.qk.capture = None, None
    torch.testing.assert_close(y, plain, rtol=0, atol=1e-12)
    for got, want in zip(captured_grads, grads, strict=True):  # capture does not change training
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    ((p, g_y),) = attn.value.take_captured()
    x = x.detach()
    xa = torch.cat([x, torch.ones(2, 7, 1, dtype=x.dtype)], -1) if bias else x
    torch.testing.assert_close(p, attention_maps(attn, x)["attn"] @ xa.unsqueeze(1), rtol=0, atol=1e-12)
    torch.testing.assert_close(g_y, 2 * (plain - target).detach(), rtol=0, atol=1e-12)


def test_values_without_capture_or_gradient_have_their_own_width():
    value = tiny_gpt().blocks[0].attn.value
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    value.capture = True
    with torch.no_grad():
        assert value.values(x).shape == (2, 4, 5, 3)  # evaluation under capture: plain values
    assert value.values(x).shape == (2, 4, 5, 3 + 17)
    value.capture = None
    assert value.values(x).shape == (2, 4, 5, 3)


def to_linear_layout(state: dict, bias: bool) -> dict:
    """A state dict as checkpoints stored it while V and O were the nn.Linear modules `v` and `o`."""
    old = {}
    for key, t in state.items():
        head, _, name = key.rpartition("value.")
        if name == "w_v":
            w = t[:, :-1] if bias else t  # the bias is W_V's last row along e′
            old[head + "v.weight"] = w.transpose(1, 2).reshape(-1, w.shape[1])
            if bias:
                old[head + "v.bias"] = t[:, -1].reshape(-1)
        elif name == "w_o":
            old[head + "o.weight"] = t.reshape(-1, t.shape[-1]).T
        elif name == "o_bias":
            old[head + "o.bias"] = t
        else:
            old[key] = t
    return old


@pytest.mark.parametrize("attention", ["mha", "dint", "diff"])
def test_a_checkpoint_with_v_and_o_linear_modules_loads_exactly(attention):
    """Checkpoints written while V and O were nn.Linear modules (keys attn.v.weight …) load into the same function."""
    model = tiny_gpt(attention)
    old = to_linear_layout(model.state_dict(), bias=True)
    assert "blocks.0.attn.v.weight" in old and not any("value." in k for k in old)
    fresh = tiny_gpt(attention)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(old)
    idx = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(fresh(idx), model(idx), rtol=0, atol=0)


def test_set_weights_refuses_shapes_that_do_not_fit():
    value = tiny_gpt().blocks[0].attn.value
    with pytest.raises(ValueError, match="do not fit 4 value heads, 4 query heads, input size 17, output size 16"):
        value.set_weights(value.w_v, value.w_o[:, :2])


def test_a_checkpoint_of_the_linear_layout_loads_and_continues_by_init_from_but_refuses_to_resume(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    fit = trainer(tmp_path, [], max_epochs=1)
    module = tiny_module(data)
    fit.fit(module, data)
    fit.save_checkpoint(tmp_path / "new.ckpt")
    ckpt = torch.load(tmp_path / "new.ckpt", weights_only=False)
    ckpt["state_dict"] = to_linear_layout(ckpt["state_dict"], bias=False)
    assert "model.blocks.0.attn.v.weight" in ckpt["state_dict"]
    torch.save(ckpt, tmp_path / "old.ckpt")

    loaded = GrowAttentionLM.load_from_checkpoint(tmp_path / "old.ckpt")
    inputs = next(iter(data.val_dataloader()))[0]
    module.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs), module(inputs), rtol=0, atol=0)
    continued = tiny_module(data, init_from=str(tmp_path / "old.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(continued.parameters(), module.parameters()))
    with pytest.raises(ValueError, match="its weights load, but its optimizer state cannot resume. Continue from its "
                                         r"weights with `--model.init_args.init_from=<ckpt>`"):
        trainer(tmp_path, [], max_epochs=2).fit(tiny_module(data), data, ckpt_path=tmp_path / "old.ckpt")
