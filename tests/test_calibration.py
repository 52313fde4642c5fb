"""The calibration covariances of an activation-aware shrink (`callback.calibration`): what a direct computation of
mean X′ᵀX′ (query/key) and mean P_jᵀP_j (value heads) gives, and what a growth window gathers for the same batches."""

import functools

import lightning as L
import torch
from callback_helpers import recall_data, tiny_module, trainer
from conftest import needs_transformers

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings
from lit_growattn.attention.qk import augment
from lit_growattn.callback.calibration import calibration_moments
from lit_growattn.module import GrowAttentionLM

F64 = torch.float64


def batches(vocab, n=3, size=4, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (size, length + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def direct_moments(module, batches, layer_inputs):
    """C̄ per unit from the inputs of each layer's attention (`layer_inputs(module)`: the modules whose outputs are
    X, by layer), computed here: X′ = [X | 1], A_j = softmax of the form's causal scores, P_j = A_j X′."""
    seen = {}
    hooks = [m.register_forward_hook(lambda _, __, out, i=i: seen.setdefault(i, []).append(out.detach()))
             for i, m in enumerate(layer_inputs(module))]
    with torch.no_grad():
        for inputs, _ in batches:
            module(inputs)
    for hook in hooks:
        hook.remove()
    moments = {}
    for (layer, name, form), (_, value_name, _) in zip(module.growable_forms(), module.growable_values()):
        xa = augment(torch.cat(seen[layer]), form.w_q.shape[1] > seen[layer][0].shape[-1])  # (n, s, e′)
        moments[name] = torch.einsum("nse,nsf->ef", xa, xa) / xa.shape[0]
        with torch.no_grad():
            attention = torch.softmax(form.scores(torch.cat(seen[layer])), dim=-1)  # (n, h, s, s)
        p = attention @ xa.unsqueeze(1)  # (n, h, s, e′)
        moments[value_name] = torch.einsum("nhse,nhsf->hef", p, p) / xa.shape[0]
    return moments


def assert_moments_equal(found, expected, rtol):
    """Equal to `rtol` of each covariance's largest entry."""
    assert found.keys() == expected.keys()
    for name in expected:
        scale = float(expected[name].abs().max())
        torch.testing.assert_close(found[name], expected[name].to(F64), rtol=rtol, atol=rtol * scale)


def test_calibration_moments_are_the_inputs_covariances_and_leave_the_module_as_it_was():
    torch.manual_seed(0)
    module = GrowAttentionLM(vocab_size=32, block_size=10, n_layer=2, n_head=2, n_embd=8, d_head=3, d_v=4,
                             bias=True, dropout=0.1).double().train()
    module.model.wte.weight.requires_grad_(False)
    data = batches(32)
    found = calibration_moments(module, data, {"d_head", "d_v"})
    assert module.training and not module.model.wte.weight.requires_grad and module.model.wpe.weight.requires_grad
    assert all(p.grad is None for p in module.parameters())
    assert all(form.capture is None and form.take_captured() == [] for _, _, form in module.growable_forms())
    module.eval()  # the reference runs without dropout, as calibration does
    expected = direct_moments(module, data, lambda m: [block.ln_1 for block in m.model.blocks])
    assert_moments_equal(found, expected, rtol=1e-12)
    # One side, and one layer per pass: the same covariances.
    assert_moments_equal(calibration_moments(module, data, {"d_v"}, layers_per_pass=1),
                         {k: v for k, v in expected.items() if k.endswith("value")}, rtol=1e-12)
    assert_moments_equal(calibration_moments(module, data, {"d_head"}, capture="extend"),
                         {k: v for k, v in expected.items() if k.endswith("qk")}, rtol=1e-12)


class WindowKeeper(GrowAttentionCallback):
    """What a growth window gathered (C̄ per unit), the batches it gathered it on (all kept) and the weights it saw."""

    def _grow(self, trainer, pl_module, point, batch_idx):
        self.gathered = {name: sums.means().c for (_, name, _), sums in zip(self._forms(pl_module), self.window.stats)}
        self.kept = list(self.window.kept)
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        super()._grow(trainer, pl_module, point, batch_idx)


def test_calibration_gathers_what_a_growth_window_gathers(tmp_path):
    """A run whose optimizer never moves the weights (lr 0), so that every step of its window sees the same ones: the
    window's C̄ over its two batches is calibration's on those batches."""
    L.seed_everything(0)
    data = recall_data(batch_size=8, examples=32)
    keeper = WindowKeeper(AtEpochs([1]), growth=GrowthSettings(columns=1, grow="both"),
                          statistics=StatisticsSettings(batches=2))
    frozen = functools.partial(torch.optim.SGD, lr=0.0)
    trainer(tmp_path, [keeper], max_epochs=2, precision="64-true", limit_val_batches=0).fit(
        tiny_module(data, dropout=0.0, optimizer=frozen), data)
    assert len(keeper.kept) == 2 and len(keeper.gathered) == 4  # two layers, both sides
    module = tiny_module(data, dropout=0.0).double()  # the weights the window saw, before the growth
    module.load_state_dict(keeper.weights)
    assert_moments_equal(calibration_moments(module, keeper.kept, {"d_head", "d_v"}), keeper.gathered, rtol=1e-12)


def test_calibration_of_a_hugging_face_model_with_gqa_and_rotary_columns(tmp_path):
    """Llama with 4 query heads on 2 KV heads, every query/key column rotary: the attention weights come from the
    model itself (eager attention's output), the inputs from each layer's input norm; no biases, so X′ = X."""
    needs_transformers()
    from hf_helpers import VOCAB, saved_tiny_model

    from lit_growattn.hf.module import HFCausalLM

    module = HFCausalLM(pretrained=saved_tiny_model("llama", tmp_path / "llama"), attn_implementation="eager").double()
    assert {form.rotary for _, _, form in module.growable_forms()} == {8}
    data = batches(VOCAB, length=8)
    found = calibration_moments(module, data, {"d_head", "d_v"})
    layers = module.model.model.layers
    seen = {i: [] for i in range(len(layers))}
    hooks = [layer.input_layernorm.register_forward_hook(lambda _, __, out, i=i: seen[i].append(out.detach()))
             for i, layer in enumerate(layers)]
    with torch.no_grad():
        attentions = [module.model(inputs, output_attentions=True).attentions for inputs, _ in data]
    for hook in hooks:
        hook.remove()
    expected = {}
    for (layer, name, _), (_, value_name, _) in zip(module.growable_forms(), module.growable_values()):
        x = torch.cat(seen[layer])
        expected[name] = torch.einsum("nse,nsf->ef", x, x) / x.shape[0]
        p = torch.cat([a[layer] for a in attentions]) @ x.unsqueeze(1)  # (n, H, s, e′)
        expected[value_name] = torch.einsum("nhse,nhsf->hef", p, p) / x.shape[0]
    # Eager attention softmaxes in float32 (the explicit capture in float64): its weights are the coarser ones.
    assert_moments_equal(found, expected, rtol=10 * torch.finfo(torch.float32).eps)


def test_calibration_takes_fewer_layers_per_pass_where_their_sums_would_not_fit():
    """Half the free memory holds every layer's kept covariances (float64) and one pass's window sums (float32, a
    growth window's: C̄ and N per form, C and N per value map); the rest decides the layers per pass."""
    from lit_growattn.callback.calibration import calibration_layers_per_pass
    from lit_growattn.contract import growable_units

    module = GrowAttentionLM(vocab_size=32, block_size=10, n_layer=3, n_head=2, n_embd=8, d_head=3, d_v=4, bias=True)
    units = growable_units(module)
    e, h, e_out = 9, 2, 8  # e′ = n_embd + 1 (bias)
    window = 4 * (e * e * (1 + h) + h * e * (e + e_out))  # per layer
    kept = 3 * 8 * (e * e + h * e * e)  # every layer's
    assert calibration_layers_per_pass(units, None) is None  # the free memory unknown: one pass
    assert calibration_layers_per_pass(units, 2 * (kept + 3 * window)) is None
    assert calibration_layers_per_pass(units, 2 * (kept + 3 * window) - 1) == 2
    assert calibration_layers_per_pass(units, 2 * (kept + 2 * window) - 1) == 1
    assert calibration_layers_per_pass(units, 1) == 1  # never fewer than one: it may still fit
    values = [named for named in units if named.form.side == "d_v"]
    assert calibration_layers_per_pass(values, 2 * (3 * 8 * h * e * e + 4 * 4 * h * e * (e + e_out))) is None
