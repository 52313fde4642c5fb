"""The quadratic step rule: float64 references, and the callback path that uses it."""

import math

import lightning as L
import pytest
import torch

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings, StepSearch
from lit_growattn.commands.cli import main
from lit_growattn.growth import candidate_steps, choose_step, loss_rounding, quadratic_step

from conftest import REPO
from callback_helpers import recall_data, tiny_module, trainer

F64 = torch.float64
F32_EPS = torch.finfo(torch.float32).eps


def test_default_candidates_reach_down_to_one_256th():
    assert candidate_steps() == [0.0] + [2.0**-k for k in range(9)]
    assert candidate_steps(2, include_zero=False) == [1.0, 0.5, 0.25]


@pytest.mark.parametrize("terms, factor", [(None, 1.0), (0, 1.0), (1, 1.0), (4, 2.0)])
def test_loss_rounding_is_root_terms_epsilons_of_the_loss(terms, factor):
    args = () if terms is None else (terms,)
    assert loss_rounding(-1.5, torch.float32, *args) == factor * F32_EPS * 1.5


def test_choose_step_tolerates_one_rounding_by_default():
    """A float32 gap of 2ε at 1.5: more than one rounding (1.5ε, the default `terms=1`), less than two (2.1ε)."""
    losses = torch.tensor([1.5 + 2 * F32_EPS, 1.5], dtype=torch.float32)
    assert choose_step(losses, [0.0, 1.0]) == 1
    assert choose_step(losses, [0.0, 1.0], terms=2) == 0


def test_choose_step_compares_python_floats_in_float64():
    """A gap that float32 would round away is a real one between float64 losses."""
    assert choose_step([1.0, 1.0 - 1e-10], [0.0, 1.0]) == 1


def test_choose_step_takes_minus_infinity_and_refuses_a_length_mismatch():
    assert choose_step([1.0, -math.inf, 0.5], [0.0, 1.0, 0.5]) == 1
    with pytest.raises(ValueError, match="^3 losses for 2 step sizes$"):
        choose_step([1.0, 0.5, 0.2], [0.0, 1.0])


def test_quadratic_step_recovers_the_minimiser_of_an_exact_quadratic():
    slope, curvature = 0.03, 0.8  # L(α) = L0 − sα + cα², minimum at s/2c
    alphas = [0.0, 1 / 16, 1 / 4, 1.0]
    decreases = [slope * a - curvature * a**2 for a in alphas]
    assert quadratic_step(slope, alphas, decreases) == pytest.approx(slope / (2 * curvature), rel=1e-12)


def test_quadratic_step_fits_only_up_to_the_best_measured_step():
    """Past the best step the loss climbs much faster than a quadratic: those points must not pull α* down."""
    slope, curvature = 0.03, 0.8
    alphas = [1 / 64, 1 / 32, 1 / 16, 1.0]
    decreases = [slope * a - curvature * a**2 for a in alphas[:3]] + [-5.0]  # α = 1 blows up
    assert quadratic_step(slope, alphas, decreases) == pytest.approx(slope / (2 * curvature), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_quadratic_step_matches_float64_least_squares(seed):
    g = torch.Generator().manual_seed(seed)
    alphas = torch.rand(6, generator=g, dtype=F64) * 0.2 + 0.01
    slope = 0.1
    decreases = slope * alphas - 0.7 * alphas**2 + 1e-3 * torch.randn(6, generator=g, dtype=F64)
    # Reference: least squares of α_i² c = s α_i − d_i by lstsq in float64, over the α_i up to the best one.
    local = alphas <= alphas[decreases.argmax()]
    a, d = alphas[local], decreases[local]
    c = torch.linalg.lstsq((a**2)[:, None], (slope * a - d)[:, None]).solution.item()
    expected = min(slope / (2 * c), 1.0)
    assert quadratic_step(slope, alphas.tolist(), decreases.tolist()) == pytest.approx(expected, rel=1e-10)


def test_quadratic_step_edge_cases():
    assert quadratic_step(-0.1, [0.0, 0.5], [0.0, 0.01]) == 0.0  # no descent predicted
    assert quadratic_step(0.0, [0.5], [0.01]) == 0.0  # nor here
    assert quadratic_step(0.1, [0.25, 0.5], [0.025, 0.05]) == 0.5  # exactly linear (c = 0): the best measured α
    assert quadratic_step(0.1, [1.0, 2.0], [0.1, 0.2]) == 1.0  # capped at max_alpha = 1 by default
    assert quadratic_step(1.0, [0.25, 0.5], [0.2375, 0.45]) == 1.0  # c = 0.2: α* = 2.5 is past it too
    assert quadratic_step(0.1, [0.25, 0.5], [0.03, 0.06]) == 0.5  # decrease keeps up: no curvature, best measured α
    assert quadratic_step(0.1, [0.25, 0.5], [0.03, 0.06], max_alpha=0.25) == 0.25
    assert quadratic_step(0.1, [0.5, 1.0], [float("nan"), 0.1 - 0.2]) == pytest.approx(0.25)  # NaN ignored
    assert quadratic_step(0.1, [0.5, 1.0], [-0.1, -0.5]) == pytest.approx(0.1 / (2 * 0.6))  # all worse: refine below the least bad
    with pytest.raises(ValueError, match="^the quadratic step needs the loss at one step size α > 0 at least$"):
        quadratic_step(0.1, [0.0], [0.0])
    with pytest.raises(ValueError, match="^max_alpha must be positive, got 0$"):
        quadratic_step(0.1, [0.5], [0.01], max_alpha=0)
    with pytest.raises(ValueError, match="2 decreases for 3 step sizes"):
        quadratic_step(0.1, [0.1, 0.2, 0.3], [0.0, 0.0])


def test_quadratic_rule_never_does_worse_than_the_grid_it_extends(tmp_path):
    """Same run, same statistics: the quadratic rule's candidates include the grid's, so its realised decrease on
    the kept batches is at least the grid's, and it is never negative."""
    history = {}
    for rule in ("grid", "quadratic"):
        L.seed_everything(0)
        data = recall_data()
        grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=2), statistics=StatisticsSettings(batches=4), step_search=StepSearch(rule=rule, alphas=[0.0, 1 / 16]))
        trainer(tmp_path / rule, [grow], max_epochs=2).fit(tiny_module(data), data)
        history[rule] = grow.history[0]
    assert history["quadratic"]["realised_decrease"] >= history["grid"]["realised_decrease"] - 1e-7
    assert history["quadratic"]["realised_decrease"] >= 0.0


def test_text_grow_config_takes_the_quadratic_step_from_the_command_line(tmp_path, tiny_cli_args):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"To be, or not to be, that is the question.\n" * 200)
    cli = main(["--config", str(REPO / "configs/text_grow.yaml"), *tiny_cli_args, "--trainer.max_epochs=2",
                f"--data.init_args.path={corpus}", "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                "--trainer.callbacks.init_args.statistics.batches=2", "--trainer.callbacks.init_args.step_search.rule=quadratic"],
               run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    (event,) = next(c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback)).history
    assert event["realised_decrease"] >= 0.0 and cli.model.model.head_sizes()[0] > 2


@pytest.mark.parametrize("kwargs", [dict(line_search="full_rank"), dict(alphas=[0.0])])
def test_quadratic_rule_refuses_what_it_cannot_fit(kwargs):
    with pytest.raises(ValueError, match="rule='quadratic' fits the losses"):
        StepSearch(rule="quadratic", **kwargs)


def test_text_config_steps_below_the_old_grid_and_appends(tmp_path, tiny_cli_args):
    """On text the loss of a growth has its minimum at α ≈ 1/256 … 1/32 (studies/growth_step/README.md): the shipped config
    must be able to take such a step, keep α = 0 available, and append (replace's edge was its Adam reset)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"To be, or not to be, that is the question.\n" * 200)
    cli = main(["--config", str(REPO / "configs/text_grow.yaml"), *tiny_cli_args, f"--data.init_args.path={corpus}"],
               run=False)
    grow = next(c for c in cli.trainer.callbacks if isinstance(c, GrowAttentionCallback))
    settings, alphas = grow.settings, grow.search.candidates
    assert 0.0 in alphas and min(a for a in alphas if a > 0) <= 1 / 256
    assert (settings.method, settings.mode) == ("natural", "append")
