"""Grid arithmetic: the two residual streams of an exact sequence stay on a fixed-point grid, so
that reconstruction is exact to the bit at any depth and in any autocast precision.

# NOTE [ Exact reversibility ]

In float arithmetic ``y = x + h`` rounds, so ``y - h`` is not ``x``; the error is carried into
every block below and grows fast in bfloat16 or float16. ``ReversibleSequence(exact=True)``
computes a slightly different function whose inverse is exact:

1. The streams (both halves) are kept in a *stream dtype* with enough mantissa: float64 for a
   float64 input, float32 otherwise (also under autocast, and for a bfloat16 or float16 input).
2. The sequence's input enters the grid once: it is cast to the stream dtype and rounded to the
   nearest multiple of ``2^-k`` (``k = FRACTION_BITS[stream dtype]``). This rounding is part of
   the function the network computes; its gradient is the identity (straight-through).
3. Every update ``h = f(x2)`` or ``g(y1)`` (computed in whatever precision autocast gives) is
   rounded to the grid the same way before it is added: ``y = x + round(h)``. Its gradient is
   the identity too, so backward is ordinary autograd's of the rounded function with the
   rounding's Jacobian taken as the identity; the reference is the same sequence with
   ``memory=Store()`` and ``exact=True``, which the reversible path equals.
4. Both operands of every addition are multiples of ``2^-k`` and, while the stream's magnitude
   stays below ``2^(p - k)`` (``p`` the stream dtype's mantissa bits, :func:`grid_range`), the
   float addition is exact, and so is the subtraction ``x = y - round(h)`` that reconstructs
   ``x``. Backward recomputes ``h`` bit for bit (the engine replays the forward's layout, RNG and
   autocast state, NOTE [ Replay ]), hence ``round(h)``, hence ``x``.
5. The range is checked, never assumed: a stream value at or beyond ``grid_range`` (or not
   finite) raises an error naming the block and the magnitude. The reversible path checks the
   blocks' outputs with one reduction each and a single device synchronisation per forward.
6. ``round(h * 2^k)`` is computed in the stream dtype, where scaling by a power of two and
   rounding to an integer lose nothing (in float16 ``h * 2^k`` would overflow), into one new
   tensor; the addition then scales it back by ``2^-k``, exactly. Nothing is stored: memory is
   that of the default reversible path, flat in depth.

7. A scaled coupling ``y = scale * x + h`` keeps the grid where ``scale = +-2^-k`` (k = 0..8,
   :func:`exact_shift`): with ``m = sign * x * 2^K`` (an integer), ``scale * x`` is
   ``(m / 2^k) * 2^-K`` and ``y = floor(m / 2^k) * 2^-K + round(h)``; the k low bits of ``m``
   that the floor drops (``m mod 2^k``, one byte per element, :func:`lost_bits`) are what its
   inverse needs beyond ``y`` and ``h``: the engine keeps them from the forward to the backward
   (``Coupling.keeps_lost``), so memory grows by a byte per element of a stream per scaled
   coupling, and reconstruction is exact to the bit. Gradients are straight-through:
   ``scale`` in ``x``, the identity in ``h``.

Additive couplings and those scaled couplings have this form (an affine coupling's scale does
not keep the grid); other couplings, and invertible modules that do not declare
``exact = True``, are refused by name.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "FRACTION_BITS", "GridWatch", "check_range", "enter_grid", "exact_shift", "grid_range",
    "lost_bits", "scale_down_", "scale_up_", "snap",
]

#: ``k``: the grid is the multiples of ``2^-k`` (float32: 6.1e-5, float64: 1.5e-11).
FRACTION_BITS = {torch.float32: 14, torch.float64: 36}
_MANTISSA_BITS = {torch.float32: 24, torch.float64: 53}


def stream_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the streams are kept in for an input of ``dtype`` (rule 1)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def grid_range(dtype: torch.dtype) -> float:
    """The magnitude below which additions on the grid are exact in ``dtype`` (rule 4)."""
    return 2.0 ** (_MANTISSA_BITS[dtype] - FRACTION_BITS[dtype])


def _check_stream(dtype: torch.dtype) -> None:
    if dtype not in FRACTION_BITS:
        raise TypeError(
            f"exact reversibility keeps the streams in float32 or float64, got a {dtype} stream; "
            "run the blocks inside ReversibleSequence(..., exact=True), which casts its input "
            "to the grid (NOTE [ Exact reversibility ])"
        )


def scaled(h: Tensor, dtype: torch.dtype) -> Tensor:
    """``round(h * 2^k)`` as a new tensor, exact (rule 6); times ``2^-k`` it is on the grid."""
    return h.to(dtype, copy=True).mul_(2.0 ** FRACTION_BITS[dtype]).round_()


def add_(x: Tensor, h: Tensor) -> Tensor:
    """``x += round(h)`` in place; exact when ``x`` is on the grid and in range."""
    _check_stream(x.dtype)
    return x.add_(scaled(h, x.dtype), alpha=2.0 ** -FRACTION_BITS[x.dtype])


def sub_(y: Tensor, h: Tensor) -> Tensor:
    """``y -= round(h)`` in place: the exact inverse of :func:`add_`."""
    _check_stream(y.dtype)
    return y.sub_(scaled(h, y.dtype), alpha=2.0 ** -FRACTION_BITS[y.dtype])


def exact_shift(scale: float) -> int | None:
    """k where ``scale = +-2^-k`` with k in 0..8 (rule 7), else None."""
    magnitude = abs(float(scale))
    if magnitude == 0:
        return None
    k = -math.log2(magnitude)
    return int(k) if k == int(k) and 0 <= k <= 8 else None


def _integers(x: Tensor, scale: float) -> Tensor:
    """``m = sign * x * 2^K`` as a new tensor: integers for ``x`` on the grid (rule 7)."""
    _check_stream(x.dtype)
    return x.mul(math.copysign(2.0 ** FRACTION_BITS[x.dtype], scale))


def lost_bits(x: Tensor, scale: float) -> Tensor:
    """The bits ``scale_down_`` drops of ``x``: ``m mod 2^k``, one byte per element (rule 7)."""
    m = _integers(x, scale)
    k = exact_shift(scale)
    low = m - torch.floor(m * 2.0 ** -k) * 2.0 ** k
    return low.to(torch.uint8)


def scale_down_(x: Tensor, scale: float) -> Tensor:
    """``x = floor(m / 2^k) * 2^-K`` in place: ``scale * x`` on the grid, rounded down
    (rule 7)."""
    _check_stream(x.dtype)
    big = 2.0 ** FRACTION_BITS[x.dtype]
    return x.mul_(math.copysign(big, scale) * 2.0 ** -exact_shift(scale)).floor_().mul_(
        1.0 / big)


def scale_up_(v: Tensor, lost: Tensor, scale: float) -> Tensor:
    """The inverse of :func:`scale_down_` given its :func:`lost_bits`, in place: ``x`` bit for
    bit (rule 7)."""
    _check_stream(v.dtype)
    big = 2.0 ** FRACTION_BITS[v.dtype]
    return v.mul_(big * 2.0 ** exact_shift(scale)).add_(lost).mul_(math.copysign(1.0 / big,
                                                                                scale))


class _Snap(torch.autograd.Function):
    """``round(h)`` on the grid of ``dtype``, in ``dtype``; straight-through gradient."""

    @staticmethod
    def forward(ctx, h: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.dtype = h.dtype
        return scaled(h, dtype).to(dtype).mul_(2.0 ** -FRACTION_BITS[dtype])

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.to(ctx.dtype), None


def snap(h: Tensor, dtype: torch.dtype) -> Tensor:
    """``h`` rounded to the grid of the stream dtype ``dtype`` (differentiable, rule 3)."""
    _check_stream(dtype)
    return _Snap.apply(h, dtype)


def enter_grid(x: Tensor) -> Tensor:
    """The sequence's input on the grid (rule 2), range-checked."""
    if not x.is_floating_point():
        raise TypeError(f"exact reversibility needs a floating-point input, got {x.dtype}")
    x = snap(x, stream_dtype(x.dtype))
    check_range(x, "the input of the sequence")
    return x


class GridEntry(torch.nn.Module):
    """:func:`enter_grid` as a module: what an exact sequence does first, for its blocks run as
    consecutive modules (:meth:`ReversibleSequence.plain_units`)."""

    def forward(self, x: Tensor) -> Tensor:
        return enter_grid(x)


def _peak(t: Tensor) -> Tensor:
    # aminmax is one vectorised pass; an infinity norm is many times slower on CPU. NaN stays NaN.
    low, high = torch.aminmax(t.detach())
    return torch.maximum(high, -low)


def _values_unknown(t: Tensor) -> bool:
    # predict_memory runs on fake tensors (and a real tensor a predicted closure holds meets
    # them under the fake mode), the meta device has no values: nothing to check.
    return (t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor)
            or torch._guards.detect_fake_mode() is not None)


def _range_error(peak: float, dtype: torch.dtype, where: str) -> OverflowError:
    limit, k = grid_range(dtype), FRACTION_BITS[dtype]
    return OverflowError(
        f"exact reversibility: {where} reached magnitude {peak:.4g}, beyond the grid's range "
        f"{limit:.0f} ({dtype} stream in steps of 2^-{k}), where additions stop being exact. "
        "Scale the input or the blocks' updates down (a normalisation or a smaller init of "
        "the last layer of f and g), feed the sequence float64 (a float64 stream, range "
        f"{grid_range(torch.float64):.0f}), or drop exact=True"
    )


@torch.compiler.disable  # reads a value: a graph break, not a compiled host sync
def check_range(t: Tensor, where: str) -> None:
    """Refuse a stream value beyond :func:`grid_range` (rule 5); synchronises once."""
    if _values_unknown(t) or t.numel() == 0:
        return
    peak = _peak(t).item()
    if not peak < grid_range(t.dtype):
        raise _range_error(peak, t.dtype, where)


class GridWatch:
    """The range check of one reversible forward: a reduction per block output as it comes, one
    synchronisation at the end (rule 5). It keeps the first block beyond the range and its
    magnitude as two scalars, whatever the depth, and computes them alike on fake tensors (a
    prediction allocates what a real run does) where there are no values to check."""

    def __init__(self) -> None:
        self.dtype: torch.dtype | None = None
        self._first: Tensor | None = None  # the first block beyond the range; -1 while none is
        self._first_peak: Tensor | None = None

    def watch(self, block: int, *halves: Tensor) -> None:
        for half in halves:
            if half.numel() == 0:
                continue
            self.dtype = half.dtype
            peak = _peak(half)
            beyond = ~(peak < grid_range(half.dtype))  # NaN is beyond
            if self._first is None:
                self._first, self._first_peak = torch.where(beyond, block, -1), peak
            else:
                new = beyond & (self._first < 0)
                self._first = torch.where(new, block, self._first)
                self._first_peak = torch.where(new, peak, self._first_peak)

    def check(self) -> None:
        first, peak, self._first, self._first_peak = self._first, self._first_peak, None, None
        if first is None or _values_unknown(first):
            return
        block, magnitude = torch.stack((first.double(), peak.double())).tolist()
        if block >= 0:
            raise _range_error(magnitude, self.dtype, f"the output of block {int(block)}")
