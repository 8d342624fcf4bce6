"""Parameters a run computes: overwritten whole before the run reads them, as ActNorm's
data-dependent initialisation does (NOTE [ Replay ], rule 3)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["parameters_standing_in", "written_after_read"]


@contextlib.contextmanager
def parameters_standing_in(
    slots: Sequence[Any], name_of: Callable[[Any], str]
) -> Iterator[None]:
    """Run a replay with a stand-in in each of ``slots`` (a recording's slots of parameters the
    run computed: the parameter in ``tensor``, set by ``put``): a copy of the parameter made
    with autograd, so that the replay's own write goes into the copy and the gradient of what
    the replay reads after it goes to the parameter. ``name_of`` names a slot for messages."""
    with torch.enable_grad():
        stand_ins = [(s, s.tensor.clone()) for s in slots]
    made = [(s, t, t.grad_fn) for s, t in stand_ins]
    for s, t, _ in made:
        s.put(t)
    try:
        yield
    finally:
        for s, _, _ in made:
            s.put(s.tensor)
    # A write with grad enabled puts the copy on the write's graph instead of the parameter's
    # (ordinary autograd refuses it: the parameter is a leaf).
    rebased = next((s for s, t, node in made if t.grad_fn is not node), None)
    if rebased is not None:
        raise RuntimeError(
            f"{name_of(rebased)} is overwritten in place in the forward pass with gradients "
            "enabled, which ordinary autograd refuses for a parameter (a leaf Variable that "
            "requires grad is being used in an in-place operation); the recomputation in "
            "backward would differentiate through the write instead. Overwrite it under "
            "torch.no_grad() or through .data (self.loc.data.copy_(...))."
        )


def written_after_read(name: str) -> RuntimeError:
    """The refusal of a parameter the run wrote into after reading it, or in part."""
    return RuntimeError(
        f"{name} was written in place during the forward pass after the forward read it (or "
        "into part of it); its gradient would be taken with respect to a value it no longer "
        "has. Change it outside the forward (before or after the training step), or overwrite "
        "the whole parameter before any use of it, as ActNorm's data-dependent initialisation "
        "does (self.loc.copy_(...) under torch.no_grad())."
    )
