"""A generator whose state cannot be taken (random.SystemRandom, a random.Random whose getstate
raises) may be held by a module in a reversible sequence or a checkpoint: one the forward never
draws from trains exactly like ordinary autograd, and one it draws from is refused by its name,
since the recomputation could not draw the same numbers (NOTE [ Generators without state ]).
The references are the same models with memory=Store()."""

import random

import numpy as np
import pytest
import torch
from torch import nn

import revnets
from revnets import Reconstruct, Store

from conftest import max_grad_error, rel_error


class Unsaveable(random.Random):
    """A generator of one's own that keeps no state it can give."""

    def getstate(self):
        raise NotImplementedError("this generator keeps no state")


KINDS = {"SystemRandom": random.SystemRandom, "getstate_raises": lambda: Unsaveable(0)}


class HoldsAGenerator(nn.Module):
    def __init__(self, make, draws):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.rng = make()
        self.draws = draws

    def forward(self, h):
        z = torch.tanh(self.linear(h))
        return z * (1 + self.rng.random()) if self.draws else z


class ScalesHoldingAGenerator(revnets.Invertible):
    """An invertible scaling that keeps a generator in a list."""

    def __init__(self, make, draws):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.rngs = [make()]
        self.draws = draws

    def forward(self, x):
        return x * self.scale * (1 + self.rngs[0].randint(0, 1) if self.draws else 1)

    def inverse(self, y):
        return y / self.scale


def plain():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh())


def built(where, make, draws, memory):
    """The model holding the generator ``where``, its weights drawn from seed 0."""
    torch.manual_seed(0)
    holder = HoldsAGenerator(make, draws)
    if where == "Checkpointed":
        checkpoint = revnets.Checkpoint() if isinstance(memory, Reconstruct) else Store()
        return nn.Sequential(revnets.Checkpointed(holder, checkpoint), nn.Linear(4, 4)).double()
    if where == "f":
        blocks = [revnets.ReversibleBlock(holder, plain(), split_dim=-1)]
    elif where == "g":
        blocks = [revnets.ReversibleBlock(plain(), holder, split_dim=-1)]
    else:
        blocks = [revnets.ReversibleBlock(plain(), plain(), split_dim=-1),
                  ScalesHoldingAGenerator(make, draws)]
    blocks.append(revnets.ReversibleBlock(plain(), plain(), split_dim=-1))
    return revnets.ReversibleSequence(blocks, memory).double()


def inputs(where):
    features = 4 if where == "Checkpointed" else 8
    return torch.randn(5, features, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


WHERE = ["f", "g", "invertible", "Checkpointed"]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("where", WHERE)
def test_a_generator_without_state_never_drawn_from_trains_like_autograd(where, kind):
    model = built(where, KINDS[kind], draws=False, memory=Reconstruct())
    reference = built(where, KINDS[kind], draws=False, memory=Store())
    x, x_reference = inputs(where).requires_grad_(), inputs(where).requires_grad_()
    for seed in range(2):
        for m, xi in ((model, x), (reference, x_reference)):
            torch.manual_seed(seed)
            m(xi).square().sum().backward()
    assert rel_error(x.grad, x_reference.grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10
    held = [g for m in model.modules() for g in (getattr(m, "rng", None), *getattr(m, "rngs", ()))
            if g is not None]
    assert held and all(vars(g).keys() <= {"gauss_next"} for g in held)  # left as it was


NAMES = {"f": r"blocks\.0\.f\.rng", "g": r"blocks\.0\.g\.rng",
         "invertible": r"blocks\.1\.rngs\[0\]", "Checkpointed": r"^rng"}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("where", WHERE)
def test_drawing_from_a_generator_without_state_is_refused_by_name(where, kind):
    model = built(where, KINDS[kind], draws=True, memory=Reconstruct())
    with pytest.raises(RuntimeError, match=NAMES[where] + r" \(.*\) is drawn from in the forward "
                                           r"pass, but its state cannot be taken.*"
                                           r"random\.Random\(seed\) or a torch\.Generator"):
        model(inputs(where).requires_grad_())


class NumpyWithoutState(np.random.Generator):
    """A numpy generator that gives no state."""

    @property
    def bit_generator(self):
        raise NotImplementedError("no state to give")


def test_a_numpy_generator_without_state_is_refused_where_a_run_holds_it():
    """Its draws run in C, where they cannot be seen: holding it is enough."""
    model = built("f", lambda: NumpyWithoutState(np.random.PCG64(0)), draws=False,
                  memory=Reconstruct())
    with pytest.raises(RuntimeError, match=r"blocks\.0\.f\.rng is a numpy generator whose state "
                                           "cannot be taken"):
        model(inputs("f").requires_grad_())
