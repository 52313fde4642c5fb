"""Sketch capture (`lit_growattn.attention.sketch`): with `sketch` set, the forms and value maps record
exactly the products `SketchFormStats.update` and `SketchValueStats.update` take, on both capture paths, for the
project's attention (mha, DIFF's and DINT's two forms, DINT's combined map before `output`) and for converted Hugging
Face attention (GQA, RoPE, Qwen3's q_norm/k_norm, a padding mask, Mistral's sliding window); outputs and gradients stay
as they are; no gradient reaches X′ through the sketch columns; the extend path never forms a tensor of width e′ per
head. Float64 against explicit references written out here: G = ∂L/∂S from an
explicit score map, A from an explicit softmax, Ω and Ψ the TestMatrices of the sums."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import required_args
from lit_growattn.analysis import attention_maps
from lit_growattn.attention.qk import QKForm
from lit_growattn.growth.sketch import SketchFormStats, SketchSize, SketchValueStats

F64 = torch.float64
SIZE = SketchSize.of(4)  # k 4, l 6, k_c 4
B, S, E, H, D, DV = 3, 9, 13, 4, 3, 5


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-12) -> None:
    """Equal up to float64 round-off of the reference's size (the products below sum a few hundred terms)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=0, atol=rel * (1 + float(want.abs().max())))


def far(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a wrong variant `b` of a reference `a` differs from it by far more than `close` allows."""
    return float((a - b).abs().max()) > 1e-3 * float(a.abs().max())


def loss_fn(y: torch.Tensor) -> torch.Tensor:
    return (y.sin() * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum()


# -- references, written out --------------------------------------------------------------------------------
def sketch_products(xa: torch.Tensor, g: torch.Tensor, omega: torch.Tensor, psi: torch.Tensor, n_kv_head: int):
    """G_j X′Ω (b, H, s, k) per query head and Σ_{j∈g} G_jᵀX′Ψ_j (b, KV, s, l) per key head, head by head."""
    h = g.shape[1]
    group = h // n_kv_head
    g_omega = torch.stack([g[:, j] @ xa @ omega for j in range(h)], 1)
    gt_psi = torch.stack([sum(g[:, j].mT @ xa @ psi[j] for j in range(i * group, (i + 1) * group))
                          for i in range(n_kv_head)], 1)
    return g_omega, gt_psi


def value_products(xa: torch.Tensor, a: torch.Tensor, g_y: torch.Tensor, tests, n_kv_head: int):
    """Σ_{j∈g} A_jᵀG_YΩ_j (b, KV, s, k), A_jX′Ψ (b, H, s, l), A_jᵀA_jX′Ω_c (b, H, s, k_c), head by head."""
    h = a.shape[1]
    group = h // n_kv_head
    omega, psi, omega_c = tests["omega"], tests["psi"], tests["omega_c"]
    e_v = torch.stack([sum(a[:, j].mT @ g_y @ omega[j] for j in range(i * group, (i + 1) * group))
                       for i in range(n_kv_head)], 1)
    a_xpsi = torch.stack([a[:, j] @ xa @ psi for j in range(h)], 1)
    e_c = torch.stack([a[:, j].mT @ a[:, j] @ xa @ omega_c for j in range(h)], 1)
    return e_v, a_xpsi, e_c


def sums_from_g(xa: torch.Tensor, g: torch.Tensor, omega: torch.Tensor, psi: torch.Tensor, n_kv_head: int):
    """y = N_jΩ (H, e′, k), w = Σ_{j∈g} N_jᵀΨ_j (KV, e′, l) from N_j = Σ_i X′ᵢᵀG_ijX′ᵢ."""
    return sums_from_n(torch.einsum("bse,bhst,btf->hef", xa, g, xa), omega, psi, n_kv_head)


def sums_from_n(n: torch.Tensor, omega: torch.Tensor, psi: torch.Tensor, n_kv_head: int):
    h, e, _ = n.shape
    return n @ omega, (n.mT @ psi).reshape(n_kv_head, h // n_kv_head, e, -1).sum(1)


def value_sums(xa: torch.Tensor, a: torch.Tensor, g_y: torch.Tensor, tests, n_kv_head: int):
    """Σ_{j∈g} N_V,jΩ_j (KV, e′, k), N_V,jᵀΨ (H, e, l), C_V,jΩ_c (H, e′, k_c) with P_j = A_jX′, N_V,j = Σ P_jᵀG_Y,
    C_V,j = Σ P_jᵀP_j."""
    p = a @ xa.unsqueeze(1)
    n_v, c_v = torch.einsum("bhse,bsf->hef", p, g_y), torch.einsum("bhse,bhsf->hef", p, p)
    h = a.shape[1]
    y = (n_v @ tests["omega"]).reshape(n_kv_head, h // n_kv_head, *n_v.shape[1:2], -1).sum(1)
    return y, n_v.mT @ tests["psi"], c_v @ tests["omega_c"]


def causal(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).tril()


# -- the project's query/key form ---------------------------------------------------------------------------
def form_and_inputs(bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    form = QKForm(E, H, D, bias=bias).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.layer_norm(torch.randn(B, S, E, generator=g, dtype=F64), (E,))
    return form, x, torch.randn(B, H, S, DV, generator=g, dtype=F64)


def explicit_g(form: QKForm, x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """X′ and G = ∂L/∂S (b, H, s, s) from an explicit causal score map (S.retain_grad)."""
    xa = form.augment(x).detach()
    s = form.tau[:, None, None] * torch.einsum("bse,hed,hfd,btf->bhst", xa, form.w_q, form.w_k, xa)
    s = s.masked_fill(~causal(x.shape[1]), float("-inf"))
    s.retain_grad()
    loss_fn(torch.softmax(s, -1) @ v).backward()
    form.zero_grad()
    return xa, s.grad


def captured(unit, run, capture, sketch) -> list[tuple[torch.Tensor, ...]]:
    unit.capture, unit.sketch = capture, sketch
    run()
    unit.capture, unit.sketch = None, None
    return unit.take_captured()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("capture", ["extend", "explicit"])
def test_form_sketch_capture_gives_g_x_omega_and_gt_x_psi(capture, bias):
    """QKForm, causal, 4 heads: the captured (X′, G X′Ω, GᵀX′Ψ) equal G's products written out, and their sums equal
    NΩ and NᵀΨ for N from today's full capture. Fails if E_W sits on the query side (G X′Ψ: the causal G is not
    symmetric), or if X′Ψ / X′Ω trade places."""
    form, x, v = form_and_inputs(bias)
    xa, g = explicit_g(form, x, v)
    run = lambda: loss_fn(form.attend(x, v)).backward()  # noqa: E731
    full = captured(form, run, capture, None)
    n = sum(torch.einsum("bse,bhsf->hef", xk, gx) for xk, gx in full)
    stats = SketchFormStats.empty_like(form, SIZE, seed=11, dtype=F64)
    ((xk, g_omega, gt_psi),) = captured(form, run, capture, stats.tests)
    omega, psi = stats.tests["omega"], stats.tests["psi"]
    assert torch.equal(xk, xa) and not xk.requires_grad
    ref_omega, ref_psi = sketch_products(xa, g, omega, psi, H)
    close(g_omega, ref_omega)
    close(gt_psi, ref_psi)
    assert far(ref_psi, g @ torch.einsum("bse,hel->bhsl", xa, psi))  # the other side of G: what a swapped E_W gives
    stats.update(xk, g_omega, gt_psi)
    y, w = sums_from_n(n, omega, psi, H)
    close(stats.y_sum, y)
    close(stats.w_sum, w)
    close(stats.c_sum, xa.reshape(-1, xa.shape[-1]).mT @ xa.reshape(-1, xa.shape[-1]))
    assert stats.instances == B and stats.weight == 1


@pytest.mark.parametrize("capture", ["extend", "explicit"])
def test_form_without_sketch_records_today_s_pairs_bit_for_bit(capture):
    """sketch None: the (X′, G X′) pairs of the full capture, the same bits as before the sketch existed (the
    explicit map's G X′ as `grad @ X′`)."""
    form, x, v = form_and_inputs(True)
    xa, g = explicit_g(form, x, v)
    ((xk, gx),) = captured(form, lambda: loss_fn(form.attend(x, v)).backward(), capture, None)
    close(gx, g @ xa.unsqueeze(1))
    assert form.sketch is None and gx.shape == (B, H, S, E + 1)


# -- the project's GPT: outputs, gradients, DIFF and DINT, the value map (g = 1) --------------------------------
def tiny_gpt(attention: str, bias: bool = True):
    from lit_growattn.model.config import GPTConfig
    from lit_growattn.model.gpt import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=16, d_head=2, d_v=3, bias=bias, attention=attention,
                    attention_args=required_args(attention))
    return GPT(cfg).double()


def set_sketch(attn, capture, value: bool, seed: int = 3) -> tuple[list, SketchValueStats | None]:
    """Turns sketch capture on for every form of `attn` (and its value map when `value`); returns the sums."""
    forms = []
    for i, form in enumerate(attn.qk_forms()):
        stats = SketchFormStats.empty_like(form, SIZE, seed=seed + i, dtype=F64)
        form.capture, form.sketch = capture, stats.tests
        forms.append(stats)
    values = None
    if value:
        values = SketchValueStats.empty_like(attn.value, SIZE, seed=seed + 10, dtype=F64)
        attn.value.capture, attn.value.sketch = True, values.tests
    return forms, values


def clear_capture(attn) -> None:
    for unit in [*attn.qk_forms(), attn.value]:
        unit.capture, unit.sketch = None, None


@pytest.mark.parametrize("capture", ["extend", "explicit"])
@pytest.mark.parametrize("attention", ["mha", "dint", "diff", "lowrank_dint"])
def test_sketch_capture_leaves_outputs_and_gradients_as_they_are(attention, capture):
    """The layer's output and the gradients of its parameters and of its input are those without capture. Fails if X′
    (in X′Ω, X′Ψ, X′Ω_c) is not detached: the input's gradient would change."""
    attn = tiny_gpt(attention).blocks[1].attn
    x = torch.randn(2, 7, 16, dtype=F64, requires_grad=True)
    target = torch.randn(2, 7, 16, dtype=F64)

    def output_and_grads():
        # backward(), as training calls it: autograd.grad of chosen inputs would not reach the zero leaves E.
        y = attn(x)
        (y - target).square().sum().backward()
        grads = [t.grad.clone() for t in (x, *attn.parameters())]
        x.grad = None
        attn.zero_grad()
        return y, grads

    plain, grads = output_and_grads()
    value = attn.value_growable
    set_sketch(attn, capture, value)
    y, sketched = output_and_grads()
    clear_capture(attn)
    torch.testing.assert_close(y, plain, rtol=0, atol=1e-12)
    for got, want in zip(sketched, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert [len(form.take_captured()) for form in attn.qk_forms()] == [1] * len(attn.qk_forms())
    assert len(attn.value.take_captured()) == int(value)


class InputGradients(TorchDispatchMode):
    """Counts the ops, views apart, whose output has X′'s size (b·s·e′ numbers, e′ last): the work backward does on
    X′'s gradient."""

    def __init__(self, numel: int, e_in: int):
        super().__init__()
        self.numel, self.e_in, self.count = numel, e_in, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and not func.is_view and t.dim() and t.shape[-1] == self.e_in
                    and t.numel() == self.numel):
                self.count += 1
        return out


@pytest.mark.parametrize("capture", ["extend", "explicit"])
def test_the_sketch_columns_carry_no_gradient_into_the_input(capture):
    """X′ enters the sketch columns detached: backward does on X′ (e′ 17) exactly the work it does without capture.
    (Not detached, the columns' gradients are zero, their partners being the zero E, so the values cannot show it.)"""
    attn = tiny_gpt("mha").blocks[1].attn
    x = torch.randn(2, 7, 16, dtype=F64, requires_grad=True)
    counts = []
    for sketch in (False, True):
        if sketch:
            set_sketch(attn, capture, value=True)
        loss = loss_fn(attn(x))
        with InputGradients(2 * 7 * 17, 17) as mode:
            loss.backward()
        clear_capture(attn)
        counts.append(mode.count)
    assert counts[0] > 0 and counts[1] == counts[0]
    (xk, *_), (xv, *_) = attn.qk.take_captured()[0], attn.value.take_captured()[0]
    assert not xk.requires_grad and not xv.requires_grad


def explicit_attend(form: QKForm, kept: dict):
    """A replacement of `form.attend`: an explicit causal softmax whose scores keep their gradient in `kept`."""
    def attend(x, v):
        q, k = form.queries_keys(form.augment(x))
        s = (q @ k.mT).masked_fill(~causal(x.shape[1]), float("-inf"))
        s.retain_grad()
        kept[form] = form.augment(x).detach(), s
        return torch.softmax(s, -1) @ v
    return attend


@pytest.mark.parametrize("capture", ["extend", "explicit"])
@pytest.mark.parametrize("attention", ["diff", "dint"])
def test_diff_and_dint_forms_capture_each_their_own_sketch(attention, capture):
    """Two forms per layer, each with its own G (DIFF: A1 − λA2 then a norm; DINT: λ·causal mean as well), captured
    through the same code as mha's form."""
    attn = tiny_gpt(attention).blocks[1].attn
    x = torch.randn(2, 7, 16, dtype=F64)
    target = torch.randn(2, 7, 16, dtype=F64)
    kept = {}
    for form in attn.qk_forms():
        form.attend = explicit_attend(form, kept)
    (attn(x) - target).square().sum().backward()
    for form in attn.qk_forms():
        del form.attend
    attn.zero_grad()
    sums, _ = set_sketch(attn, capture, value=False)
    (attn(x) - target).square().sum().backward()
    clear_capture(attn)
    gs = []
    for form, stats in zip(attn.qk_forms(), sums, strict=True):
        xa, s = kept[form]
        ((xk, g_omega, gt_psi),) = form.take_captured()
        ref_omega, ref_psi = sketch_products(xa, s.grad, stats.tests["omega"], stats.tests["psi"], form.n_kv_head)
        close(g_omega, ref_omega)
        close(gt_psi, ref_psi)
        gs.append(s.grad)
    assert far(gs[0], gs[1])  # the two forms' G differ: each form records its own


@pytest.mark.parametrize("qk_capture", [None, "extend", "explicit"])
@pytest.mark.parametrize("attention, bias", [("mha", True), ("mha", False), ("dint", True)])
def test_value_sketch_capture_of_the_project_gpt(attention, bias, qk_capture):
    """g = 1 (one value head per query head): E_V.grad = A_jᵀG_YΩ_j, A_jX′Ψ, E_C.grad = A_jᵀA_jX′Ω_c with A the layer's
    combined map (DINT's A1 + λ(mean A1 − A2)) and G_Y the output's gradient; their sums equal those of today's
    full capture (P = AX′, G_Y). The query/key side's sketch columns may share the call."""
    attn = tiny_gpt(attention, bias).blocks[1].attn
    x = torch.randn(2, 7, 16, dtype=F64)
    target = torch.randn(2, 7, 16, dtype=F64)
    run = lambda: (attn(x) - target).square().sum().backward()  # noqa: E731
    attn.value.capture = True
    run()
    ((p, g_y_full),) = attn.value.take_captured()
    attn.zero_grad()
    _, stats = set_sketch(attn, qk_capture, value=True)
    if qk_capture is None:
        for form in attn.qk_forms():
            form.sketch = None
    with torch.no_grad():
        a = attention_maps(attn, x)["attn"]
        g_y = 2 * (attn(x) - target)
    run()
    clear_capture(attn)
    ((xk, e_v, a_xpsi, g_y_sk, e_c),) = attn.value.take_captured()
    xa = torch.cat([x, torch.ones(2, 7, 1, dtype=F64)], -1) if bias else x
    assert torch.equal(xk, xa)
    refs = value_products(xa, a, g_y, stats.tests, attn.value.n_kv_head)
    for got, want in zip((e_v, a_xpsi, e_c), refs, strict=True):
        close(got, want)
    close(g_y_sk, g_y)
    stats.update(xk, e_v, a_xpsi, g_y_sk, e_c)
    n_v, c_v = torch.einsum("bhse,bsf->hef", p, g_y_full), torch.einsum("bhse,bhsf->hef", p, p)
    close(stats.y_sum, n_v @ stats.tests["omega"])
    close(stats.w_sum, n_v.mT @ stats.tests["psi"])
    close(stats.f_sum, c_v @ stats.tests["omega_c"])


# -- Hugging Face attention: GQA, RoPE, Qwen3's norms, padding ----------------------------------------------------
VOCAB = 96


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Tiny Llama (hidden 64, 4 heads, 2 KV heads, RoPE), Qwen3 (the same, head_dim 16, q_norm/k_norm with random
    weights) and Mistral (the same, a sliding window of 4) built from configs with random weights and written with
    save_pretrained."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    folders = {}
    configs = {"llama": LlamaConfig(**common), "qwen3": Qwen3Config(**common, head_dim=16),
               "mistral": MistralConfig(**common, sliding_window=4)}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        if name == "qwen3":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                    layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        folders[name] = folder
    return folders


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    from lit_growattn.hf import make_growable

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").double()
    make_growable(model.train())  # no dropout in these configs
    return model, [layer.self_attn for layer in model.model.layers]


def hf_loss(model, ids, mask, logits: list | None = None) -> torch.Tensor:
    out = model(ids, attention_mask=mask, use_cache=False).logits
    if logits is not None:
        logits.append(out.detach())
    return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def hf_inputs(padding: bool):
    ids = torch.randint(0, VOCAB, (3, 14), generator=torch.Generator().manual_seed(2))
    if not padding:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1, -3:], mask[2, -6:] = 0, 0  # right padding: every query still sees position 0
    return ids, mask


def reference_attend(attn, kept: dict, i: int):
    """A replacement of `attn.attend`: the scores q·kᵀ (+ the model's mask) written out, keys repeated per group,
    their gradient kept, the softmax in float64."""
    def attend(x, q, k, v, attention_mask, dropout, **kwargs):
        group = attn.n_head // attn.n_kv_head
        s = q @ k.repeat_interleave(group, 1).mT
        if attention_mask is None:
            allowed = causal(s.shape[-1]).expand_as(s)
        elif attention_mask.dtype == torch.bool:
            allowed = attention_mask.expand_as(s)
        else:
            allowed = (attention_mask == 0).expand_as(s)
        s = s.masked_fill(~allowed, float("-inf"))
        s.retain_grad()
        a = torch.softmax(s, -1)
        kept[i] = dict(x=x.detach(), s=s, a=a.detach(), allowed=allowed)
        return (a @ v.repeat_interleave(group, 1)).transpose(1, 2), None
    return attend


@pytest.mark.parametrize("capture", ["extend", "explicit"])
@pytest.mark.parametrize("model_type, padding", [("llama", False), ("llama", True), ("qwen3", False), ("qwen3", True),
                                                 ("mistral", False)])
def test_hf_sketch_capture_equals_the_explicit_products(hf_folders, model_type, capture, padding):
    """Both sides of every layer in one call, after RoPE (and Qwen3's norms, which the sketch columns bypass): the
    query/key products with the group's co-range summed over its 2 query heads, the value products with g = 2, G zero
    on the masked pairs (padding, Mistral's sliding window); the logits and gradients as without capture; the sums as
    N, N_V and C_V give them."""
    model, attns = hf_model(hf_folders[model_type])
    ids, mask = hf_inputs(padding)
    hf_loss(model, ids, mask).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    kept, outputs = {}, {}
    hooks = []
    for i, attn in enumerate(attns):
        attn.attend = reference_attend(attn, kept, i)

        def keep_output(module, args, out, i=i):
            out[0].retain_grad()
            outputs[i] = out[0]
        hooks.append(attn.register_forward_hook(keep_output))
    logits = []
    hf_loss(model, ids, mask, logits).backward()
    for attn, hook in zip(attns, hooks):
        del attn.attend
        hook.remove()
    model.zero_grad()

    sums = []
    for i, attn in enumerate(attns):
        form, value = (SketchFormStats.empty_like(attn, SIZE, seed=20 + i, dtype=F64),
                       SketchValueStats.empty_like(attn.value, SIZE, seed=30 + i, dtype=F64))
        attn.capture, attn.sketch, attn.value.capture, attn.value.sketch = capture, form.tests, True, value.tests
        sums.append((form, value))
    hf_loss(model, ids, mask, logits).backward()
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-12)

    for i, (attn, (form, value)) in enumerate(zip(attns, sums)):
        attn.capture = attn.sketch = attn.value.capture = attn.value.sketch = None
        ref = kept[i]
        g, xa, a, g_y = ref["s"].grad, ref["x"], ref["a"], outputs[i].grad
        if padding or model_type == "mistral":
            assert (causal(14) & ~ref["allowed"]).any() and ref["allowed"].any(-1).all()  # masked beyond causal
        assert not g[~ref["allowed"]].any()  # G is zero on masked pairs
        ((xk, g_omega, gt_psi),) = attn.take_captured()
        assert torch.equal(xk, xa) and not xk.requires_grad
        ref_omega, ref_psi = sketch_products(xa, g, form.tests["omega"], form.tests["psi"], attn.n_kv_head)
        close(g_omega, ref_omega)
        close(gt_psi, ref_psi)
        per_query_head = sketch_products(xa, g, form.tests["omega"], form.tests["psi"], attn.n_head)[1]
        assert gt_psi.shape[1] == 2 and far(ref_psi, per_query_head[:, ::2])  # the group's sum, not its first head
        form.update(xk, g_omega, gt_psi)
        y, w = sums_from_g(xa, g, form.tests["omega"], form.tests["psi"], attn.n_kv_head)
        close(form.y_sum, y)
        close(form.w_sum, w)

        ((xv, e_v, a_xpsi, g_y_sk, e_c),) = attn.value.take_captured()
        assert torch.equal(xv, xa) and not xv.requires_grad
        refs = value_products(xa, a, g_y, value.tests, attn.value.n_kv_head)
        for got, want in zip((e_v, a_xpsi, e_c), refs, strict=True):
            close(got, want)
        close(g_y_sk, g_y)
        # Inject's blocks keep the two heads of a group apart: swapped within each group, E_C.grad is another matrix.
        swapped = refs[2].reshape(3, 2, 2, *refs[2].shape[2:]).flip(2).reshape(refs[2].shape)
        assert far(refs[2], swapped)
        value.update(xv, e_v, a_xpsi, g_y_sk, e_c)
        for got, want in zip((value.y_sum, value.w_sum, value.f_sum), value_sums(xa, a, g_y, value.tests, 2)):
            close(got, want)


def test_hf_explicit_sketch_equals_the_extend_sketch_in_sums(hf_folders):
    """The two capture paths of a GQA model give the same sketch sums (N from the full explicit capture as well)."""
    model, attns = hf_model(hf_folders["llama"])
    ids, _ = hf_inputs(False)
    stats = {}
    for capture in ("explicit", "extend", None):
        for i, attn in enumerate(attns):
            attn.capture = capture or "explicit"
            attn.sketch = SketchFormStats.empty_like(attn, SIZE, seed=40 + i, dtype=F64).tests if capture else None
        hf_loss(model, ids, None).backward()
        model.zero_grad()
        stats[capture] = []
        for i, attn in enumerate(attns):
            if capture is None:
                n = sum(torch.einsum("bse,bhsf->hef", xk, gx) for xk, gx in attn.take_captured())
                tests = SketchFormStats.empty_like(attn, SIZE, seed=40 + i, dtype=F64).tests
                stats[capture].append(sums_from_n(n, tests["omega"], tests["psi"], attn.n_kv_head))
            else:
                sums = SketchFormStats.empty_like(attn, SIZE, seed=40 + i, dtype=F64)
                for triple in attn.take_captured():
                    sums.update(*triple)
                stats[capture].append((sums.y_sum, sums.w_sum))
            attn.capture = attn.sketch = None
    for full, explicit, extend in zip(stats[None], stats["explicit"], stats["extend"]):
        for f, a, b in zip(full, explicit, extend):
            close(a, f)
            close(b, f)


# -- the point of the sketch: width k + l, not e′ -------------------------------------------------------------------
@pytest.fixture
def sdpa_widths(monkeypatch):
    """((heads, width) of q, k, v) of every `F.scaled_dot_product_attention` call (the project's and transformers'
    sdpa interface both look it up at call time)."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        calls.append(tuple((t.shape[1], t.shape[-1]) for t in (q, k, v)))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns, in forward and backward."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def per_head_e_in(shapes: set, e_in: int, b: int, s: int) -> set:
    """The recorded tensors that hold e′ numbers per head and position: (b, heads, s, e′)."""
    return {t for t in shapes if len(t) == 4 and t[0] == b and t[2] == s and t[3] == e_in}


def test_extend_sketch_never_forms_a_tensor_of_width_e_in_per_head(sdpa_widths):
    """The project's mha layer (e′ 17, 4 heads) capturing both sides through SDPA: no (b, h, s, e′) tensor in forward or
    backward, and SDPA sees d + k + l query columns and d_v + k + l + k_c + k_c value columns; the full capture forms
    them (so the check can fail)."""
    attn = tiny_gpt("mha").blocks[1].attn
    x = torch.randn(2, 7, 16, dtype=F64, requires_grad=True)
    seen = {}
    for sketch in (False, True):
        if sketch:
            set_sketch(attn, "extend", value=True)
        else:
            attn.qk.capture, attn.value.capture = "extend", True
        with Shapes() as mode:
            loss_fn(attn(x)).backward()
        clear_capture(attn)
        assert len(attn.qk.take_captured()) == len(attn.value.take_captured()) == 1
        seen[sketch] = mode.shapes
    assert per_head_e_in(seen[False], 17, 2, 7)
    assert not per_head_e_in(seen[True], 17, 2, 7)
    qk, v = 2 + SIZE.k + SIZE.l, 3 + SIZE.k + SIZE.l + 2 * SIZE.k_c
    assert sdpa_widths == [((4, 2 + 17), (4, 2 + 17), (4, 3 + 17)), ((4, qk), (4, qk), (4, v))]


def test_hf_extend_sketch_never_forms_a_tensor_of_width_e_in_per_head(hf_folders, sdpa_widths):
    """Llama, GQA 4/2, e′ 64, head_dim 16: queries and keys widened by k + l per head (keys per KV head), values by
    k + l + k_c + g·k_c; no (b, heads, s, e′) tensor."""
    model, attns = hf_model(hf_folders["llama"])
    ids, _ = hf_inputs(False)
    for i, attn in enumerate(attns):
        attn.capture, attn.sketch = "extend", SketchFormStats.empty_like(attn, SIZE, seed=i, dtype=F64).tests
        attn.value.capture = True
        attn.value.sketch = SketchValueStats.empty_like(attn.value, SIZE, seed=9 + i, dtype=F64).tests
    with Shapes() as mode:
        hf_loss(model, ids, None).backward()
    assert not per_head_e_in(mode.shapes, 64, 3, 14)
    qk, v = 16 + SIZE.k + SIZE.l, 16 + SIZE.k + SIZE.l + SIZE.k_c + 2 * SIZE.k_c
    print("sdpa (heads, width) of q, k, v:", sdpa_widths)
    assert [(q[1], k[1], v[1]) for q, k, v in sdpa_widths] == [(qk, qk, v)] * 2
    assert all(k[0] == v[0] for _, k, v in sdpa_widths)  # keys and values per KV head or repeated alike
    assert all(len(attn.take_captured()) == len(attn.value.take_captured()) == 1 for attn in attns)
