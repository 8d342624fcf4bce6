"""Forward times measured once and passed to any number of plans (NOTE [ Times measured once ]
in revnets/planning/step_times.py): plans made on them do not follow a new measurement's
noise, a smaller budget never gets a higher measured peak, and measuring leaves the model as
it was."""

from dataclasses import replace

import pytest
import timm
import torch
from torch import nn

import revnets
from revnets.memory import measure_memory
from revnets.planning import step_times

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


def test_plans_on_one_measurement_are_the_same_in_every_call_and_measured_anew_are_not(
        monkeypatch):
    """Every measurement here is scaled at random step by step (``scaled``): plans measuring
    their own times follow that noise, plans on one measurement do not measure again."""
    measure = step_times.chain_times
    seeds = iter(range(1000))
    monkeypatch.setattr(step_times, "chain_times",
                        lambda chain, x: scaled(measure(chain, x), next(seeds)))
    monkeypatch.setattr(revnets.planning.auto, "chain_times", step_times.chain_times)
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
