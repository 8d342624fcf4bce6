"""What a planned training step checks before it runs a traced graph: that what its trace read
is as it was when planned, and that no hook is registered where it would not fire (NOTE [ Traced
modules run as their graph ] in traced.py)."""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

import numpy as np
from torch import Tensor, nn

from revnets.planning.trace_reads import TraceReads
from revnets.planning.traced import _MODE
from revnets.replay.containers import MUTABLE
from revnets.replay.held import attributes_of, is_plain_object, reached
from revnets.replay.hooks import hooked
from revnets.replay.known import names_run_by

__all__ = ["Frozen", "refuse_hooks"]

class _Absent:
    """An attribute not there; the same in a copy of the planned model (a prediction's)."""

    def __deepcopy__(self, memo: dict) -> _Absent:
        return self


_MISSING = _Absent()


_SCALARS = (int, float, bool, str, complex, type(None))


class Frozen:
    """What a traced graph froze (NOTE [ Traced modules run as their graph ]), found by what
    its trace read (``reads``: trace_reads.py): every attribute its code looked up on any
    module (numbers, flags and strings by value, a numpy array or a partial by its contents,
    anything else by identity, one absent then by its absence), but tensors (followed: NOTE [
    A planned model is the model ]) and modules; what the lists, dicts and plain objects among
    them hold (``self.scales[0]``; ``self.cfg.rate``: NOTE [ What a module holds ]); the
    tensors whose values it read, by version; and of the modules a planned step runs as their
    graph (``traced``: names and modules), their classes' constants that their code names
    (``type(self).rate``), and their submodules, by identity and order. ``model``: to name
    what changed."""

    def __init__(self, model: nn.Module, traced: Iterable[tuple[str, nn.Module]],
                 reads: TraceReads = TraceReads()) -> None:
        traced = list(traced)
        self.traced, self.values_read = traced, _Versions(reads.values)
        named = {id(m): n for n, m in reversed(list(model.named_modules()))}
        self.values, self.held = [], []  # held: (path, holder, its frozen contents as found)
        seen: set[int] = set()
        for module, keys in reads.attributes:
            name = named.get(id(module), "<a module the model does not register>")
            read = _read(module, keys)
            self.values += [(name, module, key, _snapshot(value)) for key, value in read]
            names = reads.names | _names_read(type(module))
            for key, value in read:
                for where, holder in reached(value, seen, f"{name + '.' if name else ''}{key}"):
                    if isinstance(holder, MUTABLE):
                        self.held.append((where, holder, _contents(holder)))
                    elif is_plain_object(holder):
                        own, slots = attributes_of(holder)
                        self.held.append((where, holder, {
                            k: _snapshot(v) for k, v in {**own, **slots}.items()
                            if k in names and not isinstance(v, (Tensor, nn.Module))}))
        self.values += [(name, module, key, _attribute(module, key)) for name, module in traced
                        for key in _class_constants(module) if key in _names_read(type(module))]
        self.modules = [(name, module, key, child) for name, module in traced
                        for key, child in module._modules.items()]
        self.names = [(name, module, tuple(module._modules)) for name, module in traced]

    def check(self) -> None:
        """Raise, naming it, if anything frozen changed."""
        for tensor, version in self.values_read:
            if tensor._version != version:
                name, holder = _tensor_name(self.traced, tensor)
                _refuse(name, holder, "", "is a tensor whose value the trace read (.item(), "
                        "bool(), a constant made from it), written since planning")
        for name, module, key, value in self.values:
            _check(name, module, key, _attribute(module, key), value)
        for name, holder, then in self.held:
            if isinstance(then, list):  # a container's elements
                now = _contents(holder)
                if len(now) != len(then) or not all(map(_same, now, then)):
                    _refuse(name, holder, "", "was changed in place since planning")
                continue
            own, slots = attributes_of(holder)
            now = {**own, **slots}
            for key, value in then.items():
                _check(name, holder, key, now.get(key, _MISSING), value)
        for name, module, key, child in self.modules:
            if module._modules.get(key) is not child:
                _refuse(name, module, key, "is another module than when planned")
        for name, module, keys in self.names:  # a block appended: the graph would skip it
            if tuple(module._modules) != keys:
                added = [key for key in module._modules if key not in keys]
                _refuse(name, module, "", f"has submodules {added} added since planning"
                        if added else "has its submodules in another order than when planned")


class _Versions(list):
    """Tensors and the versions they had: the same tensors in a copy of the planned model (a
    prediction's fake copy, whose tensors start at version 0), which checks the model's own."""

    def __deepcopy__(self, memo: dict) -> _Versions:
        return self


def _tensor_name(traced: list[tuple[str, nn.Module]], tensor: Tensor) -> tuple[str, Any]:
    for name, module in traced:
        for key, value in (*module._parameters.items(), *module._buffers.items(),
                           *vars(module).items()):
            if value is tensor:
                return ".".join(filter(None, (name, key))), module
    return f"a tensor of shape {tuple(tensor.shape)}", tensor


# What a module's attribute lookup finds besides its own and its classes' attributes: torch's
# (the Module machinery's state, the training flag, which is flipped on purpose).
_MACHINERY_NAMES = frozenset(vars(nn.Module())) | {_MODE}


def _read(module: nn.Module, keys: frozenset[str]) -> list[tuple[str, Any]]:
    """The attributes ``keys`` of ``module`` a graph may have frozen (all of them where its
    ``__dict__`` was read), as they are now: its own or its classes', or absent; not tensors,
    modules, dunder names and torch's own."""
    if "__dict__" in keys:
        keys = keys | vars(module).keys()
    registered = (module._parameters, module._buffers, module._modules)
    found = []
    for key in sorted(keys):
        if key in _MACHINERY_NAMES or key.startswith("__") or any(key in r for r in registered):
            continue
        value = _attribute(module, key)
        if (value is _MISSING and hasattr(type(module), key)) or isinstance(
                value, (Tensor, nn.Module)):
            continue
        found.append((key, value))
    return found


def _class_constants(module: nn.Module) -> list[str]:
    """The numbers, flags and strings ``module`` finds as its user classes' attributes."""
    return [key for key in {k for base in _user_classes(type(module)) for k in vars(base)}
            if not key.startswith("__") and key not in vars(module)
            and _is_scalar(_attribute(module, key))]


def _attribute(module: nn.Module, key: str) -> Any:
    """``module``'s attribute ``key`` now: its own, else its user classes' (a constant, which
    code may change on the class itself), else ``_MISSING``."""
    own = vars(module)
    if key in own:
        return own[key]
    return next((vars(base)[key] for base in _user_classes(type(module)) if key in vars(base)),
                _MISSING)


@functools.cache
def _user_classes(kind: type) -> tuple[type, ...]:
    return tuple(base for base in kind.__mro__
                 if base is not object and not base.__module__.startswith("torch."))


def _is_scalar(value: Any) -> bool:
    return isinstance(value, _SCALARS) or isinstance(value, np.generic)


# Values compared by their contents, which change in place without a new object: a numpy
# array (``self.w[0] = 3.0``), a partial's keywords.
def _snapshot(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return _Snapshot(value, value.copy())
    if isinstance(value, functools.partial):
        return _Snapshot(value, (value.func, value.args, dict(value.keywords)))
    return value


class _Snapshot:
    __slots__ = ("value", "contents")

    def __init__(self, value: Any, contents: Any) -> None:
        self.value, self.contents = value, contents

    def same(self, now: Any) -> bool:
        if now is not self.value:
            return False
        if isinstance(now, np.ndarray):
            then = self.contents
            return now.shape == then.shape and now.dtype == then.dtype and bool(
                np.array_equal(now, then, equal_nan=now.dtype.kind in "fc"))
        func, args, keywords = self.contents
        return now.func is func and now.args == args and now.keywords == keywords


def _same(now: Any, then: Any) -> bool:
    if isinstance(then, _Snapshot):
        return then.same(now)
    return now is then or (_is_scalar(now) and _is_scalar(then) and bool(now == then))


def _check(name: str, holder: Any, key: str, now: Any, then: Any) -> None:
    if not _same(now, then):
        what = ("changed in place since planning" if isinstance(then, _Snapshot)
                and now is then.value else f"{_named(now)}, {_named(then)} when planned")
        _refuse(name, holder, key, f"is {what}")


def _named(value: Any) -> str:
    if _is_scalar(value):
        return repr(value)
    if value is _MISSING:
        return "absent"
    if isinstance(value, _Snapshot):
        return _named(value.value)
    return getattr(value, "__name__", None) or f"another {type(value).__name__}"


def _contents(container: Any) -> list:
    """A container's keys and elements, in order, one flat list."""
    if isinstance(container, dict):
        return [x for item in dict.items(container) for x in item]
    return list(container)


def _refuse(name: str, module: Any, key: str, what: str) -> None:
    raise RuntimeError(
        f"auto_checkpoint: {'.'.join(filter(None, (name, key))) or 'the model'} "
        f"({type(module).__name__}) {what}; the plan runs a graph traced with it as it was. "
        f"Plan again (auto_checkpoint on the model as it is now)"
    )


@functools.cache
def _names_read(kind: type) -> frozenset[str]:
    """Every attribute name the code of ``kind`` and its bases (torch's own excluded) reads:
    methods, and the functions under properties, static and class methods; and the strings
    in that code that could name one (``getattr(self, "scale")``)."""
    functions = [getattr(f, "fget", None) or getattr(f, "__func__", None) or f
                 for base in _user_classes(kind) for f in vars(base).values()]
    codes = [f.__code__ for f in functions if isinstance(f, types.FunctionType)]
    strings: set[str] = set()
    while codes:
        code = codes.pop()
        strings.update(c for c in code.co_consts if isinstance(c, str) and c.isidentifier())
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names_run_by(functions) | strings


def _global_hooks() -> bool:
    module = nn.modules.module
    return bool(module._global_forward_hooks or module._global_forward_pre_hooks
                or module._global_backward_hooks or module._global_backward_pre_hooks)


def refuse_hooks(traced: Iterable[tuple[str, nn.Module]]) -> None:
    """Raise, naming it, if a module a planned step runs as its traced graph (``traced``: names
    and modules, "" for the model itself) has a hook, or if a global module hook is registered
    (NOTE [ Traced modules run as their graph ])."""
    if _global_hooks():
        raise RuntimeError(
            "auto_checkpoint: a global module hook (torch.nn.modules.module.register_module_"
            "forward_hook and the like) is registered; a planned training step runs traced "
            "graphs in which most of the model's modules are never called, so it would not fire "
            "as in the model. Remove it around planned training steps, or register hooks on the "
            "modules themselves before planning (the planner then keeps them whole)"
        )
    for name, module in traced:
        if hooked(module):
            where = (f"the model itself ({type(module).__name__}): register it on the model "
                     "auto_checkpoint returned" if not name else
                     f"{name} ({type(module).__name__}), which the plan runs as its traced graph: "
                     "register hooks before auto_checkpoint, which then keeps the module whole")
            raise RuntimeError(
                f"auto_checkpoint: a hook is registered on {where}. Where it is now, it would "
                "not run in a planned training step"
            )
