"""Layers shared by the model zoo."""

from revnets.layers.units import (
    PoolPadShortcut,
    ResidualUnit,
    RevNetDownsampleUnit,
    preact_basic,
    preact_bottleneck,
    shortcut,
)

__all__ = [
    "PoolPadShortcut",
    "ResidualUnit",
    "RevNetDownsampleUnit",
    "preact_basic",
    "preact_bottleneck",
    "shortcut",
]
