import pytest
import torch
from torch import nn

import revnets
from revnets.replay import Recording, state_tensors

from conftest import max_grad_error, twin


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
    assert replay.default_generator(torch.device("xpu", 1)) is generators[1]
    assert replay.default_generator(torch.device("xpu")) is generators[0]
    single = replay.default_generator(torch.device("mps"))
    assert torch.equal(single.get_state(), torch.zeros(4, dtype=torch.uint8))


class _UpdatedStatistics(nn.Module):
    """Running statistics a kernel updates in place without its schema saying so, as
    batch_norm_update_stats does."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x):
        torch.batch_norm_update_stats(x.detach(), self.running_mean, self.running_var, 0.1)
        return x - x.mean((0, 2, 3), keepdim=True)


class _GatheredNorm(nn.BatchNorm2d):
    """A BatchNorm updating its running statistics as nn.SyncBatchNorm does, through
    batch_norm_gather_stats_with_counts (one process)."""

    def forward(self, x):
        mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
        self.num_batches_tracked.add_(1)
        self.gather(x.detach(), mean.detach()[None], (var.detach() + self.eps).rsqrt()[None],
                    x.numel() // x.shape[1])
        scale = self.weight * (var + self.eps).rsqrt()
        return (x - mean[:, None, None]) * scale[:, None, None] + self.bias[:, None, None]


    def gather(self, x, mean, invstd, count):
        counts = torch.full((1,), count, dtype=x.dtype)
        torch.batch_norm_gather_stats_with_counts(x, mean, invstd, self.running_mean,
                                                  self.running_var, self.momentum, self.eps, counts)


class _GatheredNormOlderKernel(_GatheredNorm):
    """The same through batch_norm_gather_stats, which takes one count for all processes."""

    def gather(self, x, mean, invstd, count):
        torch.batch_norm_gather_stats(x, mean, invstd, self.running_mean, self.running_var,
                                      self.momentum, self.eps, count)


def _gather_on_cpu(x, mean, invstd, running_mean, running_var, momentum, eps, counts):
    """The one-process case of CUDA's kernel, for the CPU, which has none."""
    mean, var = mean[0], invstd[0].pow(-2) - eps
    n = counts.sum() if isinstance(counts, torch.Tensor) else counts
    running_mean.mul_(1 - momentum).add_(momentum * mean)
    running_var.mul_(1 - momentum).add_(momentum * var * n / (n - 1))
    return mean, invstd[0]


@pytest.fixture
def gather_stats_on_cpu():
    library = torch.library.Library("aten", "IMPL")
    library.impl("batch_norm_gather_stats_with_counts", _gather_on_cpu, "CPU")
    library.impl("batch_norm_gather_stats", _gather_on_cpu, "CPU")
    yield
    library._destroy()


@pytest.mark.parametrize("norm", [_UpdatedStatistics, _GatheredNorm, _GatheredNormOlderKernel])
@pytest.mark.parametrize("wrapper", ["checkpointed", "reversible"])
def test_statistics_kernels_that_hide_their_writes_update_once(norm, wrapper,
                                                               gather_stats_on_cpu):
    """batch_norm_update_stats and SyncBatchNorm's gathering kernel write the running
    statistics without declaring it in their schemas: the first was replayed onto them (updated
    twice, silently), the second refused as code reading a BatchNorm's statistics. Compared with
    the same model storing everything: gradients and every buffer."""
    torch.manual_seed(0)

    def unit():
        return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, bias=False), norm(2), nn.ReLU())

    model = (revnets.Checkpointed(unit()) if wrapper == "checkpointed" else
             revnets.ReversibleSequence([revnets.ReversibleBlock(unit(), unit())])).double()
    plain = twin(model)
    x = torch.randn(2, 4 if wrapper == "reversible" else 2, 5, 5, dtype=torch.float64)
    for m in (model, plain):
        for _ in range(2):
            m(x).square().sum().backward()
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b), name
