"""Plans of whole modules, for models torch.fx cannot trace: the model's own forward runs, and
some of the modules it calls run as checkpoints (NOTE [ Plans of whole modules ])."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from revnets.checkpoint import Checkpointed
from revnets.plan import Checkpoint, MemoryPlan, PartPlan, Reconstruct, Store
from revnets.planning.budget import LossFn, no_fit, training_step
from revnets.planning.profile import _address, _flops
from revnets.prediction import Predictor
from revnets.reversible import ReversibleSequence

__all__ = ["CheckpointedModules", "ModuleProfile", "plan_modules"]

# NOTE [ Plans of whole modules ]
# A model whose own forward torch.fx cannot trace (Python control flow on shapes: CrossViT) has
# no chain of steps to cut, but it has its modules, each called by its code. Its plan is a set
# of them, none inside another, that run as checkpoints: for a training step each is swapped at
# its parent for a Checkpointed of itself (revnets.checkpoint: generators, module state and hooks
# replayed), and put back after, so the model's own code runs unchanged around them; attributes
# its code reads through them are the module's. One prediction of the unplanned step profiles
# every module call: the storages it saves for backward besides its inputs and the model's
# state, what a checkpoint keeps instead (its inputs), and what rerunning it costs, counted (the
# floating-point operations of its products and the elements its operators make), so that every
# call at one budget ranks the same plans the same way, and a refusal names a budget that then
# plans. For each depth of the call tree, its modules (and the leaves above it), ordered by
# bytes saved per cost, give plans of growing prefixes; a modelled peak (the unplanned peak, less
# what each saves, plus the largest recomputation) orders them, and an exact prediction accepts
# one, as for chains (NOTE [ Modelled search, exact acceptance ] in search.py). The most frugal
# plan as modelled is always predicted last: its exact peak is the budget a refusal names.
MAX_PREDICTIONS = 4  # exact predictions of plans within the budget as modelled, cheapest first


@dataclass(frozen=True)
class ModuleProfile:
    """One module's calls in the forward of a training step, summed."""

    name: str
    depth: int  # the modules called around its first call: 1 for the model's own children
    saved: int  # bytes it saves for backward, besides its inputs and the model's state
    kept: int  # bytes of its tensor inputs: what a checkpoint keeps of it instead
    cost: int  # operations of its products and elements its operators make
    leaf: bool  # it calls no other module

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


class _Profiler(TorchDispatchMode):
    """A training step that profiles the calls of its model's modules (:class:`ModuleProfile`)
    while it runs: hooks on the model it is given (in a prediction, the fake copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, _Calls] = {}
        self._stack: list[tuple[_Calls, set[int]]] = []
        self._state: set[int] = set()

    def __call__(self, model: nn.Module, x: Any, loss_fn: LossFn,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self._state = {_address(t) for t in (*model.parameters(), *model.buffers())}
        handles = []
        for name, module in model.named_modules():
            if name:
                handles += [
                    module.register_forward_pre_hook(self._enter(name), with_kwargs=True),
                    module.register_forward_hook(self._leave, always_call=True),
                ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _same), self:
                training_step(model, x, loss_fn, optimizer)
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, name: str) -> Any:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls = self.calls.setdefault(name, _Calls(len(self._stack) + 1))
            if self._stack:
                self._stack[-1][0].leaf = False
            inputs = {_address(t): t.untyped_storage().nbytes()
                      for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
            calls.kept += sum(inputs.values())
            self._stack.append((calls, set(inputs)))
        return pre_hook

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._stack.pop()

    def _pack(self, t: Tensor) -> Tensor:
        address = _address(t)
        if address not in self._state:
            for calls, inputs in self._stack:
                if address not in inputs:
                    calls.saved[address] = t.untyped_storage().nbytes()
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._stack:
            cost = _flops(func, args, kwargs, out) + sum(
                t.numel() for t in tree_leaves(out) if isinstance(t, Tensor))
            for calls, _ in self._stack:
                calls.cost += cost
        return out

    def profiles(self) -> list[ModuleProfile]:
        return [ModuleProfile(name, c.depth, sum(c.saved.values()), c.kept, c.cost, c.leaf)
                for name, c in self.calls.items()]


def _same(t: Tensor) -> Tensor:
    return t


class _InPlaceOf(Checkpointed):
    """A checkpoint of a module, standing in its place for a step: the model's code reads the
    module's attributes through it."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


@contextlib.contextmanager
def _swapped_in(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Each module of ``names`` replaced at its parent by a checkpoint of itself, and put back."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for name in names:
            parent_name, _, key = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            module = parent._modules[key]
            parent._modules[key] = _InPlaceOf(module)
            swapped.append((parent, key, module))
        yield
    finally:
        for parent, key, module in reversed(swapped):
            parent._modules[key] = module


class CheckpointedModules(nn.Module):
    """A model whose training steps (training mode, grad enabled) run ``names``, modules it
    calls, as checkpoints, its own forward around them (NOTE [ Plans of whole modules ]);
    everything else runs the model as it is. It shares every parameter and buffer with
    ``model``: save and load weights through ``.model``."""

    memory_plan: MemoryPlan

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)

    @property
    def memory(self) -> MemoryPlan:
        return self.memory_plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)
        with _swapped_in(self.model, self.names):
            return self.model(*args, **kwargs)


@dataclass(frozen=True)
class _Candidate:
    names: tuple[str, ...]
    cost: int
    modelled: int


def _candidates(profiles: Sequence[ModuleProfile], unplanned: int) -> list[_Candidate]:
    """Prefixes of each depth's modules, most bytes saved per cost first, with their modelled
    peaks (NOTE [ Plans of whole modules ])."""
    found: dict[tuple[str, ...], _Candidate] = {}
    for depth in sorted({p.depth for p in profiles}):
        level = [p for p in profiles if p.saving > 0 and (
            p.depth == depth or (p.leaf and p.depth < depth))]
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
) -> nn.Module:
    """``model`` set up to train within ``budget`` with whole modules checkpointed (NOTE
    [ Plans of whole modules ]), or ``model`` itself where it fits as it is. ``untraceable``:
    why it has no chain, for an error where its step cannot be predicted either."""
    predictor, profiler = Predictor(), _Profiler()
    try:
        unplanned = predictor.predict(
            profiler, (model, example_input, loss_fn, optimizer), {}).peak_bytes
    except ValueError as error:  # the prediction's refusal: a tensor's value read
        raise TypeError(f"{untraceable}, and its training step cannot be predicted to plan "
                        f"its modules instead: {error}") from error
    stages = Reconstruct() if any(isinstance(m, ReversibleSequence) and isinstance(
        m.memory, Reconstruct) for m in model.modules()) else Store()
    if unplanned <= budget:
        model.memory_plan = MemoryPlan(stages, Store(), (PartPlan(type(model).__name__, Store()),),
                                       unplanned, budget)
        return model
    profiles = {p.name: p for p in profiler.profiles()}
    candidates = _candidates(list(profiles.values()), unplanned)
    if not candidates:
        raise no_fit(budget, unplanned, f"{type(model).__name__} as it is: no module it calls "
                                        f"saves memory checkpointed")
    frugal = min(candidates, key=lambda c: (c.modelled, c.cost, c.names))
    tries = [c for c in candidates if c.modelled <= budget and c is not frugal][:MAX_PREDICTIONS]
    for candidate in (*tries, frugal):
        planned = CheckpointedModules(model, candidate.names)
        peak = predictor.predict(
            training_step, (planned, example_input, loss_fn, optimizer), {}).peak_bytes
        if peak <= budget:
            parts = tuple(PartPlan(name, Checkpoint(), profiles[name].kept, math.nan)
                          for name in candidate.names)
            planned.memory_plan = MemoryPlan(stages, Checkpoint(), parts, peak, budget)
            return planned
    raise no_fit(budget, peak, f"checkpoints of {len(frugal.names)} whole modules, "
                               f"{_listed(frugal.names)}")


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:5])} .. {names[-1]}"
