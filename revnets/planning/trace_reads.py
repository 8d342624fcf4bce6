"""What a trace read, which a traced graph froze and a planned step must refuse to run once it
has changed (NOTE [ Traced modules run as their graph ] in traced.py): the tensors whose values
it read, and the modules' attributes its code read.

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

Attributes are read by the code a trace runs wherever it is: a module's own forward
(``self.scale``), a child reading its parent through a plain reference
(``self.owner[0].scale``), a function outside any class (``scale_of(self)``), ``getattr`` with
a name made at run time. So the trace runs with modules' attribute lookup recording, for each
module, the names looked up on it by code other than torch.fx's, the Module machinery's and the
planner's own (:class:`AttributesRead`), and the code that looked them up. What code the trace
never ran (a method forward does not call, a branch not taken, a helper only kept-whole blocks
call) read nothing.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["AttributesRead", "TraceReads", "ValuesRead"]

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


class AttributesRead:
    """While active (around a trace), the attributes of modules that code other than torch's
    and the planner's machinery looked up (``self.scale``, ``getattr(m, name)``, ``hasattr``,
    ``vars(m)`` as ``__dict__``), by module, and that code's names. Module attribute lookup
    goes through a recording ``__getattribute__`` meanwhile (one Python call a lookup), put
    back on exit, as torch.fx puts back the ``__call__`` and ``__getattr__`` it patches."""

    def __init__(self) -> None:
        self.read: dict[int, tuple[nn.Module, set[str]]] = {}
        self.codes: set[types.CodeType] = set()

    def __enter__(self) -> AttributesRead:
        read, codes, machinery = self.read, self.codes, _MACHINERY
        generic, frame = object.__getattribute__, sys._getframe
        self._before = vars(nn.Module).get("__getattribute__")

        def __getattribute__(module: nn.Module, name: str) -> Any:
            code = frame(1).f_code
            skip = machinery.get(code)
            if skip is None:
                skip = machinery[code] = code.co_filename.startswith(_MACHINERY_FILES)
            if not skip:
                found = read.get(id(module))
                if found is None:
                    found = read[id(module)] = (module, set())
                found[1].add(name)
                codes.add(code)
            return generic(module, name)

        nn.Module.__getattribute__ = __getattribute__
        return self

    def __exit__(self, *exc: object) -> None:
        if self._before is None:
            del nn.Module.__getattribute__
        else:
            nn.Module.__getattribute__ = self._before

    def reads(self, values: ValuesRead) -> TraceReads:
        names: set[str] = set()
        for code in self.codes:
            names.update(code.co_names)
            names.update(c for c in code.co_consts if isinstance(c, str) and c.isidentifier())
        return TraceReads(
            values.versions(),
            tuple((module, frozenset(keys)) for module, keys in self.read.values()),
            frozenset(names))


def _folder(module: types.ModuleType) -> str:
    return os.path.dirname(module.__file__) + os.sep


# The code whose lookups are not the traced code's: torch.fx tracing, the Module machinery
# calling forward and hooks, the planner's and the state machinery's checks.
_MACHINERY_FILES = (
    _folder(torch.fx), nn.modules.module.__file__,
    os.path.dirname(os.path.dirname(__file__)) + os.sep + "replay" + os.sep,
    os.path.dirname(__file__) + os.sep,
)
_MACHINERY: dict[types.CodeType, bool] = {}


@dataclass(frozen=True)
class TraceReads:
    """What a trace read: the tensors whose values it read, with their versions then
    (``values``); each module whose attributes its code looked up, with their names
    (``attributes``); and the names that code mentions (``names``: a plain object's attribute
    it may have read, ``self.cfg.rate``)."""

    values: tuple[tuple[Tensor, int], ...] = ()
    attributes: tuple[tuple[nn.Module, frozenset[str]], ...] = ()
    names: frozenset[str] = field(default_factory=frozenset)
