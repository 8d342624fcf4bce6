"""i-RevNet's blocks (Jacobsen et al. 2018) as the public code builds them, and how a stage of them
runs in a :class:`~revnets.ReversibleSequence` at the cost of one extra forward.

An i-RevNet block maps the two streams ``(x1, x2)`` to ``(psi(x2), psi(x1) + F(x2))``: one
transform F, whose first convolution carries the stride, the downsampling ``psi`` (space to depth)
on both streams when the stride is 2, and the streams swapped. Two consecutive blocks are exactly
one RevNet coupling: ``(a, b) -> (b, a + F1(b)) -> (a + F1(b), b + F2(a + F1(b)))`` is
``y1 = a + f(b), y2 = b + g(y1)`` with ``f = F1, g = F2``. So a stage is built as couplings of
pairs of blocks, which the engine reverses with one recomputation of each transform; a stage with
an odd number of blocks runs its first block as an :class:`IRevNetBlock`, whose backward computes
F twice (once to invert, once to differentiate).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from revnets.reversible import ReversibleBlock
from revnets.reversible.invertible import Invertible, SpaceToDepth

__all__ = ["AtFinerResolution", "IRevNetBlock", "irevnet_bottleneck", "irevnet_stage"]


def irevnet_bottleneck(
    in_ch: int,
    out_ch: int,
    stride: int = 1,
    preactivate: bool = True,
    drop_rate: float = 0.0,
    mult: int = 4,
) -> nn.Sequential:
    """i-RevNet's F: [BN-ReLU] conv3x3(stride) BN-ReLU conv3x3 [Dropout] BN-ReLU conv3x3, with
    ``out_ch // mult`` channels inside and no biases."""
    mid = out_ch // mult
    layers: list[nn.Module] = []
    if preactivate:
        layers += [nn.BatchNorm2d(in_ch), nn.ReLU(inplace=True)]
    layers += [
        nn.Conv2d(in_ch, mid, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(mid),
        nn.ReLU(inplace=True),
        nn.Conv2d(mid, mid, 3, padding=1, bias=False),
    ]
    if drop_rate:
        layers.append(nn.Dropout(drop_rate))
    layers += [
        nn.BatchNorm2d(mid),
        nn.ReLU(inplace=True),
        nn.Conv2d(mid, out_ch, 3, padding=1, bias=False),
    ]
    return nn.Sequential(*layers)


class IRevNetBlock(Invertible):
    """One i-RevNet block on the merged streams: ``(x1, x2) -> (psi(x2), psi(x1) + F(x2))``.

    ``psi`` is :class:`~revnets.SpaceToDepth` with block size ``stride`` (nothing at stride 1);
    ``transform`` is F, with the same stride in its first convolution.
    """

    def __init__(self, transform: nn.Module, stride: int = 1) -> None:
        super().__init__()
        self.transform = transform
        self.psi = SpaceToDepth(stride)

    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=1)
        return torch.cat((self.psi(x2), self.psi(x1) + self.transform(x2)), dim=1)

    def inverse(self, y: Tensor) -> Tensor:
        x2_down, y1 = y.chunk(2, dim=1)
        x2 = self.psi.inverse(x2_down)
        return torch.cat((self.psi.inverse(y1 - self.transform(x2)), x2), dim=1)


class AtFinerResolution(nn.Module):
    """``transform(psi^-1(x))``: a strided block's F, in a coupling that runs after ``psi``."""

    def __init__(self, transform: nn.Module, block_size: int) -> None:
        super().__init__()
        self.transform = transform
        self.psi = SpaceToDepth(block_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.transform(self.psi.inverse(x))


def irevnet_stage(transforms: Sequence[nn.Module], stride: int) -> list[nn.Module]:
    """The blocks of a reversible sequence equal to i-RevNet blocks with these transforms (the
    first with ``stride``), run in order: couplings of pairs, after ``psi`` on both streams."""
    transforms = list(transforms)
    blocks: list[nn.Module] = []
    if len(transforms) % 2:
        blocks.append(IRevNetBlock(transforms.pop(0), stride))
    elif stride > 1:
        blocks.append(SpaceToDepth(stride, groups=2))
        transforms[0] = AtFinerResolution(transforms[0], stride)
    blocks += [ReversibleBlock(f, g) for f, g in zip(transforms[::2], transforms[1::2])]
    return blocks
