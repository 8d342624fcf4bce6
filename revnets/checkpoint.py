"""Checkpointing for what is not invertible: recompute in backward instead of storing.

Built on non-reentrant :func:`torch.utils.checkpoint.checkpoint`, which replays the default
generators and autocast. Its recomputation here is a replay in the sense of NOTE [ Replay ]
(:mod:`revnets.replay`, shared with the reversible engine): every generator, the module state the
forward found with every update made once, and forward hooks, so a checkpointed model trains
exactly like the plain one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.utils.checkpoint
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from revnets.facts.operators import KEPT_PRODUCERS, NORMS, SELECTIVE_OPS
from revnets.plan import Checkpoint, Store
from revnets.replay import Recording, submodules
from revnets.replay.known_calls import plain_device
from revnets.transforms import aot_traced, func_transforms

__all__ = [
    "SELECTIVE_OPS",
    "Checkpointed",
    "checkpoint",
    "checkpoint_segments",
    "open_checkpoint",
    "run_checkpointed_segments",
    "segment_bounds",
]


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # NOTE [ Selective recomputation ] in revnets/facts/operators.py
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _compiled_selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # NOTE [ Norms in a compiled selective checkpoint ] in revnets/facts/operators.py
    if op in NORMS and type(getattr(args[0], "grad_fn", None)).__name__ in KEPT_PRODUCERS:
        return CheckpointPolicy.PREFER_SAVE
    return _selective_policy(ctx, op, *args, **kwargs)


def checkpoint(
    module: nn.Module | Callable[..., Any], /, *args: Any, preserve_rng_state: bool = True,
    selective: bool = False, **kwargs: Any,
) -> Any:
    """``module(*args, **kwargs)``, storing only the inputs (and with ``selective``, the outputs
    of matrix products, convolutions and attention: NOTE [ Selective recomputation ]); the
    internals are recomputed in backward.

    ``module`` is an ``nn.Module``, or a method of one (``checkpoint(self._stage, x)``), whose
    module's state the replay follows; a plain function names no module and is refused. Every
    keyword but ``preserve_rng_state`` and ``selective`` is ``module``'s, those torch's
    checkpoint takes as options too (``debug``, ``early_stop``).

    Non-reentrant :func:`torch.utils.checkpoint.checkpoint` whose recomputation is a replay
    (NOTE [ Replay ] in :mod:`revnets.replay`): it draws from every generator as the forward did
    (wherever the module keeps it), reads the module state the forward found and updates it once
    (BatchNorm statistics, spectral norm, moving averages, modified in place or reassigned),
    replays forward hooks that changed an output and silences the others, and is refused if the
    module's weights were swapped or modified in place after the forward
    (``torch.func.functional_call``, an optimizer step).
    """
    # Compiled, the graph recomputes and no replay runs: dynamo cannot look into a bound method
    # for its owner, found only where the region runs eagerly (NOTE [ Compiled checkpoints ]).
    owner = module if torch.compiler.is_dynamo_compiling() else _owner_of(module)
    return checkpoint_forward(owner, module, args, kwargs, preserve_rng_state, selective,
                              watched=module is not owner)


def _owner_of(fn: Any) -> nn.Module:
    """The module whose state a checkpoint of ``fn`` replays: ``fn`` itself, the module a method
    is bound to, or that of the function a ``functools.partial`` wraps."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, nn.Module):
        raise TypeError(
            f"revnets.checkpoint: {fn!r} is not an nn.Module or a method of one. Its "
            f"recomputation replays the state of the module it runs (BatchNorm statistics "
            f"updated once, the random draws of its layers), which a plain function does not "
            f"name; checkpoint the module (checkpoint(block, x)), a method of it "
            f"(checkpoint(self._forward_stage, x)), or wrap the function in an nn.Module"
        )
    return owner


def checkpoint_forward(
    module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict,
    preserve_rng_state: bool = True, selective: bool = False, watched: bool = False,
    given: tuple = (),
) -> Any:
    """``forward(*args, **kwargs)`` as :func:`checkpoint` runs ``module``, its replay following
    ``module``: ``forward`` is ``module`` itself, or its forward alone, whose module's own hooks
    run once around it (NOTE [ Plans of whole modules ] in ``planning/modules/plan.py``).
    ``given``: what ``forward`` holds of the call besides ``args`` and ``kwargs`` (arguments it
    closes over), replayed as found with them (NOTE [ Replay ], rule 2).
    ``watched``: ``forward`` is other code of the module's (a method), whose run is watched
    rather than known from the module's layers (NOTE [ Known layers ])."""
    # Keyword arguments travel by position: torch's checkpoint takes some names as its own
    # options (debug, early_stop, determinism_check, ...), which a module may take too.
    names, values = tuple(kwargs), (*args, *kwargs.values())
    if torch.compiler.is_dynamo_compiling():
        # NOTE [ Compiled checkpoints ]: the region's code runs in the graph, or eagerly.
        return torch.utils.checkpoint.checkpoint(
            _compiled_region, module, forward, watched, names, *values, use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
            context_fn=functools.partial(_region_contexts, preserve_rng_state, selective),
        )
    transforms = func_transforms()
    if "grad" in transforms:  # forward-mode jvp and vmap run it as they are
        raise RuntimeError(
            f"revnets.checkpoint: checkpointed {type(module).__name__} runs under torch.func "
            f"({', '.join(transforms)}), whose grad (vjp, jacrev, hessian) does not support the "
            f"saved-tensor hooks its recomputation runs by. Differentiate with loss.backward() or "
            f"torch.autograd.grad, or switch the checkpoint off there "
            f"(Checkpointed(module, revnets.Store()))"
        )
    if aot_traced():
        raise RuntimeError(
            f"revnets.checkpoint: checkpointed {type(module).__name__} is traced by make_fx or "
            f"AOTAutograd outside torch.compile (aot_function, aot_module). Its recomputation "
            f"replays the module's state and random draws from Python, which such a trace does "
            f"not capture, and torch's checkpoint refuses it there. Compile the model with "
            f"torch.compile, which traces checkpoints as graphs, or trace it without "
            f"checkpoints (Checkpointed(module, revnets.Store()))"
        )
    if _initialising(module):
        # A lazy module makes its parameters in its first call, drawing their initial values
        # from torch's generators: a recomputation, with the parameters made, would not draw
        # them and its dropout masks would differ. That call stores what it computes, as
        # ReversibleSequence's does. (Compiled, dynamo makes them before it traces.)
        return forward(*args, **kwargs)
    # The replay keeps and restores the generators the forward draws from (NOTE [ Replay ],
    # rule 1): torch's own copy of the CPU's and each device's state would be a second one, kept
    # (5,056 bytes on CPU) whether the forward draws or not.
    return torch.utils.checkpoint.checkpoint(
        _called, forward, names, *values, use_reentrant=False, preserve_rng_state=False,
        context_fn=_Replay(module, preserve_rng_state, _device(watched, args, kwargs),
                           selective, given=(*values, *given)).contexts,
    )


def open_checkpoint(
    modules: Sequence[nn.Module], recompute: Callable[..., Any], args: tuple, given: tuple = (),
) -> Iterator[None]:
    """A checkpoint whose forward is whatever runs until the generator returned is exhausted
    (``next`` once, after the forward): the calls of a run of ``modules``, which
    ``recompute(*args)`` runs again in backward, replayed (NOTE [ Replay ]) as a checkpointed
    module's forward is. Exhaust it after the run's last call, ``close()`` it where the run
    fails (NOTE [ Runs of modules ] in ``planning/modules/install.py``)."""
    tracing = ", ".join(func_transforms()) or ("make_fx or AOTAutograd" if aot_traced() else
                                               "dynamo" if torch.compiler.is_dynamo_compiling()
                                               else "")
    if tracing:
        raise RuntimeError(
            f"revnets.checkpoint: a checkpointed run of {len(modules)} modules runs under "
            f"{tracing}, which its recomputation cannot follow. Train the model eagerly, or "
            f"plan it with one checkpoint per module")
    replay = _Replay(modules[0], True, _device(False, args, {}), given=(*args, *given),
                     run=modules)
    generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator_impl(
        recompute, args, {}, preserve_rng_state=False, context_fn=replay.contexts)  # the replay's
    next(generator)
    return generator


def _initialising(module: nn.Module) -> bool:
    return any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
               for m in submodules(module))


def _called(forward: Callable[..., Any], names: tuple[str, ...], /, *values: Any) -> Any:
    args, kwargs = _arguments(names, values)
    return forward(*args, **kwargs)


def _arguments(names: tuple[str, ...], values: tuple) -> tuple[tuple, dict[str, Any]]:
    cut = len(values) - len(names)
    return values[:cut], dict(zip(names, values[cut:]))


def _device(watched: bool, args: tuple, kwargs: dict) -> torch.device | None:
    # The first tensor's device, also inside the tuple a traced graph's steps hand on; None
    # where an input is not a plain value (NOTE [ Known calls ]): the run is then watched.
    return None if watched else plain_device((args, kwargs))


class _Replay:
    """The recording of one checkpointed call's forward (or of a run of modules' calls), for
    its recomputation."""

    def __init__(
        self, module: nn.Module, preserve_rng_state: bool, device: torch.device | None,
        selective: bool = False, given: tuple = (), run: Sequence[nn.Module] = (),
    ) -> None:
        self.module = module
        # ``given``: the call's arguments, whose containers and plain objects (a cache the
        # forward fills) the replay finds as the run did (NOTE [ Replay ], rule 2).
        self.recording = Recording(list(run) or [module], preserve_rng_state, device=device,
                                   given=given, torch_recomputes=True)
        self.selective = selective

    def contexts(self) -> tuple[contextlib.AbstractContextManager, ...]:
        # The first context wraps the original forward, the second each recomputation (one per
        # backward through it: retain_graph).
        if not self.selective:
            return self.recording, _EachTime(self._recomputation)
        keeping, kept = _selective_contexts()
        return (_nested(self.recording, keeping),
                _EachTime(lambda: _nested(self._recomputation(), kept)))

    @contextlib.contextmanager
    def _recomputation(self) -> Iterator[None]:
        self.recording.check(
            f"checkpointed {type(self.module).__name__}",
            "Call the module without checkpointing there.",
        )
        with self.recording.replayed():
            yield


def _selective_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    return create_selective_checkpoint_contexts(_selective_policy)


# NOTE [ Compiled checkpoints ]
# (Compiled: in code dynamo traces, NOTE [ Code dynamo traces ] in compiling.py.)
# Under torch.compile, dynamo traces a checkpoint's region into the graph (a higher-order op) and
# the compiled backward recomputes from that graph, not by rerunning Python: module state is
# updated once by construction and no replay runs. AOTAutograd asks context_fn for its contexts
# while it traces: they are selective checkpointing's, with a selective checkpoint's policy, or
# recomputing everything, as torch runs a plain checkpoint under compile. Where the region
# breaks dynamo's graph (a print, ``.item()``, control flow on a value), dynamo runs the same
# call to torch's checkpoint eagerly, and its recomputation reruns Python. context_fn is then
# called outside any trace and its contexts hand the two runs to a replay (_Replay, NOTE
# [ Replay ]) as an eager checkpoint does, so BatchNorm statistics are updated once there too.
# The replay needs the module, which context_fn cannot hold (dynamo takes a partial only as a
# constant): the module travels as the region's argument, and the region finds its run's
# contexts on a per-thread stack (none without grad: torch's checkpoint then enters none). A
# backend that runs dynamo's graph untraced (backend="eager") calls context_fn outside a trace
# too, but runs the graph, not the region: torch recomputes it without its random state there
# (tag_activation_checkpoint), so its recomputation is refused by name (a forward alone, as
# torch._dynamo.explain runs, is right).
def _compiled_region(module: Any, forward: Callable[..., Any], watched: bool,
                     names: tuple[str, ...], /, *values: Any) -> Any:
    if torch.compiler.is_dynamo_compiling() or not torch.is_grad_enabled():  # no contexts entered
        return _called(forward, names, *values)
    return _EagerRegion.innermost().run(module, forward, watched, *_arguments(names, values))


def _region_contexts(
    preserve_rng_state: bool, selective: bool
) -> tuple[contextlib.AbstractContextManager, ...]:
    if torch._guards.TracingContext.try_get() is not None:
        return create_selective_checkpoint_contexts(
            _compiled_selective_policy if selective else _recompute_all)
    region = _EagerRegion(preserve_rng_state, selective)
    return (_EachTime(functools.partial(region.entered, recomputing=False)),
            _EachTime(functools.partial(region.entered, recomputing=True)))


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class _EagerRegion:
    """A compiled checkpoint's region that dynamo ran eagerly, and its replay (NOTE [ Compiled
    checkpoints ])."""

    _open = threading.local()

    def __init__(self, preserve_rng_state: bool, selective: bool) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.selective = selective
        self.recomputing = False
        self.contexts: tuple[contextlib.AbstractContextManager, ...] = ()

    @contextlib.contextmanager
    def entered(self, recomputing: bool) -> Iterator[None]:
        if recomputing and not self.contexts:
            raise RuntimeError(
                "revnets.checkpoint: torch.compile ran a checkpoint's captured graph as it is, "
                "without tracing it (backend='eager', or a backend that runs dynamo's graph "
                "unchanged). Torch's checkpoint recomputes that graph without its random state "
                "(other dropout masks: wrong gradients) and updates its module state again. "
                "Compile with backend='aot_eager' or 'inductor' (the default) to train"
            )
        stack = self._open.__dict__.setdefault("stack", [])
        stack.append(self)
        self.recomputing = recomputing
        try:
            yield
        finally:
            stack.pop()

    @classmethod
    def innermost(cls) -> _EagerRegion:
        stack = cls._open.__dict__.get("stack")
        if not stack:
            raise RuntimeError("revnets.checkpoint: a compiled region ran outside its checkpoint")
        return stack[-1]

    def run(self, module: Any, forward: Callable[..., Any], watched: bool, args: tuple,
            kwargs: dict) -> Any:
        if not self.recomputing:
            owner = module if isinstance(module, nn.Module) else _owner_of(module)
            if _initialising(owner):  # inside torch's checkpoint already: too late to store
                raise RuntimeError(
                    f"revnets.checkpoint: {type(owner).__name__} holds a lazy module that has "
                    f"not made its parameters yet, in a compiled checkpoint whose code breaks "
                    f"dynamo's graph. Its first call draws their initial values, which a "
                    f"recomputation would not draw again. Run one forward of the model first, "
                    f"with torch.no_grad()"
                )
            self.contexts = _Replay(owner, self.preserve_rng_state,
                                    _device(watched, args, kwargs), self.selective,
                                    given=(*args, *kwargs.values())).contexts()
        with self.contexts[self.recomputing]:
            return forward(*args, **kwargs)


class _EachTime(contextlib.AbstractContextManager):
    """A context manager made anew by ``make`` at each entry: torch's checkpoint enters its
    recomputation context once per backward through it."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.make = make
        self.entered: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> Any:
        self.entered.append(self.make())
        return self.entered[-1].__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self.entered.pop().__exit__(*exc)


@contextlib.contextmanager
def _nested(
    outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager
) -> Iterator[None]:
    with outer, inner:
        yield


# Options of earlier spellings, refused by name as keywords and as attributes: the value of
# ``memory`` that says the same.
_RENAMED = {"enabled": "revnets.Store() (for enabled=False)"}


class Checkpointed(nn.Module):
    """Wrap any module so that, in training with grad enabled, its forward stores only its inputs
    and its internals are recomputed in backward.

    Args:
        module: the module to wrap (its state_dict keys gain a ``module.`` prefix).
        memory: :class:`~revnets.Checkpoint` (the default) or :class:`~revnets.Store`, the off
            switch, which runs ``module`` as is.
        preserve_rng_state: replay RNG (dropout masks) in the recomputation.

    Gradients, outputs and module state (BatchNorm running statistics and every other buffer)
    equal those of the unwrapped module.
    """

    def __init__(
        self,
        module: nn.Module,
        memory: Checkpoint | Store = Checkpoint(),
        preserve_rng_state: bool = True,
        **renamed: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Checkpointed wraps an nn.Module, got {type(module).__name__}: wrap the "
                f"function in an nn.Module, or call revnets.checkpoint(self.method, *args) in "
                f"the forward of the module it is a method of"
            )
        if renamed:
            name = next(iter(renamed))
            hint = f": use memory={_RENAMED[name]}" if name in _RENAMED else ""
            raise TypeError(f"Checkpointed got an unexpected keyword argument {name!r}{hint}")
        self.module = module
        self.memory = memory
        self.preserve_rng_state = preserve_rng_state

    @property
    def memory(self) -> Checkpoint | Store:
        return self._memory

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _RENAMED:
            raise AttributeError(
                f"Checkpointed has no option {name!r}: set checkpointed.memory = {_RENAMED[name]}"
            )
        super().__setattr__(name, value)

    @memory.setter
    def memory(self, memory: Checkpoint | Store) -> None:
        if not isinstance(memory, (Checkpoint, Store)):
            raise TypeError(
                "Checkpointed: memory must be revnets.Checkpoint() or revnets.Store(), got "
                f"{memory!r}"
            )
        self._memory = memory

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (
            isinstance(self.memory, Checkpoint) and self.training and torch.is_grad_enabled()
        ):
            return self.module(*args, **kwargs)
        # Every keyword is the module's (selective, preserve_rng_state too).
        return checkpoint_forward(self.module, self.module, args, kwargs,
                                  self.preserve_rng_state, self.memory.selective)

    def extra_repr(self) -> str:
        return f"memory={self.memory}"


def segment_bounds(n: int, segments: int | None = None) -> list[tuple[int, int]]:
    """(start, stop) of ``segments`` near-equal runs covering ``range(n)``; default about
    sqrt(n)."""
    if segments is None:
        segments = max(1, round(math.sqrt(n)))
    if not 1 <= segments <= max(n, 1):
        raise ValueError(f"segments must be between 1 and {n}, got {segments}")
    bounds = [round(i * n / segments) for i in range(segments + 1)]
    return list(zip(bounds, bounds[1:]))


def run_checkpointed_segments(
    layers: Sequence[nn.Module], x: Any, segments: int | None = None,
    checkpoint_last: bool = False, selective: bool = False,
) -> Any:
    """Run ``layers`` in order, checkpointing each of about sqrt(n) segments but the last.

    The last segment is not checkpointed by default: if nothing follows it, backward would
    recompute it at once, saving nothing. Where more layers follow (a stage of a network), pass
    ``checkpoint_last=True``: otherwise its activations stay stored through their backward.
    """
    bounds = segment_bounds(len(layers), segments)
    for i, (start, stop) in enumerate(bounds):
        segment = nn.Sequential(*layers[start:stop])  # a view on the layers, not registered
        stored = i == len(bounds) - 1 and not checkpoint_last
        x = segment(x) if stored else checkpoint(segment, x, selective=selective)
    return x


def checkpoint_segments(
    sequential: nn.Sequential, segments: int | Sequence[tuple[int, int]] | None = None
) -> nn.Sequential:
    """Split a sequential model into segments and checkpoint each, Chen et al.'s sqrt(n) plan.

    With ``n`` layers and ``segments`` about ``sqrt(n)`` (the default), training stores one
    activation per segment boundary plus one segment's internals at a time: O(sqrt n) memory for
    one extra forward pass. ``segments`` may also list the (start, stop) bounds of a plan. The
    last segment is not checkpointed: backward would recompute it at once, saving nothing.

    Returns a new ``nn.Sequential`` of ``Checkpointed(nn.Sequential(...))`` segments sharing the
    original layers (so parameters are the same objects).
    """
    if not isinstance(sequential, nn.Sequential):
        raise TypeError(f"checkpoint_segments: takes an nn.Sequential, got "
                        f"{type(sequential).__name__}; checkpoint a single module with "
                        f"revnets.Checkpointed")
    layers = list(sequential)
    if not layers:
        return nn.Sequential()
    if segments is None or (isinstance(segments, int) and not isinstance(segments, bool)):
        bounds = segment_bounds(len(layers), segments)
    else:
        bounds = list(segments) if isinstance(segments, (list, tuple)) else []
        if not bounds or any(not isinstance(b, (list, tuple)) or len(b) != 2 for b in bounds) or \
                [b[0] for b in bounds[1:]] != [b[1] for b in bounds[:-1]] or (
                bounds[0][0], bounds[-1][1]) != (0, len(layers)):
            raise ValueError(
                f"checkpoint_segments: segments is a number of segments or a list of (start, "
                f"stop) bounds covering 0..{len(layers)} in order, got {segments!r}"
            )
    for a, b in bounds[1:-1]:
        if getattr(layers[a], "inplace", False):
            raise ValueError(
                f"checkpoint_segments: the checkpointed segment {a}..{b} starts with an in-place "
                f"layer ({type(layers[a]).__name__}), which would overwrite the input its "
                "checkpoint keeps; move the cut"
            )
    parts = [nn.Sequential(*layers[a:b]) for a, b in bounds]
    return nn.Sequential(*(Checkpointed(part) for part in parts[:-1]), parts[-1])
