"""A model torch.fx cannot trace is planned as checkpoints of whole modules its own forward
calls (NOTE [ Plans of whole modules ]): measured == predicted within the budget, training
exactly as the model itself does, and left as it was."""

import random

import pytest
import torch
from torch import nn

import revnets
from revnets.memory import measure_memory
from revnets.planning import CheckpointedModules

from conftest import activation_budget, train_step


class Exchange(nn.Module):
    """Two streams that feed each other, taking and returning a list (as CrossViT's blocks),
    skipped at random in training (stochastic depth drawn with Python's ``random``)."""

    def __init__(self, width: int, skip: float):
        super().__init__()
        self.skip = skip
        self.a, self.b = (nn.Sequential(nn.Linear(width, 4 * width), nn.BatchNorm1d(4 * width),
                                        nn.GELU(), nn.Dropout(0.2), nn.Linear(4 * width, width))
                          for _ in range(2))
        self.gain = 1.5  # read by the model's own forward, through whatever stands here

    def forward(self, xs):
        a, b = xs
        if self.training and random.random() < self.skip:
            return [a, b]
        return [a + self.a(b), b + self.b(a)]


class TwoStreams(nn.Module):
    """Its forward picks a path by a shape: torch.fx cannot trace it."""

    def __init__(self, width: int = 32, depth: int = 4, skip: float = 0.0):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Exchange(width, skip) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.stem(x)
        xs = [h, h.flip(0)] if h.shape[0] > 1 else [h, h]
        for block in self.blocks:
            xs = block(xs)
        return self.head(xs[0] + xs[1]) * self.blocks[0].gain


def untraceable(dtype=torch.float32, skip=0.0):
    """A skip drawn makes every step's peak a draw: planned at 0, peaks are exact."""
    torch.manual_seed(0)
    return TwoStreams(skip=skip).to(dtype), torch.randn(256, 8, dtype=dtype)


def plan(model, x, budget):
    with pytest.warns(UserWarning, match="TwoStreams cannot be traced.*whole modules"):
        return revnets.auto_checkpoint(model, x, budget)


def unplanned_peak(model, x):
    return measure_memory(train_step, model, x).peak_bytes


def test_a_model_fx_cannot_trace_is_planned_as_checkpoints_of_the_modules_it_calls():
    model, x = untraceable()
    unplanned = unplanned_peak(model, x)
    budget = activation_budget(model, x, 0.5)
    planned = plan(model, x, budget)
    assert isinstance(planned, CheckpointedModules) and planned.model is model
    assert planned.memory_plan.parts and all(
        isinstance(part.decision, revnets.Checkpoint) for part in planned.memory_plan.parts)
    measured = measure_memory(train_step, planned, x).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= budget < unplanned


def test_its_training_steps_are_the_model_s_own_gradients_buffers_draws_and_hooks():
    model, x = untraceable(torch.float64, skip=0.3)
    planned = plan(model, x, activation_budget(model, x, 0.5))
    calls = []
    model.blocks[1].register_forward_hook(lambda *args: calls.append(1))

    def steps(trained):
        torch.manual_seed(1)
        random.seed(1)
        grads = []
        for _ in range(3):
            train_step(trained, x)
            grads.append([p.grad for p in model.parameters()])  # None in a block skipped
        return grads, [b.clone() for b in model.buffers()], random.random(), len(calls)

    buffers = [b.clone() for b in model.buffers()]
    own = steps(model)
    for b, saved in zip(model.buffers(), buffers):
        b.copy_(saved)
    calls.clear()
    theirs = steps(planned)
    for own_step, their_step in zip(own[0], theirs[0]):
        assert [a is None for a in own_step] == [b is None for b in their_step]
        assert max((a - b).abs().max().item() for a, b in zip(own_step, their_step)
                   if a is not None) < 1e-10
    assert all(torch.equal(a, b) for a, b in zip(own[1], theirs[1]))  # BatchNorm, once a step
    assert own[2:] == theirs[2:]  # Python's generator drawn as often; the hook ran once a step


def test_outside_training_steps_the_model_itself_runs_and_no_module_stays_swapped():
    model, x = untraceable()
    modules = dict(model.named_modules())
    planned = plan(model, x, activation_budget(model, x, 0.5))
    train_step(planned, x)
    with torch.no_grad():
        torch.manual_seed(1)
        no_grad = planned(x)
        torch.manual_seed(1)
        assert torch.equal(no_grad, model(x))
    planned.eval()
    assert not model.training and torch.equal(planned(x), model(x))
    planned.train()
    model.blocks[2].b[0].weight.data = torch.randn(1, 1)  # the step fails in the model's code
    with pytest.raises(RuntimeError):
        train_step(planned, x)
    assert dict(model.named_modules()) == modules
    assert set(planned.state_dict()) == {f"model.{key}" for key in model.state_dict()}


def test_a_refusal_names_a_budget_that_then_plans_the_same_way_every_time():
    model, x = untraceable()
    with pytest.raises(revnets.PlanningError) as refused:
        plan(model, x, 10**5)
    smallest = refused.value.smallest_budget
    first, again = plan(model, x, smallest), plan(model, x, smallest)
    assert first.names == again.names
    assert measure_memory(train_step, first, x).peak_bytes == first.memory_plan.peak_bytes
    assert first.memory_plan.peak_bytes <= smallest


def test_a_smaller_budget_never_gets_a_higher_peak():
    model, x = untraceable()
    unplanned = unplanned_peak(model, x)
    with pytest.raises(revnets.PlanningError) as refused:
        plan(model, x, 10**5)
    low = refused.value.smallest_budget
    peaks = [measure_memory(train_step, plan(model, x, int(low + share * (unplanned - low))),
                            x).peak_bytes for share in (0.0, 0.2, 0.4, 0.6, 0.8)]
    assert peaks == sorted(peaks) and len(set(peaks)) > 1


def test_a_model_that_fits_as_it_is_comes_back_as_itself():
    model, x = untraceable()
    unplanned = unplanned_peak(model, x)
    planned = plan(model, x, unplanned)
    assert planned is model and model.memory_plan.peak_bytes == unplanned


def test_forward_times_of_an_untraceable_model_are_empty_and_plan_as_no_times_do():
    model, x = untraceable()
    times = revnets.forward_times(model, x)
    assert times.steps == ()
    budget = activation_budget(model, x, 0.5)
    with pytest.warns(UserWarning):
        timed = revnets.auto_checkpoint(model, x, budget, measure_time=times)
    assert timed.names == plan(model, x, budget).names
