"""What a reversible sequence's forward pass leaves for its backward: the tape, one step per block,
and the small types the steps share.

# NOTE [ Layout ]
# Random draws and kernel choices follow a tensor's memory layout (dropout's mask is filled in
# memory order; a channels_last convolution rounds differently), so a recomputation must see its
# input with exactly the sizes and strides the forward gave it.
#
# 1. In the forward, every transform runs on a dense half of the engine's own, in the sequence's
#    memory format: the halves of the caller's input (strided views) and of an invertible module's
#    output are copied once before the first coupling that reads them.
# 2. Each step records the layout of f's input and of g's input (:class:`Layout`).
# 3. In backward a step first makes the two halves it reconstructs from its own, in those layouts
#    (:meth:`Carry.own`): a half the engine did not make in this backward (the sequence's output,
#    a kept input), or one in another layout, is copied. The backward then reconstructs in place
#    and writes only into halves of its own. The sequence's output is never written: a caller who
#    holds it, a view of it or its storage sees it intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from revnets.facts.tensors import storage_key
from revnets.replay import AutocastState

__all__ = ["Carry", "Context", "Layout", "Tape", "dense", "memory_format"]


@dataclass(frozen=True)
class Layout:
    """The sizes and strides a tensor had in the forward pass."""

    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: Tensor) -> Layout:
        return cls(t.shape, t.stride())

    def holds(self, t: Tensor) -> bool:
        return t.shape == self.shape and t.stride() == self.stride

    def copy(self, t: Tensor) -> Tensor:
        """``t``'s values in this layout, in new memory."""
        out = torch.empty_strided(self.shape, self.stride, dtype=t.dtype, device=t.device)
        return out.copy_(t)


def memory_format(x: Tensor) -> torch.memory_format:
    """The format the sequence keeps its halves in: the input's, where it is channels-last."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last
    ):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last_3d
    ):
        return torch.channels_last_3d
    return torch.contiguous_format


def dense(t: Tensor, mine: bool, fmt: torch.memory_format) -> Tensor:
    """``t`` if the engine may write into it and it is dense in ``fmt``, else a copy that is
    (NOTE [ Layout ], rule 1)."""
    if mine and t._base is None and t.is_contiguous(memory_format=fmt):
        return t
    return t.clone(memory_format=fmt)


@dataclass
class Carry:
    """What one block's backward step hands the next one down: the block's output halves, to
    reconstruct its input from, and their gradients. ``mine``: whether each half was made by this
    backward (NOTE [ Layout ], rule 3)."""

    y1: Tensor | None
    y2: Tensor | None
    dy1: Tensor | None
    dy2: Tensor | None
    mine: tuple[bool, bool] = (False, False)

    def own(self, layout1: Layout, layout2: Layout | None) -> tuple[Tensor, Tensor | None]:
        """Take the two halves, each the engine's own and in the given layout (the inputs of g
        and f in the forward pass); the second is dropped where ``layout2`` is None."""
        shared = _same_storage(self.y1, self.y2)
        halves: list[Tensor | None] = []
        for half, layout, mine in zip((self.y1, self.y2), (layout1, layout2), self.mine):
            if layout is None:
                halves.append(None)
            elif mine and not shared and layout.holds(half):
                halves.append(half)
            else:
                # Two halves of one tensor share a version counter: writing one would show in a
                # graph built on the other. A half the backward did not make is not its to write.
                halves.append(layout.copy(half))
        self.y1 = self.y2 = None
        return halves[0], halves[1]

    def take_gradients(self) -> tuple[Tensor | None, Tensor | None]:
        dy1, dy2, self.dy1, self.dy2 = self.dy1, self.dy2, None, None
        return dy1, dy2


def _same_storage(a: Tensor | None, b: Tensor | None) -> bool:
    key = None if a is None or b is None else storage_key(a)  # also on meta
    return key is not None and key == storage_key(b)


class Context:
    """The context arguments of one forward, with the leaves that backward differentiates."""

    __slots__ = ("values", "leaves")

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = tuple(values)
        self.leaves = [v.detach().requires_grad_() for v in values if _requires_grad(v)]

    def args(self) -> tuple[Any, ...]:
        """The context as f and g receive it in a recomputation: grad-requiring tensors
        replaced by their leaves."""
        leaves = iter(self.leaves)
        return tuple(next(leaves) if _requires_grad(v) else v for v in self.values)

    def gradients(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Gradients by context argument (None for those that need none) from gradients by
        leaf."""
        by_leaf = iter(grads)
        return [next(by_leaf) if _requires_grad(v) else None for v in self.values]


def _requires_grad(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


@dataclass
class Tape:
    """Everything one forward of a sequence leaves for its backward."""

    steps: list[Any] = field(default_factory=list)  # a BlockStep per block (steps/)
    autocast: AutocastState | None = None
    memory_format: torch.memory_format = torch.contiguous_format
    report: Any = None  # a ReconstructionReport, while revnets.check_reconstruction is on
    true_inputs: list[tuple[Tensor, Tensor]] | None = None
    used: bool = False  # backward ran: a second one is refused
