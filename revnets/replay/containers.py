"""Python lists, dicts, sets and deques that modules hold, put back for a replay as the run found
them, whoever changed them in place since (NOTE [ Replay ], rule 2): a history a forward appends
to, a cache it fills, a dict of counters, a skip list a decoder empties."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["ContainerCopy", "as_found"]

MUTABLE = (list, dict, set, collections.deque)
NESTING = (*MUTABLE, tuple, frozenset)


class ContainerCopy:
    """A container's contents (one level deep: the elements themselves, not copies of them) at
    one moment, to compare with later and to put back in place, so that whoever else holds the
    container sees it change as well."""

    __slots__ = ("container", "contents")

    def __init__(self, container: Any) -> None:
        self.container = container
        self.contents: Any = dict(container) if isinstance(container, dict) else list(container)

    def same(self) -> bool:
        """Whether the container holds the same elements (by identity) as when copied."""
        now, then = self.container, self.contents
        if len(now) != len(then):
            return False
        if isinstance(now, dict):  # in order: code may read the first key (an LRU cache)
            return all(
                (k is j or k == j) and v is w for (k, v), (j, w) in zip(now.items(), then.items())
            )
        if isinstance(now, set):
            return now == set(then)
        return all(a is b for a, b in zip(now, then))

    def put_back(self) -> None:
        container = self.container
        if isinstance(container, list):
            container[:] = self.contents
        else:  # dict, set, deque
            container.clear()
            (container.extend if isinstance(container, collections.deque)
             else container.update)(self.contents)


@contextlib.contextmanager
def as_found(found: Sequence[ContainerCopy]) -> Iterator[None]:
    """The containers as the run found them for the time of a replay (those changed since, by
    the run or by code after it), then as they were before it, whatever the replay did to any
    of them (a list the run appended to and later code emptied is emptied again)."""
    now = [type(c)(c.container) for c in found]  # plain objects' attributes too (held.py)
    for c in found:
        if not c.same():
            c.put_back()
    try:
        yield
    finally:
        for c in now:
            if not c.same():
                c.put_back()
