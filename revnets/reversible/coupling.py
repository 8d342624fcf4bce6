"""Couplings: how a reversible block updates one half from a transform of the other half (pure
maths, no state)."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from revnets.replay.known import known_code
from revnets.reversible import grid

__all__ = [
    "KNOWN_COUPLINGS", "STOCK_COUPLINGS", "AdditiveCoupling", "AffineCoupling", "Coupling",
    "ExactAdditiveCoupling", "ExactScaledCoupling", "ScaledCoupling", "make_coupling",
]


class Coupling:
    """How a reversible block updates one half from a transform ``h`` of the other half.

    Write your own coupling by subclassing and implementing three methods:

    - ``combine(x, h) -> y``: differentiable in ``x`` and ``h``.
    - ``uncombine(y, h) -> x``: the inverse in ``x``, ``combine(uncombine(y, h), h) == y`` up to
      round-off. It runs under ``torch.no_grad``; keep it well-conditioned (never divide by ~0).
    - ``transform_shape(half_shape) -> shape``: the shape that f and g must return for an input
      half of ``half_shape`` (the default: the same shape).

    Couplings are stateless: learnable parts belong in f and g, whose parameters the reversible
    engine knows about.
    """

    #: The coupling is a plain sum ``y = x + h``: the engine may add into ``x`` in place, and
    #: drop paths scale ``h`` alone.
    is_additive: bool = False

    #: The coupling is ``y = x_factor * x + h`` (None: it is not): its Jacobian is
    #: ``x_factor`` in ``x`` and the identity in ``h``, so the engine's backward scales the
    #: gradient instead of running ``combine`` again with a graph, and writes into ``x``.
    x_factor: float | None = None

    #: Reconstruction is exact to the bit (NOTE [ Exact reversibility ]): only such couplings may
    #: sit in a ``ReversibleSequence(exact=True)``.
    exact: bool = False

    #: ``uncombine`` needs, beyond ``y`` and ``h``, what ``lost(x)`` returns for the ``x`` that
    #: ``combine`` is given (the bits an exact scaling drops: NOTE [ Exact reversibility ],
    #: rule 7); the engine keeps it from the forward to the backward and reconstructs with
    #: ``uncombine_kept``.
    keeps_lost: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A class that writes its own combine or uncombine is trusted to be additive, scaled or
        # in place only where it says so itself: what it inherits described its base's maths.
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if "combine" in own or "uncombine" in own:
            for name, plain in (("is_additive", False), ("x_factor", None),
                                ("combine_", Coupling.combine_),
                                ("uncombine_", Coupling.uncombine_)):
                if name not in own:
                    setattr(cls, name, plain)

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        raise NotImplementedError

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        raise NotImplementedError

    def lost(self, x: Tensor) -> Tensor:
        """What ``uncombine_kept`` needs of ``x`` (``keeps_lost`` couplings)."""
        raise NotImplementedError

    def uncombine_kept(self, y: Tensor, h: Tensor, lost: Tensor) -> Tensor:
        """``x`` from ``y``, ``h`` and ``lost(x)``, as a new tensor (``keeps_lost`` couplings)."""
        raise NotImplementedError

    def combine_(self, x: Tensor, h: Tensor) -> Tensor:
        """``combine`` written into ``x``, for memory the engine owns."""
        return x.copy_(self.combine(x, h))

    def uncombine_(self, y: Tensor, h: Tensor) -> Tensor:
        """``uncombine`` written into ``y``, for memory the engine owns."""
        return y.copy_(self.uncombine(y, h))

    def transform_shape(self, half_shape: torch.Size) -> torch.Size:
        return half_shape

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AdditiveCoupling(Coupling):
    """``y = x + h``, the RevNet coupling: volume preserving and exactly invertible in exact
    arithmetic."""

    is_additive = True
    x_factor = 1.0

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        return x + h

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        return y - h

    def combine_(self, x: Tensor, h: Tensor) -> Tensor:
        return x.add_(h)

    def uncombine_(self, y: Tensor, h: Tensor) -> Tensor:
        return y.sub_(h)


class ExactAdditiveCoupling(AdditiveCoupling):
    """``y = x + round(h)``, ``round`` to the grid of the stream (NOTE [ Exact reversibility ]):
    ``uncombine`` recovers ``x`` bit for bit. The rounding's gradient is the identity, so the
    coupling stays additive for the engine. ``ReversibleSequence(exact=True)`` puts its blocks'
    additive couplings in this form and its input on the grid; ``x`` must be float32 or
    float64."""

    exact = True
    is_additive = True
    x_factor = 1.0

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        y = x + grid.snap(h, x.dtype)
        grid.check_range(y, "a reversible block's output")
        return y

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        return y - grid.snap(h, y.dtype)

    def combine_(self, x: Tensor, h: Tensor) -> Tensor:
        return grid.add_(x, h)  # range-checked by the engine (GridWatch)

    def uncombine_(self, y: Tensor, h: Tensor) -> Tensor:
        return grid.sub_(y, h)


class AffineCoupling(Coupling):
    """``y = x * s + t`` where f (or g) returns ``h = (r, t)`` stacked along ``dim`` and
    ``s = exp(m * tanh(r / m))`` with ``m = max_log_scale``.

    The soft clamp keeps ``s`` within ``[exp(-m), exp(m)]``: the inverse ``(y - t) / s`` never
    divides by a number near zero, and round-off in reconstruction stays bounded per block.
    f and g must return twice as many channels (along ``dim``) as the half they read.
    """

    def __init__(self, dim: int = 1, max_log_scale: float = 2.0) -> None:
        if max_log_scale <= 0:
            raise ValueError(f"AffineCoupling: max_log_scale must be positive, got {max_log_scale}")
        self.dim = dim
        self.max_log_scale = max_log_scale

    def _scale_shift(self, h: Tensor) -> tuple[Tensor, Tensor]:
        raw, shift = h.chunk(2, dim=self.dim)
        m = self.max_log_scale
        return torch.exp(m * torch.tanh(raw / m)), shift

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        scale, shift = self._scale_shift(h)
        return x * scale + shift

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        scale, shift = self._scale_shift(h)
        return (y - shift) / scale

    def transform_shape(self, half_shape: torch.Size) -> torch.Size:
        shape = list(half_shape)
        shape[self.dim] *= 2
        return torch.Size(shape)

    def __repr__(self) -> str:
        return f"AffineCoupling(dim={self.dim}, max_log_scale={self.max_log_scale})"


class ScaledCoupling(Coupling):
    """``y = scale * x + h``, a fixed nonzero ``scale`` in [-1, 1]: the coupling of a pretrained
    stack made reversible (revnets/conversion/construction.py; a negative scale is a momentum),
    where a small scale keeps the pretrained function closer. ``uncombine`` divides by
    ``scale``, so round-off in reconstruction grows by ``1 / |scale|`` per block
    (``check_reconstruction`` reports it); ``scale=1`` is the additive coupling."""

    def __init__(self, scale: float) -> None:
        if isinstance(scale, torch.Tensor):
            raise TypeError(f"ScaledCoupling: scale must be a number, got a tensor ({scale!r}); "
                            f"give float(scale) (a coupling is stateless: a scale to train "
                            f"belongs in f or g)")
        # Any real number (numpy's too), kept as a Python float.
        if (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                or not (0 < abs(scale) <= 1)):
            raise ValueError(f"ScaledCoupling: scale must be a nonzero number in [-1, 1], got "
                             f"{scale!r}")
        self.scale = float(scale)

    @property
    def x_factor(self) -> float:  # type: ignore[override]
        return self.scale  # follows a scale set later

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        return x * self.scale + h

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        return (y - h) / self.scale

    def combine_(self, x: Tensor, h: Tensor) -> Tensor:
        return x.mul_(self.scale).add_(h)  # the same two roundings as ``combine``

    def uncombine_(self, y: Tensor, h: Tensor) -> Tensor:
        return y.sub_(h).div_(self.scale)

    def __repr__(self) -> str:
        return f"ScaledCoupling(scale={self.scale})"


class ExactScaledCoupling(ScaledCoupling):
    """``y = scale * x + round(h)`` on the grid of the stream, ``scale = +-2^-k`` (k = 1..8):
    ``scale * x`` rounded down to the grid, the k bits of each element that drops kept by the
    engine (one byte per element: ``lost``), so that ``uncombine_kept`` recovers ``x`` bit for
    bit (NOTE [ Exact reversibility ], rule 7). Gradients are straight-through (``scale`` in
    ``x``, the identity in ``h``). ``ReversibleSequence(exact=True)`` puts its scaled couplings
    in this form and its input on the grid."""

    exact = True
    keeps_lost = True
    x_factor = ScaledCoupling.x_factor  # straight-through: scale in x

    def __init__(self, scale: float) -> None:
        super().__init__(scale)
        if grid.exact_shift(self.scale) is None:
            raise ValueError(
                f"ExactScaledCoupling: scale must be +-2^-k with k in 0..8 (0.5, 0.25, -0.5, "
                f"...), got {scale!r}: another scale leaves the fixed-point grid")

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        scaled = x * self.scale
        down = grid.scale_down_(x.detach().clone(), self.scale)
        y = scaled + (down - scaled).detach() + grid.snap(h, x.dtype)  # value: down + round(h)
        grid.check_range(y, "a reversible block's output")
        return y

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        raise RuntimeError(
            f"{self!r}: inverting it needs the bits its forward dropped, which the reversible "
            f"engine keeps; block.inverse cannot reconstruct without them (run the block in a "
            f"ReversibleSequence, or use the additive coupling)")

    def combine_(self, x: Tensor, h: Tensor) -> Tensor:
        return grid.add_(grid.scale_down_(x, self.scale), h)  # range-checked by the engine

    def lost(self, x: Tensor) -> Tensor:
        return grid.lost_bits(x, self.scale)

    def uncombine_kept(self, y: Tensor, h: Tensor, lost: Tensor) -> Tensor:
        return grid.scale_up_(grid.sub_(y.clone(), h), lost, self.scale)

    def __repr__(self) -> str:
        return f"ExactScaledCoupling(scale={self.scale})"


# The couplings revnets defines: tested, drawing no random numbers.
STOCK_COUPLINGS = (AdditiveCoupling, ExactAdditiveCoupling, AffineCoupling, ScaledCoupling,
                   ExactScaledCoupling)

# Couplings whose code is revnets' own, running torch operators that draw nothing and write
# only into memory they made: a block using one is known where its f and g are
# (NOTE [ Known layers ]). The exact coupling's grid code reads values and is left to the watch.
KNOWN_COUPLINGS = frozenset(
    known_code(c) for c in (AdditiveCoupling, AffineCoupling, ScaledCoupling))


def make_coupling(coupling: str | Coupling, split_dim: int) -> Coupling:
    if isinstance(coupling, Coupling):
        return coupling
    if coupling == "additive":
        return AdditiveCoupling()
    if coupling == "affine":
        return AffineCoupling(dim=split_dim)
    raise ValueError(
        f"unknown coupling {coupling!r}: use 'additive', 'affine' or a revnets.Coupling instance"
    )
