"""Modules named for messages: by their registered names, or by the path they are held
through where a module holds them unregistered."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from revnets.replay.state import _own_attributes

__all__ = ["module_names"]


def module_names(modules: Sequence[nn.Module]) -> dict[int, str]:
    """Each module under ``modules`` by identity, for messages: its dotted name and a dot; one
    held unregistered by the path it is held through (``blocks.0.helpers[0].lin.``), after
    every registered one."""
    names: dict[int, str] = {}
    pending = [(root, "") for root in modules]
    for root, prefix in pending:  # grows: the modules held unregistered come last
        for name, m in root.named_modules():
            if id(m) in names:
                continue
            names[id(m)] = path = f"{prefix}{name}." if name else prefix
            pending += [(held, f"{where}.") for key in _own_attributes(tuple(vars(m)))
                        for where, held in _held_in(vars(m)[key], path + key, _HELD_DEPTH)
                        if id(held) not in names]
    return names


_HELD_DEPTH = 4  # how deep in containers module_names looks for modules held unregistered


def _held_in(value: Any, path: str, depth: int) -> Iterator[tuple[str, nn.Module]]:
    if isinstance(value, nn.Module):
        yield path, value
    elif depth and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _held_in(v, f"{path}[{i}]", depth - 1)
    elif depth and isinstance(value, dict):
        for k, v in value.items():  # keys named where their repr is plain and cannot fail
            key = repr(k) if type(k) in (str, int) else f"<{type(k).__name__}>"
            yield from _held_in(v, f"{path}[{key}]", depth - 1)
