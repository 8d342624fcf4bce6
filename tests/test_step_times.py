"""Forward times measured once and passed to any number of plans (NOTE [ Times measured once ]
in revnets/planning/costs/step_times.py): plans made on them do not follow a new measurement's
noise, a smaller budget never gets a higher measured peak, and measuring leaves the model as
it was."""

import math
import re
from dataclasses import replace

import numpy
import pytest
import timm
import torch
from test_planning_speed import conv_chain
from torch import nn

import revnets
from revnets.memory import measure_memory
from revnets.planning.costs import step_times

from conftest import activation_budget, train_step


def blocks(depth: int = 6, width: int = 64) -> nn.Sequential:
    """Pre-norm MLP blocks: products to keep, norms and activations to recompute."""
    def block() -> nn.Sequential:
        return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                             nn.Linear(4 * width, width), nn.Dropout(0.1))

    return nn.Sequential(*(block() for _ in range(depth)))


def scaled(times: revnets.ForwardTimes, seed: int) -> revnets.ForwardTimes:
    """``times`` with each step's seconds scaled at random from a quarter to four times: what
    a busy machine may have measured."""
    generator = torch.Generator().manual_seed(seed)
    scales = 4 ** (2 * torch.rand(len(times.seconds), generator=generator,
                                  dtype=torch.float64) - 1)
    return replace(times, seconds=tuple(s * float(r) for s, r in zip(times.seconds, scales)))


def plan_of(planned: nn.Module) -> tuple:
    return tuple((part.name, str(part.decision)) for part in planned.memory_plan.parts)


@pytest.mark.parametrize("seed", range(3))
def test_plans_on_one_measurement_never_peak_higher_at_a_smaller_budget(seed):
    torch.manual_seed(seed)
    model, x = blocks(), torch.randn(128, 64)
    times = scaled(revnets.forward_times(model, x), seed)
    with pytest.raises(revnets.PlanningError) as refusal:
        revnets.auto_checkpoint(model, x, 1, measure_time=times)
    floor, stored = refusal.value.smallest_budget, activation_budget(model, x, 1.0)
    peaks = []
    for share in torch.linspace(1.0, 0.0, 11).tolist():
        planned = revnets.auto_checkpoint(model, x, int(floor + share * (stored - floor)),
                                          measure_time=times)
        peaks.append(measure_memory(train_step, planned, x).peak_bytes)
    assert peaks == sorted(peaks, reverse=True), peaks


# Forward seconds one busy measurement of conv_chain() gave, each scaled at random (seed 11 of
# a sweep of random scales).
CONV_CHAIN_SECONDS = (
    0.00141, 0.00182, 0.000207, 0.000418, 0.000587, 4.09e-05, 0.000518, 0.000369, 0.0001,
    0.000173, 3.67e-05, 4.78e-05, 0.000399, 0.000173, 7.81e-05, 0.00258, 0.000109, 6.12e-05,
    0.000848, 0.000454, 0.000373, 0.00128, 2.7e-05, 0.00018, 0.000111, 7.66e-05, 0.000195,
    0.000385, 2.25e-05, 1.81e-05, 0.000112, 8.23e-05, 4.87e-06, 0.000142, 0.000907, 0.000109,
    0.000617, 5.61e-05, 6.44e-05)


def test_a_plan_a_larger_budget_finds_is_found_at_a_smaller_one_it_fits():
    """The larger budget's plan keeps a convolution's output selectively, and the checkpoint
    after it keeps that output as its input: one storage. Modelled twice, 64 kB high, the plan
    was never tried at the smaller budget, which took a dearer plan peaking 18 kB higher."""
    model, x = conv_chain(), torch.randn(4, 3, 16, 16)
    times = revnets.ForwardTimes(revnets.forward_times(model, x).steps, CONV_CHAIN_SECONDS)
    smaller, larger = (revnets.auto_checkpoint(model, x, budget, measure_time=times)
                       for budget in (1_292_928, 1_351_474))
    assert smaller.memory_plan.peak_bytes <= larger.memory_plan.peak_bytes


def test_plans_on_one_measurement_are_the_same_in_every_call_and_measured_anew_are_not(
        monkeypatch):
    """Every measurement here is scaled at random step by step (``scaled``): plans measuring
    their own times follow that noise, plans on one measurement do not measure again."""
    measure = step_times.chain_times
    seeds = iter(range(1000))
    monkeypatch.setattr(step_times, "chain_times",
                        lambda chain, x: scaled(measure(chain, x), next(seeds)))
    monkeypatch.setattr(revnets.planning.chain_planner, "chain_times", step_times.chain_times)
    torch.manual_seed(0)
    model, x = blocks(), torch.randn(128, 64)
    budget = activation_budget(model, x, 0.4)
    times = revnets.forward_times(model, x)
    once = {plan_of(revnets.auto_checkpoint(model, x, budget, measure_time=times))
            for _ in range(4)}
    anew = {plan_of(revnets.auto_checkpoint(model, x, budget)) for _ in range(4)}
    assert len(once) == 1 and len(anew) > 1, (once, anew)


def test_times_of_another_model_are_refused_by_name():
    x = torch.randn(8, 64)
    times = revnets.forward_times(blocks(depth=2), x)
    with pytest.raises(ValueError, match="forward times of another chain"):
        revnets.auto_checkpoint(blocks(depth=3), x, 10**9, measure_time=times)


@pytest.mark.parametrize("seconds, why", [
    ((0.1,) * 2, "2 seconds for 3 steps"), ((0.1,) * 4, "4 seconds for 3 steps"),
    ((0.1, math.nan, 0.1), "nan"), ((0.1, -1.0, 0.1), "-1.0"), ((0.1, math.inf, 0.1), "inf"),
    ((0.1, "0.2", 0.1), "'0.2'"),
], ids=["short", "long", "nan", "negative", "infinite", "text"])
def test_times_not_one_finite_number_a_step_are_refused_by_name(seconds, why):
    # Fewer seconds than steps were paired with the first steps: the plan left out the last
    # one, and the planned model computed another function.
    with pytest.raises(ValueError, match=re.escape(why)):
        revnets.ForwardTimes(("0:Linear", "1:ReLU", "2:Linear"), seconds)
    with pytest.raises(TypeError, match="measure_time is True, False or the ForwardTimes"):
        revnets.auto_checkpoint(blocks(depth=2), torch.randn(8, 64), 10**9, measure_time=seconds)


class BatchShaped(nn.Module):
    """Adds a constant shaped to its batch: it runs at that batch size only."""

    def __init__(self, batch: int, width: int = 64):
        super().__init__()
        self.a, self.b, self.batch = nn.Linear(width, width), nn.Linear(width, width), batch

    def forward(self, x):
        offset = torch.linspace(0, 1, self.batch * x.shape[1]).view(self.batch, x.shape[1])
        return self.b(torch.tanh(self.a(x) + offset))


def test_a_model_that_runs_at_its_own_batch_size_only_is_timed_on_the_whole_batch():
    # Times are measured on 8 samples of a batch; this model failed there.
    model, x = BatchShaped(256), torch.randn(256, 64)
    times = revnets.forward_times(model, x)
    with pytest.raises(revnets.PlanningError) as refusal:
        revnets.auto_checkpoint(model, x, 1, measure_time=times)
    budget = refusal.value.smallest_budget
    planned = revnets.auto_checkpoint(model, x, budget, measure_time=times)
    assert measure_memory(train_step, planned, x).peak_bytes <= budget


class Averaging(nn.Module):
    """Keeps an average of its inputs in a buffer (not a norm's), and builds a constant."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.register_buffer("average", torch.zeros(width))

    def forward(self, x):
        if self.training:
            self.average.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.a(x)[:, torch.arange(x.shape[1] - 1, -1, -1)]


def test_measuring_leaves_every_buffer_and_generator_and_adds_no_attribute():
    model = nn.Sequential(Averaging(), nn.Tanh(), Averaging())
    x, names = torch.randn(16, 64), set(vars(model[0]))
    numpy_state = numpy.random.get_state()[1].copy()
    revnets.forward_times(model, x)
    assert all(not b.any() for b in model.buffers())
    assert (numpy.random.get_state()[1] == numpy_state).all()
    assert set(vars(model[0])) == names


def test_measuring_leaves_the_model_and_the_random_number_generators_as_they_were():
    model = timm.create_model("revnet38", units=(2, 2, 2))
    memory, x = model.memory, torch.randn(2, 3, 32, 32)
    sequences = [(m, m.memory) for m in model.modules()
                 if isinstance(m, revnets.ReversibleSequence)]
    statistics = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    times = revnets.forward_times(model, x)
    assert len(times.steps) == len(times.seconds) > 3
    assert all(s > 0 for s in times.seconds)
    assert model.memory is memory and all(m.memory is d for m, d in sequences)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in statistics.items())
    assert torch.equal(torch.get_rng_state(), state)
