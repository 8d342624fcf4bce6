"""The reversible residual block: ``y1 = combine(x1, f(x2))``, ``y2 = combine(x2, g(y1))``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from revnets.replay.known import KnownWalk, known_composite
from revnets.reversible.coupling import KNOWN_COUPLINGS, Coupling, make_coupling

__all__ = ["ReversibleBlock", "split_halves"]


def split_halves(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"ReversibleBlock: split_dim={dim} does not exist for an input of shape "
            f"{tuple(x.shape)}"
        )
    if x.shape[dim] % 2:
        raise ValueError(
            f"ReversibleBlock: cannot split an input of shape {tuple(x.shape)} into two equal "
            f"halves along split_dim={dim} (size {x.shape[dim]} is odd)"
        )
    x1, x2 = x.chunk(2, dim=dim)
    return x1, x2


@known_composite()
class ReversibleBlock(nn.Module):
    """One reversible residual unit: ``y1 = combine(x1, f(x2))``, ``y2 = combine(x2, g(y1))``.

    Args:
        f: transform of the second half, added to the first. Must return the shape the coupling
            asks for (for ``"additive"``: the shape of its input) and must not modify its input.
        g: transform of the new first half, added to the second; same rules as f.
        coupling: ``"additive"`` (RevNet), ``"affine"`` or a :class:`Coupling` instance.
        split_dim: the dimension split into two equal halves (channels for NCHW images,
            the last dimension for transformer tokens).

    Calling the block runs it with ordinary autograd. Memory is saved by running blocks inside a
    :class:`ReversibleSequence`. ``block.inverse(y)`` reconstructs the input of ``block(y)``.

    Extra arguments are *context*, passed unchanged to every call of f and g after the half:
    ``block(x, t)`` computes ``f(x2, t)`` and ``g(y1, t)`` (a time or class embedding for FiLM,
    the encoder output for cross-attention). Tensors among them get exact gradients.
    """

    def __init__(
        self,
        f: nn.Module,
        g: nn.Module,
        coupling: str | Coupling = "additive",
        split_dim: int = 1,
    ) -> None:
        super().__init__()
        self.f = f
        self.g = g
        self.coupling = make_coupling(coupling, split_dim)
        self.split_dim = split_dim

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The two halves of ``x`` along ``split_dim`` (views, no copy)."""
        return split_halves(x, self.split_dim)

    def merge(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.cat((a, b), dim=self.split_dim)

    def forward(self, x: Tensor, *context: Any) -> Tensor:
        return self.merge(*self.forward_halves(*self.split(x), *context))

    def inverse(self, y: Tensor, *context: Any) -> Tensor:
        return self.merge(*self.inverse_halves(*self.split(y), *context))

    def forward_halves(self, x1: Tensor, x2: Tensor, *context: Any) -> tuple[Tensor, Tensor]:
        y1 = self.coupling.combine(x1, self.transform("f", x2, *context))
        y2 = self.coupling.combine(x2, self.transform("g", y1, *context))
        return y1, y2

    def inverse_halves(self, y1: Tensor, y2: Tensor, *context: Any) -> tuple[Tensor, Tensor]:
        x2 = self.coupling.uncombine(y2, self.transform("g", y1, *context))
        x1 = self.coupling.uncombine(y1, self.transform("f", x2, *context))
        return x1, x2

    def transform(
        self, name: str, half: Tensor, *context: Any,
        call: Callable[..., Tensor] | None = None,
    ) -> Tensor:
        """Run ``f`` or ``g`` (by ``name``) on a half, checking what reversibility relies on.
        ``call(fn, half, *context)``, where given, runs it instead of ``fn(half, *context)`` (a
        compiled function: NOTE [ Compiled transforms ])."""
        fn = self.f if name == "f" else self.g
        version = _version(half)
        try:
            h = fn(half, *context) if call is None else call(fn, half, *context)
        except (RuntimeError, NotImplementedError) as error:
            message = str(error)
            if half.is_leaf and half.requires_grad and "in-place operation" in message:
                raise self._modified_input_error(name, fn) from error
            if half.device.type == "cpu" and ("'Half'" in message or "Got Half" in message):
                raise TypeError(
                    f"ReversibleBlock.{name} ({type(fn).__name__}) uses an operation that has no "
                    "float16 kernel on CPU; use bfloat16 on CPU (torch.autocast('cpu', "
                    "dtype=torch.bfloat16)) or float32"
                ) from error
            raise
        if version is not None and half._version != version:
            raise self._modified_input_error(name, fn)
        if not isinstance(h, Tensor):
            raise TypeError(
                f"ReversibleBlock.{name} ({type(fn).__name__}) must return a single Tensor, "
                f"got {type(h).__name__}"
            )
        expected = self.coupling.transform_shape(half.shape)
        if h.shape != expected:
            raise ValueError(
                f"ReversibleBlock.{name} ({type(fn).__name__}) returned shape {tuple(h.shape)} for "
                f"an input half of shape {tuple(half.shape)}; {self.coupling!r} needs "
                f"{tuple(expected)}. A module that changes the shape (strided or "
                "channel-changing) is not invertible: keep it outside the reversible sequence "
                "(wrap it in revnets.Checkpointed to save its memory)"
            )
        return h

    def walk_known(self, walk: KnownWalk) -> bool:
        """Whether a call runs only known code (NOTE [ Known layers ]): f on a view of the
        input, then g on the coupling's fresh output."""
        coupling = self.coupling
        if type(coupling) not in KNOWN_COUPLINGS or any(map(callable, vars(coupling).values())):
            return False
        walk.kinds.add(type(coupling))
        if not walk.module(self.f):
            return False
        walk.fresh = True
        return walk.module(self.g)

    @staticmethod
    def _modified_input_error(name: str, fn: nn.Module) -> RuntimeError:
        return RuntimeError(
            f"ReversibleBlock.{name} ({type(fn).__name__}) modified its input in place; a "
            "reversible block needs its input intact to be inverted (look for inplace=True "
            "on the first layer of f or g, or an in-place op such as add_ on the input)"
        )

    def extra_repr(self) -> str:
        return f"coupling={self.coupling!r}, split_dim={self.split_dim}"


def _version(half: Tensor) -> int | None:
    """The version counter that catches f or g modifying its input in place (None: unchecked).

    Inference tensors keep no version counter. Under torch.compile neither ``is_inference()``
    nor a version compared after f ran traces (dynamo breaks the graph there, and every break
    inside a block recompiles the code after it for each block shape), so compiled code leaves
    the check out. It guards reconstruction, which compiled code never does: the reversible
    engine runs eagerly (``torch.compiler.disable``), its checks included; stored and
    checkpointed blocks are ordinary autograd. Only a compiled ``block.inverse`` goes unchecked.
    """
    if torch.compiler.is_compiling() or half.is_inference():
        return None
    return half._version
