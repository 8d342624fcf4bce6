"""``torch.compile`` as revnets calls it: the model's memory layout kept where inductor's own choice
costs more than it saves (NOTE [ Layout under torch.compile ])."""

from __future__ import annotations

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
# gradient back in its accumulation, and runs its convolutions in the layout that this CPU's
# kernels handle more slowly for wide channels on small maps. Measured on this project's 2-core
# CPU (benchmarks/compile_speed.py, results/compile_speed-cpu-*-zoo-imagenet*.md, docs/compile.md),
# compiled / eager training step at 64x64, batch 4: revnet104 1.22x with inductor's default and
# 0.90x with the layout kept, preact_resnet101 1.14x and 0.92x; under the checkpoint plan 0.91x
# and 0.77x, 0.89x and 0.68x. The narrow CIFAR models change little.
# So revnets compiles a CPU model whose convolution weights are not all channels_last with
# ``layout_optimization`` off: compiled code runs in the layout the model and its input have,
# as eager code does. A user who wants channels_last converts the model and the input
# (``model.to(memory_format=torch.channels_last)``), as in eager, and inductor's choice is then
# left on (it converts nothing). On a GPU inductor's heuristic is left alone: it was not
# measured here to cost anything.
_LAYOUT_KEPT = {"layout_optimization": False}


def compile_options(module: nn.Module) -> dict[str, Any]:
    """The inductor options revnets adds when compiling ``module`` (NOTE [ Layout under
    torch.compile ]): ``layout_optimization`` off for a module on the CPU whose convolution
    weights are not all channels_last; none otherwise."""
    kernels = [p for p in module.parameters() if p.dim() in (4, 5)]
    if not kernels or any(p.device.type != "cpu" for p in kernels):
        return {}
    if all(_channels_last(p) for p in kernels):
        return {}
    return dict(_LAYOUT_KEPT)


def _channels_last(weight: torch.Tensor) -> bool:
    layout = torch.channels_last if weight.dim() == 4 else torch.channels_last_3d
    # A 1x1 kernel is laid out alike both ways: it decides nothing.
    return weight.is_contiguous(memory_format=layout) and (
        not weight.is_contiguous() or weight.shape[2:].numel() == 1
    )


def compile_model(model: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.compile(model, **kwargs)`` with :func:`compile_options` added to inductor's
    options (the default backend): a CPU model keeps its memory layout in compiled code
    (NOTE [ Layout under torch.compile ]). ``mode`` is given to inductor as its options (both
    cannot be passed to torch.compile); options the caller gives win. Any other backend gets
    ``kwargs`` unchanged."""
    backend = kwargs.get("backend", "inductor")
    options = compile_options(model)
    if backend != "inductor" or not options:
        return torch.compile(model, **kwargs)
    mode = kwargs.pop("mode", None)
    of_mode = torch._inductor.list_mode_options(mode) if mode else {}
    kwargs["options"] = {**of_mode, **options, **(kwargs.get("options") or {})}
    return torch.compile(model, **kwargs)
