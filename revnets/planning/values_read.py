"""The tensors whose values a trace read: what a traced graph froze of tensors, which a planned
step must refuse to run once they are written (NOTE [ Traced modules run as their graph ] in
traced.py).

torch.fx traces with proxies for the input and the parameters, but a buffer or a plain tensor
attribute is the real tensor: ``self.flag.item()``, ``float(self.t)`` or ``if self.on:`` read its
value while tracing, and the graph keeps what they read as a constant or a branch taken; so does
a tensor the forward computes from one (a table of sines made from a buffer). Following such a
tensor by name (NOTE [ A planned model is the model ]) cannot help: the graph never reads it
again. So the trace runs under a dispatch mode that records, for every tensor an operator makes
from real tensors, the tensors it came from; those a value was read of (``item``, ``bool``,
``equal``), and those a constant of the graph was made from, are the tensors read, with their
versions then. A tensor the graph holds as itself (a plain attribute in an expression) is a
constant that follows writes into it, and is not counted, nor is a tensor a constant is a view
of.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ValuesRead"]

_VALUE_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                torch.ops.aten.equal.default}


class ValuesRead(TorchDispatchMode):
    """While active (around a trace), the tensors whose values the traced code read."""

    def __init__(self) -> None:
        super().__init__()
        self.came_from: WeakIdKeyDictionary = WeakIdKeyDictionary()  # made: {id: source}
        self.read: dict[int, Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sources: dict[int, Tensor] = {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, Tensor):
                sources.update(self._sources(t))
        if func in _VALUE_READS:
            self.read.update(sources)
        elif sources:
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self.came_from[t] = sources
        return out

    def clear(self) -> ValuesRead:
        """Forget what was recorded (a trace that kept more modules whole follows)."""
        self.came_from, self.read = WeakIdKeyDictionary(), {}
        return self

    def _sources(self, tensor: Tensor) -> dict[int, Tensor]:
        found = self.came_from.get(tensor)
        return found if found is not None else {id(tensor): tensor}

    def constant(self, tensor: Tensor) -> None:
        """``tensor`` became a constant of the graph: what it was made from was read, but a
        tensor it is a view of (``self.table[:n]``), whose writes it follows."""
        found = self.came_from.get(tensor)
        if found is not None:
            storage = _storage(tensor)
            self.read.update((key, t) for key, t in found.items()
                             if storage is None or _storage(t) != storage)

    def versions(self) -> tuple[tuple[Tensor, int], ...]:
        """The tensors read, with their versions now (inference tensors have none, and cannot
        be written)."""
        return tuple((t, t._version) for t in self.read.values() if not t.is_inference())


def _storage(tensor: Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one
        return None
