"""What a module holds besides its registered state, found by one walk that the replay, the
planner and the messages naming modules all share (NOTE [ What a module holds ])."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from revnets.replay.containers import MUTABLE, NESTING, ContainerCopy

__all__ = [
    "AttributesCopy", "attributes_of", "generators_held", "is_plain_object", "modules_held",
    "path_to", "reached", "state_copies",
]

# NOTE [ What a module holds ]
# Besides its parameters, buffers and submodules, a module holds what its attributes reach
# through containers (lists, tuples, dicts, sets, deques) and plain objects (an instance with a
# ``__dict__`` that is not a module, tensor, class, function or Python module, nor one of torch's
# own: a config, a counter, a store), at any depth, each object once. A forward changes state
# there (``self.cfg.count += 1``, ``self.store["feats"].append(x)``) and calls modules held there
# (``self.helpers[0]``, ``self.cfg.helper``) as it calls registered ones. One walk, ``reached``,
# decides what that is for everyone that looks: the replay puts it back and checks it (Census,
# state.py), the planner undoes and detects what a trace changed there (Attributes,
# graph/trace_state.py),
# generators are found there (generators_held) and refusals name modules by the path they are
# held through (names.py). Walked by two rules, the replay and the planner would disagree, and
# a module one of them does not see runs twice or changes state silently. A plain object's
# attributes are its ``__dict__`` and its ``__slots__`` (a dataclass with slots). Not walked
# into: what an object keeps in C (a numpy array's contents, an iterator's position), torch's
# own objects (the fx graph a GraphModule keeps) and the standard library's, but for its
# namespaces (SimpleNamespace, argparse's): a logger, a lock, a queue, a path are the process's
# machinery, not model state, and a logger reaches every other logger, torch's among them,
# whose caches torch fills while it traces.

_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_NOT_PLAIN = (nn.Module, Tensor, type, types.FunctionType, types.MethodType,
              types.BuiltinFunctionType, types.ModuleType)
# The standard library's records of attributes, which are state as a user's class is.
_RECORDS = (types.SimpleNamespace, argparse.Namespace)


def is_plain_object(value: Any) -> bool:
    """Whether ``reached`` walks into ``value``'s attributes (NOTE [ What a module holds ]):
    its ``__dict__`` and ``__slots__``. Decided by its class, without calling the object's own
    code (a ``__getattr__`` that raises)."""
    return _plain_kind(type(value))


@functools.cache
def _plain_kind(kind: type) -> bool:
    package = str(getattr(kind, "__module__", "")).partition(".")[0]
    if issubclass(kind, _NOT_PLAIN) or package == "torch" or (
            package in sys.stdlib_module_names and kind not in _RECORDS):
        return False
    return bool(getattr(kind, "__dictoffset__", 0)) or bool(_slot_names(kind))


def _own_dict(value: Any) -> dict | None:
    try:
        found = object.__getattribute__(value, "__dict__")
    except Exception:  # no __dict__, or a descriptor of the user's that refuses
        return None
    return found if type(found) is dict else None


@functools.cache
def _slot_names(kind: type) -> tuple[str, ...]:
    names = []
    for base in kind.__mro__:
        slots = vars(base).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):  # mangled, as Python does
                name = f"_{base.__name__.lstrip('_')}{name}"
            names.append(name)
    return tuple(dict.fromkeys(names))


def attributes_of(value: Any) -> tuple[dict, dict]:
    """A plain object's attributes as they are: its ``__dict__`` (a copy) and its slots that
    are set."""
    own = _own_dict(value)
    slots = {}
    for name in _slot_names(type(value)):
        try:
            slots[name] = object.__getattribute__(value, name)
        except AttributeError:  # a slot not set
            pass
    return ({} if own is None else dict(own)), slots


class AttributesCopy:
    """A plain object's attributes at one moment (the values themselves, not copies of them),
    to compare with later and to put back, as :class:`ContainerCopy` does a container's
    elements; a frozen dataclass's too."""

    __slots__ = ("container", "contents")

    def __init__(self, value: Any) -> None:
        self.container = value
        self.contents = attributes_of(value)

    def same(self) -> bool:
        return all(len(now) == len(then) and all(k in then and v is then[k]
                                                 for k, v in now.items())
                   for now, then in zip(attributes_of(self.container), self.contents))

    def put_back(self) -> None:
        value, (own, slots) = self.container, self.contents
        found = _own_dict(value)
        if found is not None:
            found.clear()
            found.update(own)
        for name in _slot_names(type(value)):
            if name in slots:
                object.__setattr__(value, name, slots[name])
            else:
                with contextlib.suppress(AttributeError):
                    object.__delattr__(value, name)


def state_copies(value: Any) -> list[ContainerCopy | AttributesCopy]:
    """What puts back the state ``value`` holds itself (a container's elements, a plain object's
    attributes, both for a dict subclass with attributes of its own), as it is now."""
    found: list[ContainerCopy | AttributesCopy] = []
    if isinstance(value, MUTABLE):
        found.append(ContainerCopy(value))
    if is_plain_object(value):
        found.append(AttributesCopy(value))
    return found


def reached(
    value: Any, seen: set[int], path: str | None = None
) -> Iterator[tuple[str | None, Any]]:
    """``value`` and what it holds (NOTE [ What a module holds ]), depth first, as ``(path,
    object)``: containers and plain objects before their contents, then walked into; modules,
    tensors and other objects not. Numbers and strings are left out. Each object comes once
    (``seen``: ids already come, shared by several walks and grown: ``value`` must outlive
    it, not a list made for the call, whose id a later one reuses), but for modules, which
    their caller tells apart itself. ``path``: where ``value`` is held, to name what it holds
    (``cfg.helper``, ``blocks[0]``, ``store['k']``); None: not named (faster)."""
    pending = [(path, value)]
    while pending:
        where, v = pending.pop()
        if type(v) in _SCALARS:
            continue
        if isinstance(v, nn.Module):
            yield where, v
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        yield where, v
        children = []
        if isinstance(v, NESTING):
            items = (dict.items(v) if isinstance(v, dict) else
                     enumerate(v) if isinstance(v, (list, tuple)) else ((None, x) for x in v))
            children = [(None if where is None else where + _part(v, k), x) for k, x in items]
        if is_plain_object(v):
            own, slots = attributes_of(v)
            children += [(None if where is None else f"{where}.{k}", x)
                         for k, x in (*own.items(), *slots.items())]
        pending += reversed(children)


def path_to(target: Any, attributes: dict, keys: Iterable[str]) -> str | None:
    """Where ``target`` is held among ``attributes`` (an object's, by ``keys``), or None."""
    seen: set[int] = set()
    for key in keys:
        for where, value in reached(attributes[key], seen, key):
            if value is target:
                return where
    return None


def _part(holder: Any, key: Any) -> str:
    if key is None:
        return "{...}"  # an element of a set: no place to name
    # keys named where their repr is plain and cannot fail
    return f"[{repr(key) if type(key) in (str, int) else f'<{type(key).__name__}>'}]"


_EMPTY_SKIPPED = (dict, collections.OrderedDict, list)


def generators_held(module: nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects ``module`` and its submodules hold, and the modules they
    hold unregistered (the model a planned model runs), in attributes and in what those reach
    (NOTE [ What a module holds ])."""
    return modules_held(module)[1]


def modules_held(module: nn.Module) -> tuple[list[nn.Module], list[torch.Generator]]:
    """``module``, its submodules and the modules they hold unregistered (the model and the
    chain a planned model runs), each once; and the ``torch.Generator`` objects they hold, in
    attributes and in what those reach (NOTE [ What a module holds ])."""
    found: dict[int, torch.Generator] = {}
    seen: set[int] = set()
    walked: dict[int, nn.Module] = {}
    pending = [module]
    while pending:
        m = pending.pop()
        if id(m) in walked:
            continue
        walked[id(m)] = m
        for attribute in vars(m).values():  # _modules among them
            if type(attribute) in _EMPTY_SKIPPED and not attribute:  # most hook tables
                continue
            for _, value in reached(attribute, seen):
                if isinstance(value, nn.Module):
                    pending.append(value)
                elif isinstance(value, torch.Generator):
                    found[id(value)] = value
    return list(walked.values()), list(found.values())
