"""Plans of whole modules, for models torch.fx cannot trace: the model's own forward runs, and
some of the modules it calls run as checkpoints (NOTE [ Plans of whole modules ])."""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from revnets.checkpoint import checkpoint_forward
from revnets.facts.operators import SELECTIVE_OPS, flops_of
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
# before it recomputes. A module is checkpointed whole (``Checkpoint()``: its inputs kept) or
# selectively (``Checkpoint(selective=True)``: the outputs of its matrix products and attention
# kept too, the rest recomputed: NOTE [ Selective recomputation ] in revnets/facts/operators.py),
# never selectively where the forward writes in place to such an output after making it.
# A prediction of the unplanned step profiles every module call: the storages it saves for
# backward besides its inputs and the model's state, what a checkpoint keeps instead (its
# inputs; selectively, the outputs of its products too), and what rerunning it costs, counted
# (the floating-point operations of its products and the elements its operators make; a
# selective checkpoint's without its products'), so that every call at one budget ranks the
# same plans the same way. For each depth of the call tree, its modules (and the leaves above
# it), ordered by bytes saved per cost, give plans of growing prefixes, checkpointed whole,
# selectively, or whole with the rest of the depth selective; a modelled peak (the unplanned
# peak, less what each saves, plus the largest recomputation) orders them, and an exact prediction
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
    products: int = 0  # bytes of the outputs of its products: what a selective one keeps too
    product_cost: int = 0  # the part of ``cost`` its products are: what it does not rerun
    selective_safe: bool = True  # no such output is written in place before the backward

    @property
    def saving(self) -> int:
        return self.saved - self.kept

    def saving_of(self, decision: Checkpoint) -> int:
        """Bytes the module's checkpoint saves: ``Checkpoint()`` or selective."""
        return self.saving - self.products if decision.selective else self.saving

    def cost_of(self, decision: Checkpoint) -> int:
        """What rerunning it costs: its products' left out of a selective checkpoint's."""
        return self.cost - self.product_cost if decision.selective else self.cost


@dataclass
class _Calls:
    depth: int
    saved: dict[int, int] = field(default_factory=dict)  # storage address: bytes
    kept: int = 0
    cost: int = 0
    leaf: bool = True
    written: bool = False
    products: dict[int, int] = field(default_factory=dict)  # storage address: bytes
    product_cost: int = 0
    selective_safe: bool = True
    inputs: list[tuple[weakref.ref, int | None]] = field(default_factory=list)
    state: list[Attributes] = field(default_factory=list)
    made: list[tuple[weakref.ref, int | None]] = field(default_factory=list)  # products' outputs


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
            calls.selective_safe &= not any(t is not None and version_of(t) != version
                                            for t, version in ((ref(), v) for ref, v in calls.made))
            calls.inputs.clear()
            calls.state.clear()
            calls.made.clear()

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
            made = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
            cost = flops_of(func, args, kwargs, out) + sum(t.numel() for t in made)
            product = func in SELECTIVE_OPS
            for entry in self._stack:
                if entry is None:
                    continue
                calls = entry[0]
                calls.cost += cost
                if product:
                    calls.product_cost += cost
                    calls.products.update(
                        (storage_key(t), t.untyped_storage().nbytes()) for t in made)
                    calls.made += [(weakref.ref(t), version_of(t)) for t in made]
        return out

    def profiles(self) -> list[ModuleProfile]:
        return [ModuleProfile(name, c.depth, sum(c.saved.values()), c.kept, c.cost, c.leaf,
                              c.written, sum(c.products.values()), c.product_cost,
                              c.selective_safe)
                for name, c in self.calls.items()]


def _same(t: Tensor) -> Tensor:
    return t


class _CheckpointedForward:
    """A module's forward run as a checkpoint, set over its class's for the steps under way:
    in a thread running none of them (another model sharing the module), the forward as it
    was. It reads as that forward (``inspect.signature``, ``__wrapped__``, ``__self__``)."""

    def __init__(self, module: nn.Module, forward: Any, decision: Checkpoint) -> None:
        self.module, self.forward, self.decision = module, forward, decision
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
        return checkpoint_forward(self.module, forward, tensors, {},
                                  selective=self.decision.selective, given=others)


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
def _checkpointed(model: nn.Module, decisions: Mapping[str, Checkpoint]) -> Iterator[None]:
    """The forward of each module of ``decisions`` run as its checkpoint in this thread, the
    module left in place (NOTE [ Plans of whole modules ]); put back as it was after the last
    step using it, unless the step set a forward of its own."""
    chosen = {id(model.get_submodule(name)): (model.get_submodule(name), decision)
              for name, decision in decisions.items()}
    modules = [module for module, _ in chosen.values()]
    running = _running()
    with _LOCK:
        for module, decision in chosen.values():
            key = id(module)
            if key in _INSTALLED:
                found, own, wrapper, users = _INSTALLED[key]
                _INSTALLED[key] = (found, own, wrapper, users + 1)
                continue
            own = module.__dict__.get("forward", _NONE)  # a forward set on the object already
            wrapper = _CheckpointedForward(module, module.forward, decision)
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

    def __init__(self, model: nn.Module,
                 decisions: Mapping[str, Checkpoint] | Sequence[str]) -> None:
        super().__init__(model)
        if not isinstance(decisions, Mapping):
            decisions = dict.fromkeys(decisions, Checkpoint())
        for name, decision in decisions.items():
            if not isinstance(decision, Checkpoint) or decision.segments is not None:
                raise TypeError(f"CheckpointedModules: {name!r} is given {decision!r}; a module "
                                f"is checkpointed whole or selectively: Checkpoint() or "
                                f"Checkpoint(selective=True)")
        self._decisions = dict(sorted(decisions.items(), key=lambda item: item[0]))

    @property
    def names(self) -> tuple[str, ...]:
        """The modules checkpointed, or the model's own ``names`` where it has one."""
        return self.models_own("names", tuple(self._decisions))

    @property
    def decisions(self) -> dict[str, Checkpoint]:
        """How each module of ``names`` is checkpointed: whole, or selectively."""
        return dict(self._decisions)

    @property
    def memory(self) -> MemoryPlan:
        """``memory_plan``, or the model's own ``memory`` where it has one (the zoo's)."""
        return self.models_own("memory", self.memory_plan)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model[0]
        if not torch.is_grad_enabled():
            return model(*args, **kwargs)
        with _checkpointed(model, self._decisions):
            return model(*args, **kwargs)


@dataclass(frozen=True)
class _Candidate:
    decisions: tuple[tuple[str, Checkpoint], ...]
    cost: int
    modelled: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.decisions)

    @property
    def order(self) -> tuple[tuple[str, bool], ...]:
        """What ties between candidates are broken by."""
        return tuple((name, decision.selective) for name, decision in self.decisions)


_WHOLE, _SELECTIVE = Checkpoint(), Checkpoint(selective=True)


def _candidates(profiles: Sequence[ModuleProfile], unplanned: int,
                around: dict[str, set[str]]) -> list[_Candidate]:
    """Prefixes of each depth's modules, most bytes saved per cost first, none inside another
    (``around``: the names of the modules each is inside), checkpointed whole, selectively, or
    whole with the rest of the depth selective, with their modelled peaks (NOTE [ Plans of
    whole modules ])."""
    found: dict[tuple[tuple[str, Checkpoint], ...], _Candidate] = {}

    def add(chosen: Sequence[tuple[ModuleProfile, Checkpoint]]) -> None:
        if not chosen:
            return
        saving = sum(p.saving_of(d) for p, d in chosen)
        cost = sum(p.cost_of(d) for p, d in chosen)
        largest = max(p.saved - (p.products if d.selective else 0) for p, d in chosen)
        decisions = tuple(sorted(((p.name, d) for p, d in chosen), key=lambda nd: nd[0]))
        found.setdefault(decisions, _Candidate(decisions, cost, unplanned - saving + largest))

    for depth in sorted({p.depth for p in profiles}):
        level = [p for p in profiles if p.saving > 0 and not p.written and (
            p.depth == depth or (p.leaf and p.depth < depth))]
        # A module shared by two parents may be called at one depth and named inside another.
        names = {p.name for p in level}
        level = [p for p in level if not around[p.name] & names]
        whole = sorted(level, key=lambda p: (-p.saving / max(p.cost, 1), p.name))
        selective = sorted((p for p in level if p.selective_safe and p.saving_of(_SELECTIVE) > 0),
                           key=lambda p: (-p.saving_of(_SELECTIVE) / max(p.cost_of(_SELECTIVE), 1),
                                          p.name))
        for k in range(1, len(whole) + 1):
            add([(p, _WHOLE) for p in whole[:k]])
            add([(p, _SELECTIVE) for p in selective[:k]])
            first = {p.name for p in whole[:k]}
            add([(p, _WHOLE) for p in whole[:k]]
                + [(p, _SELECTIVE) for p in selective if p.name not in first])
    return sorted(found.values(), key=lambda c: (c.cost, c.modelled, c.order))


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
    floors = sorted(candidates, key=lambda c: (c.modelled, c.cost, c.order))[:FLOORS]
    tries = [c for c in candidates
             if fits(c.modelled, budget) and c not in floors][:MAX_PREDICTIONS]
    peaks: dict[_Candidate, int] = {}
    for candidate in (*tries, *sorted(floors, key=lambda c: (c.cost, c.modelled, c.order))):
        planned = CheckpointedModules(model, dict(candidate.decisions))
        peaks[candidate] = predictor.predict(
            training_step, (planned, example_input, loss_fn, optimizer), {}).peak_bytes
        if fits(peaks[candidate], budget):
            parts = tuple(PartPlan(name, decision, profiles[name].kept + (
                              profiles[name].products if decision.selective else 0), math.nan)
                          for name, decision in candidate.decisions)
            planned.memory_plan = MemoryPlan(stages, Checkpoint(), parts, peaks[candidate],
                                             budget)
            return planned
    lowest = min(floors, key=lambda c: (peaks[c], c.cost, c.order))
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
