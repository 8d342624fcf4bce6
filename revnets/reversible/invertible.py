"""Invertible modules that are not couplings: they may sit in a :class:`~revnets.ReversibleSequence`
beside reversible blocks, and their activations are reconstructed too (i-RevNet, Jacobsen et al.
2018: invertible downsampling and injective padding make a network invertible end to end).

The protocol: subclass :class:`Invertible` and implement ``forward(x)`` and ``inverse(y)`` with
``inverse(forward(x)) == x`` (exactly, or up to round-off), with or without parameters. In a
reversible sequence the module sees the two halves merged into one tensor along the sequence's
split dimension; backward reconstructs its input with ``inverse`` and backpropagates through a
recomputation of ``forward``, so nothing of it is stored. Check a module of your own with
:func:`check_invertible`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from revnets.reversible.inverse_check import mark_inverse_checked

__all__ = ["InjectivePad", "Invertible", "SpaceToDepth", "check_invertible"]


class Invertible(nn.Module):
    """A module with an exact inverse: ``inverse(forward(x)) == x``.

    ``exact = True`` on a subclass says that this holds to the bit for values on the grid of an
    exact sequence (NOTE [ Exact reversibility ]), and that its outputs stay on the grid, within
    the range of its inputs: a permutation or zero padding. Only such modules may sit in a
    ``ReversibleSequence(exact=True)``.
    """

    exact: bool = False

    def inverse(self, y: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement inverse(y)")


class SpaceToDepth(Invertible):
    """i-RevNet's invertible downsampling (its ``psi``): every ``block_size`` x ``block_size``
    patch of pixels becomes channels, ``(N, C, H, W) -> (N, C b^2, H / b, W / b)``, nothing lost.

    Channels are ordered as in i-RevNet (TensorFlow's ``space_to_depth``):
    ``out[:, (i * b + j) * C + c, h, w] = x[:, c, h * b + i, w * b + j]``; torch's
    ``pixel_unshuffle`` orders them ``c * b * b + i * b + j``, the same up to a fixed permutation.
    """

    exact = True  # a permutation

    def __init__(self, block_size: int = 2, groups: int = 1) -> None:
        super().__init__()
        for name, value in (("block_size", block_size), ("groups", groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SpaceToDepth: {name} must be a positive int, got {value!r}")
        self.block_size = block_size
        self.groups = groups

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"SpaceToDepth: takes NCHW images, got an input of shape "
                             f"{tuple(x.shape)}")
        n, c, h, w = x.shape
        b, g = self.block_size, self.groups
        if h % b or w % b:
            raise ValueError(
                f"SpaceToDepth: an input of {h}x{w} pixels does not split into {b}x{b} blocks"
            )
        if c % g:
            raise ValueError(f"SpaceToDepth: {c} channels do not split into {g} groups")
        x = x.reshape(n, g, c // g, h // b, b, w // b, b)  # n, g, c, h', i, w', j
        return x.permute(0, 1, 4, 6, 2, 3, 5).reshape(n, b * b * c, h // b, w // b)

    def inverse(self, y: Tensor) -> Tensor:
        n, cb, h, w = y.shape
        b, g = self.block_size, self.groups
        c = cb // (b * b * g)
        y = y.reshape(n, g, b, b, c, h, w)  # n, g, i, j, c, h', w'
        return y.permute(0, 1, 4, 5, 2, 6, 3).reshape(n, g * c, h * b, w * b)

    def extra_repr(self) -> str:
        groups = f", groups={self.groups}" if self.groups > 1 else ""
        return f"block_size={self.block_size}{groups}"


class InjectivePad(Invertible):
    """i-RevNet's injective padding: ``channels`` zero channels appended along ``dim``; the
    inverse slices them off (injective, so invertible on its image)."""

    exact = True  # zeros appended, sliced off

    def __init__(self, channels: int, dim: int = 1) -> None:
        super().__init__()
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 0:
            raise ValueError(f"InjectivePad: channels must be a non-negative int, got "
                             f"{channels!r}")
        self.channels = channels
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        shape = list(x.shape)
        shape[self.dim] = self.channels
        return torch.cat((x, x.new_zeros(shape)), dim=self.dim)

    def inverse(self, y: Tensor) -> Tensor:
        return y.narrow(self.dim, 0, y.shape[self.dim] - self.channels)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, dim={self.dim}"


def check_invertible(module: Invertible, x: Tensor, tolerance: float = 1e-6) -> float:
    """The largest relative error of ``module.inverse(module(x))`` against ``x``; raises if it
    exceeds ``tolerance`` (the module is then not invertible, or badly conditioned)."""
    if not callable(getattr(module, "inverse", None)):
        raise TypeError(f"check_invertible: {type(module).__name__} has no inverse method; "
                        f"subclass revnets.Invertible and define inverse(y)")
    with torch.no_grad():
        error = ((module.inverse(module(x)) - x).abs().max() / x.abs().max().clamp_min(1e-30))
    if error > tolerance:
        raise ValueError(
            f"{type(module).__name__} is not invertible on this input: inverse(forward(x)) is "
            f"{error.item():.2e} off (relative), above {tolerance:.0e}"
        )

    mark_inverse_checked(module)  # NOTE [ A user's inverse is checked once ]
    return error.item()
