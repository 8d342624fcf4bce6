"""What each module's calls in a training step cost (ModuleProfile), and the runs of modules the
model's code calls one after another (NOTE [ Plans of whole modules ] in plan.py)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from revnets.facts.operators import SELECTIVE_OPS, flops_of
from revnets.facts.tensors import storage_key
from revnets.graph.trace_state import Attributes, version_of
from revnets.plan import Checkpoint
from revnets.planning.budget import LossFn, training_step

__all__ = ["ModuleProfile", "ModuleProfiler", "hidden_of", "objects_of"]


@dataclass(frozen=True)
class ModuleProfile:
    """One module's calls in the forward of a training step, summed."""

    name: str
    depth: int  # the modules called around its first call: 1 for the model's own children
    saved: int  # bytes it saves for backward, besides its inputs and the model's state
    kept: int  # bytes of its tensor inputs: what a checkpoint keeps of it instead
    cost: int  # operations of its products and elements its operators make
    leaf: bool  # it calls no other module
    written: bool  # its input, or a tensor its modules hold, written or replaced before backward
    products: int = 0  # bytes of the outputs of its products: what a selective one keeps too
    product_cost: int = 0  # the part of ``cost`` its products are: what it does not rerun
    selective_safe: bool = True  # no such output is written in place before the backward
    calls: int = 1

    @property
    def saving(self) -> int:
        return self.saved - self.kept

    def saving_of(self, decision: Checkpoint) -> int:
        """Bytes the module's checkpoint saves: ``Checkpoint()`` or selective."""
        return self.saving - self.products if decision.selective else self.saving

    def cost_of(self, decision: Checkpoint) -> int:
        """What rerunning it costs: its products' left out of a selective checkpoint's."""
        return self.cost - self.product_cost if decision.selective else self.cost


def hidden_of(tree: Any) -> Tensor | None:
    """The tensor a module's call is given first, or returns first: the hidden state a run of
    modules hands on (NOTE [ Runs of modules ] in install.py)."""
    return next((t for t in tree_leaves(tree) if isinstance(t, Tensor)), None)


def objects_of(tree: Any) -> tuple[int, ...]:
    """The ids of the objects a call is given besides tensors and plain values (a cache)."""
    return tuple(id(leaf) for leaf in tree_leaves(tree) if not isinstance(
        leaf, (Tensor, type(None), bool, int, float, complex, str, torch.dtype, torch.device)))


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
    calls: int = 0
    inputs: list[tuple[weakref.ref, int | None]] = field(default_factory=list)
    state: list[Attributes] = field(default_factory=list)
    made: list[tuple[weakref.ref, int | None]] = field(default_factory=list)  # products' outputs


@dataclass
class _Left:
    """The last call that returned under one caller: what a next call continuing its run finds."""

    name: str
    hidden: weakref.ref | None
    operations: int  # operators dispatched in the forward until it returned
    objects: tuple[int, ...]


class ModuleProfiler(TorchDispatchMode):
    """A training step that profiles the calls of its model's modules (:class:`ModuleProfile`)
    while it runs, and the runs they make (NOTE [ Runs of modules ]): hooks on the model it is
    given (in a prediction, the fake copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, _Calls] = {}
        # The calls under way, innermost last; None where a module runs again in the backward
        # (the reversible engine's blocks): the forward alone is profiled.
        self._stack: list[tuple[_Calls, set[int]] | None] = []
        self._state: set[int] = set()
        self._forward = True
        self._operations = 0
        self._hooked: set[str] = set()  # modules with hooks of their own: in no run
        self._left: dict[int, _Left] = {}  # by the caller's calls (0: the model's)
        self._runs: list[list[str]] = []
        self._run_of: dict[str, list[str]] = {}

    def __call__(self, model: nn.Module, x: Any, loss_fn: LossFn,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self._state = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self._hooked = {name for name, m in model.named_modules() if m._forward_hooks
                        or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks}
        handles = []
        for name, module in model.named_modules():
            if name and not isinstance(module, torch.jit.ScriptModule):  # no hooks there
                handles += [
                    module.register_forward_pre_hook(self._enter(name), with_kwargs=True),
                    module.register_forward_hook(self._leave(name), with_kwargs=True,
                                                 always_call=True),
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

    def _caller(self) -> int:
        top = self._stack[-1] if self._stack else None
        return id(top[0]) if top is not None else 0

    def _enter(self, name: str) -> Any:
        # The reversible engine calls a block's pre-hooks itself, without keywords.
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
            if not self._forward:
                self._stack.append(None)
                return
            self._follow_run(name, (args, kwargs))
            calls = self.calls.setdefault(name, _Calls(len(self._stack) + 1))
            calls.calls += 1
            if self._stack and self._stack[-1] is not None:
                self._stack[-1][0].leaf = False
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            inputs = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
            calls.kept += sum(inputs.values())
            calls.inputs += [(weakref.ref(t), version_of(t)) for t in tensors]
            self._stack.append((calls, set(inputs)))
        return pre_hook

    def _follow_run(self, name: str, given: Any) -> None:
        """``name`` continues the run of the call that returned last under the same caller if
        nothing ran since, it is given that call's output first and the same objects."""
        last = self._left.pop(self._caller(), None)
        hidden = hidden_of(given)
        if (last is not None and last.operations == self._operations and hidden is not None
                and last.hidden is not None and last.hidden() is hidden
                and last.objects == objects_of(given) and name not in self._run_of):
            run = self._run_of[last.name]
            run.append(name)
        else:
            run = [name]
            self._runs.append(run)
        self._run_of.setdefault(name, run)

    def _leave(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            top = self._stack.pop()
            if top is None:
                return
            top[0].state.append(Attributes(module.modules()))  # what its recomputation reads
            hidden = hidden_of(output)
            self._left[self._caller()] = _Left(
                name, weakref.ref(hidden) if hidden is not None else None, self._operations,
                objects_of((args, kwargs)))
        return hook

    def _forward_done(self) -> None:
        if not self._forward:  # a second step (an optimizer's first)
            return
        self._forward = False
        for calls in self.calls.values():
            calls.written |= any(t is not None and version_of(t) != version
                                 for t, version in ((ref(), v) for ref, v in calls.inputs))
            # State changed since the call otherwise is put back as found for its recomputation.
            calls.written |= any(state.tensor_changed() is not None for state in calls.state)
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
        if self._forward:
            self._operations += 1
        if self._forward and self._stack:
            made = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
            cost = flops_of(func, args, kwargs, out) + sum(t.numel() for t in made)
            product = func in SELECTIVE_OPS
            for entry in filter(None, self._stack):
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
                              c.selective_safe, c.calls)
                for name, c in self.calls.items()]

    def runs(self) -> list[tuple[str, ...]]:
        """Runs of two or more modules the forward called one after another, each once, each
        given the one before's output and nothing computed between them (NOTE [ Runs of
        modules ]): a run the forward called is cut where a module has hooks of its own or
        was called more than once, the pieces either side kept."""
        pieces: list[list[str]] = []
        for run in self._runs:
            pieces.append([])
            for name in run:
                if self.calls[name].calls == 1 and name not in self._hooked:
                    pieces[-1].append(name)
                elif pieces[-1]:
                    pieces.append([])
        return [tuple(piece) for piece in pieces if len(piece) > 1]


def _same(t: Tensor) -> Tensor:
    return t
