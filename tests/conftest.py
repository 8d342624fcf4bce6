import copy
import os

import pytest
import torch
from torch import nn

import revnets

try:  # transformers' log handler, made now on the session's stderr: made in a test, it would
    # write to that test's captured stream, closed after it, and print a logging traceback
    import transformers

    transformers.utils.logging.get_logger("transformers")
except ImportError:
    pass


def pytest_configure(config: pytest.Config) -> None:
    # The default run spreads the test files over one pytest-xdist worker per core (pyproject's
    # addopts): each worker, and each process it starts, gets its share of the cores, so that
    # kernels do not oversubscribe them.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def conv_unit(in_channels: int, out_channels: int | None = None, dropout: float = 0.0) -> nn.Module:
    out_channels = out_channels or in_channels
    layers = [
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    ]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def make_stack(
    depth: int,
    half: int = 4,
    coupling: str = "additive",
    dropout: float = 0.0,
    memory: revnets.Reconstruct | revnets.Store = revnets.Reconstruct(),
    drop_path: float = 0.0,
) -> revnets.ReversibleSequence:
    out = 2 * half if coupling == "affine" else half
    return revnets.ReversibleSequence(
        (
            revnets.ReversibleBlock(
                conv_unit(half, out, dropout), conv_unit(half, out, dropout), coupling=coupling,
                drop_path=drop_path,
            )
            for _ in range(depth)
        ),
        memory,
    )


def twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (same weights) with every memory saving switched off."""
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if isinstance(m, (revnets.ReversibleSequence, revnets.Checkpointed)):
            m.memory = revnets.Store()
    return plain


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def max_grad_error(model: nn.Module, reference: nn.Module, skip=lambda model: ()) -> float:
    """The largest relative gradient error over the parameters, but those ``skip(model)`` names
    (parameters whose true gradient is zero, where a relative error compares round-off)."""
    skipped = set(skip(model))
    errors = [
        rel_error(p.grad, q.grad)
        for (name, p), q in zip(model.named_parameters(), reference.parameters())
        if q.grad is not None and name not in skipped
    ]
    assert errors, "no gradients to compare"
    return max(errors)


def train_step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).float().sum().backward()


def activation_budget(model, x, keep: float) -> int:
    """The measured peak with only ``keep`` of its activation part."""
    peak = revnets.measure_memory(train_step, model, x).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    return int(state + keep * (peak - state))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
