"""The attributes of revnets' own module classes that no run changes, which a census of module
state and a trace's snapshot leave out."""

from __future__ import annotations

from torch import nn

__all__ = ["InstalledForward", "structure_of", "structure_unchanged_by_runs"]

# NOTE [ What runs never change ]
# A class of revnets' own registered with ``@structure_unchanged_by_runs`` names in ``structure``
# attributes no run changes (a traced step's names, lookups and caches): no census scans or puts
# them back, no trace snapshots them (a planned chain holds tens of thousands).
_STRUCTURES: dict[type, frozenset[str]] = {}


def structure_unchanged_by_runs(cls: type) -> type:
    """Class decorator (NOTE [ What runs never change ])."""
    _STRUCTURES[cls] = frozenset(cls.structure)
    return cls


def structure_of(module: nn.Module) -> frozenset[str]:
    """The attributes no run of ``module`` changes (NOTE [ What runs never change ])."""
    return _STRUCTURES.get(type(module), frozenset())


class InstalledForward:
    """Base of the forwards a plan sets over a module's own for its steps (a plan of modules:
    planning/modules/install.py). The plan sets and removes them, whichever thread runs a step,
    so no census scans them or puts them back (NOTE [ What runs never change ]): a replay that
    put one back would leave it on the module after the plan removed it."""
