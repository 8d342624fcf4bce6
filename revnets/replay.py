"""Replaying a forward computation exactly during backward: RNG, autocast, BatchNorm statistics
and the weights themselves.

Both memory strategies in revnets (reconstruction in :mod:`revnets.reversible` and recomputation in
:mod:`revnets.checkpoint`) run user code a second time in backward. That second run must see the
same random numbers, the same autocast state and the same parameters as the first, and must not
touch running statistics a second time. Everything needed for that lives here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = [
    "AutocastState",
    "ForwardWeights",
    "RngState",
    "forked_rng",
    "frozen_running_stats",
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


class RngState:
    """CPU and accelerator generator states taken before a piece of user code runs.

    Cheap enough to take around every f and g: a transform that draws no random numbers leaves
    the generators untouched, and then nothing needs to be kept (see :meth:`unchanged`).
    """

    __slots__ = ("cpu", "devices", "device_states")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.cpu = torch.get_rng_state()
        if all(t.device.type in ("cpu", "meta") for t in tensors):
            self.devices, self.device_states = [], []  # the common case, without a pytree walk
        else:
            # torch.utils.checkpoint's helper: the generators of every device the tensors are on.
            self.devices, self.device_states = get_device_states(*tensors)

    def unchanged(self) -> bool:
        """True if nothing was drawn since capture, so this state need not be kept.

        Only the CPU generator is compared; accelerator states are a few bytes each and are
        always kept.
        """
        return not self.devices and torch.equal(self.cpu, torch.get_rng_state())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.devices:
            set_device_states(self.devices, self.device_states)


@contextlib.contextmanager
def forked_rng(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Run a replay without disturbing the caller's generators (they are restored on exit)."""
    state = RngState(tensors)
    try:
        yield
    finally:
        state.restore()


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
    frozen = [
        (m, m.momentum, m.num_batches_tracked.clone())
        for root in modules
        for m in root.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
    ]
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


class ForwardWeights:
    """The parameters and buffers a module's forward pass ran with.

    A recomputation in backward reads them from the module again. Anything that swaps them in only
    for the forward call, as ``torch.func.functional_call`` does, would make it differentiate other
    weights than the forward used: a wrong gradient with no error. :meth:`check` turns that into
    an error naming the tensor.
    """

    __slots__ = ("module", "tensors")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.tensors = state_tensors(module)

    def check(self, owner: str, remedy: str) -> None:
        """Raise if ``module`` no longer holds the very tensors it held at construction."""
        now = state_tensors(self.module)
        if len(now) == len(self.tensors) and all(a is b for a, b in zip(now, self.tensors)):
            return
        names = state_tensors(self.module, names=True)
        changed = next(
            (
                f"{name} is not the tensor the forward pass used"
                for name, a, b in zip(names, now, self.tensors)
                if a is not b
            ),
            "its parameters and buffers are not those the forward pass used",
        )
        raise RuntimeError(
            f"{owner}: {changed}, so recomputing in "
            "backward would differentiate other weights than the forward used. Something "
            "swapped the module's parameters or buffers between forward and backward "
            "(torch.func.functional_call and other stateless calls swap them for the forward "
            f"call only). {remedy}"
        )


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
