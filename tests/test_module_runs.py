"""Runs of modules checkpointed as one (NOTE [ Runs of modules ] in
revnets/planning/modules/install.py): a loop of layers that a model torch.fx cannot trace calls
one after another keeps its first layer's input alone, trains as the model does, is predicted to
the byte, and a step that leaves the planned run is refused by name."""

import pytest
import torch
from torch import nn

import revnets
from revnets.memory import measure_memory, predict_memory
from revnets.planning import CheckpointedModules

from conftest import train_step

DEPTH = 6


class Context:
    """An object the layers are given besides tensors, as a decoder's layers get a cache."""

    scale = 0.5


class Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.2),
                                 nn.Linear(4 * width, width))

    def forward(self, h, mask, *, context):
        return h + context.scale * self.mlp(self.norm(h)) * mask


class Decoder(nn.Module):
    """Layers in a loop, each given the one before's output, a mask and a context; a head much
    wider than the layers, so that the step peaks at its output and gradient. Its forward picks
    a path by a shape: torch.fx cannot trace it. ``stop``, ``between`` and ``repeat`` make the
    loop leave the planned run: an early exit, a computation between two layers, the first
    layer run twice."""

    def __init__(self, width: int = 32, depth: int = DEPTH, vocab: int = 1024):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)
        self.stop, self.between, self.repeat = depth, False, False

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h
        mask = (x[:, :1] > -2).to(h.dtype)
        context = Context()
        if self.repeat:
            h = self.layers[0](h, mask, context=context)
        for i, layer in enumerate(self.layers[:self.stop]):
            h = layer(h, mask, context=context)
            if self.between and i == 2:
                h = h * 1.0
        return self.head(h)


def decoder(dtype=torch.float32):
    torch.manual_seed(0)
    return Decoder().to(dtype), torch.randn(512, 8, dtype=dtype)


LAYERS = tuple(f"layers.{i}" for i in range(DEPTH))


def planned(model, x, budget):
    with pytest.warns(UserWarning, match="Decoder cannot be traced"):
        return revnets.auto_checkpoint(model, x, budget)


def least_budget(model, x) -> int:
    with pytest.warns(UserWarning, match="Decoder cannot be traced"), \
            pytest.raises(revnets.PlanningError) as refused:
        revnets.auto_checkpoint(model, x, 1)
    return refused.value.smallest_budget


def peak(model, x) -> int:
    return measure_memory(train_step, model, x).peak_bytes


def test_a_run_of_layers_goes_below_one_checkpoint_per_layer_measured_as_predicted():
    model, x = decoder()
    per_layer = peak(CheckpointedModules(model, LAYERS), x)
    least = least_budget(model, x)
    plan = planned(model, x, least)
    assert any(isinstance(part, tuple) and len(part) > 1 for part in plan.decisions)
    measured = peak(plan, x)
    assert measured == plan.memory_plan.peak_bytes <= least < per_layer
    as_one = CheckpointedModules(model, {LAYERS: revnets.Checkpoint()})
    assert peak(as_one, x) == predict_memory(train_step, as_one, x).peak_bytes


def steps_of(model, planned, x, between=lambda: None):
    """One step of ``model`` and one of ``planned`` from the same buffers and seed (the same
    dropout masks), ``between()`` called between them: each one's gradients, buffers after,
    and the generator's next draw after."""

    def step(trained):
        torch.manual_seed(1)
        train_step(trained, x)
        return ([p.grad.clone() for p in model.parameters()],
                [b.clone() for b in model.buffers()], torch.rand(1))

    buffers = [b.clone() for b in model.buffers()]
    own = step(model)
    for b, saved in zip(model.buffers(), buffers):
        b.copy_(saved)
    between()
    return own, step(planned)


def test_a_run_trains_as_the_model_gradients_buffers_and_draws():
    model, x = decoder(torch.float64)
    run = CheckpointedModules(model, {LAYERS: revnets.Checkpoint()})
    assert run.names == LAYERS

    own, theirs = steps_of(model, run, x)
    assert max((a - b).abs().max().item() for a, b in zip(own[0], theirs[0])) < 1e-10
    assert all(torch.equal(a, b) for a, b in zip(own[1], theirs[1]))  # BatchNorm, once a step
    assert torch.equal(own[2], theirs[2])  # the generator left where the model leaves it


def test_a_module_with_hooks_of_its_own_breaks_the_run_there():
    model, x = decoder()
    calls = []
    model.layers[2].register_forward_hook(lambda *args: calls.append(1))
    plan = planned(model, x, least_budget(model, x))
    runs = [part for part in plan.decisions if isinstance(part, tuple)]
    assert runs and not any("layers.2" in run for run in runs)
    calls.clear()  # planning ran the hook on fake tensors
    train_step(plan, x)
    assert calls == [1]  # the hook ran once, around the module's checkpoint or forward


@pytest.mark.parametrize("leaves, refusal", [
    ("stop", r"returned before calling layers.5"),
    ("between", r"layers.3 was called after layers.2 with other arguments"),
    ("repeat", r"layers.0 was called again before layers.5"),
])
def test_a_step_leaving_the_planned_run_is_refused_by_name_and_the_next_trains(leaves, refusal):
    model, x = decoder()
    run = CheckpointedModules(model, {LAYERS: revnets.Checkpoint()})
    setattr(model, leaves, {"stop": 3, "between": True, "repeat": True}[leaves])
    with pytest.raises(RuntimeError, match=rf"layers.0 .. layers.5 as one run.*{refusal}"
                                           r".*Plan the model again"):
        train_step(run, x)
    model.stop, model.between, model.repeat = DEPTH, False, False
    train_step(run, x)
    assert all(p.grad is not None for p in model.parameters())
    assert not any("forward" in vars(m) for m in model.modules())
