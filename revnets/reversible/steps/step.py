"""What every step of a reversible sequence is and shares: the interface (:class:`BlockStep`:
``forward`` takes the block's input halves and returns its output halves, ``reverse`` turns a
:class:`~revnets.reversible.tape.Carry` from the block's output and its gradient into its input
and its gradient), what the engine knows of a block (:class:`BlockPlan`), and what the steps of
one forward (:class:`ForwardRun`) and of one backward (:class:`Backward`) share."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from revnets.replay import AutocastState, RecordingChain, has_forward_hooks, submodules
from revnets.reversible.block import ReversibleBlock
from revnets.reversible.gradient_memory import GradientMemory
from revnets.reversible.grid import GridWatch
from revnets.reversible.hooked import parameters_and_hooks, refuse_sharded, trainable
from revnets.reversible.invertible import Invertible
from revnets.reversible.tape import Carry, Context

__all__ = ["REMEDY", "Backward", "BlockPlan", "BlockStep", "ForwardRun", "Pairs"]

REMEDY = "Or run it with memory=revnets.Store() there (ordinary autograd)."

Pairs = list[tuple[nn.Parameter, Tensor]]


class BlockPlan:
    """What the engine needs to know of one block for one step, looked up once per step."""

    __slots__ = ("block", "f_params", "g_params", "params", "hooked", "block_hooked", "lazy")

    def __init__(self, block: ReversibleBlock | Invertible) -> None:
        self.block = block
        # Hooks see the activations of an ordinary forward: intact and, like under autograd,
        # carrying a graph (which leads to an error rather than to a silently missing gradient).
        # One walk over f and one over g find both their parameters and their hooks.
        if isinstance(block, Invertible):
            (f_slots, hooked, lazy), g_slots = parameters_and_hooks(block), []
            block_hooked = hooked
        else:
            f_slots, f_hooked, f_lazy = parameters_and_hooks(block.f)
            g_slots, g_hooked, g_lazy = parameters_and_hooks(block.g)
            lazy = f_lazy or g_lazy
            others = [m for m in block._modules.values() if m is not block.f and m is not block.g]
            block_hooked = has_forward_hooks(
                [block, *(m for other in others if other is not None for m in submodules(other))]
            )
            hooked = f_hooked or g_hooked or block_hooked
        if hooked:  # FSDP2 shards by hooks
            refuse_sharded(block)
        self.hooked = hooked
        self.block_hooked = block_hooked  # run by CouplingStep's hooked forward, not a stored one
        self.lazy = lazy
        self.f_params = trainable(f_slots)  # an Invertible's own parameters
        self.g_params = trainable(g_slots)
        self.params = list(dict.fromkeys((*self.f_params, *self.g_params)))


@dataclass
class Backward:
    """What the steps of one backward share: the context's leaves and their gradients so far, the
    gradient memory policy and the forward's autocast state."""

    context: Context
    context_grads: list[Tensor | None]
    memory: GradientMemory
    autocast: AutocastState

    def add_context_grads(self, grads: list[Tensor | None]) -> None:
        for k, grad in enumerate(grads):
            if grad is not None:
                total = self.context_grads[k]
                self.context_grads[k] = grad if total is None else total + grad


class BlockStep(abc.ABC):
    """One block on the tape."""

    def __init__(self, index: int, plan: BlockPlan) -> None:
        self.index = index
        self.plan = plan
        self.kept: tuple[Tensor, Tensor, int, int] | None = None

    @abc.abstractmethod
    def forward(
        self, x1: Tensor, x2: Tensor, mine: bool, context: Context, run: ForwardRun
    ) -> tuple[Tensor, Tensor, bool]:
        """The block's output halves, and whether the engine may write into them."""

    @abc.abstractmethod
    def reverse(self, carry: Carry, back: Backward, need_input_grad: bool) -> Pairs:
        """Turn ``carry`` from the block's output into its input; return the parameters'
        gradients."""

    def keep_input(self, x1: Tensor, x2: Tensor) -> None:
        """Keep the block's true input (``keep_input_every``), to start its backward from."""
        self.kept = (x1, x2, x1._version, x2._version)

    def kept_input(self) -> tuple[Tensor, Tensor] | None:
        if self.kept is None:
            return None
        x1, x2, version1, version2 = self.kept
        self.kept = None
        if (x1._version, x2._version) != (version1, version2):
            # Block 0's is the caller's input; ordinary autograd would refuse the same change.
            raise RuntimeError(
                f"ReversibleSequence: the input of block {self.index}, kept by keep_input_every, "
                "was modified in place after the forward pass; backward would start from the "
                "changed values. Clone the input before modifying it."
            )
        return x1, x2


@dataclass
class ForwardRun:
    """What every step of one forward shares."""

    device: torch.device
    preserve_rng: bool
    memory_format: torch.memory_format
    autocast: AutocastState
    grid: GridWatch | None = None  # the range check of an exact sequence (NOTE [ Exact ... ])
    # The backend that compiles f and g where they allow it, or None: eager (NOTE [ Compiled
    # transforms ]).
    compile_transforms: str | None = None
    # Python's and numpy's generator states between consecutive recordings; a step that runs
    # user code outside a recording cuts it.
    chain: RecordingChain = field(default_factory=RecordingChain)
