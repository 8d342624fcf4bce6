"""Plans of whole modules, for models torch.fx cannot trace: the model's own forward runs, and
some of the modules it calls run as checkpoints (NOTE [ Plans of whole modules ])."""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from revnets.checkpoint import checkpoint_forward
from revnets.facts.operators import flops_of
from revnets.facts.tensors import storage_key
from revnets.graph.trace_state import Attributes, version_of
from revnets.memory import Predictor
from revnets.plan import Checkpoint, MemoryPlan, PartPlan, Reconstruct, Store
from revnets.planning.budget import LossFn, training_step
from revnets.planning.model_view import ModelView
from revnets.planning.search.budget import fits, no_fit
from revnets.reversible import ReversibleSequence

__all__ = ["CheckpointedModules", "ModuleProfile", "plan_modules"]

# NOTE [ Plans of whole modules ]
# A model whose own forward torch.fx cannot trace (Python control flow on shapes: CrossViT) has
# no chain of steps to cut, but it has its modules, each called by its code. Its plan is a set
# of them, none inside another, that run as checkpoints. For a step with grad enabled, each
# gets an instance attribute ``forward`` over its class's, which runs that forward as a
# checkpoint (revnets.checkpoint: generators, module state and the hooks of its submodules
# replayed), removed after. The module itself stays where it is: the model's code sees the same
# object (its type, its mode, its attributes, what it writes to it, ``self.modules()``), and its
# own hooks run once around the checkpoint, as ``nn.Module.__call__`` runs them around any
# forward, which reads as the module's own (its signature). (A stand-in module swapped in at its
# parent was seen by that code: ``isinstance`` failed, writes landed on the stand-in,
# ``modules()`` met both.) Only the thread running the step checkpoints: the forward goes back
# when the last step using it ends, unless the step set one of its own. A module whose input,
# or state its modules hold (a config dict, a float the parent changes), is written between
# its call and the loss, is never checkpointed: its recomputation would read the written value.
# Its inputs go to torch's checkpoint as positional tensors, which torch checks for writes
# before it recomputes.
# A prediction of the unplanned step profiles every module call: the storages it saves for
# backward besides its inputs and the model's state, what a checkpoint keeps instead (its
# inputs), and what rerunning it costs, counted (the floating-point operations of its products
# and the elements its operators make), so that every call at one budget ranks the same plans
# the same way. For each depth of the call tree, its modules (and the leaves above it), ordered
# by bytes saved per cost, give plans of growing prefixes; a modelled peak (the unplanned peak,
# less what each saves, plus the largest recomputation) orders them, and an exact prediction
# accepts one, as for chains (NOTE [ Modelled search, exact acceptance ] in
# planning/search/options.py). The
# ``FLOORS`` plans of least modelled peak are predicted last, from the cheapest; where none
# fits, a refusal names the least of their exact peaks, which they meet again when asked for.
MAX_PREDICTIONS = 4  # exact predictions of plans within the budget as modelled, cheapest first
FLOORS = 3  # then those of least modelled peak


@dataclass(frozen=True)
class ModuleProfile:
    """One module's calls in the forward of a training step, summed."""

    name: str
    depth: int  # the modules called around its first call: 1 for the model's own children
    saved: int  # bytes it saves for backward, besides its inputs and the model's state
    kept: int  # bytes of its tensor inputs: what a checkpoint keeps of it instead
    cost: int  # operations of its products and elements its operators make
    leaf: bool  # it calls no other module
    written: bool  # its input, or state its modules hold, is written before the backward

    @property
    def saving(self) -> int:
        return self.saved - self.kept


@dataclass
class _Calls:
    depth: int
    saved: dict[int, int] = field(default_factory=dict)  # storage address: bytes
    kept: int = 0
    cost: int = 0
    leaf: bool = True
    written: bool = False
    inputs: list[tuple[weakref.ref, int | None]] = field(default_factory=list)
    state: list[Attributes] = field(default_factory=list)


class _Profiler(TorchDispatchMode):
    """A training step that profiles the calls of its model's modules (:class:`ModuleProfile`)
    while it runs: hooks on the model it is given (in a prediction, the fake copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, _Calls] = {}
        # The calls under way, innermost last; None where a module runs again in the backward
        # (the reversible engine's blocks): the forward alone is profiled.
        self._stack: list[tuple[_Calls, set[int]] | None] = []
        self._state: set[int] = set()
        self._forward = True

    def __call__(self, model: nn.Module, x: Any, loss_fn: LossFn,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self._state = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        handles = []
        for name, module in model.named_modules():
            if name and not isinstance(module, torch.jit.ScriptModule):  # no hooks there
                handles += [
                    module.register_forward_pre_hook(self._enter(name), with_kwargs=True),
                    module.register_forward_hook(self._leave, always_call=True),
                ]

        def loss(output: Any) -> Tensor:
            value = loss_fn(output)
            self._forward_done()  # what the loss wrote too, before the backward reads it
            return value

        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _same), self:
                training_step(model, x, loss, optimizer)
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, name: str) -> Any:
        # The reversible engine calls a block's pre-hooks itself, without keywords.
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
            if not self._forward:
                self._stack.append(None)
                return
            calls = self.calls.setdefault(name, _Calls(len(self._stack) + 1))
            if self._stack:
                self._stack[-1][0].leaf = False
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            inputs = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
            calls.kept += sum(inputs.values())
            calls.inputs += [(weakref.ref(t), version_of(t)) for t in tensors]
            self._stack.append((calls, set(inputs)))
        return pre_hook

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        top = self._stack.pop()
        if top is not None:  # what its recomputation reads of the state its modules hold
            top[0].state.append(Attributes(module.modules()))

    def _forward_done(self) -> None:
        if not self._forward:  # a second step (an optimizer's first)
            return
        self._forward = False
        for calls in self.calls.values():
            calls.written |= any(t is not None and version_of(t) != version
                                 for t, version in ((ref(), v) for ref, v in calls.inputs))
            calls.written |= any(state.changed() is not None for state in calls.state)
            calls.inputs.clear()
            calls.state.clear()

    def _pack(self, t: Tensor) -> Tensor:
        address = storage_key(t)
        if address not in self._state:
            for calls, inputs in filter(None, self._stack):
                if address not in inputs:
                    calls.saved[address] = t.untyped_storage().nbytes()
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._forward and self._stack:
            cost = flops_of(func, args, kwargs, out) + sum(
                t.numel() for t in tree_leaves(out) if isinstance(t, Tensor))
            for calls, _ in self._stack:
                calls.cost += cost
        return out

    def profiles(self) -> list[ModuleProfile]:
        return [ModuleProfile(name, c.depth, sum(c.saved.values()), c.kept, c.cost, c.leaf,
                              c.written)
                for name, c in self.calls.items()]


def _same(t: Tensor) -> Tensor:
    return t


class _CheckpointedForward:
    """A module's forward run as a checkpoint, set over its class's for the steps under way:
    in a thread running none of them (another model sharing the module), the forward as it
    was. It reads as that forward (``inspect.signature``, ``__wrapped__``, ``__self__``)."""

    def __init__(self, module: nn.Module, forward: Any) -> None:
        self.module, self.forward = module, forward
        functools.update_wrapper(self, forward)
        self.__self__ = module
        self.__func__ = getattr(forward, "__func__", forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if id(self.module) not in _running():
            return self.forward(*args, **kwargs)
        # Every tensor handed over positionally: torch checks those for writes in place
        # before it recomputes (a keyword's or a list's, it would read as written).
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]

        def forward(*tensors: Tensor) -> Any:
            values = list(leaves)
            for i, tensor in zip(where, tensors):
                values[i] = tensor
            args, kwargs = tree_unflatten(values, spec)
            return self.forward(*args, **kwargs)

        tensors = tuple(leaves[i] for i in where)
        others = tuple(leaf for leaf in leaves if not isinstance(leaf, Tensor))
        return checkpoint_forward(self.module, forward, tensors, {}, given=others)


class _Running(threading.local):
    def __init__(self) -> None:
        self.modules: dict[int, int] = {}  # id: steps under way in this thread


_RUNNING = _Running()
_INSTALLED: dict[int, tuple[nn.Module, Any, _CheckpointedForward, int]] = {}
_LOCK = threading.Lock()
_NONE = object()


def _running() -> dict[int, int]:
    return _RUNNING.modules


@contextlib.contextmanager
def _checkpointed(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """The forward of each module of ``names`` run as a checkpoint in this thread, the module
    left in place (NOTE [ Plans of whole modules ]); put back as it was after the last step
    using it, unless the step set a forward of its own."""
    modules = list({id(m): m for m in map(model.get_submodule, names)}.values())
    running = _running()
    with _LOCK:
        for module in modules:
            key = id(module)
            if key in _INSTALLED:
                found, own, wrapper, users = _INSTALLED[key]
                _INSTALLED[key] = (found, own, wrapper, users + 1)
                continue
            own = module.__dict__.get("forward", _NONE)  # a forward set on the object already
            wrapper = _CheckpointedForward(module, module.forward)
            module.__dict__["forward"] = wrapper
            _INSTALLED[key] = (module, own, wrapper, 1)
    for module in modules:
        running[id(module)] = running.get(id(module), 0) + 1
    try:
        yield
    finally:
        for module in modules:
            running[id(module)] -= 1
            if not running[id(module)]:
                del running[id(module)]
        with _LOCK:
            for module in modules:
                found, own, wrapper, users = _INSTALLED.pop(id(module))
                if users > 1:
                    _INSTALLED[id(module)] = (found, own, wrapper, users - 1)
                elif module.__dict__.get("forward") is wrapper:
                    if own is _NONE:
                        del module.__dict__["forward"]
                    else:
                        module.__dict__["forward"] = own


class CheckpointedModules(ModelView):
    """A model whose steps with grad enabled run ``names``, modules it calls, as checkpoints,
    its own forward around them (NOTE [ Plans of whole modules ]); without grad, the model as
    it is. It is the model itself to everything but its forward (NOTE [ A planned model is the
    model ]). The plan's peak is that of the training step planned, in the modes the modules
    had then."""

    memory_plan: MemoryPlan

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__(model)
        self._names = tuple(names)

    @property
    def names(self) -> tuple[str, ...]:
        """The modules checkpointed, or the model's own ``names`` where it has one."""
        return self.models_own("names", self._names)

    @property
    def memory(self) -> MemoryPlan:
        """``memory_plan``, or the model's own ``memory`` where it has one (the zoo's)."""
        return self.models_own("memory", self.memory_plan)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model[0]
        if not torch.is_grad_enabled():
            return model(*args, **kwargs)
        with _checkpointed(model, self._names):
            return model(*args, **kwargs)


@dataclass(frozen=True)
class _Candidate:
    names: tuple[str, ...]
    cost: int
    modelled: int


def _candidates(profiles: Sequence[ModuleProfile], unplanned: int,
                around: dict[str, set[str]]) -> list[_Candidate]:
    """Prefixes of each depth's modules, most bytes saved per cost first, none inside another
    (``around``: the names of the modules each is inside), with their modelled peaks (NOTE
    [ Plans of whole modules ])."""
    found: dict[tuple[str, ...], _Candidate] = {}
    for depth in sorted({p.depth for p in profiles}):
        level = [p for p in profiles if p.saving > 0 and not p.written and (
            p.depth == depth or (p.leaf and p.depth < depth))]
        # A module shared by two parents may be called at one depth and named inside another.
        names = {p.name for p in level}
        level = [p for p in level if not around[p.name] & names]
        level.sort(key=lambda p: -p.saving / max(p.cost, 1))
        saving = cost = largest = 0
        for k, p in enumerate(level, 1):
            saving, cost, largest = saving + p.saving, cost + p.cost, max(largest, p.saved)
            names = tuple(sorted(q.name for q in level[:k]))
            found.setdefault(names, _Candidate(names, cost, unplanned - saving + largest))
    return sorted(found.values(), key=lambda c: (c.cost, c.modelled, c.names))


def plan_modules(
    model: nn.Module,
    example_input: Any,
    budget: int,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    untraceable: Exception,
    predictor: Predictor,
) -> nn.Module:
    """``model`` set up to train within ``budget`` with whole modules checkpointed (NOTE
    [ Plans of whole modules ]), or ``model`` itself where it fits as it is. ``untraceable``:
    why it has no chain, for an error where its step cannot be predicted either; ``predictor``
    predicts every step."""
    profiler = _Profiler()
    try:
        unplanned = predictor.predict(
            training_step, (model, example_input, loss_fn, optimizer), {}).peak_bytes
    except ValueError as error:  # the prediction's refusal: a tensor's value read
        raise TypeError(f"{untraceable}, and its training step cannot be predicted to plan "
                        f"its modules instead: {error}") from error
    stages = Reconstruct() if any(isinstance(m, ReversibleSequence) and isinstance(
        m.memory, Reconstruct) for m in model.modules()) else Store()
    if fits(unplanned, budget):
        model.memory_plan = MemoryPlan(stages, Store(), (PartPlan(type(model).__name__, Store()),),
                                       unplanned, budget)
        return model
    # Not the peak: code may run otherwise under saved-tensor hooks (a reversible sequence
    # stores what it would reconstruct).
    predictor.predict(profiler, (model, example_input, loss_fn, optimizer), {})
    profiles = {p.name: p for p in profiler.profiles()}
    candidates = _candidates(list(profiles.values()), unplanned, _around(model))
    if not candidates:
        raise no_fit(budget, unplanned, f"{type(model).__name__} as it is: no module it calls "
                                        f"saves memory checkpointed")
    floors = sorted(candidates, key=lambda c: (c.modelled, c.cost, c.names))[:FLOORS]
    tries = [c for c in candidates
             if fits(c.modelled, budget) and c not in floors][:MAX_PREDICTIONS]
    peaks: dict[_Candidate, int] = {}
    for candidate in (*tries, *sorted(floors, key=lambda c: (c.cost, c.modelled, c.names))):
        planned = CheckpointedModules(model, candidate.names)
        peaks[candidate] = predictor.predict(
            training_step, (planned, example_input, loss_fn, optimizer), {}).peak_bytes
        if fits(peaks[candidate], budget):
            parts = tuple(PartPlan(name, Checkpoint(), profiles[name].kept, math.nan)
                          for name in candidate.names)
            planned.memory_plan = MemoryPlan(stages, Checkpoint(), parts, peaks[candidate],
                                             budget)
            return planned
    lowest = min(floors, key=lambda c: (peaks[c], c.cost, c.names))
    if peaks[lowest] >= unplanned:
        raise no_fit(budget, unplanned, f"{type(model).__name__} as it is")
    raise no_fit(budget, peaks[lowest], f"checkpoints of {len(lowest.names)} whole modules, "
                                        f"{_listed(lowest.names)}")


def _around(model: nn.Module) -> dict[str, set[str]]:
    """The names of the modules each module of ``model`` is inside (by its first name; a module
    registered under several parents is inside each)."""
    first = {id(m): name for name, m in model.named_modules()}
    above: dict[str, set[str]] = {name: set() for name in first.values()}

    def walk(module: nn.Module, path: frozenset[str]) -> None:
        for child in module.children():
            name = first[id(child)]
            if not path - above[name] and above[name]:
                continue  # reached this way already
            above[name] |= path
            walk(child, path | {name})

    walk(model, frozenset())
    return above


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:5])} .. {names[-1]}"
