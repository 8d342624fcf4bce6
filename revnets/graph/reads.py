"""What a trace read, which a traced graph froze and a planned step must refuse to run once it
has changed (NOTE [ Traced modules run as their graph ] in trace_state.py): the tensors whose
values it read, and the modules' attributes its code read.

torch.fx traces with proxies for the input and the parameters, but a buffer or a plain tensor
attribute is the real tensor: ``self.flag.item()``, ``float(self.t)`` or ``if self.on:`` read its
value while tracing, and the graph keeps what they read as a constant or a branch taken; so does
a tensor the forward computes from one (a table of sines made from a buffer). Following such a
tensor by name (NOTE [ A planned model is the model ]) cannot help: the graph never reads it
again. So the trace runs under a dispatch mode that records, for every tensor an operator makes
from real tensors, the tensors it came from; those a value was read of (``item``, ``bool``,
``equal``), and those a constant of the graph was made from, are the tensors read (checked by
value under the name they were read by: graph/guard.py). A tensor the graph holds as itself (a plain
attribute in an expression) is a constant that follows writes into it, and is not counted, nor
is a tensor a constant is a view of.

Attributes are read by the code a trace runs wherever it is: a module's own forward
(``self.scale``), a child reading its parent through a plain reference
(``self.owner[0].scale``), a function outside any class (``scale_of(self)``), ``getattr`` with
a name made at run time, a config's property or method (``self.cfg.rate``). So the trace runs
with attribute lookup on modules, and on the classes of the plain objects the model holds,
recording, for each object, the names looked up on it by code other than torch.fx's, the Module
machinery's and the planner's own (:class:`AttributesRead`). What code the trace never ran (a
method forward does not call, a branch not taken, a helper only kept-whole blocks call) read
nothing. A lookup that bypasses the class's (``object.__getattribute__(self, "x")``) is not
seen.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from revnets.facts.tensors import storage_key
from revnets.replay.held import is_plain_object

__all__ = ["AttributesRead", "TraceReads", "ValuesRead", "classes_closed_over"]

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
            storage = storage_key(tensor)
            self.read.update((key, t) for key, t in found.items()
                             if storage is None or storage_key(t) != storage)

    def read_tensors(self) -> tuple[Tensor, ...]:
        """The tensors whose values were read."""
        return tuple(self.read.values())


class AttributesRead:
    """While active (around a trace), the attributes looked up on modules and on the plain
    objects of ``classes`` (a config, a helper: NOTE [ What a module holds ]) by code other
    than torch's and the planner's machinery (``self.scale``, ``getattr(m, name)``,
    ``hasattr``, a property's code, ``vars(cfg)`` as ``__dict__``), by object. Attribute
    lookup on those classes goes through a recording ``__getattribute__`` meanwhile (one
    Python call a lookup), put back on exit, as torch.fx puts back the ``__call__`` and
    ``__getattr__`` it patches. A class that cannot take one (a C type: SimpleNamespace) is
    ``unwatched``: what its objects hold counts as read."""

    def __init__(self, classes: Iterable[type] = ()) -> None:
        self.classes = list(dict.fromkeys((nn.Module, *classes)))
        self.read: dict[int, tuple[Any, set[str]]] = {}
        self.unwatched: set[type] = set()
        self._put_back: list[tuple[type, Any]] = []

    def __enter__(self) -> AttributesRead:
        # Each class's own lookup, found before any is replaced: a subclass's calls its base's.
        lookups = [(kind, getattr(kind, "__getattribute__")) for kind in self.classes]
        for kind, lookup in lookups:
            before = vars(kind).get("__getattribute__", _NONE)
            try:
                type.__setattr__(kind, "__getattribute__", self._recording(lookup))
            except TypeError:
                self.unwatched.add(kind)
                continue
            self._put_back.append((kind, before))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._put_back:
            kind, before = self._put_back.pop()
            if before is _NONE:
                type.__delattr__(kind, "__getattribute__")
            else:
                type.__setattr__(kind, "__getattribute__", before)

    def _recording(self, lookup: Any) -> Any:
        read, machinery, frame = self.read, _MACHINERY, sys._getframe
        thread, tracing = threading.get_ident, threading.get_ident()  # not another thread's

        def __getattribute__(holder: Any, name: str) -> Any:
            code = frame(1).f_code
            skip = machinery.get(code)
            if skip is None:
                skip = machinery[code] = code.co_filename.startswith(_MACHINERY_FILES)
            if not skip and thread() == tracing:
                found = read.get(id(holder))
                if found is None:
                    found = read[id(holder)] = (holder, set())
                found[1].add(name)
            return lookup(holder, name)

        return __getattribute__

    def reads(self, values: ValuesRead) -> TraceReads:
        """What the trace read: these lookups, and the tensors whose values ``values`` saw
        read."""
        return TraceReads(
            values.read_tensors(),
            tuple((holder, frozenset(keys)) for holder, keys in self.read.values()),
            frozenset(self.unwatched))


_NONE = object()


def classes_closed_over(modules: Iterable[nn.Module]) -> set[type]:
    """The classes of the plain objects the forwards of ``modules`` close over (a config a
    class made by a factory reads), whose lookups a trace records too."""
    found: set[type] = set()
    for module in modules:
        for forward in {type(module).forward, vars(module).get("forward")}:
            for cell in getattr(forward, "__closure__", None) or ():
                try:
                    held = cell.cell_contents
                except ValueError:  # a cell not yet filled
                    continue
                if is_plain_object(held):
                    found.add(type(held))
    return found


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
    """What a trace read: the tensors whose values it read (``values``); each module and plain
    object whose attributes its code looked up, with their names (``attributes``); and the
    classes of plain objects whose lookups could not be recorded (``unwatched``)."""

    values: tuple[Tensor, ...] = ()
    attributes: tuple[tuple[Any, frozenset[str]], ...] = ()
    unwatched: frozenset[type] = field(default_factory=frozenset)
