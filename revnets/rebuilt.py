"""A list or tuple rebuilt with other elements, its type kept, for the walks over arguments and
outputs that replace tensors in place (fakes, meta tensors, real ones, graph values)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["rebuilt"]

S = TypeVar("S", list, tuple)


def rebuilt(value: S, items: Iterable[Any]) -> S:
    """``items`` in a container of ``value``'s type. A namedtuple's constructor takes its fields
    one by one, as torch's pytree rebuilds it (``type(value)(items)`` raised a TypeError there);
    lists, tuples, their subclasses and torch's return types take one iterable."""
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return type(value)(*items)
    return type(value)(items)
