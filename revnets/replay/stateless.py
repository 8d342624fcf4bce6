"""Generators whose state cannot be taken: a run may hold them, not draw from them (NOTE
[ Generators without state ])."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["StatelessDraws", "has_state"]

# NOTE [ Generators without state ]
# A Python or numpy generator whose state cannot be taken (``random.SystemRandom``, which reads
# the operating system's entropy; a ``random.Random`` subclass whose ``getstate`` raises) cannot
# be replayed (NOTE [ Replay ], rule 1). A module may hold one: a run that never draws from it
# trains as ever, and one that draws from it is refused by the generator's name when the run
# ends. Its draws are seen without its state: for the run, the methods every draw of
# ``random.Random`` goes through (``random``, ``getrandbits``, ``randbytes``: ``randint``,
# ``choice``, ``shuffle``, ``gauss`` call them on ``self``) are shadowed on the instance, which
# Python looks in before its class. A numpy generator's draws run in C, past any such look-up:
# one without state is refused where the run can reach it.

_DRAWS = ("random", "getrandbits", "randbytes")
_ABSENT = object()


def has_state(generator: Any) -> bool:
    """Whether ``generator`` (a ``random.Random`` or revnets' view of a numpy one) gives its
    state."""
    try:
        generator.getstate()
    except Exception:  # NotImplementedError from SystemRandom; anything a subclass raises
        return False
    return True


class StatelessDraws:
    """Notes, for one run, which of the generators without state its modules hold it draws from
    (NOTE [ Generators without state ]). ``held``: (the module holding one, the path it is held
    through, the generator)."""

    def __init__(self, held: Sequence[tuple[nn.Module, str | None, Any]]) -> None:
        self.held = list(held)
        self.drawn: tuple[nn.Module, str | None, Any] | None = None
        self._shadowed: list[tuple[dict, str, Any]] = []

    def refuse_unseen(self, names: dict[int, str], prefix: str = "") -> None:
        """Refuse a numpy generator without state: its draws cannot be seen."""
        for entry in self.held:
            if not isinstance(entry[2], random.Random):
                raise RuntimeError(
                    f"{_name(entry, names, prefix)} is a numpy generator whose state cannot be "
                    "taken, and its draws run in C, where the replay cannot see them: the "
                    "recomputation in backward could not draw what the forward drew. Use "
                    "numpy.random.default_rng(seed) or a torch.Generator (both are replayed), "
                    "or draw outside the checkpointed or reversible part and pass the numbers in."
                )

    def __enter__(self) -> StatelessDraws:
        for entry in self.held:
            if not isinstance(entry[2], random.Random):
                continue
            own = vars(entry[2])
            for method in _DRAWS:
                self._shadowed.append((own, method, own.get(method, _ABSENT)))
                own[method] = self._noting(getattr(entry[2], method), entry)
        return self

    def __exit__(self, *exc: Any) -> None:
        for own, method, before in reversed(self._shadowed):
            if before is _ABSENT:
                own.pop(method, None)
            else:
                own[method] = before
        self._shadowed = []

    def _noting(self, draw: Any, entry: tuple[nn.Module, str | None, Any]) -> Any:
        def noted(*args: Any, **kwargs: Any) -> Any:
            if self.drawn is None:
                self.drawn = entry
            return draw(*args, **kwargs)

        return noted

    def refuse_drawn(self, names: dict[int, str], prefix: str = "") -> None:
        """Refuse the run if it drew from one of them."""
        if self.drawn is None:
            return
        kind = type(self.drawn[2])
        raise RuntimeError(
            f"{_name(self.drawn, names, prefix)} ({kind.__module__}.{kind.__qualname__}) is drawn "
            "from in the forward pass, but its state cannot be taken (getstate raises), so the "
            "recomputation in backward could not draw the same numbers again. Use "
            "random.Random(seed) or a torch.Generator (both are replayed), or draw outside the "
            "checkpointed or reversible part and pass the numbers in."
        )


def _name(entry: tuple[nn.Module, str | None, Any], names: dict[int, str], prefix: str) -> str:
    owner, path, _ = entry
    return prefix + names.get(id(owner), f"{type(owner).__name__}.") + (
        path or "(a generator it holds)")
