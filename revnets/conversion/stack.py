"""A pretrained stack of layers run as one reversible stage, its layers where they were (NOTE
[ Reversible conversion ] in the package's face)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from revnets.plan import Reconstruct, Store
from revnets.reversible import ReversibleBlock, ReversibleSequence
from revnets.reversible.coupling import ScaledCoupling

__all__ = ["LayerUpdate", "ReversibleLayers", "Zero"]


class LayerUpdate(nn.Module):
    """``h(x) = layer(x, *arguments) - scale * x``: a pretrained layer as the transform of a
    coupling ``y = scale * x1 + h(x2)`` (rule 1). The layer's other arguments come as the
    context (the call's pytree spec first, then its leaves), so tensors among them get their
    gradients from the engine."""

    def __init__(self, layer: nn.Module, scale: float) -> None:
        super().__init__()
        self.layer = layer
        self.scale = scale

    def forward(self, x: Tensor, spec: Any = None, *leaves: Any) -> Tensor:
        args, kwargs = ((), {}) if spec is None else tree_unflatten(list(leaves), spec)
        out = self.layer(x, *args, **kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"make_reversible: {type(self.layer).__name__} returns {type(out).__name__}, "
                f"not the hidden state alone; a converted layer maps a tensor to a tensor of its "
                f"shape (transformers 5's decoder layers and timm's blocks do)")
        if out.shape != x.shape:
            raise ValueError(
                f"make_reversible: {type(self.layer).__name__} maps shape {tuple(x.shape)} to "
                f"{tuple(out.shape)}; a converted layer keeps its input's shape, so convert only "
                f"layers that keep it (a ResNet stage's blocks after its first: name them)")
        return out - x if self.scale == 1 else out - self.scale * x

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class Zero(nn.Module):
    """The update of the missing second layer of a stack with an odd number of layers."""

    def forward(self, x: Tensor, *context: Any) -> Tensor:
        return torch.zeros_like(x)


class ReversibleLayers(nn.ModuleList):
    """The layers of a pretrained stack, under their own names, run as one reversible stage
    (NOTE [ Reversible conversion ]): called (``blocks(x)``) or iterated by the model's own loop
    (``for layer in self.layers: hidden = layer(hidden, ...)``), its layers compute the
    converted function with activation memory flat in their number. Its state_dict is the
    stack's, key for key."""

    planning_unit = True  # auto_checkpoint keeps the stage whole: it is reversible already

    def __init__(self, layers: list[nn.Module], scale: float = 1.0, dim: int = -1,
                 memory: Reconstruct | Store = Reconstruct(), exact: bool = False) -> None:
        super().__init__(layers)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise ValueError(f"make_reversible: scale must be a number in (0, 1], got {scale!r}")
        if exact and scale != 1:
            raise ValueError(
                f"make_reversible: exact=True needs scale=1 (the additive coupling); scale="
                f"{scale} multiplies a stream by it, which leaves the fixed-point grid, and its "
                f"inverse divides by it (NOTE [ Reversible conversion ], rule 4)")
        self.scale, self.dim, self.exact = float(scale), dim, exact
        # Unregistered (rule 3): the blocks hold the layers, which are this module's children.
        self._stages: dict[tuple[int, ...], tuple[ReversibleSequence]] = {}
        self._memory = memory
        self._output: weakref.ref | None = None  # the last stage's output (rule 3)
        self.sequence(0, len(self))  # refuses a bad option now, not in the first step

    @property
    def memory(self) -> Reconstruct | Store:
        """``Reconstruct()`` (the reversible engine) or ``Store()`` (the same blocks with ordinary
        autograd: the reference, and the baseline of its memory)."""
        return self._memory

    @memory.setter
    def memory(self, decision: Reconstruct | Store) -> None:
        self._memory = decision
        for (stage,) in self._stages.values():
            stage.set_memory(decision)

    def sequence(self, start: int, stop: int) -> ReversibleSequence:
        """The reversible sequence of layers ``start:stop``: layers ``2k`` and ``2k + 1`` of it
        are f and g of block k (rule 1)."""
        layers = list(self._modules.values())[start:stop]
        key = (start, stop, *map(id, layers))  # a layer replaced or added since: built anew
        if key not in self._stages:
            updates = [LayerUpdate(layer, self.scale) for layer in layers]
            if len(updates) % 2:
                updates.append(Zero())
            coupling = "additive" if self.scale == 1 else ScaledCoupling(self.scale)
            blocks = [ReversibleBlock(updates[i], updates[i + 1], coupling, split_dim=self.dim)
                      for i in range(0, len(updates), 2)]
            stage = ReversibleSequence(blocks, Store() if isinstance(self._memory, Store)
                                       else self._memory, exact=self.exact)
            self._stages[key] = (stage,)
        return self._stages[key][0]

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self.run(0, len(self), x, args, kwargs)

    def run(self, start: int, stop: int, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
        """Layers ``start:stop`` on ``x`` as one stage, each given ``args`` and ``kwargs``."""
        stage = self.sequence(start, stop)
        if stage.training != self.training:
            stage.train(self.training)
        reversing = (isinstance(stage.memory, Reconstruct) and self.training
                     and torch.is_grad_enabled())
        if reversing:  # rule 5: a cache is filled by calls that run once
            args, kwargs = _without_caches(args), _without_caches(kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        context = (spec, *leaves) if leaves or args or kwargs else ()
        both = torch.cat((x, x), dim=self.dim)
        y1, y2 = stage.split(stage(both, *context))
        out = y2 if (stop - start) % 2 == 0 else y1
        self._output = weakref.ref(out)
        return out

    # -- the model's own loop (rule 3) ----------------------------------------------------------
    def __iter__(self) -> Iterator[nn.Module]:
        return iter(_Layer(self, i, 0, len(self)) for i in range(len(self)))

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("a converted stack runs its layers in order: no step")
            return _Slice(self, start, stop)
        position = range(len(self))[index]
        return _Layer(self, position, 0, len(self))

    def layer(self, index: int) -> nn.Module:
        """The pretrained layer ``index`` itself (indexing gives the stand-in the loop calls)."""
        return list(self._modules.values())[index]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_output"] = None  # a weak reference does not pickle (torch.save of the model)
        return state

    __repr__ = nn.Module.__repr__  # of the layers, not what iterating gives

    def extra_repr(self) -> str:
        return (f"scale={self.scale}, dim={self.dim}, memory={self._memory}"
                + (", exact=True" if self.exact else ""))


class _Slice:
    """``layers[a:b]``, which the model's loop iterates (Llama's ``self.layers[:n]``)."""

    def __init__(self, owner: ReversibleLayers, start: int, stop: int) -> None:
        self.owner, self.start, self.stop = owner, start, stop

    def __iter__(self) -> Iterator[_Layer]:
        return iter(_Layer(self.owner, i, self.start, self.stop)
                    for i in range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> _Layer:
        return _Layer(self.owner, range(self.start, self.stop)[index], self.start, self.stop)


class _Layer:
    """Layer ``index`` of a converted stack as the model's loop meets it (rule 3): the first of
    a run calls the whole run as one stage; each other one hands back the stage's output. Its
    attributes are the layer's (``layers[0].self_attn``)."""

    def __init__(self, owner: ReversibleLayers, index: int, start: int, stop: int) -> None:
        self.__dict__.update(owner=owner, index=index, start=start, stop=stop)

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        owner = self.owner
        if self.index == self.start:
            return owner.run(self.start, self.stop, x, args, kwargs)
        last = None if owner._output is None else owner._output()
        if x is not last:
            raise RuntimeError(
                f"make_reversible: layer {self.index} of a converted stack was called on a "
                f"tensor other than the stage's output. The stack runs layers {self.start}.."
                f"{self.stop - 1} as one reversible stage in the call of layer {self.start}, "
                f"so the others only pass its output on: code that changes the hidden state "
                f"between layers, or calls one layer alone, needs the stack unconverted "
                f"(use stack.layer({self.index}) for the pretrained layer itself)")
        return x

    def __getattr__(self, name: str) -> Any:
        return getattr(self.owner.layer(self.index), name)

    def __repr__(self) -> str:
        kind = type(self.owner.layer(self.index)).__name__
        return f"<layer {self.index} of a converted stack: {kind}>"


def _without_caches(tree: Any) -> Any:
    """``tree`` with every Hugging Face cache replaced by None (rule 5)."""
    transformers = sys.modules.get("transformers")
    cache = getattr(transformers, "Cache", None) if transformers is not None else None
    if cache is None:
        return tree
    leaves, spec = tree_flatten(tree, is_leaf=lambda leaf: isinstance(leaf, cache))
    return tree_unflatten([None if isinstance(leaf, cache) else leaf for leaf in leaves], spec)
