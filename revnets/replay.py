"""Replaying a forward computation exactly during backward: random numbers, autocast, module state
(parameters and every buffer) and hooks.

Both memory strategies in revnets (reconstruction in :mod:`revnets.reversible` and recomputation in
:mod:`revnets.checkpoint`) run user code a second time in backward. That second run must draw the
same random numbers, run under the same autocast state, read the same parameters and buffers as the
first, must not update any buffer a second time, and must not fire observers a second time.
Everything needed for that lives here.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "AutocastState",
    "ModuleState",
    "RandomDraws",
    "RngState",
    "forked_rng",
    "frozen_running_stats",
    "is_recomputing",
    "recomputing",
    "silenced_tensor_hooks",
    "state_tensors",
]


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings in force when a forward ran, to be re-entered for its replay."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        if not torch.amp.is_autocast_available(device_type):  # e.g. the meta device
            return cls(device_type, False, torch.float32, False)
        return cls(
            device_type=device_type,
            enabled=torch.is_autocast_enabled(device_type),
            dtype=torch.get_autocast_dtype(device_type),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )

    def __call__(self) -> contextlib.AbstractContextManager:
        if not torch.amp.is_autocast_available(self.device_type):
            return contextlib.nullcontext()
        if not self.enabled:
            if not torch.is_autocast_enabled(self.device_type):
                return contextlib.nullcontext()
            # Replay must also switch autocast *off* if backward happens to run inside one.
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(
            self.device_type, dtype=self.dtype, enabled=True, cache_enabled=self.cache_enabled
        )


# -- random numbers --------------------------------------------------------------------------------


def _accelerator(device: torch.device) -> Any | None:
    """The torch device module (``torch.cuda``, ``torch.xpu``, ...) whose generator ``device``
    draws from, or None for the CPU and meta devices."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device.type)


def _device_rng(accelerator: Any, device: torch.device) -> Tensor:
    try:
        return accelerator.get_rng_state(device)
    except TypeError:  # a device module with one generator (mps) takes no device
        return accelerator.get_rng_state()


def module_generators(modules: Iterable[nn.Module]) -> list[torch.Generator]:
    """The ``torch.Generator`` objects held as attributes of ``modules`` (and their submodules),
    which user code may draw from instead of the default generators."""
    found: dict[int, torch.Generator] = {}
    for root in modules:
        for m in root.modules():
            for value in vars(m).values():
                if isinstance(value, torch.Generator):
                    found[id(value)] = value
    return list(found.values())


class RngState:
    """Every generator a piece of user code may draw from, as it was at one moment: the CPU
    generator, the accelerator's generator of ``device``, Python's ``random`` module, and the
    explicit ``torch.Generator`` objects passed in (those that modules keep as attributes).

    ``torch.random.fork_rng`` inside user code draws from the state it finds and puts it back:
    restoring that state replays it too. A generator reached any other way (a global, a closure)
    cannot be seen, and is not replayed.
    """

    __slots__ = ("cpu", "device", "device_state", "python", "generators", "generator_states")

    def __init__(self, device: torch.device, generators: Sequence[torch.Generator] = ()) -> None:
        self.cpu = torch.get_rng_state()
        accelerator = _accelerator(device)
        self.device = device
        self.device_state = _device_rng(accelerator, device) if accelerator is not None else None
        self.python = random.getstate()
        self.generators = generators
        self.generator_states = [g.get_state() for g in generators]

    def same_as(self, other: RngState) -> bool:
        """True if no generator moved between ``other`` and this state."""
        return (
            torch.equal(self.cpu, other.cpu)
            and (self.device_state is None or torch.equal(self.device_state, other.device_state))
            and self.python == other.python
            and all(
                torch.equal(a, b) for a, b in zip(self.generator_states, other.generator_states)
            )
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device_state is not None:
            accelerator = _accelerator(self.device)
            try:
                accelerator.set_rng_state(self.device_state, self.device)
            except TypeError:  # a device module with one generator (mps) takes no device
                accelerator.set_rng_state(self.device_state)
        random.setstate(self.python)
        for generator, state in zip(self.generators, self.generator_states):
            generator.set_state(state)


class _SeededOps(TorchDispatchMode):
    """Notes whether any operator that draws random numbers ran (on the meta device nothing is
    drawn, so the generators cannot tell)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
        return func(*args, **(kwargs or {}))


class RandomDraws:
    """Watches one run of user code: :meth:`finish` returns the state the generators had before it
    if it drew random numbers (the state to restore for an exact replay), else None, so that code
    which draws nothing costs nothing to keep.

    On the meta device, where nothing is drawn, the operators are watched instead and a
    placeholder of the CPU state's size stands in for the state, so that a prediction of memory
    on the meta device counts what a CPU run keeps.
    """

    __slots__ = ("before", "watcher")

    def __init__(self, device: torch.device, generators: Sequence[torch.Generator] = ()) -> None:
        self.before = RngState(device, generators)
        self.watcher = None
        if device.type == "meta":
            self.watcher = _SeededOps()
            self.watcher.__enter__()

    def finish(self) -> RngState | Tensor | None:
        if self.watcher is not None:
            self.watcher.__exit__(None, None, None)
            if not self.watcher.seen:
                return None
            return torch.empty(self.before.cpu.numel(), dtype=torch.uint8, device="meta")
        after = RngState(self.before.device, self.before.generators)
        # Compared out of sight of any dispatch mode (a memory tracker), so that only a state
        # that is kept is seen; it is shown to the tracker once (detach is a dispatched
        # operator), as the placeholder is on the meta device.
        hidden = (
            contextlib.nullcontext()
            if torch.compiler.is_compiling()  # Dynamo traces through; it has no memory tracker
            else torch._C._DisableTorchDispatch()
        )
        with hidden:
            if after.same_as(self.before):
                return None
        self.before.cpu = self.before.cpu.detach()
        return self.before


@contextlib.contextmanager
def forked_rng(device: torch.device, generators: Sequence[torch.Generator] = ()) -> Iterator[None]:
    """Run a replay without disturbing the caller's generators (they are restored on exit)."""
    state = RngState(device, generators)
    try:
        yield
    finally:
        state.restore()


# -- module state ----------------------------------------------------------------------------------


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


def _tracked_norms(modules: Iterable[nn.Module]) -> list[nn.modules.batchnorm._NormBase]:
    return [
        m
        for root in modules
        for m in root.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
    ]


@contextlib.contextmanager
def frozen_running_stats(modules: nn.Module | Sequence[nn.Module]) -> Iterator[None]:
    """Within this context, BatchNorm layers in training mode normalise with batch statistics as
    usual but leave ``running_mean``, ``running_var`` and ``num_batches_tracked`` as they were.

    The forward pass already updated them once; a recomputation must not update them again.
    Layers in eval mode are untouched (they use the running statistics, which is what the forward
    pass used too).
    """
    if isinstance(modules, nn.Module):
        modules = [modules]
    frozen = [(m, m.momentum, m.num_batches_tracked.clone()) for m in _tracked_norms(modules)]
    for m, _, _ in frozen:
        # Momentum 0 blends in nothing of the batch: running = running * 1 + batch * 0, exactly.
        # Everything else stays as in the original forward, down to which tensors autograd saves
        # (torch.utils.checkpoint checks that the recomputation saves the same ones).
        m.momentum = 0.0
    try:
        yield
    finally:
        with torch.no_grad():
            for m, momentum, count in frozen:
                m.momentum = momentum
                m.num_batches_tracked.copy_(count)


class ModuleState:
    """The parameters and buffers one forward pass of ``module`` ran with, for replaying it.

    Create it just before the forward and call :meth:`forward_done` just after. The replay
    (:meth:`replayed`) then reads what the forward read:

    - buffers the forward modified (spectral norm's power iteration, an exponential moving
      average, running statistics kept by hand) are replaced, for the replay, by copies of the
      values the forward found, so that the replay computes the same and the update the forward
      made is kept, once;
    - BatchNorm's running statistics (in training mode, where the output does not depend on them)
      are left alone by the replay, which costs no copy;
    - anything else the forward read, parameters included, must be what it was at the end of the
      forward: a tensor modified in place or swapped for another in between (an optimizer step,
      ``torch.func.functional_call``) is refused by name, as ordinary autograd refuses a saved
      tensor that was modified.

    Before the forward, every buffer but BatchNorm's running statistics is copied (usually none);
    the copies of those the forward modified are kept until the replay.
    """

    __slots__ = ("module", "norms", "pre", "tensors", "versions", "changed")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.norms = _tracked_norms([module])
        skip = {id(b) for m in self.norms for b in m._buffers.values()}
        self.pre = [
            (m, key, b, b.clone(), b._version)
            for m in module.modules()
            for key, b in m._buffers.items()
            if b is not None and id(b) not in skip
        ]
        self.tensors: list[Any] = []
        self.versions: list[int | None] = []
        self.changed: list[tuple[nn.Module, str, Tensor]] = []

    def forward_done(self) -> None:
        # Kernels that update running statistics (F.batch_norm) leave the version counter alone.
        self.changed = [
            (m, key, value)
            for m, key, b, value, version in self.pre
            if b._version != version or not torch.equal(b, value)
        ]
        self.pre = []
        changed = {id(m._buffers[key]) for m, key, _ in self.changed}
        norm_buffers = {id(b) for m in self.norms for b in m._buffers.values()}
        self.tensors = state_tensors(self.module)
        self.versions = [
            None if t is None or id(t) in changed or id(t) in norm_buffers else _version(t)
            for t in self.tensors
        ]

    def check(self, owner: str, remedy: str, prefix: str = "") -> None:
        """Raise if a tensor the forward read was swapped or modified in place since; ``prefix``
        is the module's dotted name, for the message."""
        now = state_tensors(self.module)
        same = len(now) == len(self.tensors) and all(a is b for a, b in zip(now, self.tensors))
        if same and all(
            v is None or _version(t) == v for t, v in zip(self.tensors, self.versions)
        ):
            return
        names = [prefix + name for name in state_tensors(self.module, names=True)]
        if not same:
            problem = next(
                (
                    f"{name} is not the tensor the forward pass used"
                    for name, a, b in zip(names, now, self.tensors)
                    if a is not b
                ),
                "its parameters and buffers are not those the forward pass used",
            )
            raise RuntimeError(
                f"{owner}: {problem}, so recomputing in backward would differentiate other "
                "weights than the forward used. Something swapped the module's parameters or "
                "buffers between forward and backward (torch.func.functional_call and other "
                f"stateless calls swap them for the forward call only). {remedy}"
            )
        name = next(
            n for n, t, v in zip(names, self.tensors, self.versions)
            if v is not None and _version(t) != v
        )
        raise RuntimeError(
            f"{owner}: {name} was modified in place between the forward pass and backward "
            "(an optimizer step, a manual update, a frozen weight or an eval-mode statistic "
            "changed by hand), so the recomputation would not see what the forward saw. "
            "Ordinary autograd refuses the same for the tensors it saves. Run backward before "
            "changing it, or change it out of place. " + remedy
        )

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        # The replay gets copies: its own update of them is dropped, and what its graph saves of
        # them is never modified afterwards.
        current = [(m, key, m._buffers[key]) for m, key, _ in self.changed]
        for m, key, value in self.changed:
            m._buffers[key] = value.clone()
        try:
            with frozen_running_stats(self.norms):
                yield
        finally:
            for m, key, buffer in current:
                m._buffers[key] = buffer


def _version(t: Tensor) -> int | None:
    # Inference tensors keep no version counter.
    return None if t.is_inference() else t._version


# -- hooks -----------------------------------------------------------------------------------------


class _Recomputing(threading.local):
    depth = 0  # a class default: every thread starts outside any replay


_RECOMPUTING = _Recomputing()


def is_recomputing() -> bool:
    """True while revnets runs user code a second time in backward (a reversible block's f and g,
    or a checkpointed module). Forward pre-hooks run in both passes (they may compute weights, as
    weight_norm, spectral_norm and pruning do); one that observes should return early here."""
    return _RECOMPUTING.depth > 0


@contextlib.contextmanager
def recomputing(modules: Sequence[nn.Module] = ()) -> Iterator[None]:
    """Mark a replay for :func:`is_recomputing`, with the forward hooks of ``modules`` (and the
    global ones) silenced: they fired in the forward pass, and ordinary autograd fires them once.
    """
    _RECOMPUTING.depth += 1
    silenced = [
        (m, m._forward_hooks) for root in modules for m in root.modules() if m._forward_hooks
    ]
    global_hooks = nn.modules.module._global_forward_hooks
    saved_global = dict(global_hooks)
    for m, _ in silenced:
        m._forward_hooks = type(m._forward_hooks)()
    global_hooks.clear()
    try:
        yield
    finally:
        global_hooks.update(saved_global)
        for m, hooks in silenced:
            m._forward_hooks = hooks
        _RECOMPUTING.depth -= 1


@contextlib.contextmanager
def silenced_tensor_hooks(tensors: Iterable[Tensor]) -> Iterator[None]:
    """Keep the ``register_hook`` hooks of leaf ``tensors`` from firing on the partial gradients
    that an internal ``torch.autograd.grad`` computes for them: they fire once, on the total that
    reaches the tensor through the autograd graph, as under ordinary autograd."""
    silenced = []
    for t in tensors:
        hooks = t._backward_hooks
        if hooks:
            silenced.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in silenced:
            hooks.update(saved)


def has_forward_hooks(modules: Iterable[nn.Module]) -> bool:
    """True if a forward hook or pre-hook is registered on any of ``modules`` (or globally)."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


@contextlib.contextmanager
def refusing_replaced_outputs(modules: Iterable[nn.Module], owner: str) -> Iterator[None]:
    """Within this context, a forward hook on any of ``modules`` that returns a replacement for
    the module's output raises: the replay runs without forward hooks (they fire once, in the
    forward pass), so it would compute something else than the forward did."""
    wrapped = []
    for m in modules:
        if not m._forward_hooks:
            continue
        hooks = m._forward_hooks
        replacement = type(hooks)()
        for key, hook in hooks.items():
            replacement[key] = _observer_only(hook, m, owner)
        m._forward_hooks = replacement
        wrapped.append((m, hooks))
    try:
        yield
    finally:
        for m, hooks in wrapped:
            m._forward_hooks = hooks


def _observer_only(hook: Any, module: nn.Module, owner: str) -> Any:
    def observe(*args: Any) -> Any:
        result = hook(*args)
        if result is not None and result is not args[-1]:
            raise RuntimeError(
                f"{owner}: a forward hook on {type(module).__name__} returned a replacement for "
                "its output. Forward hooks fire once, in the forward pass, and the recomputation "
                "in backward runs without them, so it would compute something else. Put what the "
                "hook computes into the module itself, or run with memory_efficient=False."
            )
        return result

    return observe
