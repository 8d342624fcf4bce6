"""revnets.compile_model keeps a CPU model's memory layout in compiled code (NOTE [ Layout under
torch.compile ] in revnets/compiling.py): inductor's own CPU choice converts every convolution
weight to channels_last in every step, and each weight gradient back."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import revnets


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )


def test_layout_is_kept_for_a_contiguous_cpu_model_and_left_to_inductor_otherwise():
    contiguous = conv_net()
    assert revnets.compile_options(contiguous) == {"layout_optimization": False}
    # Converted by the user: inductor's channels_last converts nothing, so its choice stands.
    assert revnets.compile_options(
        copy.deepcopy(contiguous).to(memory_format=torch.channels_last)) == {}
    assert revnets.compile_options(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == {}  # no kernel
    # 1x1, one-input-channel and depthwise kernels are laid out alike both ways: they decide
    # nothing, beside kernels that do.
    alike = [nn.Conv2d(8, 8, 1), nn.Conv2d(1, 8, 3), nn.Conv2d(8, 8, 3, groups=8)]
    converted = nn.Sequential(*alike, nn.Conv2d(8, 16, 3)).to(memory_format=torch.channels_last)
    assert revnets.compile_options(converted) == {}
    assert revnets.compile_options(nn.Sequential(*alike, nn.Conv3d(8, 8, 3))) == {
        "layout_optimization": False}
    assert revnets.compile_options(lambda x: x.sin()) == {}  # a function: nothing to read


def test_what_is_neither_a_module_nor_a_callable_is_refused_naming_it():
    """torch.compile refused a string with a bare assertion, and compile_options read None as a
    model with nothing to add."""
    with pytest.raises(TypeError, match=r"compile_model: expected an nn.Module or a callable .* "
                                        r"got str 'model'"):
        revnets.compile_model("model")
    with pytest.raises(TypeError, match="compile_options: .* got NoneType None"):
        revnets.compile_options(None)


def test_mode_is_handed_to_inductor_as_its_options_and_the_callers_options_win(monkeypatch):
    """torch.compile takes ``mode`` or ``options``, not both: the mode becomes its options."""
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: seen.update(kwargs) or model)
    revnets.compile_model(conv_net(), mode="max-autotune-no-cudagraphs",
                          options={"coordinate_descent_tuning": False})
    assert seen == {"options": {"max_autotune": True, "coordinate_descent_tuning": False,
                                "layout_optimization": False}}
    seen.clear()  # mode and options together, on a model whose layout adds nothing
    revnets.compile_model(nn.Linear(3, 3), mode="max-autotune-no-cudagraphs",
                          options={"coordinate_descent_tuning": False})
    assert seen == {"options": {"max_autotune": True, "coordinate_descent_tuning": False}}
    seen.clear()
    revnets.compile_model(conv_net(), backend="aot_eager")  # not inductor: nothing added
    assert seen == {"backend": "aot_eager"}


def _conversions_in_a_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    for _ in range(2):  # compiled and warm
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def test_compiled_step_converts_no_weight_and_gives_eagers_gradients():
    """Inductor's default converts both convolution weights in every step; compile_model's
    step converts nothing and gives eager's gradients."""
    eager = conv_net()
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 3])
    torch._dynamo.reset()
    assert _conversions_in_a_step(torch.compile(copy.deepcopy(eager)), x, y) == 2
    kept = copy.deepcopy(eager)
    assert _conversions_in_a_step(revnets.compile_model(kept), x, y) == 0
    eager.zero_grad(set_to_none=True)
    F.cross_entropy(eager(x), y).backward()
    for p, q in zip(kept.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
