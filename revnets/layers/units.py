"""Pre-activation residual units (He et al. 2016, v2) as the official RevNet code builds them.

Convolutions have no bias. A unit's transform starts with BatchNorm-ReLU, except the very first
unit of a network, which follows the stem's own BatchNorm-ReLU. Shortcuts that change the shape are
average pooling plus zero channel padding for basic units (no parameters) and a strided 1x1
projection (no BatchNorm) for bottleneck units.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "PoolPadShortcut",
    "ResidualUnit",
    "RevNetDownsampleUnit",
    "preact_basic",
    "preact_bottleneck",
    "shortcut",
]


def _bn_relu(channels: int) -> list[nn.Module]:
    return [nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]


def preact_basic(
    in_ch: int, out_ch: int, stride: int = 1, preactivate: bool = True
) -> nn.Sequential:
    """[BN-ReLU] conv3x3(stride) BN-ReLU conv3x3."""
    layers = _bn_relu(in_ch) if preactivate else []
    layers += [
        nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False),
        *_bn_relu(out_ch),
        nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False),
    ]
    return nn.Sequential(*layers)


def preact_bottleneck(
    in_ch: int, out_ch: int, stride: int = 1, preactivate: bool = True
) -> nn.Sequential:
    """[BN-ReLU] conv1x1(stride) BN-ReLU conv3x3 BN-ReLU conv1x1, with out_ch / 4 inside."""
    mid = out_ch // 4
    layers = _bn_relu(in_ch) if preactivate else []
    layers += [
        nn.Conv2d(in_ch, mid, 1, stride=stride, bias=False),
        *_bn_relu(mid),
        nn.Conv2d(mid, mid, 3, padding=1, bias=False),
        *_bn_relu(mid),
        nn.Conv2d(mid, out_ch, 1, bias=False),
    ]
    return nn.Sequential(*layers)


class PoolPadShortcut(nn.Module):
    """Average pooling by ``stride`` and zero padding of the channels, split evenly on both
    sides. An odd size pools its last row and column alone (``ceil_mode``), to the size the
    strided convolution beside it makes: even sizes pool as before."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        if (out_ch - in_ch) % 2 or out_ch < in_ch:
            raise ValueError(f"PoolPadShortcut: cannot pad {in_ch} channels to {out_ch}")
        self.pad = (out_ch - in_ch) // 2
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        if self.stride > 1:
            x = F.avg_pool2d(x, self.stride, self.stride, ceil_mode=True,
                             count_include_pad=False)
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, self.pad, self.pad))
        return x

    def extra_repr(self) -> str:
        return f"pad={self.pad}, stride={self.stride}"


def shortcut(in_ch: int, out_ch: int, stride: int, bottleneck: bool) -> nn.Module:
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    if bottleneck:
        return nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)
    return PoolPadShortcut(in_ch, out_ch, stride)


class ResidualUnit(nn.Module):
    """``transform(x) + shortcut(x)``: one unit of a pre-activation ResNet."""

    planning_unit = True  # auto_checkpoint cuts between units, not inside them

    def __init__(self, transform: nn.Module, shortcut: nn.Module) -> None:
        super().__init__()
        self.transform = transform
        self.shortcut = shortcut

    def forward(self, x: Tensor) -> Tensor:
        return self.transform(x) + self.shortcut(x)


class RevNetDownsampleUnit(nn.Module):
    """The first unit of a RevNet stage, where the shape changes, so it cannot be inverted:

        y1 = f(x2) + shortcut1(x1),    y2 = g(y1) + shortcut2(x2)

    Its input is stored (or checkpointed) like any ordinary layer's.
    """

    def __init__(
        self, f: nn.Module, g: nn.Module, shortcut1: nn.Module, shortcut2: nn.Module
    ) -> None:
        super().__init__()
        self.f = f
        self.g = g
        self.shortcut1 = shortcut1
        self.shortcut2 = shortcut2

    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=1)
        y1 = self.f(x2) + self.shortcut1(x1)
        y2 = self.g(y1) + self.shortcut2(x2)
        return torch.cat((y1, y2), dim=1)
