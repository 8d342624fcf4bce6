"""The checkpointed forwards a plan of modules sets over the modules' own for a training step:
one module's, or a run's (NOTE [ Plans of whole modules ] in plan.py, NOTE [ Runs of modules ])."""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from revnets.checkpoint import checkpoint_forward, open_checkpoint
from revnets.plan import Checkpoint
from revnets.planning.modules.profile import hidden_of, objects_of
from revnets.replay.structure import InstalledForward

__all__ = ["CheckpointedForwards", "Part", "is_inside", "names_of"]

Part = str | tuple[str, ...]  # a module's name, or the names of a run of modules

# NOTE [ Runs of modules ]
# A run is modules the model's code calls one after another under one caller (a decoder's
# layers in its loop), each given the one before's output first and the same other objects (a
# cache, a mask), nothing computed between them, each called once and with no hooks of its
# own: the profiler finds them (ModuleProfiler.runs). Checkpointed as one, a run keeps its
# first module's inputs alone where one checkpoint per module keeps every module's: below the
# peak of transformers' checkpointing of every layer where the step peaks outside the layers
# (the logits and their gradient). Its checkpoint opens before its first module's forward and
# closes after its last's (revnets.checkpoint.open_checkpoint); each module's forward runs
# when the model calls it, its hooks around it, its output handed back, so the model's code
# sees what it sees unplanned. Each call is recorded with the output it was given replaced by
# a mark (no reference to it kept: that would keep it alive), and the recomputation runs the
# recorded calls in order, each given its predecessor's recomputed output. What breaks the
# run at step time (the run left before its last module, another hidden state or other
# objects given, a module called twice) is refused by name, and the checkpoint is closed.

# NOTE [ Forwards made once ]
# A plan makes each module's checkpointed forward once and sets that same object over the
# module's own at every step (made again only where the module's own forward has changed: one
# set on the object, or its class's): torch.compile guards on the forward it traced (an
# instance attribute ``forward`` is a guarded object), and a wrapper made for each step would be
# freed after it, invalidating the compiled code, compiled again at every step. What a step
# has under way (a run's checkpoint, the modules running) is kept per thread, not on the
# wrappers, so that a plan is copied and pickled with them. One wrapper is set on a module at
# a time, the first step's using it; called, it runs as the innermost step under way in the
# calling thread checkpoints the module (two plans sharing a module step at once, each with
# its own decisions), and as the module's own forward in a thread running none. A replay
# leaves the wrappers alone (replay.structure.InstalledForward): one put back by a
# recomputation in another thread would stay on the module after its last step.

# NOTE [ Nested checkpoints ]
# A part of a plan may hold other parts (a decoder layer, and its attention and MLP): where a
# step peaks in one layer's recomputation and backward (deep, narrow models), one checkpoint a
# layer holds all of that layer's activations there, and checkpoints inside it hold one
# sublayer's at a time. torch's non-reentrant checkpoints nest where the recomputation saves
# what the forward saved, in the same order (it matches them by position): so the parts inside
# run as checkpoints in the step's forward, where the part around them saves their inputs as
# it saves anything (not kept: recomputed), and again in its recomputation, entered there
# around the recomputed forward, since the step's forward has set the modules' own forwards
# back by then. The backward runs a part inside another three times. Both are whole
# checkpoints (CheckpointedModules refuses selective ones there: a selective part inside
# another would keep its products from the step's forward, in every layer, to its backward).


class _CheckpointedForward(InstalledForward):
    """A module's forward run as a checkpoint, set over its class's for the steps under way:
    called, it runs as the innermost step under way in this thread checkpoints the module (a
    plan's, another's sharing the module, a part's inside another's), and in a thread running
    none of them, as the forward it was. It reads as that forward (``inspect.signature``,
    ``__wrapped__``, ``__self__``), and takes none of its attributes (a callable object's
    ``forward`` is not this one's)."""

    def __init__(self, module: nn.Module, forward: Any, decision: Checkpoint,
                 inner: Any = contextlib.nullcontext) -> None:
        functools.update_wrapper(self, forward, updated=())
        self.module, self.forward, self.decision, self.inner = module, forward, decision, inner
        self.__self__ = module
        self.__func__ = getattr(forward, "__func__", forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = _running().get(id(self.module))
        if not active:
            return self.forward(*args, **kwargs)
        return active[-1].checkpointed(*args, **kwargs)

    def checkpointed(self, *args: Any, **kwargs: Any) -> Any:
        """The forward as this wrapper's plan checkpoints it."""
        # Every tensor handed over positionally: torch checks those for writes in place
        # before it recomputes (a keyword's or a list's, it would read as written).
        leaves, spec = tree_flatten((args, kwargs))
        tensors = tuple(leaf for leaf in leaves if isinstance(leaf, Tensor))
        others = tuple(leaf for leaf in leaves if not isinstance(leaf, Tensor))
        skeleton = _without_tensors(leaves)

        def forward(*tensors: Tensor) -> Any:
            values = _with_tensors(skeleton, tensors)
            args, kwargs = tree_unflatten(values, spec)
            with self.inner():  # in its recomputation too: NOTE [ Nested checkpoints ]
                return self.forward(*args, **kwargs)

        return checkpoint_forward(self.module, forward, tensors, {},
                                  selective=self.decision.selective, given=others)


class _RunMember(_CheckpointedForward):
    """Module ``index`` of a run checkpointed as one, set over its class's forward."""

    def __init__(self, module: nn.Module, forward: Any, run: _Run, index: int) -> None:
        super().__init__(module, forward, Checkpoint())
        self.run, self.index = run, index

    def checkpointed(self, *args: Any, **kwargs: Any) -> Any:
        return self.run.call(self.index, self.forward, args, kwargs)


class _RunState:
    """A run's checkpoint under way in one thread (NOTE [ Runs of modules ])."""

    def __init__(self) -> None:
        self.checkpoint: Iterator[None] | None = None
        self.calls: list[tuple[Any, list, Any, int | None]] = []  # forward, leaves, spec, mark
        self.last: Tensor | None = None  # the hidden state the last call returned
        self.objects: tuple[int, ...] = ()


class _Run:
    """A run of modules checkpointed as one (NOTE [ Runs of modules ])."""

    def __init__(self, names: tuple[str, ...], modules: list[nn.Module],
                 inner: Any = contextlib.nullcontext) -> None:
        self.names, self.modules, self.inner = names, modules, inner

    @property
    def state(self) -> _RunState:
        """This run's state in this thread (kept per thread, not on the run: a plan is copied
        and pickled with its runs)."""
        return _RUNNING.runs.setdefault(id(self), _RunState())

    # Under torch.compile a run's members run eagerly, the rest of the model compiled: dynamo
    # cannot trace a checkpoint that opens in one module's call and closes in another's.
    @torch.compiler.disable
    def call(self, index: int, forward: Any, args: tuple, kwargs: dict) -> Any:
        state = self.state
        leaves, spec = tree_flatten((args, kwargs))
        if index == 0:
            if state.checkpoint is not None:
                self.abandon()
                raise RuntimeError(
                    f"auto_checkpoint: the plan checkpoints {self.names[0]} .. {self.names[-1]} "
                    f"as one run, each module called once, but {self.names[0]} was called "
                    f"again before {self.names[-1]} (a layer run twice, a loop restarted). "
                    f"Plan the model again with the step it runs")
            state.objects = objects_of((args, kwargs))
            # this checkpoint's, to the end; its tensors are the checkpoint's inputs
            state.calls = [(forward, _without_tensors(leaves), spec, None)]
            tensors = tuple(leaf for leaf in leaves if isinstance(leaf, Tensor))
            others = tuple(leaf for leaf in leaves if not isinstance(leaf, Tensor))
            state.checkpoint = open_checkpoint(
                self.modules, functools.partial(_recompute, self.inner, state.calls), tensors,
                others)
        else:
            self._follows(index, leaves, (args, kwargs))
            mark = next(i for i, leaf in enumerate(leaves) if leaf is state.last)
            state.calls.append((forward, [None if i == mark else leaf
                                          for i, leaf in enumerate(leaves)], spec, mark))
        try:
            out = forward(*args, **kwargs)
        except BaseException:
            self.abandon()
            raise
        if index < len(self.modules) - 1:
            state.last = hidden_of(out)
            return out
        state.last, checkpoint, state.checkpoint = None, state.checkpoint, None
        next(checkpoint, None)  # closes it: the run's forward ends here
        state.calls = []
        return out

    def _follows(self, index: int, leaves: list, given: Any) -> None:
        state = self.state
        expected = len(state.calls) if state.checkpoint is not None else 0
        if index != expected or not any(leaf is state.last for leaf in leaves) \
                or objects_of(given) != state.objects:
            self.abandon()
            raise RuntimeError(
                f"auto_checkpoint: the plan checkpoints {self.names[0]} .. {self.names[-1]} as "
                f"one run, each module given the one before's output, but {self.names[index]} "
                f"was called " + (f"after {self.names[expected - 1]}" if expected else
                                  "before the run's first module") + " with other arguments "
                "than the planned step's (another hidden state, other objects, or out of "
                "order). Plan the model again with the step it runs")

    def left_open(self) -> bool:
        state = _RUNNING.runs.get(id(self))
        return state is not None and state.checkpoint is not None

    def abandon(self) -> None:
        state = _RUNNING.runs.pop(id(self), None)
        if state is not None and state.checkpoint is not None:
            state.checkpoint.close()


class _Running(threading.local):
    def __init__(self) -> None:
        # id of a module: the wrappers of the steps under way in this thread, innermost last
        self.modules: dict[int, list[_CheckpointedForward]] = {}
        self.runs: dict[int, _RunState] = {}  # id of a run: its checkpoint under way


_RUNNING = _Running()
# id of a module: the module, its own forward, the wrapper set on it, the steps using it
_INSTALLED: dict[int, tuple[nn.Module, Any, Any, int]] = {}
_LOCK = threading.Lock()
_NONE = object()


def _running() -> dict[int, list[_CheckpointedForward]]:
    return _RUNNING.modules


class CheckpointedForwards:
    """The checkpointed forwards of a plan's parts, each module's made once (NOTE [ Forwards
    made once ]) and set over its own for each step in the thread running it (``installed``),
    a run's modules' as one (NOTE [ Runs of modules ]), the module left in place (NOTE [ Plans
    of whole modules ] in plan.py)."""

    def __init__(self, model: nn.Module, decisions: Mapping[Part, Checkpoint]) -> None:
        # Each module, its wrapper's maker, and the forward it wrapped and the wrapper last made
        # (lists, not keyed by id: a copied plan holds the copies' modules).
        self.makers: list[tuple[nn.Module, Any]] = []
        self.runs: list[_Run] = []
        self.made: list[tuple[Any, Any] | None] = []
        for part, decision in decisions.items():
            inside = {other: d for other, d in decisions.items() if is_inside(other, part)}
            inner = CheckpointedForwards(model, inside).installed if inside \
                else contextlib.nullcontext
            if isinstance(part, str):
                module = model.get_submodule(part)
                self.makers.append((module, functools.partial(
                    _CheckpointedForward, module, decision=decision, inner=inner)))
                continue
            members = [model.get_submodule(name) for name in part]
            self.runs.append(run := _Run(part, members, inner))
            for index, module in enumerate(members):
                self.makers.append((module, functools.partial(
                    _RunMember, module, run=run, index=index)))
        self.made = [None] * len(self.makers)

    def _wrapper(self, index: int, own: Any) -> _CheckpointedForward:
        """The wrapper over module ``index``'s own forward (set on the object, ``own``, or its
        class's): the one made before, where that forward is the same."""
        module, make = self.makers[index]
        found = type(module).forward if own is _NONE else own
        made = self.made[index]
        if made is None or made[0] is not found:
            forward = types.MethodType(found, module) if own is _NONE else own
            self.made[index] = made = (found, make(forward))
        return made[1]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Each module's checkpointed forward in this thread, for one step; put back as it was
        after the last step using it, unless the step set a forward of its own."""
        modules = [module for module, _ in self.makers]
        running = _running()
        mine = []
        with _LOCK:
            for index, module in enumerate(modules):
                key = id(module)
                if key in _INSTALLED:  # another step's, of this plan or another, or inside one
                    found, own, wrapper, users = _INSTALLED[key]
                    _INSTALLED[key] = (found, own, wrapper, users + 1)
                    mine.append(self._wrapper(index, own))
                    continue
                own = module.__dict__.get("forward", _NONE)  # a forward set on the object already
                mine.append(wrapper := self._wrapper(index, own))
                module.__dict__["forward"] = wrapper
                _INSTALLED[key] = (module, own, wrapper, 1)
        for module, wrapper in zip(modules, mine):
            running.setdefault(id(module), []).append(wrapper)
        try:
            yield
            left = [run for run in self.runs if run.left_open()]
            for run in left:
                run.abandon()
            if left:
                raise RuntimeError(
                    f"auto_checkpoint: the plan checkpoints {left[0].names[0]} .. "
                    f"{left[0].names[-1]} as one run, and the model's forward returned before "
                    f"calling {left[0].names[-1]} (an early exit, a layer skipped). Plan the "
                    f"model again with the step it runs")
        finally:
            for run in self.runs:
                run.abandon()
            for module in modules:
                running[id(module)].pop()
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


def _recompute(inner: Any, calls: list[tuple[Any, list, Any, int | None]],
               *tensors: Tensor) -> Any:
    """A run's recorded calls again, each given its predecessor's recomputed output, the parts
    inside the run checkpointed (``inner``)."""
    out = None
    with inner():
        for forward, leaves, spec, mark in calls:
            values = _with_tensors(leaves, tensors) if mark is None else list(leaves)
            if mark is not None:
                values[mark] = hidden_of(out)
            args, kwargs = tree_unflatten(values, spec)
            out = forward(*args, **kwargs)
    return out


_TENSOR = object()  # where a recorded call's tensor was: not held, handed to the checkpoint


def _without_tensors(leaves: list) -> list:
    """A call's arguments with its tensors left out: a checkpoint's inputs are its to keep
    (saved, where a checkpoint around it recomputes them: NOTE [ Nested checkpoints ])."""
    return [_TENSOR if isinstance(leaf, Tensor) else leaf for leaf in leaves]


def _with_tensors(skeleton: list, tensors: tuple) -> list:
    given = iter(tensors)
    return [next(given) if leaf is _TENSOR else leaf for leaf in skeleton]


def names_of(part: Part) -> tuple[str, ...]:
    """The modules of a plan's part: one, or a run's."""
    return (part,) if isinstance(part, str) else part


def is_inside(part: Part, other: Part) -> bool:
    """Whether every module of ``part`` is a submodule of one of ``other``'s, by name."""
    return part != other and all(any(name.startswith(f"{outer}.") for outer in names_of(other))
                                 for name in names_of(part))
