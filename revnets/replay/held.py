"""What a module holds besides its registered state, found by one walk that the replay, the
planner and the messages naming modules all share (NOTE [ What a module holds ])."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from revnets.replay.containers import NESTING

__all__ = ["is_plain_object", "reached"]

# NOTE [ What a module holds ]
# Besides its parameters, buffers and submodules, a module holds what its attributes reach
# through containers (lists, tuples, dicts, sets, deques) and plain objects (an instance with a
# ``__dict__`` that is not a module, tensor, class, function or Python module, nor one of torch's
# own: a config, a counter, a store), at any depth, each object once. A forward changes state
# there (``self.cfg.count += 1``, ``self.store["feats"].append(x)``) and calls modules held there
# (``self.helpers[0]``, ``self.cfg.helper``) as it calls registered ones. One walk, ``reached``,
# decides what that is for everyone that looks: the replay puts it back and checks it (Census,
# state.py), the planner undoes and detects what a trace changed there (Attributes, traced.py),
# generators are found there (generators_held) and refusals name modules by the path they are
# held through (names.py). Walked by two rules, the replay and the planner would disagree, and
# a module one of them does not see runs twice or changes state silently. What an object keeps
# in ``__slots__`` or in C (a numpy array's contents) is not followed; torch's own objects (an fx
# graph a GraphModule keeps) keep no state a forward changes, and are not walked into.

_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_NOT_PLAIN = (nn.Module, Tensor, type, types.FunctionType, types.MethodType,
              types.BuiltinFunctionType, types.ModuleType)


def is_plain_object(value: Any) -> bool:
    """Whether ``reached`` walks into ``value``'s attributes (NOTE [ What a module holds ])."""
    return (isinstance(getattr(value, "__dict__", None), dict)
            and not isinstance(value, _NOT_PLAIN)
            and not type(value).__module__.startswith("torch."))


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
        if isinstance(v, dict):
            items: Any = v.items()
        elif isinstance(v, NESTING):
            items = enumerate(v) if isinstance(v, (list, tuple)) else ((None, x) for x in v)
        elif is_plain_object(v):
            items, where = vars(v).items(), None if where is None else where + "."
        else:
            continue
        children = [(None if where is None else where + _part(v, k), x) for k, x in items]
        pending += reversed(children)


def _part(holder: Any, key: Any) -> str:
    if not isinstance(holder, NESTING):
        return str(key)  # an attribute of a plain object
    if key is None:
        return "{...}"  # an element of a set: no place to name
    # keys named where their repr is plain and cannot fail
    return f"[{repr(key) if type(key) in (str, int) else f'<{type(key).__name__}>'}]"
