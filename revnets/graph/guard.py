"""What a planned training step checks before it runs a traced graph: that what its trace read
is as it was when planned, and that no hook is registered where it would not fire (NOTE [ Traced
modules run as their graph ] in graph/trace_state.py)."""

from __future__ import annotations

import copy
import enum
import functools
import types
from collections.abc import Container, Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from revnets.graph.reads import TraceReads
from revnets.graph.trace_state import FLIPPED_MODE, copy_of, version_of
from revnets.replay.containers import MUTABLE
from revnets.replay.held import attributes_of, reached
from revnets.replay.hooks import hooked
from revnets.replay.known import names_run_by
from revnets.replay.state import own_attributes

__all__ = ["Frozen", "refuse_hooks"]


class _Absent:
    """An attribute not there; the same in a copy of the planned model (a prediction's)."""

    def __deepcopy__(self, memo: dict) -> _Absent:
        return self


_MISSING = _Absent()


_SCALARS = (int, float, bool, str, complex, type(None))


class Frozen:
    """What a traced graph froze (NOTE [ Traced modules run as their graph ]), found by what
    its trace read (``reads``: graph/reads.py): every attribute its code looked up on a module
    or a plain object (numbers, flags and strings by value, a numpy array, a partial or a
    function by its contents, anything else by identity, one absent then by its absence),
    modules aside; what the lists and dicts among them hold, and the plain objects whose
    lookups could not be recorded (NOTE [ What a module holds ]); the tensors whose values it
    read, by value, under the name it read them by (a tensor put there since, a cast); and of
    the modules a planned step runs as their graph (``traced``: names and modules), their
    class and forward (what it closes over too), their classes' constants that their code
    names (``type(self).rate``), and their submodules, by identity and order. ``model``: to
    name what changed. A copy of the planned model (a prediction's, an EMA) checks its own
    state against that state as copied, where the model was as planned then."""

    def __init__(self, model: nn.Module, traced: Iterable[tuple[str, nn.Module]],
                 reads: TraceReads = TraceReads()) -> None:
        self.traced = list(traced)
        paths = _paths(model)
        self.values: list[tuple[str, Any, str]] = []  # path, holder, key
        self.held: list[tuple[str, Any, tuple[str, ...] | None]] = []  # path, holder, keys
        self.tensors: list[tuple[str, Any, str | None, Tensor | None]] = []
        seen: set[int] = set()
        values_read = {id(t): t for t in reads.values}
        for holder, keys in reads.attributes:
            path = paths.get(id(holder), f"<a {type(holder).__name__} the model does not hold>")
            for key in keys:
                if isinstance(now := _attribute(holder, key), Tensor) and id(now) in values_read:
                    del values_read[id(now)]
                    self.tensors.append((path, holder, key, None))
            self._watch(path, holder, _read(holder, keys), seen, reads.unwatched)
        self.tensors += [(f"a tensor of shape {tuple(t.shape)}", None, None, t)
                         for t in values_read.values()]
        for name, module in self.traced:
            self._watch(name, module, [(key, _attribute(module, key))
                                       for key in _class_constants(module)], seen, ())
        self.then = self._state()

    def _watch(self, path: str, holder: Any, read: list[tuple[str, Any]], seen: set[int],
               unwatched: Container[type]) -> None:
        self.values += [(path, holder, key) for key, _ in read]
        for key, value in read:
            for where, v in reached(value, seen, f"{path + '.' if path else ''}{key}"):
                if isinstance(v, MUTABLE):
                    self.held.append((where, v, None))
                elif type(v) in unwatched:  # its lookups not recorded: all of it
                    self.held.append((where, v, tuple(k for k, _ in _read(
                        v, frozenset({"__dict__"})))))

    def _state(self) -> tuple[list, ...]:
        """What is watched, as it is now."""
        return (
            [_snapshot(_attribute(holder, key)) for _, holder, key in self.values],
            [[_snapshot(x) for x in _contents(holder)] if keys is None else
             [_snapshot(_attribute(holder, key)) for key in keys]
             for _, holder, keys in self.held],
            [_tensor_state(_tensor(holder, key, tensor)) for _, holder, key, tensor
             in self.tensors],
            [(type(m), vars(m).get("forward"), _snapshot(type(m).forward), tuple(
                m._modules.items())) for _, m in self.traced])

    def check(self) -> None:
        """Raise, naming it, if anything frozen changed."""
        values, held, tensors, code = self.then
        for (path, holder, key, tensor), then in zip(self.tensors, tensors):
            _check_tensor(path, holder, key, _tensor(holder, key, tensor), then)
        for (name, module), (kind, forward, function, children) in zip(self.traced, code):
            if type(module) is not kind or vars(module).get("forward") is not forward or (
                    not _same(kind.forward, function)):
                _refuse(name, module, "", "runs other code than when planned (its class or "
                        "forward replaced, or what its forward closes over changed)")
            if tuple(module._modules.items()) != children:
                _refuse_submodules(name, module, children)
        for (path, holder, key), then in zip(self.values, values):
            _check(path, holder, key, _attribute(holder, key), then)
        for (path, holder, keys), then in zip(self.held, held):
            if keys is not None:
                for key, value in zip(keys, then):
                    _check(path, holder, key, _attribute(holder, key), value)
                continue
            now = _contents(holder)
            if len(now) != len(then) or not all(map(_same, now, then)):
                _refuse(path, holder, "", "was changed in place since planning")

    def __deepcopy__(self, memo: dict) -> Frozen:
        new = Frozen.__new__(Frozen)
        new.traced = [(name, copy.deepcopy(m, memo)) for name, m in self.traced]
        new.values, new.held, new.tensors = (
            [(path, copy.deepcopy(holder, memo), *rest) for path, holder, *rest in entries]
            for entries in (self.values, self.held, self.tensors))
        new.tensors = [(path, holder, key, copy.deepcopy(tensor, memo))
                       for path, holder, key, tensor in new.tensors]
        try:
            self.check()
        except RuntimeError:  # a stale model's copy is refused as the model is
            new.then = copy.deepcopy(self.then, memo)
        else:  # the copy's own state is as planned (holders whose copies are not memo's)
            new.then = new._state()
        return new


def _refuse_submodules(name: str, module: nn.Module, children: tuple) -> None:
    then = dict(children)
    for key, child in module._modules.items():
        if key in then and then[key] is not child:
            _refuse(name, module, key, "is another module than when planned")
    added = [key for key in module._modules if key not in then]
    _refuse(name, module, "", f"has submodules {added} added since planning" if added
            else "has its submodules in another order than when planned" if len(
                module._modules) == len(then) else "has submodules removed since planning")


def _tensor(holder: Any, key: str | None, tensor: Tensor | None) -> Any:
    return tensor if key is None else _attribute(holder, key)


def _tensor_state(tensor: Any) -> list:
    """A tensor whose value a trace read: itself, its version, a copy of its value (none of
    a fake one: a prediction's copy, nothing to compare)."""
    fake = isinstance(tensor, FakeTensor) or not isinstance(tensor, Tensor) or (
        tensor.device.type == "meta")
    return [tensor, None if fake else version_of(tensor), None if fake else copy_of(tensor)]


def _check_tensor(path: str, holder: Any, key: str | None, now: Any, then: list) -> None:
    """Refuse if the tensor whose value the trace read, as named then (``key`` of ``holder``;
    None: that tensor), holds another value now; one holding the same (the model cast without
    loss) is followed from then on."""
    tensor, version, value = then
    if now is tensor and (version is None or version_of(now) == version):
        return
    if not isinstance(now, Tensor):
        _refuse(path, holder, key or "", f"is {_named(now)}, a tensor whose value the trace "
                "read when planned")
    if isinstance(now, FakeTensor) or now.device.type == "meta":
        return
    if value is None or now.shape != value.shape or not torch.equal(
            now.detach().to(value.device, value.dtype), value):
        _refuse(path, holder if key else now, key or "", "is a tensor whose value the trace "
                "read (.item(), bool(), a constant made from it), changed since planning")
    then[:] = [now, version_of(now), value]


def _paths(model: nn.Module) -> dict[int, str]:
    """Where each module of ``model`` and each container and plain object they hold is, by
    id (the first path found)."""
    paths: dict[int, str] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        paths.setdefault(id(module), name)
        own = vars(module)
        for key in own_attributes(tuple(own)):
            for where, v in reached(own[key], seen, f"{name + '.' if name else ''}{key}"):
                if not isinstance(v, nn.Module):
                    paths.setdefault(id(v), where)
    return paths


# What a module's attribute lookup finds besides its own and its classes' attributes: torch's
# (the Module machinery's state, the training flag, which is flipped on purpose).
_MACHINERY_NAMES = frozenset(vars(nn.Module())) | {FLIPPED_MODE}


def _read(holder: Any, keys: frozenset[str]) -> list[tuple[str, Any]]:
    """The attributes ``keys`` of a module or plain object a graph may have frozen (all of
    them where its ``__dict__`` was read), as they are now: its own or its classes', or
    absent; not tensors (their values: ``Frozen.tensors``), modules, dunder names, and of a
    module, its registered ones and torch's own."""
    module = isinstance(holder, nn.Module)
    if "__dict__" in keys:
        keys = keys | _own(holder).keys()
    found = []
    for key in sorted(keys):
        if key.startswith("__") or module and (key in _MACHINERY_NAMES or any(
                key in table for table in (holder._parameters, holder._buffers,
                                           holder._modules))):
            continue
        value = _attribute(holder, key)
        if (value is _MISSING and hasattr(type(holder), key)) or isinstance(
                value, (Tensor, nn.Module)):
            continue
        found.append((key, value))
    return found


def _class_constants(module: nn.Module) -> list[str]:
    """What ``module`` finds as its user classes' attributes that their code names (``type(
    self).rate``), methods and descriptors aside."""
    names = _names_read(type(module))
    return [key for key in {k for base in _user_classes(type(module)) for k in vars(base)}
            if key in names and not key.startswith("__") and key not in vars(module)
            and not callable(value := _attribute(module, key))
            and not isinstance(value, (property, staticmethod, classmethod))]


def _own(holder: Any) -> dict[str, Any]:
    if isinstance(holder, nn.Module):
        return vars(holder)
    own, slots = attributes_of(holder)
    return {**own, **slots}


def _attribute(holder: Any, key: str) -> Any:
    """``holder``'s attribute ``key`` now: a module's registered one, its own, else its user
    classes' (a constant, which code may change on the class itself), else ``_MISSING``."""
    if isinstance(holder, nn.Module):
        for table in (holder._parameters, holder._buffers):
            if key in table:
                return table[key]
    own = _own(holder)
    if key in own:
        return own[key]
    return next((vars(base)[key] for base in _user_classes(type(holder)) if key in vars(base)),
                _MISSING)


def _user_classes(kind: type) -> tuple[type, ...]:
    # A dict, not functools.cache: torch.compile traces a planned step's checks, and only
    # warns of a cache wrapper it looks through.
    found = _USER_CLASSES.get(kind)
    if found is None:
        found = _USER_CLASSES[kind] = tuple(
            base for base in kind.__mro__
            if base is not object and not base.__module__.startswith("torch."))
    return found


_USER_CLASSES: dict[type, tuple[type, ...]] = {}


def _is_scalar(value: Any) -> bool:
    return isinstance(value, _SCALARS) or isinstance(value, np.generic)


# Values compared by their contents, which change in place without a new object: a numpy
# array (``self.w[0] = 3.0``), a partial's keywords, what a function closes over (a lambda
# reading a list) and its defaults.
def _snapshot(value: Any) -> Any:
    contents = _state(value)
    return value if contents is None else _Snapshot(value, contents)


def _state(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, functools.partial):
        return value.func, value.args, dict(value.keywords)
    if isinstance(value, types.FunctionType):
        cells = []
        for cell in value.__closure__ or ():
            try:
                held = cell.cell_contents
            except ValueError:  # a cell not yet filled
                held = _MISSING
            cells.append((held, _contents(held) if isinstance(held, MUTABLE) else _state(held)))
        return value.__defaults__, dict(value.__kwdefaults__ or {}), cells
    return None


def _equal(now: Any, then: Any) -> bool:
    if isinstance(then, np.ndarray):
        return isinstance(now, np.ndarray) and now.shape == then.shape and (
            now.dtype == then.dtype) and bool(np.array_equal(
                now, then, equal_nan=now.dtype.kind in "fc"))
    if type(then) in (tuple, list) and type(now) is type(then):
        return len(now) == len(then) and all(map(_equal, now, then))
    if type(then) is dict and type(now) is dict:
        return now.keys() == then.keys() and all(_equal(now[k], then[k]) for k in then)
    return now is then or (_is_scalar(now) and _is_scalar(then) and bool(now == then))


class _Snapshot:
    __slots__ = ("value", "contents")

    def __init__(self, value: Any, contents: Any) -> None:
        self.value, self.contents = value, contents

    def same(self, now: Any) -> bool:
        return now is self.value and _equal(_state(now), self.contents)


def _same(now: Any, then: Any) -> bool:
    if isinstance(then, _Snapshot):
        return then.same(now)
    if isinstance(then, tuple) and type(now) is type(then) and now is not then:
        # an equal tuple put there (a namedtuple of settings made again)
        return len(now) == len(then) and all(map(_same, now, then))
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
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
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
