"""Layers shared by the model zoo."""

from revnets.layers.irevnet import (
    AtFinerResolution,
    IRevNetBlock,
    irevnet_bottleneck,
    irevnet_stage,
)
from revnets.layers.units import (
    PoolPadShortcut,
    ResidualUnit,
    RevNetDownsampleUnit,
    preact_basic,
    preact_bottleneck,
    shortcut,
)

__all__ = [
    "AtFinerResolution",
    "IRevNetBlock",
    "irevnet_bottleneck",
    "irevnet_stage",
    "PoolPadShortcut",
    "ResidualUnit",
    "RevNetDownsampleUnit",
    "preact_basic",
    "preact_bottleneck",
    "shortcut",
]
