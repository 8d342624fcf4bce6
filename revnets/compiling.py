"""``torch.compile`` as revnets calls it: the model's memory layout kept where inductor's own choice
costs more than it saves (NOTE [ Layout under torch.compile ])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._inductor
from torch import nn

__all__ = ["compile_model", "compile_options"]

# NOTE [ Layout under torch.compile ]
# On a CPU with MKLDNN, inductor runs every convolution of a graph in channels_last, whatever the
# layout of the model and its input (torch._inductor.graph.GraphLowering.decide_layout_opt:
# "For cpu backend and mkldnn enabled, we always use channels_last"; on a GPU it decides from the
# convolutions' shapes). A model stored as nn.Conv2d makes it, contiguous (NCHW), then pays in
# every step for converting each weight to channels_last in the forward and each weight
# gradient back in its accumulation (one copy per convolution and step; a profile by hand
# also found the convolutions themselves slower in channels_last at these shapes on this CPU).
# Measured on this project's 2-core CPU (benchmarks/compile_speed.py,
# results/compile_speed-cpu-*-zoo-imagenet*.md, docs/compile.md), compiled / eager training
# step at 64x64, batch 4: revnet104 1.22x with inductor's default and 0.90x with the layout
# kept, preact_resnet101 1.14x and 0.92x; under the checkpoint plan 0.91x and 0.77x, 0.89x and
# 0.68x. The narrow CIFAR models change little.
# So revnets compiles a CPU model whose convolution weights are not all channels_last with
# ``layout_optimization`` off: compiled code runs in the layout the model and its input have,
# as eager code does. A user who wants channels_last converts the model and the input
# (``model.to(memory_format=torch.channels_last)``), as in eager, and inductor's choice is then
# left on (it converts nothing). On a GPU inductor's heuristic is left alone: it was not
# measured here to cost anything (on an H200 preact_resnet101 compiled took 1.14x of eager at
# 64x64, batch 4, docs/compile.md; whether the layout is why was not measured).
_LAYOUT_KEPT = {"layout_optimization": False}

# NOTE [ Code dynamo traces ]
# revnets' code takes another path where dynamo traces it (a checkpoint's region handed to the
# graph, a selective run as one, checks that do not trace left out): it asks
# ``torch.compiler.is_dynamo_compiling()``, true only in the code dynamo is tracing, never
# ``torch.compiler.is_compiling()``, a flag of the whole process that stays true while any
# thread compiles anything. An eager checkpoint running beside another thread's compilation
# took the compiled path on that flag: its recomputation updated the batch statistics again,
# with other dropout masks (found by review on 2026-11-29; tests/test_checkpoint.py).


def compile_options(module: Callable[..., Any]) -> dict[str, Any]:
    """The inductor options revnets adds when compiling ``module`` (NOTE [ Layout under
    torch.compile ]): ``layout_optimization`` off for a module on the CPU whose convolution
    weights are not all channels_last (a kernel laid out alike both ways decides nothing; where
    none decides, the layout is kept too); none otherwise (a function: none). Anything else (a
    string, None) is refused: an empty answer would hide the mistake until torch.compile."""
    _check_compilable("compile_options", module)
    if not isinstance(module, nn.Module):
        return {}
    kernels = [p for p in module.parameters() if p.dim() in (4, 5)]
    if not kernels or any(p.device.type != "cpu" for p in kernels):
        return {}
    # A kernel laid out alike both ways (1x1, one input channel, depthwise) decides nothing.
    deciding = [p for p in kernels if not (p.is_contiguous() and _channels_last(p))]
    if deciding and all(_channels_last(p) for p in deciding):
        return {}
    return dict(_LAYOUT_KEPT)


def _check_compilable(caller: str, model: Any) -> None:
    if not callable(model):
        raise TypeError(
            f"{caller}: expected an nn.Module or a callable (a function) to compile, got "
            f"{type(model).__name__} {model!r:.60}"
        )


def _channels_last(weight: torch.Tensor) -> bool:
    layout = torch.channels_last if weight.dim() == 4 else torch.channels_last_3d
    return weight.is_contiguous(memory_format=layout)


def compile_model(model: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(model, **kwargs)`` with :func:`compile_options` added to inductor's
    options (the default backend): a CPU model keeps its memory layout in compiled code
    (NOTE [ Layout under torch.compile ]). ``mode`` and ``options`` may be given together:
    the mode is handed to inductor as its options (torch.compile takes one or the other), and
    the options given win. Any other backend gets ``kwargs`` unchanged."""
    _check_compilable("compile_model", model)  # torch.compile's own refusal is a bare assert
    if kwargs.get("backend", "inductor") != "inductor":
        return torch.compile(model, **kwargs)
    added, given = compile_options(model), kwargs.pop("options", None) or {}
    if added or given:
        mode = kwargs.pop("mode", None)
        of_mode = torch._inductor.list_mode_options(mode) if mode else {}
        kwargs["options"] = {**of_mode, **added, **given}
    return torch.compile(model, **kwargs)
