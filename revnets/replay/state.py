"""Module state by slot, and the generators user code draws from (NOTE [ Replay ], rules 1-3)."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from revnets.facts import device_of, storage_key, version_of
from revnets.replay.containers import ContainerCopy
from revnets.replay.held import AttributesCopy, path_to, reached, state_copies
from revnets.replay.stateless import has_state
from revnets.replay.structure import InstalledForward, structure_of

__all__ = ["forked_rng", "state_tensors"]


def default_generator(device: torch.device) -> Any:
    """The generator an operator on ``device`` draws from when it is given none."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return _ModuleGenerator(module)
    return generators[device.index if device.index is not None else module.current_device()]


class _ModuleGenerator:
    """A device whose generator is reached through its module's get/set_rng_state only (mps)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def get_state(self) -> Tensor:
        return self.module.get_rng_state()

    def set_state(self, state: Tensor) -> None:
        self.module.set_rng_state(state)


CPU_STATE_BYTES = torch.default_generator.get_state().numel()


class NumpyGenerator:
    """numpy's global generator (np.random.seed, np.random.rand) or a RandomState or Generator,
    behind Python's getstate/setstate."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def getstate(self) -> Any:
        g = self.generator
        return g.get_state() if hasattr(g, "get_state") else g.bit_generator.state

    def setstate(self, state: Any) -> None:
        g = self.generator
        if hasattr(g, "set_state"):
            g.set_state(state)
        else:
            g.bit_generator.state = state

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        numpy = sys.modules["numpy"]
        if isinstance(a, tuple):  # the legacy state: (name, keys, pos, has_gauss, cached)
            return a[2:] == b[2:] and a[0] == b[0] and numpy.array_equal(a[1], b[1])
        return repr(a) == repr(b)


class RecordingChain:
    """What holds between consecutive recordings of one forward while only revnets' own code runs
    between them (NOTE [ Replay ]): Python's and numpy's generator states where the last recording
    ended, for the next to begin from, so that each boundary is read once, not twice; and the
    torch namespaces already found as torch made them (NOTE [ Known layers ]), so that each is
    compared once per chain, not once per recording. Code that runs user code outside a
    recording between two of them calls :meth:`cut`; a recording that runs user code (one the
    dispatcher watches) calls :meth:`user_code_runs`."""

    def __init__(self) -> None:
        self.states: dict[int, tuple[Any, Any]] = {}
        self.verified: set[Any] = set()

    def cut(self) -> None:
        self.states = {}
        self.verified = set()

    def user_code_runs(self) -> None:
        """User code may patch anything: namespaces are compared again after it."""
        self.verified = set()

    def begin(self, generators: dict[int, Any]) -> dict[int, tuple[Any, Any]]:
        """Each generator with its state now: from the chain where it holds one, else read."""
        chained, self.states = self.states, {}
        begun = {}
        for key, g in generators.items():
            link = chained.get(key)
            begun[key] = (g, link[1] if link is not None else g.getstate())
        return begun

    def end(self, generators: dict[int, Any]) -> dict[int, tuple[Any, Any]]:
        """Each generator with its state now, kept for the next recording."""
        self.states = {key: (g, g.getstate()) for key, g in generators.items()}
        return self.states


def same_state(generator: Any, a: Any, b: Any) -> bool:
    return generator.same(a, b) if isinstance(generator, NumpyGenerator) else a == b


def device_of_op(args: Any, kwargs: dict) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    return device_of((args, kwargs), torch.device("cpu"))


@contextlib.contextmanager
def forked_rng(
    device: torch.device, held: Sequence[torch.Generator] = ()
) -> Iterator[None]:
    """Run code without disturbing the CPU's, ``device``'s and Python's generators, nor the
    generators ``held`` (a model's own: :func:`generators_held`); they are put back on exit."""
    generators = [torch.default_generator, *held]
    if device.type not in ("cpu", "meta"):
        generators.append(default_generator(device))
    states = [g.get_state() for g in generators]
    python = random.getstate()
    try:
        yield
    finally:
        for g, state in zip(generators, states):
            g.set_state(state)
        random.setstate(python)


def state_tensors(
    module: nn.Module, buffers: bool = True, names: bool = False
) -> list[Any]:
    """Every parameter (and buffer) slot of ``module`` and its submodules, depth first in a fixed
    order, ``None`` slots included; their dotted names instead if ``names``.

    Walks the modules' own dictionaries: ``named_parameters`` and ``parameters`` build every name
    on the way, which costs more than a small block's arithmetic when it runs every step.
    """
    found: list[Any] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, m = stack.pop()
        tables = (m._parameters, m._buffers) if buffers else (m._parameters,)
        for table in tables:
            found += [prefix + key for key in table] if names else table.values()
        stack += [
            (f"{prefix}{key}." if names else "", child)
            for key, child in reversed(m._modules.items())
            if child is not None
        ]
    return found


@dataclass(slots=True)
class Slot:
    """One place a module keeps a tensor: ``table`` is ``_parameters``, ``_buffers`` or
    ``__dict__`` (a plain tensor attribute)."""

    module: nn.Module
    table: str
    key: str
    tensor: Tensor | None  # None: the slot did not exist before the run
    version: int | None
    storage: int | None = None
    requires_grad: bool = False
    reached: bool = False  # a module held unregistered: checked only where the run read it
    found: Tensor | None = None  # what the replay runs with, where the run changed the slot
    left: Tensor | None = None  # what the run left, for an inverse

    def current(self) -> Any:
        return _table(self.module, self.table).get(self.key)

    def put(self, value: Any) -> None:
        table = _table(self.module, self.table)
        if value is None and self.table == "__dict__":
            table.pop(self.key, None)  # an attribute the run created
        else:
            table[self.key] = value

    def name(self, names: dict[int, str]) -> str:
        return names.get(id(self.module), f"{type(self.module).__name__}.") + self.key


def _table(module: nn.Module, table: str) -> dict:
    return vars(module) if table == "__dict__" else getattr(module, table)


def submodules(root: nn.Module) -> list[nn.Module]:
    """``root`` and every module below it, each once, as ``root.modules()`` lists them, without
    building their names on the way (it runs for every block of every step)."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        found.append(m)
        stack += [c for c in reversed(m._modules.values()) if c is not None]
    return found


def _is_tracked_norm(m: nn.Module) -> bool:
    return (
        isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
    )


def tracked_norms(modules: Iterable[nn.Module]) -> list[nn.modules.batchnorm._NormBase]:
    return [m for root in modules for m in submodules(root) if _is_tracked_norm(m)]


# What every nn.Module keeps in its __dict__ (hook tables, _parameters, ...): no generators there.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


@dataclass(slots=True)
class Loose:
    """A tensor a module holds in a container or a plain object (NOTE [ What a module holds ]):
    to the replay what a saved tensor is to autograd where the run read it (NOTE [ Replay ],
    rule 3), its place followed as the container's."""

    module: nn.Module
    tensor: Tensor
    version: int | None
    storage: int | None
    requires_grad: bool

    def name(self, names: dict[int, str]) -> str:
        d = vars(self.module)
        where = path_to(self.tensor, d, own_attributes(tuple(d)))
        return names.get(id(self.module), f"{type(self.module).__name__}.") + (
            where or "(a tensor it holds)")


@dataclass
class Census:
    """What a run's modules hold before the run, found in one walk over them (every module once):
    a recording runs for every transform of every step, so it looks at each module only here and
    in :meth:`new_tensor_attributes`.

    The run's modules are the roots and their submodules, and, where the run may be user code
    (``reach``), the modules they hold unregistered (in an attribute, a list, a dict, a plain
    object: NOTE [ What a module holds ]) with their own submodules, but for any that holds a
    root among its submodules (a parent): of that, its own numbers, containers and tensors
    only, which the run may read; its hooks and other modules are the rest of the forward's.
    Tensors of modules held unregistered are checked before a replay only where the run read
    them (NOTE [ Replay ], rule 3)."""

    modules: list[nn.Module]
    norms: list[nn.modules.batchnorm._NormBase]  # BatchNorms in training mode (rule 2)
    slots: list[Slot]  # parameters, buffers and tensor attributes, BatchNorms' own left out
    scalars: list[tuple[dict, str, Any]]  # plain numbers and flags, ``training`` among them
    # Python's and numpy's generators (the global ones and the modules' own), by the identity of
    # the generator object.
    python: dict[int, Any]
    hooked: list[nn.Module]  # modules with forward hooks
    # Each module's attribute names, and those of its attributes that could become a tensor
    # (anything but a tensor or a module's internals), for new_tensor_attributes.
    attributes: list[tuple[nn.Module, dict, tuple[str, ...], list[str]]]
    # The lists, dicts, sets and deques the modules hold, nested ones too, and plain objects'
    # attributes, as they were.
    containers: list[ContainerCopy | AttributesCopy]
    # Tensors held in those containers and plain objects, checked where the run read them.
    loose: list[Loose]
    # Generators whose state cannot be taken: (holder, path, generator), NOTE [ Generators
    # without state ] in stateless.py.
    stateless: list[tuple[nn.Module, str | None, Any]]

    @classmethod
    def take(cls, roots: Sequence[nn.Module], generators: bool, reach: bool = False,
             given: Sequence[Any] = ()) -> Census:
        found = cls([], [], [], [], {}, [], [], [], [], [])
        kinds: tuple[type, ...] = (random.Random,)
        numpy = sys.modules.get("numpy") if generators else None
        if generators:
            found.python[id(random._inst)] = random._inst
        if numpy is not None:
            found.python[id(numpy.random)] = NumpyGenerator(numpy.random)
            kinds += (numpy.random.RandomState, numpy.random.Generator)
        seen: set[int] = set()
        walk = _HeldWalk(found, kinds if generators else None) if reach else None
        stack = list(reversed(roots))
        reached = False
        while stack:
            while stack:  # depth first, each module once (modules may be shared)
                m = stack.pop()
                if id(m) in seen:
                    continue
                seen.add(id(m))
                stack += [c for c in reversed(m._modules.values()) if c is not None]
                found._visit(m, reached, walk)
            if walk is not None:  # then the modules held unregistered, and what they hold
                stack = walk.modules_outside(seen, roots)
                reached = True
        if walk is not None:  # what the call is given, besides tensors and numbers: rule 2
            for value in given:
                if not isinstance(value, (Tensor, nn.Module)):
                    walk.scan(value, roots[0], modules=False)
        return found

    def _visit(self, m: nn.Module, reached: bool, walk: _HeldWalk | None) -> None:
        self.modules.append(m)
        norm = _is_tracked_norm(m)
        if norm:
            self.norms.append(m)
        if m._forward_hooks:
            self.hooked.append(m)
        tables = (m._parameters,) if norm else (m._parameters, m._buffers)
        for table in tables:
            for key, t in table.items():
                if t is not None:
                    kind = "_parameters" if table is m._parameters else "_buffers"
                    self.slots.append(Slot(
                        m, kind, key, t, version_of(t), storage_key(t), t.requires_grad, reached
                    ))
        d = vars(m)
        self.scalars.append((d, "training", d["training"]))
        candidates = []
        keys = tuple(d)
        for key in own_attributes(keys, structure_of(m)):
            value = d[key]
            if isinstance(value, Tensor):
                self.slots.append(Slot(
                    m, "__dict__", key, value, version_of(value), storage_key(value),
                    value.requires_grad, reached,
                ))
                continue
            if isinstance(value, InstalledForward):
                continue
            candidates.append(key)
            if type(value) in (bool, int, float):
                self.scalars.append((d, key, value))
            elif walk is not None:  # user code may reassign anything (a list, a mode string)
                if not isinstance(value, nn.Module):
                    self.scalars.append((d, key, value))
                walk.scan(value, m)
        self.attributes.append((m, d, keys, candidates))

    def _visit_holder(self, m: nn.Module, walk: _HeldWalk) -> None:
        """A module that holds a root (a parent): its own numbers, containers and tensors, which
        the run may read and the rest of the forward change (its tensors as a held module's,
        checked where the run read them); its hooks and other modules are the rest of the
        forward's."""
        for table, kind in ((m._parameters, "_parameters"), (m._buffers, "_buffers")):
            self.slots += [
                Slot(m, kind, k, t, version_of(t), storage_key(t), t.requires_grad, True)
                for k, t in table.items() if t is not None
            ]
        d = vars(m)
        for key in own_attributes(tuple(d), structure_of(m)):
            value = d[key]
            if isinstance(value, Tensor):  # as a held module's: replayed where the run read it
                self.slots.append(Slot(
                    m, "__dict__", key, value, version_of(value), storage_key(value),
                    value.requires_grad, True,
                ))
            elif type(value) in (bool, int, float):
                self.scalars.append((d, key, value))
            elif not isinstance(value, (nn.Module, InstalledForward)):
                walk.scan(value, m, modules=False)

    def new_tensor_attributes(self) -> list[Slot]:
        """Tensor attributes the run created: slots that did not exist before it."""
        created = []
        for m, d, keys, candidates in self.attributes:
            if tuple(d) != keys:  # attributes added or deleted: look at every one
                candidates = [k for k in d if k not in _MODULE_INTERNALS]
                before = {s.key for s in self.slots if s.module is m and s.table == "__dict__"}
                candidates = [k for k in candidates if k not in before]
            created += [
                Slot(m, "__dict__", k, None, None)
                for k in candidates
                if isinstance(d.get(k), Tensor)
            ]
        return created

    def attribute_names(self) -> list[tuple[dict, frozenset[str]]]:
        """Each walked module's attributes and their names now (after the run): what code
        after it adds there is away for the replay (:func:`without_added`)."""
        return [(d, frozenset(d)) for _, d, _, _ in self.attributes]

    def new_plain_attributes(self) -> list[tuple[dict, str, Any]]:
        """Other attributes the run created (a counter made on the first call), as scalars
        that were ``MISSING`` before it: the replay runs without them, as the run did."""
        created = []
        for _, d, keys, _ in self.attributes:
            if tuple(d) != keys:
                before = set(keys)
                created += [
                    (d, k, MISSING) for k, v in d.items()
                    if k not in before and k not in _MODULE_INTERNALS
                    and not isinstance(v, (Tensor, nn.Module))
                ]
        return created


MISSING = object()  # an attribute that did not exist when the run began


_OWN_ATTRIBUTES: dict[tuple[tuple[str, ...], frozenset[str]], tuple[str, ...]] = {}


def own_attributes(keys: tuple[str, ...],
                    structure: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The attribute names among ``keys`` (a module's, in order) that are not nn.Module's own
    internals, nor its class's ``structure`` (NOTE [ What runs never change ]); modules of one
    class mostly share their names, so this is looked up."""
    own = _OWN_ATTRIBUTES.get((keys, structure))
    if own is None:
        if len(_OWN_ATTRIBUTES) > 4096:  # modules that keep gaining attributes
            _OWN_ATTRIBUTES.clear()
        own = _OWN_ATTRIBUTES[keys, structure] = tuple(
            k for k in keys if k not in _MODULE_INTERNALS and k not in structure)
    return own


class _HeldWalk:
    """What modules hold besides their registered state (:meth:`Census.take`, NOTE [ What a
    module holds ]): their containers and plain objects' attributes, the modules held there,
    and the Python and numpy generators among them (``kinds``; None: not looked for)."""

    def __init__(self, census: Census, kinds: tuple[type, ...] | None) -> None:
        self.census = census
        self.kinds = kinds
        self.held: list[nn.Module] = []
        self.seen: set[int] = set()

    def scan(self, value: Any, owner: nn.Module, modules: bool = True) -> None:
        """``value``'s containers, plain objects, tensors, generators and (``modules``)
        modules; ``owner``: the module holding ``value``, to name a tensor by."""
        for _, v in reached(value, self.seen):
            if isinstance(v, nn.Module):
                if modules:
                    self.held.append(v)
            elif isinstance(v, Tensor):
                self.census.loose.append(
                    Loose(owner, v, version_of(v), storage_key(v), v.requires_grad))
            elif self.kinds is not None and isinstance(v, self.kinds):
                g = v if isinstance(v, random.Random) else NumpyGenerator(v)
                if type(v) is random.Random or has_state(g):
                    self.census.python[id(v)] = g
                else:
                    d = vars(owner)
                    where = path_to(v, d, own_attributes(tuple(d)))
                    self.census.stateless.append((owner, where, v))
            else:  # a container's elements, a plain object's attributes
                self.census.containers += state_copies(v)

    def modules_outside(self, seen: set[int], roots: Sequence[nn.Module]) -> list[nn.Module]:
        """The modules held unregistered not yet walked, but for those that hold a root."""
        held, self.held = self.held, []
        rooted = {id(r) for r in roots}
        found = []
        for m in held:
            if id(m) in seen:
                continue
            if any(id(s) in rooted for s in submodules(m)):
                seen.add(id(m))
                self.census._visit_holder(m, self)
                continue
            found.append(m)
        return found[::-1]


def put_attribute(attributes: dict, key: str, value: Any) -> None:
    if value is MISSING:
        attributes.pop(key, None)
    else:
        attributes[key] = value


@contextlib.contextmanager
def without_added(names: Sequence[tuple[dict, frozenset[str]]]) -> Iterator[None]:
    """The modules' attributes added since the run (by code after it: ``self.extra = ...``,
    which the run's ``getattr(self, "extra", default)`` did not find) away while inside, then
    back (NOTE [ Replay ], rule 2); torch's own bookkeeping stays."""
    away = [(d, k, d.pop(k)) for d, found in names
            for k in [k for k in d if k not in found and k not in _MODULE_INTERNALS]]
    try:
        yield
    finally:
        for d, k, v in away:
            d[k] = v
