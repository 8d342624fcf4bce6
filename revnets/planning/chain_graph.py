"""Turning a model nobody here wrote into a chain of layers, when its graph is one.

Many networks are a chain at some granularity: torchvision's ResNets (stem, then bottleneck blocks
inside ``layer1..4``, then pooling and the classifier), VGG, DenseNet (dense blocks and transitions
in ``features``). ``as_chain`` traces the model with torch.fx, descending into ``nn.Sequential``
containers and keeping every other module whole; if every step consumes exactly the previous
step's output, the steps become an ``nn.Sequential`` over the *same* modules, which the chain
planners can cut anywhere between steps. Graphs with real branches across those steps (auxiliary
heads, several outputs) are refused with an error saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx
from torch import nn

__all__ = ["NotAChainError", "as_chain"]


class NotAChainError(ValueError):
    """The model's graph branches at the granularity ``as_chain`` works at."""


class _Tracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return not isinstance(m, nn.Sequential)


class _Call(nn.Module):
    """A function step of the chain (``torch.flatten(x, 1)``, ``F.relu``...), bound arguments
    kept."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, position: int) -> None:
        super().__init__()
        self.fn, self.args, self.kwargs, self.position = fn, args, kwargs, position
        # Planners must not start a checkpointed segment with a step that overwrites its input.
        name = fn if isinstance(fn, str) else getattr(fn, "__name__", "")
        self.inplace = bool(kwargs.get("inplace", False)) or name.endswith("_")

    def forward(self, x: Any) -> Any:
        args = list(self.args)
        args[self.position] = x
        return self.fn(*args, **self.kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


class _Method(_Call):
    def forward(self, x: Any) -> Any:
        return getattr(x, self.fn)(*self.args, **self.kwargs)

    def extra_repr(self) -> str:
        return f"Tensor.{self.fn}"


def as_chain(model: nn.Module) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of steps sharing its modules, if its graph is a chain."""
    graph = _Tracer().trace(model)
    steps: list[nn.Module] = []
    previous = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                raise NotAChainError(f"as_chain: {type(model).__name__} takes several inputs")
            previous = node
            continue
        if node.op == "output":
            if node.args[0] is not previous:
                raise NotAChainError(
                    f"as_chain: {type(model).__name__} returns more than its last step's output"
                )
            break
        uses = [i for i, a in enumerate(node.args) if a is previous]
        others = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
        if len(uses) != 1 or len(others) != 1 or len(previous.users) != 1:
            raise NotAChainError(
                f"as_chain: {type(model).__name__} branches at {node.name!r} ({node.op} "
                f"{node.target}); only chains of steps can be planned this way"
            )
        if node.op == "call_module":
            steps.append(model.get_submodule(node.target))
        elif node.op == "call_function":
            steps.append(_Call(node.target, node.args, dict(node.kwargs), uses[0]))
        elif node.op == "call_method" and uses[0] == 0:
            steps.append(_Method(node.target, node.args[1:], dict(node.kwargs), 0))
        else:
            raise NotAChainError(f"as_chain: cannot express {node.op} {node.target} as a step")
        previous = node
    return nn.Sequential(*steps)


