"""Exact reversibility (NOTE [ Exact reversibility ]): with ``exact=True`` the reversible path
reconstructs every block's input bit for bit, so its gradients are ordinary autograd's of the same
network in the same arithmetic (``memory=Store(), exact=True``), in bfloat16 and float16 autocast,
at any depth, with memory flat in depth."""

from __future__ import annotations

import contextlib
import copy

import pytest
import timm
import torch
from torch import nn

import revnets
from revnets import Reconstruct, ReversibleBlock, ReversibleSequence, Store
from revnets.memory import measure_memory
from revnets.plan import parse_memory_plan
from revnets.reversible.grid import grid_range

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def branch(channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(2, channels), nn.GELU()
    )


def stack(depth: int, half: int = 4, exact: bool = True, seed: int = 0) -> ReversibleSequence:
    """The issue's stack: conv + GroupNorm + GELU couplings."""
    torch.manual_seed(seed)
    blocks = [ReversibleBlock(branch(half), branch(half)) for _ in range(depth)]
    return ReversibleSequence(blocks, exact=exact)


def gradients(sequence: ReversibleSequence, x: torch.Tensor, precision: str | None) -> torch.Tensor:
    """The input's and every parameter's gradient of a fixed linear loss, as one vector."""
    sequence.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    autocast = (
        torch.autocast("cpu", dtype=AUTOCAST[precision]) if precision
        else contextlib.nullcontext()
    )
    with autocast:
        y = sequence(x)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    (y * weights).sum().backward()
    return torch.cat([x.grad.flatten().double()]
                     + [p.grad.flatten().double() for p in sequence.parameters()])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def reversible_vs_stored(
    sequence: ReversibleSequence, x: torch.Tensor, precision: str | None
) -> float:
    """Relative error (global norm) of the reversible path's gradients against ordinary
    autograd's of the same sequence, in the same arithmetic."""
    exact = sequence.exact
    sequence.memory = Reconstruct()
    reversible = gradients(sequence, x, precision)
    sequence.memory = Store()  # keeps the arithmetic: exact stays as it was
    assert sequence.exact == exact
    stored = gradients(sequence, x, precision)
    sequence.memory = Reconstruct()
    return relative_error(reversible, stored)


def drift(sequence: ReversibleSequence, x: torch.Tensor, precision: str | None) -> float:
    with revnets.check_reconstruction() as report:
        gradients(sequence, x, precision)
    assert len(report.drifts) == len(sequence)
    return max(d.max_abs_error for d in report.drifts)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_exact_gradients_equal_ordinary_autograd_at_256_blocks(precision):
    sequence = stack(256)
    x = torch.randn(2, 8, 4, 4)
    assert reversible_vs_stored(sequence, x, precision) <= 1e-4
    assert drift(sequence, x, precision) == 0.0


def test_without_exact_the_same_bf16_stack_drifts():
    sequence = stack(256, exact=False)
    x = torch.randn(2, 8, 4, 4)
    assert reversible_vs_stored(sequence, x, "bf16") > 1e-3
    assert drift(sequence, x, "bf16") > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_exact_gradients_equal_ordinary_autograd_at_1000_blocks(precision):
    sequence = stack(1000)
    x = torch.randn(2, 8, 4, 4)
    assert reversible_vs_stored(sequence, x, precision) <= 1e-4
    assert drift(sequence, x, precision) == 0.0


def test_exact_float64_equals_ordinary_autograd():
    sequence = stack(16).double()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64)
    assert reversible_vs_stored(sequence, x, None) <= 1e-10
    assert drift(sequence, x, None) == 0.0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_weight_tied_across_blocks_gets_the_exact_sum_of_its_uses_gradients(precision):
    """Under autocast, ordinary autograd casts a tied weight once (autocast's cache) and sums its
    uses' gradients in that low precision; the reversible path takes each block's gradient of
    its own cast and sums them in float32. Both start from the same per-use gradients (those of
    the untied network); the reversible path's sum is theirs, ordinary autograd's is rounded."""
    torch.manual_seed(0)
    f, g = branch(4), branch(4)
    tied = ReversibleSequence([ReversibleBlock(f, g) for _ in range(6)], exact=True)
    untied = ReversibleSequence([ReversibleBlock(copy.deepcopy(f), copy.deepcopy(g))
                                 for _ in range(6)], memory=Store(), exact=True)
    x = torch.randn(2, 8, 4, 4)
    gradients(untied, x, precision)
    per_use_sum = sum(block.f[0].weight.grad.double() for block in untied)

    def tied_gradient(memory):
        tied.memory = memory
        gradients(tied, x, precision)
        return f[0].weight.grad.double()

    assert relative_error(tied_gradient(Reconstruct()), per_use_sum) <= 1e-6
    assert relative_error(tied_gradient(Store()), per_use_sum) > 1e-4  # rounded to bf16/fp16


@pytest.mark.parametrize(
    "memory", [Reconstruct(store_last_blocks=2), Reconstruct(keep_input_every=4)], ids=str)
def test_exact_with_stored_last_blocks_and_kept_inputs(memory):
    sequence = stack(16)
    x = torch.randn(2, 8, 4, 4)
    sequence.memory = Store()
    stored = gradients(sequence, x, "bf16")
    sequence.memory = memory
    assert relative_error(gradients(sequence, x, "bf16"), stored) <= 1e-4


def test_exact_changes_the_function_by_the_rounding_only():
    """exact=True rounds the input and every update to a grid of 2^-14 in float32: the output
    moves by a few grid steps from the default arithmetic's, no more."""
    x = torch.randn(2, 8, 4, 4)
    sequence = stack(16, exact=False).eval()
    with torch.no_grad():
        default = sequence(x)
        sequence.exact = True
        exact = sequence(x)
    assert exact.dtype == torch.float32
    assert 0 < (exact - default).abs().max().item() < 16 * 2 * 2.0**-14


def test_exact_streams_are_float32_under_autocast_and_for_a_bfloat16_input():
    sequence = stack(4)
    x = torch.randn(2, 8, 4, 4, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sequence(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_exact_memory_is_flat_in_depth_and_predicted_to_the_byte():
    def step(model, x):
        model(x).square().mean().backward()

    x = torch.randn(4, 16, 8, 8)
    above = {}
    for depth in (16, 128):
        model = stack(depth, half=8)
        predicted = revnets.predict_memory(step, model, x)
        measured = measure_memory(step, model, x)
        assert predicted.peak_bytes == measured.peak_bytes
        assert predicted.above_model_state_bytes == measured.above_model_state_bytes
        above[depth] = measured.above_model_state_bytes
    assert above[16] == above[128]


def test_under_autocast_exact_costs_one_copy_of_the_input_whatever_the_depth():
    """Under autocast torch caches a bfloat16 copy of every weight until the autocast region
    ends, with or without exact; exact=True adds only the input's float32 copy on the grid, and
    both are predicted to the byte."""

    def step(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.square().mean().backward()

    x = torch.randn(4, 16, 8, 8)
    extra = {}
    for depth in (32, 64):
        measured = {}
        for exact in (False, True):
            model = stack(depth, half=8, exact=exact)
            predicted = revnets.predict_memory(step, model, x)
            measured[exact] = measure_memory(step, model, x)
            assert predicted.peak_bytes == measured[exact].peak_bytes
        extra[depth] = (measured[True].above_model_state_bytes
                        - measured[False].above_model_state_bytes)
    assert extra[32] == extra[64] == x.numel() * 4


def test_out_of_range_stream_is_refused_naming_the_block_and_the_magnitude():
    sequence = stack(3)
    with torch.no_grad():
        sequence[1].g[1].bias.fill_(2 * grid_range(torch.float32))
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    with pytest.raises(OverflowError, match=r"output of block 1 reached magnitude .*range 1024"):
        sequence(x)
    sequence.memory = Store()  # the ordinary path refuses the same value
    with pytest.raises(OverflowError, match="range 1024"):
        sequence(x)
    with pytest.raises(OverflowError, match="input of the sequence"):
        sequence(torch.full((2, 8, 4, 4), 1e4))


def test_couplings_and_modules_without_an_exact_form_are_refused_by_name():
    torch.manual_seed(0)
    affine = ReversibleBlock(nn.Conv2d(2, 4, 1), nn.Conv2d(2, 4, 1), coupling="affine")
    with pytest.raises(TypeError, match="block 0 has the coupling AffineCoupling"):
        ReversibleSequence([affine], exact=True)
    sequence = ReversibleSequence([affine])
    with pytest.raises(TypeError, match="AffineCoupling"):
        sequence.exact = True
    assert not sequence.exact

    class Flip(revnets.Invertible):
        def forward(self, x):
            return -x

        def inverse(self, y):
            return -y

    with pytest.raises(TypeError, match="block 1 is a Flip"):
        ReversibleSequence([stack(1, exact=False)[0], Flip()], exact=True)
    # i-RevNet's own invertible modules keep the grid.
    ReversibleSequence([stack(1, exact=False)[0], revnets.SpaceToDepth(2)], exact=True)


def test_exact_is_the_sequences_arithmetic_which_no_memory_decision_changes():
    sequence = stack(2, exact=False)
    sequence.exact = True
    assert type(sequence[0].coupling).__name__ == "ExactAdditiveCoupling"
    for decision in (Store(), Reconstruct(), Reconstruct(store_last_blocks=1)):
        sequence.set_memory(decision)
        assert sequence.exact and str(sequence.memory) == str(decision)
    sequence.exact = False
    assert type(sequence[0].coupling).__name__ == "AdditiveCoupling"
    # Spelt as a memory option in any form plans come in, it is refused, naming its home.
    home = "exact is the arithmetic of a reversible sequence"
    with pytest.raises(TypeError, match=home):
        Reconstruct(exact=True)
    with pytest.raises(ValueError, match=home):
        parse_memory_plan("reversible(exact=true)")
    with pytest.raises(ValueError, match=home):
        revnets.plan_from_options("reversible", exact=True)


def test_a_model_cast_to_low_precision_is_refused_naming_autocast():
    sequence = stack(2).bfloat16().train()
    x = torch.randn(2, 8, 4, 4, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(TypeError, match=r"parameter blocks.0.f.0.weight is torch.bfloat16 .*"
                                        r"model.float\(\).*torch.autocast"):
        sequence(x)
    sequence.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sequence(x).float().sum().backward()  # the remedy trains


def test_exact_through_the_zoo_timm_keyword():
    torch.manual_seed(0)
    model = timm.create_model("revnet38", num_classes=10, exact=True)
    assert all(s.exact for s in model.modules() if isinstance(s, ReversibleSequence))
    with pytest.raises(ValueError, match="resnet32 has no reversible sequence"):
        timm.create_model("resnet32", exact=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), revnets.check_reconstruction() as report:
        model(x).float().square().sum().backward()
    assert report.drifts and max(d.max_abs_error for d in report.drifts) == 0.0
