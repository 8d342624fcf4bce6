"""Forward hooks in a replay: which fire, which are replayed (NOTE [ Replay ], rule 4)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from revnets.facts import version_of

__all__ = [
    "HookWatch",
    "ReplayedHook",
    "has_forward_hooks",
    "hooks_hidden_since",
    "hooked",
    "is_recomputing",
    "recomputing",
    "silenced_tensor_hooks",
]


@dataclass(frozen=True)
class ReplayedHook:
    """A forward hook that changed an output in the recorded run, with how it was registered."""

    module: nn.Module | None  # None: a global hook
    hook: Any
    with_kwargs: bool
    always_call: bool


def _flags(module: nn.Module | None) -> tuple[dict, dict]:
    """The with_kwargs and always_call registries of a module's forward hooks (or the global)."""
    if module is None:
        return (
            nn.modules.module._global_forward_hooks_with_kwargs,
            nn.modules.module._global_forward_hooks_always_called,
        )
    return module._forward_hooks_with_kwargs, module._forward_hooks_always_called


class HookWatch:
    """Wraps the forward hooks of a run's modules (and the global ones) to see which of them
    replaced an output or changed it in place (NOTE [ Replay ], rule 4)."""

    def __init__(
        self, hooked: Sequence[nn.Module], roots: Sequence[nn.Module], root_owner: str | None
    ) -> None:
        self.root_owner = root_owner  # None: the roots' own hooks may transform too
        self.roots = {id(m) for m in roots}
        self.transforming: list[ReplayedHook] = []
        self.wrapped: list[tuple[nn.Module | None, dict]] = []
        self.modules = list(hooked)  # the modules below the roots that have forward hooks

    def __enter__(self) -> HookWatch:
        for m in self.modules:
            self._wrap(m, m._forward_hooks)
        global_hooks = nn.modules.module._global_forward_hooks
        if global_hooks:
            self._wrap(None, global_hooks)
        return self

    def _wrap(self, module: nn.Module | None, hooks: dict) -> None:
        saved = dict(hooks)
        for key, hook in saved.items():
            hooks[key] = self._watching(module, key, hook)
        self.wrapped.append((module, saved))

    def _watching(self, module: nn.Module | None, key: Any, hook: Any) -> Any:
        def watched(*args: Any) -> Any:
            target, output = args[0], args[-1]
            tensors = [t for t in tree_leaves(output) if isinstance(t, Tensor)]
            versions = [version_of(t) for t in tensors]
            result = hook(*args)
            replaced = result is not None and result is not output
            edited = any(version_of(t) != v for t, v in zip(tensors, versions))
            if replaced or edited:
                if self.root_owner is not None and id(target) in self.roots:
                    raise RuntimeError(
                        f"{self.root_owner}: a forward hook on {type(target).__name__} "
                        f"{'replaced' if replaced else 'changed in place'} its output, so the "
                        "output is no longer what the module computes and cannot be inverted. "
                        "Register the hook on a module inside f or g (it is then replayed in "
                        "backward), or on the sequence."
                    )
                flags = _flags(module)
                self.transforming.append(
                    ReplayedHook(module, hook, key in flags[0], key in flags[1])
                )
            return result

        return watched

    def __exit__(self, *exc: Any) -> None:
        for module, saved in self.wrapped:
            hooks = module._forward_hooks if module is not None else (
                nn.modules.module._global_forward_hooks
            )
            for key in list(hooks):
                if key in saved:
                    hooks[key] = saved[key]


class _Recomputing(threading.local):
    depth = 0  # a class default: every thread starts outside any replay


_RECOMPUTING = _Recomputing()


def is_recomputing() -> bool:
    """True while revnets runs user code a second time in backward (a reversible block's f and g,
    or a checkpointed module). Forward pre-hooks run in both passes (they may compute weights, as
    weight_norm, spectral_norm and pruning do); one that observes should return early here."""
    return _RECOMPUTING.depth > 0


class recomputing:  # noqa: N801 (a context manager, named like contextlib's)
    """Mark a replay for :func:`is_recomputing`, with the forward hooks of ``modules`` and their
    submodules (``walked``: ``modules`` lists them all already) and the global ones silenced but
    those in ``replay_hooks``, which changed an output in the recorded run (NOTE [ Replay ], rule
    4). A class rather than a generator: it is entered for every replay of every transform."""

    __slots__ = ("modules", "replay_hooks", "walked", "silenced", "saved_global", "replayed")

    def __init__(
        self,
        modules: Sequence[nn.Module] = (),
        replay_hooks: Sequence[ReplayedHook] = (),
        walked: bool = False,
    ) -> None:
        self.modules, self.replay_hooks, self.walked = modules, replay_hooks, walked

    def __enter__(self) -> None:
        _RECOMPUTING.depth += 1
        modules = self.modules
        every = modules if self.walked else [m for root in modules for m in root.modules()]
        self.silenced = [(m, m._forward_hooks) for m in every if m._forward_hooks]
        global_hooks = nn.modules.module._global_forward_hooks
        self.saved_global = dict(global_hooks) if global_hooks else None
        for m, _ in self.silenced:
            m._forward_hooks = type(m._forward_hooks)()
        global_hooks.clear()
        self.replayed = []
        for k, replay in enumerate(self.replay_hooks):
            module = replay.module
            hooks = module._forward_hooks if module is not None else global_hooks
            key = ("revnets-replay", k)
            hooks[key] = replay.hook
            with_kwargs, always_called = _flags(module)
            if replay.with_kwargs:
                with_kwargs[key] = True
            if replay.always_call:
                always_called[key] = True
            self.replayed.append((key, hooks, with_kwargs, always_called))

    def __exit__(self, *exc: Any) -> None:
        for key, *tables in self.replayed:
            for table in tables:
                table.pop(key, None)
        global_hooks = nn.modules.module._global_forward_hooks
        global_hooks.clear()
        if self.saved_global:
            global_hooks.update(self.saved_global)
        for m, hooks in self.silenced:
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


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own (forward, pre-forward, backward) that run when it
    is called."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def has_forward_hooks(modules: Iterable[nn.Module]) -> bool:
    """True if a forward hook or pre-hook is registered on any of ``modules`` (or globally)."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


@contextlib.contextmanager
def hooks_hidden_since(serial: int, modules: Iterable[nn.Module]) -> Iterator[None]:
    """Without the forward pre-hooks, backward hooks and backward pre-hooks registered on
    ``modules`` or globally since ``RemovableHandle.next_id`` was ``serial`` (hook ids grow with
    every registration): a replay runs as the recorded run did, before they existed."""
    hidden = []
    if RemovableHandle.next_id != serial:
        module = nn.modules.module
        tables = [module._global_forward_pre_hooks, module._global_backward_hooks,
                  module._global_backward_pre_hooks]
        for m in modules:
            tables += [m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks]
        for table in tables:
            newer = [k for k in table if isinstance(k, int) and k >= serial]
            if newer:
                hidden.append((table, dict(table)))
                for k in newer:
                    del table[k]
    try:
        yield
    finally:
        for table, saved in hidden:
            table.clear()
            table.update(saved)
