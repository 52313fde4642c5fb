"""Attention padded for the fused SDPA kernels: exact, and every call the model makes is flash-eligible."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lit_growattn.attention import ATTENTIONS
from lit_growattn.attention.qk import QKForm
from lit_growattn.attention.sdpa import causal_attention, padded_widths
from lit_growattn.commands.cli import main
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT

from conftest import REPO, required_args


@pytest.mark.parametrize("d_v", [16, 32, 64])
def test_padding_is_exact_in_float64_for_every_head_size(d_v):
    g = torch.Generator().manual_seed(d_v)
    for d in range(1, 65):
        q, k = (torch.randn(2, 2, 12, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
        v = torch.randn(2, 2, 12, d_v, generator=g, dtype=torch.float64, requires_grad=True)
        out = causal_attention(q, k, v, pad="on")
        ref = causal_attention(q, k, v, pad="off")
        assert out.shape == ref.shape == (2, 2, 12, d_v)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=f"d_head {d}, d_v {d_v}")
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        refs = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for got, want in zip(grads, refs):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"gradient, d_head {d}, d_v {d_v}")


def test_padded_widths_follow_the_fused_kernel_rules():
    assert padded_widths(1, 16) == (16, 16) and padded_widths(9, 16) == (16, 16) and padded_widths(20, 16) == (24, 24)
    assert padded_widths(256, 8) == (256, 256)
    assert padded_widths(264, 32) == (264, 32)  # beyond flash's 256: multiples of 8 for memory-efficient attention


def flash_eligible(call) -> bool:
    """CUDA flash attention: q, k, v of one width, a multiple of 8, at most 256, each with unit stride along it."""
    widths, last_strides = call
    q, k, v = widths
    return q == k == v and q % 8 == 0 and q <= 256 and last_strides == (1, 1, 1)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """((q, k, v) widths, their strides along the width) of every SDPA call."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        calls.append((tuple(t.shape[-1] for t in (q, k, v)), tuple(t.stride(-1) for t in (q, k, v))))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def test_growth_run_with_padding_calls_sdpa_with_flash_shapes_only(tmp_path, tiny_cli_args, sdpa_calls):
    # Training, evaluation and the `extend` statistics capture, before and after growth, from the command line.
    cli = main(["--config", str(REPO / "configs/mqar_grow.yaml"), *tiny_cli_args, "--trainer.max_epochs=2",
                "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]", "--trainer.callbacks.init_args.statistics.batches=2",
                "--trainer.callbacks.init_args.statistics.capture=extend", "--model.init_args.sdpa_pad=on",
                "--data.init_args.num_train_examples=256", "--data.init_args.num_val_examples=64"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.model.model.head_sizes() == [4, 4]
    widths = {call[0][0] for call in sdpa_calls}
    # d_head 2 and 4 padded to d_v 32; the extension's 2 + 64 padded to 72.
    assert widths == {32, 72}, widths
    assert all(flash_eligible(call) for call in sdpa_calls)


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_every_variant_runs_on_flash_alone_at_every_growth_width(attention, sdpa_calls):
    # On CPU too, flash needs q, k and v of one width: under `sdpa_kernel(FLASH)` a math fallback raises.
    # n_embd 24 lets d_head reach 20 (a static d_head above n_embd is refused), wider than d_v and than 16.
    for d_head in (1, 5, 9, 20):
        cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=24, d_head=d_head, d_v=8,
                        attention=attention, attention_args=required_args(attention), sdpa_pad="on")
        model = GPT(cfg)
        idx = torch.randint(0, 16, (2, 8))
        for capture in (None, "extend"):
            for form in model.qk_forms()[0]:
                form.capture = capture
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                model(idx).sum().backward()
            for form in model.qk_forms()[0]:
                assert len(form.take_captured()) == (capture is not None)
    assert sdpa_calls and all(flash_eligible(call) for call in sdpa_calls)


def test_auto_leaves_cpu_shapes_alone_and_bad_values_fail():
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, d_head=3, d_v=8)
    model = GPT(cfg)
    with pytest.raises(RuntimeError):  # unpadded, d_head 3 ≠ d_v 8 has no fused kernel (torch warns why)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.warns(UserWarning, match="Flash attention"):
            model(torch.randint(0, 16, (2, 8)))
    with pytest.raises(ValueError, match="sdpa_pad must be one of auto, on, off"):
        GPTConfig(sdpa_pad="yes")


@pytest.mark.parametrize(("written", "meant"), [("off", "off"), ("on", "on"), ("'off'", "off")])
def test_a_config_file_may_write_sdpa_pad_unquoted(tmp_path, written, meant):
    # YAML 1.1 reads an unquoted on/off as a boolean: the model takes it as the switch it names, not as a type error.
    (tmp_path / "pad.yaml").write_text(f"model:\n  init_args:\n    sdpa_pad: {written}\n")
    cli = main(["--config", str(REPO / "configs/text.yaml"), "--config", str(tmp_path / "pad.yaml"),
                "--data.init_args.path", str(REPO / "README.md")], run=False)
    assert cli.model.cfg.sdpa_pad == meant
    forms = [m for m in cli.model.modules() if isinstance(m, QKForm)]
    assert forms and all(form.sdpa_pad == meant for form in forms)
