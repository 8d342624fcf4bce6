"""What a trace through a module freezes and must leave as it was: the state the module holds,
its hooks, what the graph reads as constants, the grad mode and autocast, and the modes its code
reads (NOTE [ Traced modules run as their graph ])."""

from __future__ import annotations

import contextlib
import inspect
import operator
import random
import sys
from collections.abc import Container, Iterable, Iterator
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn

from revnets.replay.held import (
    generators_held,
    is_plain_object,
    reached,
    state_copies,
)
from revnets.replay.known_calls import bound_arguments
from revnets.replay.state import NumpyGenerator
from revnets.replay.structure import structure_of

__all__ = [
    "FLIPPED_MODE", "Attributes", "Draws", "code_by_module", "copy_of",
    "drop_specialisation_checks",
    "grad_and_autocast", "modes_flipped", "mutated_argument", "own_code",
    "steering_defaults", "version_of", "writes_in_place",
]

# NOTE [ Traced modules run as their graph ]
# A module the planner's trace goes through (any module with submodules that is not kept whole:
# those the tracer entered, ``traced`` of as_graph_chain) is never called in a planned training
# step: its steps run the nodes its forward recorded once, on proxies; a planned model also
# watches every module its steps do not call (planning/planned.py). Whatever else a traced
# forward does
# would happen once, at planning time, with proxies, and never again. So a module stays whole
# (called as itself by its step, its code run each time) where its forward does more than
# compute values:
#   - it has hooks (forward, pre-forward, backward): they run where the module is called;
#   - it changes state a module holds: assigns an attribute of any module (a counter, a cache,
#     features kept for a loss), changes a list, dict, set or plain object reached from one
#     (``self.stats.count += 1``, ``self.store["feats"].append(x)``), or writes in place into a
#     tensor attribute. The trace is checked against that state as it was before
#     (``Attributes``), undone, and traced again with the module whole (a buffer updated in
#     place too: torch.fx runs what a forward does to a buffer, which is not a value of the
#     graph; kept whole, the update is replayed once per step like any module state);
#   - it draws from Python's random module, or its code depends on ``training`` (trace.py).
# State outside the model is not followed, but for the plain objects a forward closes over (a
# config a class made by a factory reads) and tensors whose values the trace read; module-level
# globals are not. A hook registered on a traced
# module after planning, on the model itself, or globally would not run either: a planned
# training step refuses them by name, and so does it refuse what the graph froze that has
# changed since (``Frozen``, graph/guard.py): every attribute the traced code looked up on a
# module or on a plain object the model holds, wherever that code is (a module's own forward,
# a child reading its parent through a plain list, a function outside any class, a config's
# property or method, ``getattr`` with a name made at run time; absent then too:
# graph/reads.py), by value where it is a number, flag or string (a drop-path rate raised by
# a schedule), by contents where it is a numpy array, a partial or a function (what it closes
# over), else by identity, with what the lists and dicts among them hold (``self.scales[0] =
# ...``), a constant of a traced module's class, a traced module's class and forward, and a
# submodule replaced (a new head), added (a block appended) or reordered. Code the trace never
# ran (a helper only kept-whole blocks call) read nothing. A tensor it reads directly (a
# parameter, a buffer, a plain attribute) is followed instead (NOTE [ A planned model is the
# model ]); one whose value the trace read (``float(self.t)``, a branch on it:
# graph/reads.py) is checked by value under the name it was read by, refused once another
# value is there (written, replaced, cast with loss). Code
# changing the grad mode or autocast keeps its module whole (trace.py), since a graph records
# neither.
# Planning's runs on the meta device run kept-whole modules too, and so do the real runs that
# time the forward; both put back what they assign the same way (profile.on_meta,
# step_times.chain_times).

# Modes are flipped on purpose, to find code that depends on them (trace.py).
FLIPPED_MODE = "training"


class Attributes:
    """The state ``modules`` hold (NOTE [ Traced modules run as their graph ]), to find and undo
    what a trace changed: each module's ``__dict__`` (hooks, parameters and submodules are dicts
    there), what that reaches (containers, plain objects' attributes: NOTE [ What a module
    holds ]), and the version of every tensor among them; tensors other than parameters (which
    a trace does not write) are copied, to put back a write into one. ``tracer_names``: the
    attributes torch.fx itself adds to the traced model (constants its graph reads), kept."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.tracer_names: set[str] = set()
        # (module, holder, its contents): the module's own dict, or a state copy (held.py)
        self.saved: list[tuple[nn.Module, Any, Any]] = []
        self.tensors: list[list] = []  # [module, tensor, version, copy or None]
        # id(module): where what it reaches is in ``saved`` and ``tensors``. An object several
        # modules reach (a config, a logger they share) is each one's: any of them may be
        # the one changing it, and the trace finds which.
        self.owned: dict[int, tuple[list[int], list[int]]] = {}
        records: dict[int, list[int]] = {}  # id(object): its entries (a tensor's as ~index)
        # Then the modules they hold unregistered (a helper in a plain list), with theirs.
        todo = list(modules)
        queued: set[int] = set()  # modules whose own modules are in todo
        for module in todo:
            if id(module) not in self.owned:
                self.owned[id(module)] = self._follow(module, records, todo, queued)

    def _follow(self, module: nn.Module, records: dict[int, list[int]],
                held: list[nn.Module], queued: set[int]) -> tuple[list[int], list[int]]:
        registered = {id(t) for t in module._parameters.values() if t is not None}
        own = vars(module)
        entries = [len(self.saved)]
        self.saved.append((module, module, dict(own)))
        seen: set[int] = set()
        structure = structure_of(module)  # NOTE [ What runs never change ]
        for key, value in list(own.items()):
            if key in structure:
                continue
            for _, v in reached(value, seen):
                if isinstance(v, nn.Module):
                    if value is not module._modules and v is not module and id(v) not in queued:
                        inside = list(v.modules())
                        if not any(m is module for m in inside):  # not a parent held back
                            held += inside
                            queued.add(id(v))  # every step of a chain holds the model
                    continue
                found = records.get(id(v))
                if found is None:
                    if isinstance(v, Tensor):
                        found = [~len(self.tensors)]
                        copy = None if id(v) in registered else copy_of(v)
                        self.tensors.append([module, v, version_of(v), copy])
                    else:  # a container's elements, a plain object's attributes
                        found = list(range(len(self.saved), len(self.saved) + len(
                            copies := state_copies(v))))
                        self.saved += [(module, v, copy) for copy in copies]
                    records[id(v)] = found
                entries += found
        return [i for i in entries if i >= 0], [~i for i in entries if i < 0]

    def _entries(self, modules: Iterable[nn.Module] | None) -> Iterator[tuple[Any, list, list]]:
        if modules is None:
            yield None, self.saved, self.tensors
            return
        for module in modules:
            saved, tensors = self.owned.get(id(module), ((), ()))
            yield module, [self.saved[i] for i in saved], [self.tensors[i] for i in tensors]

    def plain_classes(self) -> set[type]:
        """The classes of the plain objects the modules reach (a config, a helper)."""
        return {type(holder) for module, holder, _ in self.saved
                if holder is not module and is_plain_object(holder)}

    def changed(self, modules: Iterable[nn.Module] | None = None) -> str | None:
        """``"Module.attribute"`` (or ``"Module (state it holds)"``) of the first change since
        in the state of ``modules`` (all of them: None), or None."""
        for module, saved, tensors in self._entries(modules):
            found = self._changed(module, saved, tensors)
            if found is not None:
                return found
        return None

    def _changed(self, who: nn.Module | None, saved_state: list, tensors: list) -> str | None:
        for module, holder, saved in saved_state:
            name = type(who or module).__name__
            if holder is module:
                key = _changed_key(vars(module), saved, self.tracer_names)
                if key is not None:
                    return f"{type(module).__name__}.{key}"
            elif not saved.same():
                return f"{name} (state it holds: {type(holder).__name__})"
        for module, tensor, version, _ in tensors:
            if version_of(tensor) != version:
                return f"{type(who or module).__name__} (a tensor it holds, written in place)"
        return None

    def tensor_changed(self, modules: Iterable[nn.Module] | None = None) -> str | None:
        """As :meth:`changed`, for the changes a replay refuses rather than puts back (NOTE
        [ Replay ], rules 2 and 3): a module's tensor attribute, parameter or buffer replaced, or a
        tensor among the state written in place. Numbers, containers and plain objects' attributes
        changed are put back as the run found them."""
        for who, saved_state, tensors in self._entries(modules):
            for module, holder, saved in saved_state:
                if holder is module:
                    now = vars(module)
                    if any(now.get(k) is not saved.get(k) for k in now.keys() | saved.keys()
                           if isinstance(now.get(k), Tensor) or isinstance(saved.get(k), Tensor)):
                        return f"{type(module).__name__} (a tensor attribute replaced)"
                elif holder is module._parameters or holder is module._buffers:
                    if not saved.same():
                        return f"{type(module).__name__} (a parameter or buffer replaced)"
            for module, tensor, version, _ in tensors:
                if version_of(tensor) != version:
                    return f"{type(who or module).__name__} (a tensor it holds, written in place)"
        return None

    def restore(self, modules: Iterable[nn.Module] | None = None) -> None:
        """Put back the state of ``modules`` (all of them: None)."""
        for _, saved, tensors in self._entries(modules):
            self._restore(saved, tensors)

    def _restore(self, saved_state: list, tensors: list) -> None:
        for module, holder, saved in saved_state:
            if holder is module:
                now = vars(module)
                for key in [k for k in now if k not in saved and k not in self.tracer_names]:
                    del now[key]
                now.update((k, v) for k, v in saved.items() if k != FLIPPED_MODE)
            elif not saved.same():
                saved.put_back()
        for entry in tensors:
            _, tensor, version, copy = entry
            if version_of(tensor) != version and copy is not None:
                with torch.no_grad():
                    tensor.copy_(copy)
                entry[2] = version_of(tensor)  # as found, at the version putting it back made


def copy_of(tensor: Tensor) -> Tensor | None:
    try:
        return tensor.detach().clone()
    except (RuntimeError, NotImplementedError):  # a tensor subclass that cannot be copied
        return None


def version_of(tensor: Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter (nor can be written)
        return None


_MISSING = object()


def _changed_key(now: dict, saved: dict, tracer_names: set[str]) -> str | None:
    for key in now.keys() | saved.keys():
        if key == FLIPPED_MODE or (key in tracer_names and key not in saved):
            continue
        if now.get(key, _MISSING) is not saved.get(key, _MISSING):
            return key
    return None


# What a trace freezes of modes: found by tracing again with each flipped (trace.py).


def grad_and_autocast() -> tuple:
    """The grad mode and autocast state, which a traced graph does not record."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))


@contextlib.contextmanager
def modes_flipped(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in the other mode while inside."""
    modules = list(model.modules())
    modes = [m.training for m in modules]
    try:
        for m, mode in zip(modules, modes):
            m.training = not mode
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.training = mode


class Draws:
    """The generators a forward may draw from while it is traced: Python's, numpy's global one
    (once imported), torch's CPU generator, CUDA's (once initialised) and those the model holds.
    A trace that changed one drew a number whose value its graph would freeze (a layer dropped
    at random, a coin ``torch.rand(()) < p``), whether or not the value differed between
    traces; :meth:`restore` puts them back, as if the trace never drew."""

    def __init__(self, model: nn.Module) -> None:
        self.generators = [torch.default_generator, *generators_held(model)]
        if torch.cuda.is_initialized():
            self.generators += list(torch.cuda.default_generators)
        numpy = sys.modules.get("numpy")
        self.numpy = NumpyGenerator(numpy.random) if numpy is not None else None
        self.initial = self.states()

    def states(self) -> tuple[Any, Any, list[torch.Tensor]]:
        return (random.getstate(), self.numpy.getstate() if self.numpy else None,
                [g.get_state() for g in self.generators])

    def drew_since(self, states: tuple[Any, Any, list[torch.Tensor]]) -> bool:
        python, numpy, torch_states = self.states()
        return (python != states[0]
                or (self.numpy is not None and not self.numpy.same(numpy, states[1]))
                or not all(torch.equal(a, b) for a, b in zip(torch_states, states[2])))

    def restore(self) -> None:
        python, numpy, torch_states = self.initial
        random.setstate(python)
        if self.numpy is not None:
            self.numpy.setstate(numpy)
        for generator, state in zip(self.generators, torch_states):
            generator.set_state(state)


def code_by_module(graph: torch.fx.Graph, model: nn.Module,
                   constants: Container[str] = ()) -> set[tuple[str, str]]:
    """Each traced module's code as its nodes (operation, target, arguments), by the innermost
    module it ran in ("" for the model's own forward); a whole module's call belongs to its
    caller. A value is named by the module that made it and its place there (counted from the
    end for a value another module made, so that a step more in one module changes that
    module's code alone), and attributes by what they hold (a tensor by its memory), since a
    trace numbers the constants it stores on the model afresh; ``constants``, the attributes a
    trace made (a tensor the forward built, ``torch.arange(n)``), by their values, new memory
    in each trace."""
    owner: dict[torch.fx.Node, str] = {}
    place: dict[torch.fx.Node, int] = {}
    count: dict[str, int] = {}
    for node in graph.nodes:
        stack = list(node.meta.get("nn_module_stack") or {})
        if node.op == "call_module" and stack:
            stack = stack[:-1]  # the module called, not one whose code ran
        owner[node] = stack[-1] if stack else ""
        place[node] = count.get(owner[node], 0)
        count[owner[node]] = place[node] + 1

    def name(value: torch.fx.Node, user: str) -> str:
        made_by = owner[value]
        if made_by == user:
            return f"%{place[value]}"
        return f"%{made_by}[{place[value] - count[made_by]}]"

    code: dict[str, list[str]] = {}
    for node in graph.nodes:
        target = node.target
        if node.op == "get_attr":
            owner_name, _, attribute = target.rpartition(".")
            value = getattr(model.get_submodule(owner_name), attribute, None)
            target = _value(value) if target in constants else _identity(value)
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda n, user=owner[node]: name(n, user)
        )
        code.setdefault(owner[node], []).append(f"{node.op} {target} {args} {kwargs}")
    return {(name, "\n".join(entries)) for name, entries in code.items()}


def own_code(graph: torch.fx.Graph, model: nn.Module, constants: Container[str] = ()) -> set:
    """The code of ``model``'s own forward in ``graph`` (:func:`code_by_module`)."""
    return {code for name, code in code_by_module(graph, model, constants) if not name}


def _value(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return (value.shape, value.dtype, hash(data.numpy().tobytes()))
    return _identity(value)


def _identity(value: Any) -> Any:
    # A constant a trace stores (a view of a buffer: ``index.view(-1)``) is another tensor
    # object in each trace, over the same memory.
    if isinstance(value, torch.Tensor):
        return (value.data_ptr(), value.storage_offset(), value.shape, value.stride(), value.dtype)
    return id(value)


# What a graph node overwrites in place: no checkpoint may be cut between a value and the node
# that overwrites it.
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.iand, operator.ior,
}


def writes_in_place(node: torch.fx.Node, root: nn.Module) -> bool:
    """Whether a node overwrites its first argument (by the conventions torch code follows)."""
    if node.op == "call_module":
        return bool(getattr(root.get_submodule(node.target), "inplace", False))
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (
            node.target in _INPLACE_OPERATORS
            or _inplace_argument(node.target, node.args, node.kwargs)
            or (name.endswith("_") and not name.startswith("_"))
        )
    if node.op == "call_method":
        return str(node.target).endswith("_") or bool(node.kwargs.get("inplace", False))
    return False


def _inplace_argument(target: Any, args: tuple, kwargs: dict) -> bool:
    # F.relu(x, True) says it positionally.
    found = bound_arguments(target, args, kwargs) or kwargs
    return bool(found.get("inplace", False))


def mutated_argument(node: torch.fx.Node, root: nn.Module) -> torch.fx.Node | None:
    """The input a node overwrites in place, if any."""
    first = node.args[0] if node.args else None
    writes = writes_in_place(node, root)
    return first if writes and isinstance(first, torch.fx.Node) else None


# Every step runs the model's optional arguments at their defaults (as_graph_chain). Traced as
# proxies, a None default takes the branch for a tensor (``if mask is not None: mask.view(...)``,
# timm's hiera: a step then called a method of None) and a flag's branch cannot be traced at
# all; traced at their values, the graph takes the branches the defaults take.
def steering_defaults(model: nn.Module) -> dict[str, Any]:
    """The optional arguments of ``model``'s forward after its input whose defaults are None or
    a Python constant (a flag, a number, a string: ``pool="avg"``), with those defaults."""
    parameters = list(inspect.signature(model.forward).parameters.values())[1:]
    return {p.name: p.default for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and (p.default is None or type(p.default) in (bool, int, float, str))}


def drop_specialisation_checks(graph: torch.fx.Graph) -> None:
    """Remove the checks torch.fx adds that an argument traced at its value has it when the
    graph runs: the steps run it at that value always, and a check would be a step of its own."""
    checks = [n for n in graph.nodes if n.op == "call_function"
              and n.target in (torch.fx._symbolic_trace._assert_is_none, torch._assert)
              and isinstance(n.args[0], torch.fx.Node)
              and (n.args[0].op == "placeholder" or n.args[0].target is operator.eq
                   and n.args[0].args[0].op == "placeholder")]
    for check in checks:
        compared = check.args[0]
        graph.erase_node(check)
        if compared.op != "placeholder" and not compared.users:
            graph.erase_node(compared)
