"""On CUDA only (marker `gpu`; skipped where there is none): what the CPU tests cannot show. Fused SDPA kernels at
every head size, padding exact on CUDA, statistics captured on CUDA, fp16/bf16 growth, `compile: true` through a
growth, and a Hugging Face Llama grown and exported after bf16 training. scripts/gpu/check.sh runs them first."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

from lit_growattn import GrowAttentionCallback, growth
from lit_growattn.attention import QKForm
from lit_growattn.attention.sdpa import causal_attention
from lit_growattn.growth.sketch import SketchFormStats, SketchSize, SketchValueStats
from lit_growattn.commands.cli import main
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT

from conftest import REPO
from test_compile import _fit as compiled_growth_fit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
# Largest difference allowed, relative to the reference's largest magnitude: a few units in the last place (fp32:
# more, for the sums over a batch and the backward through two layers that the statistics are).
RELATIVE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    scale = want.abs().max().item() or 1.0
    error = (got.float() - want.float()).abs().max().item()
    assert error <= RELATIVE[dtype] * scale, f"{what}: max difference {error:.3g} against max magnitude {scale:.3g}"


@pytest.mark.parametrize("capture", [None, "extend"])
def test_padded_attention_runs_a_fused_kernel_at_every_head_size(capture):
    # Restricted to the fused backends, a math fallback raises. At n_embd 384 the `extend` capture widens the
    # queries past flash's 256, where memory-efficient attention has to take them.
    torch.manual_seed(0)
    x = torch.randn(2, 128, 384, device=CUDA)
    v = torch.randn(2, 6, 128, 64, device=CUDA, requires_grad=True)
    for d in range(1, 65):
        form = QKForm(384, 6, d, sdpa_pad="on").to(CUDA)
        form.capture = capture
        with sdpa_kernel(FUSED):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = form.attend(x, v)
            out.float().square().sum().backward()
        assert torch.isfinite(out).all(), f"d_head {d}"
        assert len(form.take_captured()) == (capture is not None), f"d_head {d}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padded_attention_equals_unpadded_on_cuda(dtype):
    g = torch.Generator(device=CUDA).manual_seed(0)
    for d in range(1, 65):
        q, k = (torch.randn(2, 4, 64, d, device=CUDA, dtype=dtype, generator=g, requires_grad=True) for _ in range(2))
        v = torch.randn(2, 4, 64, 64, device=CUDA, dtype=dtype, generator=g, requires_grad=True)
        out, ref = causal_attention(q, k, v, pad="on"), causal_attention(q, k, v, pad="off")
        assert_near(out, ref, dtype, f"output, d_head {d}")
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        refs = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
        for name, got, want in zip("qkv", grads, refs):
            assert_near(got, want, dtype, f"gradient of {name}, d_head {d}")


def test_statistics_captured_on_cuda_equal_the_cpus():
    torch.manual_seed(0)
    on_cpu = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, d_head=3, d_v=16))
    models = {"cpu": on_cpu, "cuda": copy.deepcopy(on_cpu).to(CUDA)}
    idx = torch.randint(0, 64, (4, 32))
    sums = {}
    for device, model in models.items():
        forms = [m for m in model.modules() if isinstance(m, QKForm)]
        for form in forms:
            form.capture = "extend"
        tokens = idx.to(device)
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        sums[device] = [growth.FormStats.empty_like(form, "natural") for form in forms]
        for stats, form in zip(sums[device], forms):
            for xa, gx in form.take_captured():
                stats.update(xa, gx)
    for layer, (want, got) in enumerate(zip(sums["cpu"], sums["cuda"])):
        for name, w, g in zip(want.names, want.tensors(), got.tensors()):
            assert_near(g.cpu(), w, torch.float32, f"form {layer} {name}")


@pytest.mark.parametrize("capture", ["extend", "explicit"])
def test_sketched_statistics_captured_on_cuda_equal_the_cpus(capture):
    """statistics.sketch: on, both sides: the sketch columns through CUDA's attention kernels, the test matrices on
    the GPU and the folded sums give the CPU's sums."""
    torch.manual_seed(0)
    on_cpu = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, d_head=3, d_v=16))
    models = {"cpu": on_cpu, "cuda": copy.deepcopy(on_cpu).to(CUDA)}
    idx = torch.randint(0, 64, (4, 32))
    size = SketchSize.of(4)
    sums = {}
    for device, model in models.items():
        attns = [block.attn for block in model.blocks]
        sums[device] = []
        for i, attn in enumerate(attns):
            (form,) = attn.qk_forms()
            qk = SketchFormStats.empty_like(form, size, seed=i)
            value = SketchValueStats.empty_like(attn.value, size, seed=10 + i)
            form.capture, form.sketch = capture, qk.tests
            attn.value.capture, attn.value.sketch = True, value.tests
            sums[device] += [(form, qk), (attn.value, value)]
        tokens = idx.to(next(model.parameters()).device)
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        for unit, stats in sums[device]:
            unit.capture, unit.sketch = None, None
            for captured in unit.take_captured():
                stats.update(*captured)
    for n, ((_, want), (_, got)) in enumerate(zip(sums["cpu"], sums["cuda"], strict=True)):
        assert got.tests.checksum == want.tests.checksum
        for name, w, g in zip(want.names, want.tensors(), got.tensors(), strict=True):
            assert_near(g.cpu(), w, torch.float32, f"unit {n} {name}")


@pytest.mark.filterwarnings("ignore:statistics.sketch_size=.* columns per head")
def test_sketched_growth_under_bf16_mixed_on_cuda(tmp_path, tiny_cli_args):
    cli = main(["--config", str(REPO / "configs/mqar_grow.yaml"), *tiny_cli_args, "--trainer.max_epochs=2",
                "--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed",
                "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                "--trainer.callbacks.init_args.statistics.batches=2",
                "--trainer.callbacks.init_args.statistics.sketch=on", "--data.init_args.num_train_examples=256",
                "--data.init_args.num_val_examples=64"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    (grow,) = [c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback)]
    assert [event["skipped"] for event in grow.history] == [False] and "sketch" in grow.history[0], grow.history
    assert cli.model.model.head_sizes() == [4, 4]
    assert math.isfinite(cli.trainer.callback_metrics["val/loss"])


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_growth_under_mixed_precision_on_cuda(tmp_path, tiny_cli_args, precision):
    cli = main(["--config", str(REPO / "configs/mqar_grow.yaml"), *tiny_cli_args, "--trainer.max_epochs=2",
                "--trainer.accelerator=gpu", f"--trainer.precision={precision}",
                "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                "--trainer.callbacks.init_args.statistics.batches=2", "--data.init_args.num_train_examples=256",
                "--data.init_args.num_val_examples=64"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    (grow,) = [c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback)]
    assert [event["skipped"] for event in grow.history] == [False], grow.history
    assert cli.model.model.head_sizes() == [4, 4]
    assert (cli.trainer.precision_plugin.scaler is not None) == (precision == "16-mixed")
    assert math.isfinite(cli.trainer.callback_metrics["val/loss"])


def test_compiled_growth_on_cuda_equals_eager_with_one_graph_per_size(tmp_path, tiny_cli_args, record_property):
    gpu = "--trainer.accelerator=gpu"
    _, eager = compiled_growth_fit(tmp_path / "eager", tiny_cli_args, gpu)
    torch.compiler.reset()
    graphs = counters["stats"]["unique_graphs"]
    _, compiled = compiled_growth_fit(tmp_path / "compiled", tiny_cli_args, gpu, "--model.init_args.compile=true")
    graphs = counters["stats"]["unique_graphs"] - graphs
    record_property("compiled_graphs", graphs)
    record_property("recompile_resets", compiled.model.compiled.resets)
    assert compiled.model.head_sizes() == eager.model.head_sizes() == [4]
    assert compiled.model.compiled.resets == 1 and graphs == 2, (compiled.model.compiled.resets, graphs)
    for (name, got), want in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4, msg=name)


def test_tiny_llama_grows_in_bf16_and_exports(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from lit_growattn.hf.export import export

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Grow the query and key width of attention while the model trains.\n" * 200)
    cli = main(["--config", str(REPO / "configs/hf_llama_grow.yaml"), f"--data.init_args.path={corpus}",
                f"--data.init_args.cache_dir={tmp_path / 'cache'}", "--data.init_args.batch_size=8",
                "--data.init_args.block_size=32", "--data.init_args.samples_per_epoch=64", "--trainer.max_epochs=2",
                "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
                f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.init_args.warmup_steps=2",
                "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                "--trainer.callbacks.init_args.statistics.batches=2", "--trainer.accelerator=gpu",
                "--trainer.precision=bf16-mixed"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.model.head_sizes() == [16, 16]
    # Lightning hands the module back on the CPU after `fit`; the comparison runs on the GPU.
    trained = cli.model.model.to(CUDA).eval()
    assert export(trained, tmp_path / "out") == "growattn_llama"
    ids = torch.randint(0, trained.config.vocab_size, (2, 24), device=CUDA)
    with torch.no_grad():
        want = trained(ids).logits
        exact = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).to(CUDA).eval()
        assert_near(exact(ids).logits, want, torch.float32, "fp32 logits of the exported model")
        half = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16).to(CUDA).eval()
        # Trained weights make this model's logits sensitive to bf16 rounding (measured 5-6 % of the largest logit,
        # on the GPU and on the CPU alike, for the module itself cast to bf16): the export in bf16 must be no further
        # from the fp32 logits than the trained module run in bf16, within a factor 2 for the other rounding order.
        own_error = (copy.deepcopy(trained).to(torch.bfloat16)(ids).logits.float() - want).abs().max().item()
        error = (half(ids).logits.float() - want).abs().max().item()
        assert error <= 2 * own_error, f"bf16 export: max difference {error:.3g}, the module in bf16 {own_error:.3g}"
        greedy = half.generate(ids[:1, :4], max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        assert greedy.shape == (1, 12)
