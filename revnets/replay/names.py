"""Modules named for messages: by their registered names, or by the path they are held
through where a module holds them unregistered (NOTE [ What a module holds ])."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from revnets.replay.held import reached
from revnets.replay.state import own_attributes

__all__ = ["module_names"]


def module_names(modules: Sequence[nn.Module]) -> dict[int, str]:
    """Each module under ``modules`` by identity, for messages: its dotted name and a dot; one
    held unregistered by the path it is held through (``blocks.0.helpers[0].lin.``,
    ``blocks.0.cfg.helper.``), after every registered one."""
    names: dict[int, str] = {}
    seen: set[int] = set()
    pending = [(root, "") for root in modules]
    for root, prefix in pending:  # grows: the modules held unregistered come last
        for name, m in root.named_modules():
            if id(m) in names:
                continue
            names[id(m)] = path = f"{prefix}{name}." if name else prefix
            pending += [(held, f"{where}.") for key in own_attributes(tuple(vars(m)))
                        for where, held in reached(vars(m)[key], seen, path + key)
                        if isinstance(held, nn.Module) and id(held) not in names]
    return names
