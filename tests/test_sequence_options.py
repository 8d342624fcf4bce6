"""How a reversible sequence runs is one record (``SequenceOptions``): a plan changes only what
it decides (whether a sequence reconstructs) and keeps every other option of every sequence; a
refused plan leaves every sequence as it was. ``exact`` is the sequence's arithmetic, which no
memory decision carries."""

import copy
import itertools
from dataclasses import replace

import pytest
import timm
import torch
from torch import nn

import revnets
from revnets import Reconstruct, SequenceOptions, Store

from conftest import max_grad_error

MEMORIES = [Store(), Reconstruct(), Reconstruct(store_last_blocks=1),
            Reconstruct(keep_input_every=2), Reconstruct(store_last_blocks=1, keep_input_every=2)]
OPTIONS = [
    SequenceOptions(memory, exact, reuse_memory=reuse)
    for memory, exact, reuse in itertools.product(MEMORIES, (False, True), (True, False))
]


def unit() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh())


def model_with(options: SequenceOptions) -> nn.Sequential:
    sequence = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(unit(), unit()) for _ in range(4)])
    sequence.options = options
    return nn.Sequential(nn.Linear(16, 16), sequence, nn.Tanh(), nn.Linear(16, 16)).double()


def sequences(model: nn.Module) -> list[revnets.ReversibleSequence]:
    return [m for m in model.modules() if isinstance(m, revnets.ReversibleSequence)]


def loss_fn(output):
    return output.square().mean()


def peak(model, x) -> int:
    return revnets.predict_memory(lambda: loss_fn(model(x)).backward()).peak_bytes


def assert_kept_but_decided(options: SequenceOptions, found: SequenceOptions) -> None:
    """Everything but ``memory`` as it was; a reconstructing sequence reconstructs with the
    options it had, if it had any."""
    assert replace(found, memory=options.memory) == options
    decided = options.memory if isinstance(options.memory, Reconstruct) else Reconstruct()
    assert found.memory in (Store(), decided)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_a_plan_changes_only_whether_a_sequence_reconstructs(options):
    model = model_with(options)
    built = copy.deepcopy(model)
    x = torch.randn(256, 16, dtype=torch.float64)
    budget = peak(model, x) - 1  # storing everything does not fit: the planner decides
    planned = revnets.auto_checkpoint(model, x, budget, loss_fn=loss_fn, measure_time=False)
    assert peak(planned, x) <= budget
    assert_kept_but_decided(options, sequences(model)[0].options)
    # The planned model computes the function it was built to compute.
    for m in (planned, built):
        loss_fn(m(x)).backward()
    assert max_grad_error(planned, built) <= 1e-10


@pytest.mark.parametrize("options", OPTIONS[::3], ids=str)
def test_a_refused_plan_leaves_every_option_as_it_was(options):
    model = model_with(options)
    x = torch.randn(256, 16, dtype=torch.float64)
    with pytest.raises(revnets.PlanningError):
        revnets.auto_checkpoint(model, x, 1, loss_fn=loss_fn, measure_time=False)
    assert sequences(model)[0].options == options


@pytest.mark.parametrize("memory", ["reversible(store_last_blocks=1)",
                                    "reversible(keep_input_every=2)"])
def test_a_zoo_models_plan_keeps_its_arithmetic_and_its_reconstructions_options(memory):
    model = timm.create_model("revnet38", num_classes=10, memory=memory, exact=True,
                              units=(3, 3), channels=(8, 8, 16)).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    found = [s.options for s in sequences(model)]
    with pytest.raises(revnets.PlanningError):
        revnets.auto_checkpoint(model, x, 1, loss_fn=loss_fn, measure_time=False)
    assert [s.options for s in sequences(model)] == found
    built = copy.deepcopy(model)
    planned = revnets.auto_checkpoint(model, x, peak(model, x) - 1, loss_fn=loss_fn,
                                      measure_time=False)
    for options, sequence in zip(found, sequences(model)):
        assert_kept_but_decided(options, sequence.options)
    for m in (planned, built):
        torch.manual_seed(0)
        loss_fn(m(x)).backward()
    assert max_grad_error(planned, built) <= 1e-10


def test_exact_has_one_home_the_sequence():
    sequence = revnets.ReversibleSequence([revnets.ReversibleBlock(unit(), unit())], exact=True)
    for decision in (Reconstruct(), Store(), Reconstruct(store_last_blocks=1)):
        sequence.set_memory(decision)
        assert sequence.exact
    with pytest.raises(TypeError, match=r"exact is the arithmetic of a reversible sequence.*"
                                        r"ReversibleSequence\(blocks, exact=True\)"):
        Reconstruct(exact=True)
    with pytest.raises(ValueError, match="timm.create_model\\(name, exact=True\\)"):
        revnets.parse_memory_plan("reversible(exact=true)")


def test_options_are_set_whole_and_checked_before_anything_changes():
    sequence = revnets.ReversibleSequence([revnets.ReversibleBlock(unit(), unit())])
    found = sequence.options
    with pytest.raises(TypeError, match="memory must be revnets.Reconstruct"):
        sequence.options = replace(found, memory=revnets.Checkpoint())
    with pytest.raises(TypeError, match="reuse_memory must be True or False"):
        sequence.reuse_memory = "no"
    assert sequence.options == found
    sequence.options = SequenceOptions(Store(), exact=True, preserve_rng_state=False)
    assert (sequence.memory, sequence.exact, sequence.preserve_rng_state) == (Store(), True, False)
    assert type(sequence[0].coupling) is revnets.ExactAdditiveCoupling


@pytest.mark.parametrize("name, keywords", [
    ("revnet38", dict(units=(3, 3), channels=(8, 8, 16))), ("irevnet163", dict(units=(2, 2, 2)))])
def test_every_plan_of_an_exact_zoo_model_computes_one_function(name, keywords):
    """A checkpointed stage runs its blocks in segments, led by the grid's entry
    (``plain_units``): the stage computes the exact function under every preset."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, exact=True, **keywords).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    reference = copy.deepcopy(model)
    out = reference(x)
    loss_fn(out).backward()
    for preset in model.memory_strategies:
        planned = copy.deepcopy(model).set_memory(preset)
        got = planned(x)
        loss_fn(got).backward()
        assert torch.equal(got, out), preset
        assert max_grad_error(planned, reference) <= 1e-10, preset
