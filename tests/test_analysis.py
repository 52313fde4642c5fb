import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from lit_growattn.analysis import (
    AttentionAnalysisCallback,
    attention_entropy,
    attention_maps,
    entropy_figure,
    row_entropy,
    spectrum_figure,
    wm_spectra,
)
from lit_growattn.attention import ATTENTIONS
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT
from lit_growattn.module import GrowAttentionLM

from conftest import reference_output, reference_values, required_args

def tiny_gpt(attention="mha", **kw):
    cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_embd=16, n_head=4, d_head=3, attention=attention,
                    attention_args=required_args(attention), **kw)
    return GPT(cfg).double()


def test_row_entropy_by_hand():
    a = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    expected = [0.0, math.log(2), -(0.2 * math.log(0.2) + 0.3 * math.log(0.3) + 0.5 * math.log(0.5))]
    torch.testing.assert_close(row_entropy(a), torch.tensor(expected, dtype=torch.float64))
    # A signed row (DIFF/DINT) is read as |A|/Σ|A|: [1.5, −0.5] → [0.75, 0.25].
    signed = torch.tensor([[1.5, -0.5]], dtype=torch.float64)
    torch.testing.assert_close(row_entropy(signed), torch.tensor([-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))],
                                                                  dtype=torch.float64))


@pytest.mark.parametrize("attention", ["mha", "diff"])
def test_uniform_causal_map_has_entropy_log_i_plus_one(attention):
    """Zero query weights make every score equal: row i is uniform over i+1 keys (for DIFF, A1 − λA2 = (1−λ)U)."""
    torch.manual_seed(0)
    model = tiny_gpt(attention)
    for forms in model.qk_forms():
        for form in forms:
            torch.nn.init.zeros_(form.w_q)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    rows = row_entropy(attention_maps(model.blocks[0].attn, x)["attn"])
    torch.testing.assert_close(rows, torch.log(torch.arange(1.0, 9.0, dtype=torch.float64)).expand_as(rows))
    per_head = attention_entropy(model, [torch.randint(0, 20, (3, 8))])
    expected = torch.log(torch.arange(1.0, 9.0, dtype=torch.float64)).mean()
    for layer in per_head:
        torch.testing.assert_close(layer["attn"], expected.expand_as(layer["attn"]))


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_entropy_uses_each_layers_attention_input(attention):
    """The hooks see X = ln_1(residual stream) of every layer; averaged over two batches of different sizes."""
    torch.manual_seed(0)
    model = tiny_gpt(attention)
    batches = [torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (1, 8))]
    got = attention_entropy(model, batches)
    expected = [{} for _ in model.blocks]
    with torch.no_grad():
        for idx in batches:
            h = model.wte(idx) + model.wpe(torch.arange(8))
            for i, block in enumerate(model.blocks):
                for name, a in attention_maps(block.attn, block.ln_1(h)).items():
                    expected[i][name] = expected[i].get(name, 0) + row_entropy(a).mean(-1).sum(0)
                h = block(h)
    assert len(got) == len(expected) == 2
    for layer, ref in zip(got, expected):
        assert layer.keys() == ref.keys() == ({"attn"} if attention == "mha" else {"attn", "a1", "a2"})
        for name in ref:
            torch.testing.assert_close(layer[name], ref[name] / 3)


@pytest.mark.parametrize("attention", ["diff", "dint", "lowrank_dint"])
def test_explicit_combined_map_reproduces_the_layer(attention):
    torch.manual_seed(0)
    attn = tiny_gpt(attention).blocks[1].attn
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    b, s, _ = x.shape
    v = reference_values(attn.value, x).transpose(1, 2)
    y = attention_maps(attn, x)["attn"] @ v
    if attention == "diff":
        y = attn.norm(y) * (1 - attn.lambda_init)
    torch.testing.assert_close(reference_output(attn.value, list(y.unbind(1))), attn(x), atol=1e-10, rtol=0)


@pytest.mark.parametrize("attention", ["mha", "diff"])
def test_wm_spectrum_matches_svd_of_explicit_product(attention):
    torch.manual_seed(0)
    model = tiny_gpt(attention, d_v=3)
    spectra = wm_spectra(model)
    for block, spectrum in zip(model.blocks, spectra):
        value = block.attn.value
        dv = value.d_v
        assert spectrum.shape == (value.n_head, dv)
        for j in range(value.n_head):
            w_v = value.w_v[j, : value.e_out]  # e × d_v: the columns of V that head j reads (no bias row)
            torch.testing.assert_close(spectrum[j], torch.linalg.svdvals(w_v @ value.w_o[j])[:dv], atol=1e-10, rtol=0)


def test_figures_have_one_panel_per_layer():
    torch.manual_seed(0)
    model = tiny_gpt("dint")
    assert len(spectrum_figure(wm_spectra(model)).axes) == 2
    fig = entropy_figure(torch.rand(2, 4))
    assert fig.axes[0].images[0].get_array().shape == (2, 4)


def token_loader(n, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 32, (n, 8), generator=g)
    labels = torch.roll(inputs, -1, dims=1)
    labels[:, -1] = -100
    return DataLoader(TensorDataset(inputs, labels), batch_size=4)


def test_callback_logs_entropy_and_figures_to_tensorboard(tmp_path):
    torch.manual_seed(0)
    module = GrowAttentionLM(vocab_size=32, block_size=8, n_layer=2, n_embd=16, n_head=2, d_head=4,
                             attention="dint", warmup_steps=1)
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, limit_train_batches=2, limit_val_batches=2, num_sanity_val_steps=1,
        logger=logger, callbacks=[AttentionAnalysisCallback(num_batches=2)], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, token_loader(16, 0), token_loader(8, 1))
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    scalars = events.Tags()["scalars"]
    for i in range(2):
        tag = f"attention/entropy/layer_{i}"
        assert {tag, f"{tag}/a1", f"{tag}/a2"} <= set(scalars)
        (event,) = events.Scalars(tag)  # one validation epoch, sanity check skipped
        assert 0 < event.value < math.log(8)
    assert {"attention/entropy", "attention/wm_spectrum"} <= set(events.Tags()["images"])
