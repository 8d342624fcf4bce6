"""Copies of generator states that torch's own code makes outside the dispatcher, shown to the
memory trackers running (NOTE [ Generator states torch keeps ])."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["shown_generator_states"]

# NOTE [ Generator states torch keeps ]
# torch.utils.checkpoint with preserve_rng_state (transformers' gradient checkpointing, a user's
# own call) copies the CPU generator's state (5,056 bytes) and that of each device the forward
# used (``torch.get_rng_state``, ``torch.cuda.get_rng_state``) for every checkpointed call, and
# holds the copies until its recomputation. C++ makes those tensors outside the dispatcher and
# torch's restore (``set_rng_state``) is no operator either: a tracker at the dispatcher would
# never see them. While trackers run, those functions tell each of them about the copy they
# return, counted from then to its last reference, as revnets' own recordings keep theirs where
# a tracker sees them (kept_generator_state in revnets/replay/known.py; revnets' checkpoints
# have torch keep none).
_TRACKERS: list[Callable[[Tensor], None]] = []
_PATCHED: list[tuple[Any, Callable[..., Tensor]]] = []


def _shown(original: Callable[..., Tensor], *args: Any, **kwargs: Any) -> Tensor:
    state = original(*args, **kwargs)
    for seen in _TRACKERS:
        seen(state)
    return state


@contextlib.contextmanager
def shown_generator_states(seen: Callable[[Tensor], None]) -> Iterator[None]:
    """Inside, ``seen(state)`` is called with every generator state torch's
    ``get_rng_state`` functions copy."""
    if not _TRACKERS:
        for owner in (torch, torch.cuda):
            original = owner.get_rng_state
            _PATCHED.append((owner, original))
            owner.get_rng_state = functools.wraps(original)(functools.partial(_shown, original))
    _TRACKERS.append(seen)
    try:
        yield
    finally:
        _TRACKERS.remove(seen)
        if not _TRACKERS:
            while _PATCHED:
                owner, original = _PATCHED.pop()
                owner.get_rng_state = original
