"""The replay's two shortcuts keep its guarantees: transforms made only of torch.nn layers are
recorded without the dispatcher's watch (NOTE [ Known layers ]), and consecutive recordings of one
forward share their Python and numpy generator states and the torch namespaces found as torch made
them (RecordingChain). Each case trains exactly like
the same modules under ordinary autograd (float64, 1e-10), or is shown to take the watched path."""

import io
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


def with_instance_helper(m):
    conv = m[0]
    conv._conv_forward = lambda x, weight, bias: nn.functional.conv1d(x, weight, bias)
    return m


def with_untracked_statistics(m):
    m[0].track_running_stats = False  # its buffers stay, and instance_norm still updates them
    return m


WATCHED = {
    "subclass": lambda: nn.Sequential(MyLinear(WIDTH, WIDTH), nn.ReLU()),
    "custom_module": lambda: nn.Sequential(Scaled(), nn.ReLU()),
    "forward_hook": lambda: with_hook(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())),
    "instance_forward": lambda: with_instance_forward(nn.Sequential(nn.Linear(WIDTH, WIDTH))),
    "parametrization": lambda: with_parametrization(nn.Sequential(nn.Linear(WIDTH, WIDTH))),
    "helper_method_on_the_instance": lambda: with_instance_helper(
        nn.Sequential(nn.Conv1d(3, 3, 1))
    ),
    "norms_in_training_and_eval_mode": lambda: nn.Sequential(
        nn.BatchNorm1d(WIDTH).eval(), nn.BatchNorm1d(WIDTH)
    ),
    "untracked_running_statistics": lambda: with_untracked_statistics(
        nn.Sequential(nn.InstanceNorm1d(3, track_running_stats=True))
    ),
    "in_place_first": lambda: nn.Sequential(nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH)),
    "in_place_after_a_view": lambda: nn.Sequential(
        nn.Identity(), nn.Dropout(0.0), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH)
    ),
}


def test_a_transform_of_torch_nn_layers_is_recorded_without_the_watch():
    assert known_run([known_unit()], CPU, keep_random=True) is not None


def test_a_tensor_saved_with_torch_save_leaves_the_layers_known(monkeypatch):
    """Pickling adds a data attribute to the tensor class (``__slotnames__``, once per process),
    which runs no code: no patch, so a training loop that saves checkpoints keeps the fast
    path (before: it was off from the first save on). A method added under a name torch looks
    up (``relu``, shadowing ``TensorBase.relu``) is still a patch; one under a name of its own
    (``relu_twice``) runs only where the user calls it."""
    monkeypatch.delattr(torch.Tensor, "__slotnames__", raising=False)
    assert known_run([known_unit()], CPU, keep_random=True) is not None
    torch.save(torch.zeros(2), io.BytesIO())
    assert "__slotnames__" in vars(torch.Tensor)
    assert known_run([known_unit()], CPU, keep_random=True) is not None
    monkeypatch.setattr(torch.Tensor, "relu_twice", lambda self: self.relu(), raising=False)
    assert known_run([known_unit()], CPU, keep_random=True) is not None
    monkeypatch.setattr(torch.Tensor, "relu", lambda self: self.clamp(min=0), raising=False)
    assert known_run([known_unit()], CPU, keep_random=True) is None


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


@pytest.mark.parametrize("owner, name", [
    (nn.modules.conv._ConvNd, "_conv_forward"),  # a helper on a base class
    (nn.Conv1d, "_conv_forward"),  # the same helper shadowed on the layer's class
    (torch, "conv1d"), (torch, "tanh"), (torch.Tensor, "tanh"),
])
def test_patched_code_anywhere_a_layer_runs_sends_it_to_the_watch(monkeypatch, owner, name):
    layers = nn.Sequential(nn.Conv1d(3, 3, 1), nn.Tanh(), nn.ReLU())
    assert known_run([layers], CPU, keep_random=True) is not None
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: original(*args, **kwargs))
    assert known_run([layers], CPU, keep_random=True) is None
    monkeypatch.undo()
    assert known_run([layers], CPU, keep_random=True) is not None


def test_what_a_forward_never_runs_may_change():
    # torch.compile wraps Module.__init__ and __setstate__ to tag modules; new submodules appear
    # in the torch namespace as they are imported.
    layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
    original = nn.Module.__init__
    try:
        nn.Module.__init__ = lambda self, *args, **kwargs: original(self, *args, **kwargs)
        torch.a_new_submodule = torch.nn
        assert known_run([layers], CPU, keep_random=True) is not None
    finally:
        nn.Module.__init__ = original
        del torch.a_new_submodule


def test_the_device_must_be_known():
    assert known_run([known_unit()], None, keep_random=True) is None


def train_like_ordinary_autograd(
    f, g, depth=4, steps=3, plan=Reconstruct(), shape=(8,), coupling="additive"
):
    torch.manual_seed(0)
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(f(), g(), coupling, split_dim=-1) for _ in range(depth)], plan
    ).double()
    reference = twin(model)
    x = torch.randn(*shape, 2 * WIDTH, dtype=torch.float64)
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


def test_a_patched_torch_function_that_draws_is_replayed(monkeypatch):
    tanh = torch.tanh
    monkeypatch.setattr(torch, "tanh", lambda x: tanh(x) * torch.rand_like(x))
    train_like_ordinary_autograd(
        lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
    )


class PatchesTanhOnce(nn.Module):
    """User code that, in its first forward, patches torch.tanh to draw random numbers: the known
    transforms after it in the same forward must not trust what was checked before it ran."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        if torch.tanh is TANH:
            torch.tanh = lambda t: TANH(t) * torch.rand_like(t)
        return self.linear(x)


TANH = torch.tanh


def test_torch_patched_by_user_code_mid_forward_sends_later_known_layers_to_the_watch():
    # Namespaces are compared once per chain of recordings (RecordingChain); user code in a
    # watched transform ends what was verified before it.
    try:
        train_like_ordinary_autograd(
            PatchesTanhOnce, lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), steps=1
        )
    finally:
        torch.tanh = TANH


def test_an_instance_norm_with_untracked_running_statistics_trains_like_ordinary_autograd():
    def unit():
        return with_untracked_statistics(nn.Sequential(
            nn.InstanceNorm1d(3, affine=True, track_running_stats=True), nn.Linear(WIDTH, WIDTH)
        ))

    train_like_ordinary_autograd(unit, unit, shape=(4, 3))


def test_a_batch_norm_without_a_batch_count_trains_like_ordinary_autograd():
    def unit():
        norm = nn.BatchNorm1d(WIDTH)
        norm.num_batches_tracked = None
        return nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), norm, nn.Tanh())

    train_like_ordinary_autograd(unit, WATCHED["custom_module"])


class SharedStatistics(nn.Module):
    """An eval-mode norm reading the running statistics a training-mode norm updates."""

    def __init__(self):
        super().__init__()
        self.reader, self.writer = nn.BatchNorm1d(WIDTH).eval(), nn.BatchNorm1d(WIDTH)
        self.reader.running_mean = self.writer.running_mean
        self.reader.running_var = self.writer.running_var

    def forward(self, x):
        return self.writer(self.reader(x))


@pytest.mark.parametrize("layers", [
    SharedStatistics,  # watched
    lambda: nn.Sequential(*SharedStatistics().children()),  # known layers
], ids=["module_of_ones_own", "torch_nn_layers"])
def test_statistics_a_training_norm_updates_read_by_an_eval_norm_are_refused(layers):
    # The replay leaves a training norm's statistics as the forward left them (NOTE [ Replay ],
    # rule 2): the eval-mode norm would read the updated ones.
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(layers(), nn.Linear(WIDTH, WIDTH), split_dim=-1)]
    )
    x = torch.randn(8, 2 * WIDTH, requires_grad=True)
    with pytest.raises(RuntimeError, match="running_mean of a BatchNorm in training mode is read"):
        model(x).sum().backward()


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


class DrawingCoupling(revnets.AdditiveCoupling):
    """Draws from Python's generator between f's recording and g's (user code the chain must not
    pass over)."""

    def combine(self, x, h):
        random.random()
        return x + h

    def combine_(self, x, h):
        random.random()
        return x.add_(h)


def test_python_randomness_drawn_by_a_coupling_of_ones_own_is_replayed():
    train_like_ordinary_autograd(PythonDepth, PythonDepth, coupling=DrawingCoupling())
