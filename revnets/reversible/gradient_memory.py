"""Which gradients the reversible backward may write into: the in-place reuse policy.

# NOTE [ Gradient memory ]
# The sequence's backward adds every block's gradient into the gradient it was given and hands
# that on as its input's gradient, instead of allocating new ones per block, when and only when
# nobody else can see that memory:
#
# 1. The incoming gradient is written only if nothing else holds it: no other Python reference
#    (a tensor hook that kept it, a caller that passed its own), no other tensor on its storage
#    (a view, another branch autograd passed it to), no Python object of its storage
#    (``untyped_storage()`` kept by someone), no base, contiguous. Python's reference counts
#    differ between interpreters: they are measured at first use (:func:`calibration`), for a
#    held and an unheld gradient, and reuse is off where the two do not differ.
# 2. A gradient handed to autograd (a parameter's, the context's) is never written afterwards,
#    nor any memory it shares (storage identity decides; on meta, data_ptr() is always 0).
# 3. The two halves of the incoming gradient are disjoint, whatever their strides.
# 4. ``ReversibleSequence(..., reuse_memory=False)`` turns all of this off.
#
# The activations' side needs no such rule: the backward writes only into halves it made itself
# (NOTE [ Layout ] in revnets/reversible/tape.py).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

import revnets.facts as facts

__all__ = ["GradientMemory", "calibration", "unshared"]


class GradientMemory:
    """The gradients one backward of a sequence may add into (NOTE [ Gradient memory ])."""

    def __init__(self, incoming: Tensor, halves: Sequence[Tensor], unshared: bool) -> None:
        self.incoming = facts.storage_key(incoming)
        self.halves = {_region(h) for h in halves} if unshared else set()
        self.handed: set[int] = set() if unshared else {self.incoming}
        self.handed_halves: set[tuple] = set()

    def hand_out(self, grad: Tensor) -> None:
        """``grad`` goes to autograd: neither it nor what shares its memory is written again."""
        storage = facts.storage_key(grad)
        if storage == self.incoming and _region(grad) in self.halves:
            self.handed_halves.add(_region(grad))
        else:
            self.handed.add(storage)

    def all_ours(self) -> bool:
        """Whether no gradient handed out shares the incoming gradient's memory (which can then
        be handed on whole, without one .grad becoming a view of another)."""
        return not self.handed_halves and self.incoming not in self.handed

    def add(self, a: Tensor, b: Tensor | None, *live: Tensor | None) -> Tensor:
        """``a + b``, written into ``a`` or ``b`` where no other gradient shares its memory.
        ``a`` comes first: it may be a half of the incoming gradient, which stays alive anyway,
        while a fresh ``b`` is then freed."""
        if b is None:
            return a
        if (
            a.shape == b.shape
            and torch.result_type(a, b) == a.dtype
            and self._disjoint_elements(a)
            and self._writable(a, b, *live)
        ):
            return a.add_(b)
        if b._base is None and b.dtype == a.dtype and self._writable(b, a, *live):
            return b.add_(a)
        return a + b

    def _overlap(self, a: Tensor, b: Tensor) -> bool:
        return (facts.storage_key(a) == facts.storage_key(b)
                and self._regions_overlap(_region(a), _region(b)))

    def _regions_overlap(self, a: tuple, b: tuple) -> bool:
        return a == b or not {a, b} <= self.halves

    def _writable(self, a: Tensor, *others: Tensor | None) -> bool:
        storage = facts.storage_key(a)
        if storage in self.handed:
            return False
        if storage == self.incoming:
            region = _region(a)
            if any(self._regions_overlap(region, h) for h in self.handed_halves):
                return False
        return all(o is None or not self._overlap(a, o) for o in others)

    def _disjoint_elements(self, a: Tensor) -> bool:
        # A half of the incoming gradient is a strided view that the overlap test gives up on.
        if facts.storage_key(a) == self.incoming and _region(a) in self.halves:
            return True
        return a._base is None and torch._debug_has_internal_overlap(a) == 0


def unshared(grad: Tensor, references: int, enabled: bool = True) -> bool:
    """Whether the gradient handed to the sequence's backward is held by nothing else (NOTE
    [ Gradient memory ], rule 1). ``references``: its Python reference count on entering
    backward."""
    if not enabled or torch.compiler.is_dynamo_compiling():
        return False
    if grad._base is not None or not grad.is_contiguous():
        return False
    probe = calibration()
    if probe is None:
        return False
    gradient_refs, storage_refs, storage_uses = probe
    return (
        references <= gradient_refs
        and grad._use_count() == 1
        and facts.storage_uses(grad) == storage_uses
        and sys.getrefcount(grad.untyped_storage()) <= storage_refs
    )


@functools.cache
def calibration() -> tuple[int, int, int] | None:
    """What an unshared gradient looks like on this interpreter and torch: its Python reference
    count on entering a Function's backward, its storage object's reference count and its
    storage's use count, each measured beside a held one; None (no reuse) where held and unheld
    do not differ. Measured once, at the first reversible forward, out of sight of dispatch and
    function modes (a memory tracker must not see the probe)."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        with torch.inference_mode(False), torch.enable_grad():
            unheld, held = _gradient_references(hold=False), _gradient_references(hold=True)
            fresh = torch.empty(1)
            storage_unheld = sys.getrefcount(fresh.untyped_storage())
            storage_uses = facts.storage_uses(fresh)
            kept = fresh.untyped_storage()  # noqa: F841  (held while measured)
            storage_held = sys.getrefcount(fresh.untyped_storage())
    if held <= unheld or storage_held <= storage_unheld:
        return None
    return unheld, storage_unheld, storage_uses


def _gradient_references(hold: bool) -> int:
    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor) -> Tensor:
            return x * 2

        @staticmethod
        def backward(ctx, grad: Tensor):
            references = sys.getrefcount(grad)  # first, as in the engine's backward
            ctx.references = references
            return grad * 2

    x = torch.zeros(2, requires_grad=True)
    y = Probe.apply(x)
    node = y.grad_fn
    kept: list[Tensor] = []
    if hold:
        y.register_hook(kept.append)
    (y * x).sum().backward()
    return node.references


def _region(tensor: Tensor) -> tuple:
    return (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
