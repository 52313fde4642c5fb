"""Adam's state across a growth (lit_growattn.training.optim_state), on a bare module: old slices scaled, new slices empty
or at the old second moments' mean, reset and unchanged parameters, and a wrong policy refused."""

import pytest
import torch
from torch import nn

from lit_growattn.growth import Carry
from lit_growattn.training.optim_state import carry_state, snapshot_state


def stepped(module: nn.Module, amsgrad: bool = False, in_features: int | None = None) -> torch.optim.AdamW:
    """An AdamW that has taken two steps on `module`, so every state entry is non-zero."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, amsgrad=amsgrad)
    for _ in range(2):
        module(torch.randn(4, in_features or module.in_features)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_snapshot_names_only_parameters_with_state():
    module = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW([module.weight], lr=1e-2)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    snapshot = snapshot_state(optimizer, module)
    assert set(snapshot) == {"weight"}
    assert snapshot["weight"] is optimizer.state[module.weight]


@pytest.mark.parametrize("policy", ["mean", "zero"])
def test_grown_slices_scaled_and_new_slices_filled(policy):
    old = nn.Linear(2, 3)
    old_state = snapshot_state(stepped(old), old)
    new = nn.Linear(5, 3)  # two old input columns, three new ones; the bias keeps its size
    new_optimizer = torch.optim.AdamW(new.parameters(), lr=1e-2)
    carries = {"weight": Carry((slice(None), slice(0, 2)), first_scale=0.5, second_scale=0.25)}
    carry_state(old_state, new_optimizer, new, carries, new_second_moment=policy)

    state = new_optimizer.state[new.weight]
    old_weight = old_state["weight"]
    assert state["exp_avg"].shape == new.weight.shape
    torch.testing.assert_close(state["exp_avg"][:, :2], 0.5 * old_weight["exp_avg"])
    torch.testing.assert_close(state["exp_avg_sq"][:, :2], 0.25 * old_weight["exp_avg_sq"])
    assert (state["exp_avg"][:, 2:] == 0).all()  # a new first moment is always empty
    expected_fill = (0.25 * old_weight["exp_avg_sq"]).mean() if policy == "mean" else torch.tensor(0.0)
    torch.testing.assert_close(state["exp_avg_sq"][:, 2:], expected_fill.expand(3, 3))
    assert torch.equal(state["step"], old_weight["step"])  # the step count (a scalar) is kept as is
    assert state["exp_avg"].is_contiguous() and state["exp_avg"].dtype == old_weight["exp_avg"].dtype
    # The bias has no carry here: its state is kept as it was, the very same object.
    assert new_optimizer.state[new.bias] is old_state["bias"]


def test_amsgrad_maximum_is_a_second_moment():
    old = nn.Linear(3, 2)
    old_state = snapshot_state(stepped(old, amsgrad=True), old)
    new = nn.Linear(3, 4)
    new_optimizer = torch.optim.AdamW(new.parameters(), lr=1e-2, amsgrad=True)
    carry_state(old_state, new_optimizer, new, {"weight": Carry((slice(0, 2),), second_scale=4.0)})
    maximum = new_optimizer.state[new.weight]["max_exp_avg_sq"]
    scaled = 4.0 * old_state["weight"]["max_exp_avg_sq"]
    torch.testing.assert_close(maximum[:2], scaled)
    torch.testing.assert_close(maximum[2:], scaled.mean().expand(2, 3))


def test_rotated_parameter_state_is_reset():
    old = nn.Linear(3, 2)
    old_state = snapshot_state(stepped(old), old)
    new = nn.Linear(3, 2)
    new_optimizer = torch.optim.AdamW(new.parameters(), lr=1e-2)
    carry_state(old_state, new_optimizer, new, {"weight": Carry(None)})
    assert new.weight not in new_optimizer.state  # AdamW starts it afresh, `step` included
    assert new.bias in new_optimizer.state


def test_parameters_without_old_state_are_left_alone():
    old = nn.Linear(3, 2)
    new = nn.Linear(3, 4)
    new_optimizer = torch.optim.AdamW(new.parameters(), lr=1e-2)
    carry_state({}, new_optimizer, new, {"weight": Carry((slice(0, 2),))})
    assert len(new_optimizer.state) == 0


def test_every_parameter_is_visited_whatever_comes_before_it():
    """A parameter without old state, then one without a carry, then a carried one: each gets its own treatment."""
    old = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    old_state = snapshot_state(stepped(old, in_features=2), old)
    del old_state["0.weight"]  # e.g. a parameter the old optimizer never stepped
    new = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    new_optimizer = torch.optim.AdamW(new.parameters(), lr=1e-2)
    carry_state(old_state, new_optimizer, new, {"1.weight": Carry((slice(None), slice(None)), first_scale=2.0)})
    assert new[0].weight not in new_optimizer.state
    assert new_optimizer.state[new[0].bias] is old_state["0.bias"]
    torch.testing.assert_close(new_optimizer.state[new[1].weight]["exp_avg"], 2.0 * old_state["1.weight"]["exp_avg"])
    assert new_optimizer.state[new[1].bias] is old_state["1.bias"]


def test_grown_state_keeps_its_dtype_and_is_contiguous():
    """The state's own dtype (not the parameter's), and a contiguous layout even for a transposed parameter."""
    old = nn.Linear(3, 2)
    old_state = snapshot_state(stepped(old), old)
    new = nn.Linear(3, 4)
    new.weight = nn.Parameter(torch.zeros(3, 4, dtype=torch.float64).t())  # (4, 3), not contiguous
    new_optimizer = torch.optim.AdamW(new.parameters(), lr=1e-2)
    carry_state(old_state, new_optimizer, new, {"weight": Carry((slice(0, 2),))})
    for key in ("exp_avg", "exp_avg_sq"):
        grown = new_optimizer.state[new.weight][key]
        assert grown.shape == (4, 3) and grown.dtype == torch.float32 and grown.is_contiguous()
        torch.testing.assert_close(grown[:2], old_state["weight"][key])


def test_unknown_second_moment_policy_refused():
    module = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="new_second_moment must be one of mean, zero; got 'ones'"):
        carry_state({}, torch.optim.AdamW(module.parameters()), module, {}, new_second_moment="ones")
