import pytest
import torch
from torch import nn

from revnets.replay import Recording, state_tensors


def test_state_tensors_walk_like_named_parameters_and_buffers():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Sequential(nn.Linear(4, 2))
    )
    slots, names = state_tensors(model), state_tensors(model, names=True)
    # Module by module, parameters then buffers: bias=None keeps its slot.
    assert names == [
        "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
        "1.num_batches_tracked", "2.0.weight", "2.0.bias",
    ]
    assert slots[1] is None
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert all(named[n] is t for n, t in zip(names, slots) if t is not None)
    assert state_tensors(model, buffers=False, names=True) == [
        n for n in names if n in dict(model.named_parameters()) or n == "0.bias"
    ]


def recorded(model, *inputs):
    recording = Recording([model])
    with recording:
        model(*inputs)
    return recording


def test_a_recording_names_what_was_swapped():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    recording = recorded(model, torch.randn(1, 2))
    recording.check("owner", "remedy")  # nothing changed
    model[1].bias = nn.Parameter(model[1].bias.detach().clone())
    with pytest.raises(RuntimeError, match=r"owner: 1.bias is not the tensor the forward pass"):
        recording.check("owner", "remedy")


def test_a_recording_names_what_was_modified_in_place():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.BatchNorm1d(2).eval())
    model[0].weight.requires_grad_(False)  # a frozen weight is checked as well
    recording = recorded(model, torch.randn(3, 2))
    with torch.no_grad():
        model[0].weight.mul_(2)
    with pytest.raises(RuntimeError, match=r"owner: 0.weight was modified in place"):
        recording.check("owner", "remedy")


class EMA(nn.Module):
    def __init__(self, reassign: bool):
        super().__init__()
        self.reassign = reassign
        self.register_buffer("ema", torch.zeros(2))

    def forward(self, x):
        if self.reassign:
            self.ema = self.ema + 1
        else:
            self.ema.add_(1)
        return x * self.ema


@pytest.mark.parametrize("reassign", [False, True], ids=["in_place", "reassigned"])
def test_the_replay_sees_the_state_the_run_found_and_its_update_is_dropped(reassign):
    model = EMA(reassign)
    recording = recorded(model, torch.ones(2))
    assert torch.equal(model.ema, torch.ones(2))  # the run's update, made once
    with recording.replayed():
        assert torch.equal(model(torch.ones(2)), torch.ones(2))  # computed from ema = 0
    assert torch.equal(model.ema, torch.ones(2))


class ScheduledMomentumNorm(nn.BatchNorm1d):
    """A batch norm whose momentum is a property (a schedule kept elsewhere)."""

    @property
    def momentum(self):
        return self.schedule

    @momentum.setter
    def momentum(self, value):
        self.schedule = value


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, ScheduledMomentumNorm])
def test_the_replay_leaves_batch_norm_statistics_as_the_run_left_them(norm):
    model = norm(2).train()
    x = torch.randn(4, 2)
    recording = recorded(model, x)
    after_run = (model.running_mean.clone(), model.running_var.clone(),
                 model.num_batches_tracked.clone())
    with recording.replayed():
        model(x)
    assert model.momentum == 0.1
    assert all(torch.equal(a, b) for a, b in zip(
        after_run, (model.running_mean, model.running_var, model.num_batches_tracked)))


def test_the_replay_draws_from_a_generator_only_a_closure_knows():
    generator = torch.Generator().manual_seed(5)

    class Noise(nn.Module):
        def forward(self, x):
            return x + torch.rand(x.shape, generator=generator)

    model = Noise()
    recording = Recording([model])
    with recording:
        first = model(torch.zeros(3))
    after = generator.get_state()
    with recording.replayed():
        assert torch.equal(model(torch.zeros(3)), first)
    assert torch.equal(generator.get_state(), after)  # the caller's generator is put back


def test_a_device_draws_from_its_own_default_generator(monkeypatch):
    """Each accelerator through its own device module (not torch.cuda), and devices whose module
    keeps one generator (mps) through its get/set_rng_state."""
    import revnets.replay.state as replay

    generators = [torch.Generator(), torch.Generator()]

    class Accelerator:
        default_generators = generators

        def current_device(self):
            return 0

    class SingleGenerator:
        def get_rng_state(self):
            return torch.zeros(4, dtype=torch.uint8)

    modules = {"xpu": Accelerator(), "mps": SingleGenerator()}
    monkeypatch.setattr(replay.torch, "get_device_module", lambda kind: modules[kind])
    assert replay._default_generator(torch.device("xpu", 1)) is generators[1]
    assert replay._default_generator(torch.device("xpu")) is generators[0]
    single = replay._default_generator(torch.device("mps"))
    assert torch.equal(single.get_state(), torch.zeros(4, dtype=torch.uint8))
