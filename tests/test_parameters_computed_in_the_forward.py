"""A parameter the forward overwrites whole before reading it (Glow's ActNorm with its
data-dependent initialisation) trains exactly like ordinary autograd: its value is the forward's,
and its gradient is taken with respect to the value the forward left, the parameter itself. One
the forward reads and then writes, or writes in part, is refused by name (NOTE [ Replay ],
rule 3). The references are the same models with memory=Store()."""

import pytest
import torch
from torch import nn

import revnets

from conftest import conv_unit, make_stack, max_grad_error, rel_error, twin


class ActNorm(revnets.Invertible):
    """Glow's ActNorm: its first forward sets ``loc`` and ``scale`` from the batch, so that its
    output has zero mean and unit variance per channel, before it uses them. ``flag``: where it
    keeps that it did (a Python bool or a uint8 buffer); ``write``: how it writes the parameters
    (under no_grad, through .data, with grad enabled, or by replacing their .data)."""

    def __init__(self, channels, flag="attribute", write="no_grad"):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.scale = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.write = write
        if flag == "attribute":
            self.initialized = False
        else:
            self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x):
        if not bool(self.initialized):
            self.initialise(x.detach())
        return (x + self.loc) * self.scale

    def initialise(self, x):
        loc = -x.mean((0, 2, 3), keepdim=True)
        scale = 1 / (x.std((0, 2, 3), keepdim=True) + 1e-6)
        if self.write == "no_grad":
            with torch.no_grad():
                self.loc.copy_(loc)
                self.scale.copy_(scale)
        elif self.write == "data":
            self.loc.data.copy_(loc)
            self.scale.data.copy_(scale)
        elif self.write == "grad_enabled":
            self.loc.copy_(loc)
            self.scale.copy_(scale)
        else:  # "replace_data"
            self.loc.data = loc
            self.scale.data = scale
        if isinstance(self.initialized, bool):
            self.initialized = True
        else:
            self.initialized.fill_(1)

    def inverse(self, y):
        return y / self.scale - self.loc


def actnorm_model(wrapper, flag="attribute", write="no_grad"):
    torch.manual_seed(0)
    if wrapper == "invertible":  # between two coupling blocks
        blocks = [make_stack(1)[0], ActNorm(8, flag, write), make_stack(1)[0]]
        return revnets.ReversibleSequence(blocks).double()
    if wrapper == "inside_f":  # a plain module of a block's f
        f = nn.Sequential(ActNorm(4, flag, write), conv_unit(4))
        return revnets.ReversibleSequence([revnets.ReversibleBlock(f, conv_unit(4))]).double()
    if wrapper == "nested checkpoints":
        inner = revnets.Checkpointed(ActNorm(8, flag, write))
        return nn.Sequential(revnets.Checkpointed(inner), conv_unit(8)).double()
    if wrapper == "sequence in a checkpoint":  # as the planner nests them
        blocks = [make_stack(1)[0], ActNorm(8, flag, write), make_stack(1)[0]]
        return revnets.Checkpointed(revnets.ReversibleSequence(blocks)).double()
    return nn.Sequential(revnets.Checkpointed(ActNorm(8, flag, write)), conv_unit(8)).double()


def batch(step):
    generator = torch.Generator().manual_seed(step)
    return 3 + 2 * torch.randn(4, 8, 5, 5, dtype=torch.float64, generator=generator)


def actnorms(model):
    return [m for m in model.modules() if isinstance(m, ActNorm)]


CASES = [(wrapper, flag, write) for wrapper in ("invertible", "inside_f", "Checkpointed")
         for flag in ("attribute", "buffer") for write in ("no_grad", "data")]
# Nested too: a watch's copy of the parameter, before the run overwrites it, is no read of the
# run for the watch around it.
CASES += [("nested checkpoints", "attribute", "no_grad"),
          ("sequence in a checkpoint", "attribute", "no_grad")]


@pytest.mark.parametrize("wrapper, flag, write", CASES)
def test_actnorm_with_data_dependent_initialisation_trains_like_autograd(wrapper, flag, write):
    model = actnorm_model(wrapper, flag, write)
    reference = twin(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(3):  # the first one initialises
        for m, optimizer in zip((model, reference), optimizers):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = m(batch(step).requires_grad_())
            versions = [p._version for p in m.parameters()]
            out.square().mean().backward()
            assert [p._version for p in m.parameters()] == versions  # backward writes none
        assert all(a.loc.grad is not None and a.scale.grad is not None for a in actnorms(model))
        assert max_grad_error(model, reference) <= 1e-10
        for optimizer in optimizers:
            optimizer.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert rel_error(p, q) <= 1e-10, name
        for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name
    assert all(bool(a.initialized) for a in actnorms(model))


def initialised_then(model, change):
    """The first (initialising) forward, then ``change`` before its backward."""
    out = model(batch(0).requires_grad_())
    change()
    return out


NAMES = {"invertible": r"blocks\.1\.", "inside_f": r"blocks\.0\.f\.0\.",
         "Checkpointed": r"checkpointed ActNorm: "}


@pytest.mark.parametrize("wrapper", ["invertible", "inside_f", "Checkpointed"])
def test_a_computed_parameter_changed_before_backward_is_refused_by_name(wrapper):
    model = actnorm_model(wrapper)
    loc = actnorms(model)[0].loc

    def step():
        with torch.no_grad():
            loc.add_(0.1)  # an optimizer step between forward and backward

    out = initialised_then(model, step)
    with pytest.raises(RuntimeError, match=NAMES[wrapper] + "loc was modified in place between "
                                           "the forward pass and backward"):
        out.sum().backward()


def test_a_parameter_overwritten_with_grad_enabled_is_refused_as_autograd_refuses_it():
    """Ordinary autograd refuses an in-place write into a leaf that requires grad in the
    forward; the engine runs its forward without grad, and refuses it in backward, by name."""
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        twin(actnorm_model("invertible", write="grad_enabled"))(batch(0))
    out = actnorm_model("invertible", write="grad_enabled")(batch(0).requires_grad_())
    with pytest.raises(RuntimeError, match=r"blocks\.1\.loc is overwritten in place in the "
                                           "forward pass with gradients enabled"):
        out.sum().backward()


@pytest.mark.parametrize("wrapper", ["invertible", "Checkpointed"])
def test_a_parameter_whose_data_is_replaced_in_the_forward_is_refused_by_name(wrapper):
    model = actnorm_model(wrapper, write="replace_data")
    name = NAMES[wrapper].removeprefix("checkpointed ActNorm: ")
    with pytest.raises(RuntimeError, match=name + r"loc's \.data was replaced during the "
                                           r"forward pass.*update it in place"):
        model(batch(0).requires_grad_())


class WritesAfterUse(revnets.Invertible):
    """Scales by ``w``, then writes into ``w``: its gradient would be with respect to a value
    ``w`` no longer has."""

    def __init__(self, write):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, 8, 1, 1))
        self.write = write

    def forward(self, x):
        if self.write == "in_part":  # written before any use, but not whole
            with torch.no_grad():
                self.w[:, :4].fill_(2.0)
        y = x * self.w
        if self.write == "after_use":
            with torch.no_grad():
                self.w.add_(1.0)
        return y

    def inverse(self, y):
        return y / self.w


@pytest.mark.parametrize("write", ["after_use", "in_part"])
@pytest.mark.parametrize("wrapper", ["invertible", "Checkpointed"])
def test_a_parameter_read_then_written_in_the_forward_is_refused_by_name(wrapper, write):
    torch.manual_seed(0)
    if wrapper == "invertible":
        model = revnets.ReversibleSequence([make_stack(1)[0], WritesAfterUse(write)]).double()
    else:
        model = nn.Sequential(revnets.Checkpointed(WritesAfterUse(write))).double()
    name = r"blocks\.1\.w" if wrapper == "invertible" else "w"
    with pytest.raises(RuntimeError, match=name + " was written in place during the forward "
                                           "pass after the forward read it"):
        model(batch(0).requires_grad_())
