"""The replay's two shortcuts keep its guarantees: transforms made only of torch.nn layers are
recorded without the dispatcher's watch (NOTE [ Known layers ]), and consecutive recordings of one
forward share their Python and numpy generator states (RandomChain). Each case trains exactly like
the same modules under ordinary autograd (float64, 1e-10), or is shown to take the watched path."""

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import revnets
from revnets import Reconstruct, Store
from revnets.replay.known import known_run

from conftest import max_grad_error, rel_error, twin

WIDTH = 6
CPU = torch.device("cpu")


def known_unit():
    return nn.Sequential(  # no bias before BatchNorm: it would get no gradient to compare
        nn.Linear(WIDTH, WIDTH, bias=False), nn.BatchNorm1d(WIDTH), nn.Identity(),
        nn.ReLU(inplace=True),
        nn.Dropout(0.3), nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2, inplace=True), nn.Tanh(),
    )


class MyLinear(nn.Linear):
    pass


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.linear(x) * 0.5


class Doubled(nn.Module):
    def forward(self, weight):
        return 2 * weight


def with_hook(m):
    m[0].register_forward_hook(lambda *args: None)
    return m


def with_instance_forward(m):
    m[0].forward = lambda x: nn.functional.linear(x, m[0].weight)
    return m


def with_parametrization(m):
    parametrize.register_parametrization(m[0], "weight", Doubled())
    return m


WATCHED = {
    "subclass": lambda: nn.Sequential(MyLinear(WIDTH, WIDTH), nn.ReLU()),
    "custom_module": lambda: nn.Sequential(Scaled(), nn.ReLU()),
    "forward_hook": lambda: with_hook(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())),
    "instance_forward": lambda: with_instance_forward(nn.Sequential(nn.Linear(WIDTH, WIDTH))),
    "parametrization": lambda: with_parametrization(nn.Sequential(nn.Linear(WIDTH, WIDTH))),
    "in_place_first": lambda: nn.Sequential(nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH)),
    "in_place_after_a_view": lambda: nn.Sequential(
        nn.Identity(), nn.Dropout(0.0), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH)
    ),
}


def test_a_transform_of_torch_nn_layers_is_recorded_without_the_watch():
    assert known_run([known_unit()], CPU, keep_random=True) is not None


@pytest.mark.parametrize("make", WATCHED.values(), ids=WATCHED.keys())
def test_anything_else_is_watched(make):
    assert known_run([make()], CPU, keep_random=True) is None


def test_a_global_hook_sends_every_transform_to_the_watch():
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert known_run([known_unit()], CPU, keep_random=True) is None
    finally:
        handle.remove()


def test_a_patched_layer_class_or_functional_sends_its_layers_to_the_watch(monkeypatch):
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: x @ self.weight.T)
    assert known_run([nn.Sequential(nn.Linear(WIDTH, WIDTH))], CPU, keep_random=True) is None
    monkeypatch.undo()
    monkeypatch.setattr(nn.functional, "dropout", lambda x, *args, **kwargs: x)
    assert known_run([nn.Sequential(nn.Dropout())], CPU, keep_random=True) is None
    monkeypatch.undo()
    assert known_run([nn.Sequential(nn.Linear(WIDTH, WIDTH))], CPU, keep_random=True)


def test_the_device_must_be_known():
    assert known_run([known_unit()], None, keep_random=True) is None


def train_like_ordinary_autograd(f, g, depth=4, steps=3, plan=Reconstruct()):
    torch.manual_seed(0)
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(f(), g(), split_dim=-1) for _ in range(depth)], plan
    ).double()
    reference = twin(model)
    x = torch.randn(8, 2 * WIDTH, dtype=torch.float64)
    x, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    for seed in range(steps):
        for m, xi in ((model, x), (reference, x_reference)):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
            m(xi).square().sum().backward()
    assert rel_error(x.grad, x_reference.grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name


@pytest.mark.parametrize("plan", [Reconstruct(), Reconstruct(store_last_blocks=1)],
                         ids=["recompute_all", "store_last_block"])
def test_known_layers_with_dropout_and_batch_norm_train_like_ordinary_autograd(plan):
    train_like_ordinary_autograd(known_unit, known_unit, plan=plan)


def test_a_watched_f_beside_a_known_g_trains_like_ordinary_autograd():
    train_like_ordinary_autograd(WATCHED["custom_module"], known_unit)


class PythonDepth(nn.Module):
    """Skips its branch at random, drawing from Python's and numpy's global generators."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        keep = (random.random() < 0.5) + (np.random.rand() < 0.5)
        return torch.tanh(self.linear(x)) * keep


def test_python_randomness_in_some_blocks_and_known_layers_in_others_is_replayed():
    # f draws from Python and numpy, g is known layers: the chain passes over every g.
    train_like_ordinary_autograd(PythonDepth, known_unit, depth=6)


def test_python_randomness_drawn_between_recordings_by_a_hook_is_replayed():
    # A forward pre-hook on a block draws between one block's recordings and the next: the
    # recordings after it must not begin from the state the previous one ended with.
    def make(plan):
        torch.manual_seed(0)
        blocks = [revnets.ReversibleBlock(PythonDepth(), PythonDepth(), split_dim=-1)
                  for _ in range(4)]
        for block in blocks[1::2]:
            block.register_forward_pre_hook(lambda module, args: random.random() and None)
        return revnets.ReversibleSequence(blocks, plan).double()

    model, reference = make(Reconstruct()), make(Store())
    x = torch.randn(8, 2 * WIDTH, dtype=torch.float64)
    x, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    for seed in range(4):
        for m, xi in ((model, x), (reference, x_reference)):
            random.seed(seed)
            np.random.seed(seed)
            m(xi).square().sum().backward()
    assert rel_error(x.grad, x_reference.grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10
