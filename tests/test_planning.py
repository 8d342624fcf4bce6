import copy

import pytest
import timm
import torch
from conftest import conv_unit, max_grad_error
from torch import nn

import revnets
from revnets.memory import measure_memory
from revnets.planning import budget_plan, candidate_plans, profile_chain, sqrt_plan


def chain(units: int = 4, channels: int = 8) -> nn.Sequential:
    """A flat chain of 3 x ``units`` layers: conv, BatchNorm, ReLU, conv, ..."""
    return nn.Sequential(*(layer for _ in range(units) for layer in conv_unit(channels)))


def training_peak(model, x):
    def step(model, x):
        model(x).float().sum().backward()

    return measure_memory(step, model, x).peak_bytes


def test_profile_counts_what_autograd_saves():
    x = torch.randn(2, 8, 8, 8)  # 4 KiB
    profiles = profile_chain(list(conv_unit(8)), x)
    assert [p.name for p in profiles] == ["Conv2d", "BatchNorm2d", "ReLU"]
    assert all(p.output_bytes == 4096 for p in profiles)
    # conv saves its input; BatchNorm its input plus mean and inverse std; ReLU its output.
    assert [p.saved_bytes for p in profiles] == [4096, 4096 + 2 * 8 * 4, 4096]
    meta = profile_chain(list(conv_unit(8).to("meta")), x.to("meta"))
    assert [p.saved_bytes for p in meta] == [p.saved_bytes for p in profiles]


def test_chen_plans():
    assert sqrt_plan(16) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    profiles = profile_chain(list(chain(4)), torch.randn(1, 8, 4, 4))  # 12 layers of 512 B each
    per_layer = [p.saved_bytes for p in profiles]
    plan = budget_plan(profiles, segment_budget=3 * max(per_layer))
    assert plan[0][0] == 0 and plan[-1][1] == 12
    assert all(sum(per_layer[a:b]) <= 3 * max(per_layer) for a, b in plan)
    plans = candidate_plans(profiles)
    # The finest plan cuts everywhere but before the in-place ReLUs (layers 2, 5, 8, 11): a
    # checkpointed segment starting with one would overwrite the input its checkpoint keeps.
    starts = [0, 1, 3, 4, 6, 7, 9, 10]
    assert plans[0] == [(0, 12)] and plans[-1] == list(zip(starts, starts[1:] + [12]))
    assert all(profiles[a].inplace is False for plan in plans for a, _ in plan)


def test_checkpoint_segments_refuses_a_cut_before_an_in_place_layer():
    with pytest.raises(ValueError, match=r"starts with an in-place layer \(ReLU\)"):
        revnets.checkpoint_segments(chain(2), [(0, 2), (2, 4), (4, 6)])


def test_auto_checkpoint_meets_the_budget_with_identical_gradients():
    torch.manual_seed(0)
    model = chain(16).double()
    x = torch.randn(4, 8, 16, 16, dtype=torch.float64)
    full = training_peak(model, x)
    budget = int(0.5 * full)
    planned = revnets.auto_checkpoint(model, x, budget)
    assert isinstance(planned[0], revnets.Checkpointed)
    assert training_peak(planned, x) <= budget  # measured, on this CPU
    model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(model)
    planned(x).sum().backward()
    reference(x).sum().backward()
    assert max_grad_error(model, reference) <= 1e-6  # float32; recomputation repeats the same ops
    for a, b in zip(model.buffers(), reference.buffers()):
        assert torch.equal(a, b)


def test_auto_checkpoint_leaves_a_model_that_fits_alone():
    model = chain(4)
    x = torch.randn(2, 8, 8, 8)
    assert revnets.auto_checkpoint(model, x, budget=10 * training_peak(model, x)) is model


def test_auto_checkpoint_names_the_smallest_reachable_budget():
    model = chain(8)
    x = torch.randn(2, 8, 8, 8)
    with pytest.raises(revnets.PlanningError, match=r"smallest budget .* is [\d.]+ MiB"):
        revnets.auto_checkpoint(model, x, budget=1000)


def test_auto_checkpoint_picks_a_memory_strategy_for_a_revnet():
    model = timm.create_model("revnet38", memory="none")
    x = torch.randn(8, 3, 32, 32)
    baseline = training_peak(model, x)
    revnets.auto_checkpoint(model, x, budget=int(0.6 * baseline))
    assert model.memory in ("reversible", "reversible+checkpoint")
    assert training_peak(model, x) <= 0.6 * baseline


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_auto_checkpoint_refuses_what_it_cannot_plan():
    with pytest.raises(TypeError, match="neither a chain of layers nor a revnets zoo model"):
        revnets.auto_checkpoint(TwoOutputs(), torch.randn(1, 2), budget=10**6)


@pytest.mark.parametrize("name, keep", [("resnet18", 0.9), ("densenet121", 0.6)])
def test_models_nobody_here_wrote(name, keep):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, num_classes=10)
    x = torch.randn(16, 3, 64, 64)  # enough activations that recomputing pays
    chain = revnets.planning.as_chain(model)
    reference = copy.deepcopy(model)
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights, grads
    budget = int(state + keep * (training_peak(chain, x) - state))  # less activation memory
    model.zero_grad(set_to_none=True)
    planned = revnets.auto_checkpoint(model, x, budget)
    assert any(isinstance(m, revnets.Checkpointed) for m in planned)
    assert training_peak(planned, x) <= budget
    model.zero_grad(set_to_none=True)
    reference.load_state_dict(model.state_dict())
    planned(x).sum().backward()
    reference(x).sum().backward()
    assert max_grad_error(model, reference) <= 1e-6  # float32; recomputation repeats the same ops


class RNNStep(nn.Module):
    """Step t of an unrolled RNN whose state (inputs, hidden) passes along the chain."""

    def __init__(self, cell: nn.RNNCell, t: int):
        super().__init__()
        self.cell, self.t = cell, t

    def forward(self, state):
        inputs, h = state
        return inputs, self.cell(inputs[self.t], h)


def test_recurrent_chain_with_tuple_state():
    torch.manual_seed(0)
    cell = nn.RNNCell(16, 128).double()
    model = nn.Sequential(*(RNNStep(cell, t) for t in range(40)))
    state = (torch.randn(40, 32, 16, dtype=torch.float64),
             torch.zeros(32, 128, dtype=torch.float64))

    def loss(out):
        return out[1].sum()

    def peak(m):
        return measure_memory(lambda m, s: loss(m(s)).backward(), m, state).peak_bytes

    budget = int(0.7 * peak(model))
    cell.zero_grad(set_to_none=True)
    planned = revnets.auto_checkpoint(model, state, budget, loss)
    assert peak(planned) <= budget
    cell.zero_grad(set_to_none=True)
    loss(planned(state)).backward()
    grads = [p.grad.clone() for p in cell.parameters()]
    cell.zero_grad(set_to_none=True)
    loss(model(state)).backward()
    for a, p in zip(grads, cell.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-12, atol=1e-12)
