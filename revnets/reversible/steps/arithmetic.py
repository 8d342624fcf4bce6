"""A block's coupling as the engine applies it: written into memory the engine owns where the
coupling says it may be (``x_factor``), inverted with the bits an exact scaling dropped where it
keeps them (NOTE [ Exact reversibility ], rule 7), and the recording chain cut where the
coupling is user code."""

from __future__ import annotations

import torch
from torch import Tensor

from revnets.reversible.coupling import STOCK_COUPLINGS, Coupling
from revnets.reversible.steps.step import ForwardRun

__all__ = ["combine", "lost_of", "uncombine", "user_code_ran"]


def combine(coupling: Coupling, x: Tensor, h: Tensor, in_place: bool) -> Tensor:
    # Updating x in place saves an allocation per half; only into memory the engine owns.
    if in_place and coupling.x_factor is not None and torch.result_type(x, h) == x.dtype:
        return coupling.combine_(x, h)
    return coupling.combine(x, h)


def user_code_ran(coupling: Coupling, run: ForwardRun) -> None:
    # The couplings revnets defines draw no random numbers; any other is user code between two
    # recordings (NOTE [ Replay ], RecordingChain).
    if type(coupling) not in STOCK_COUPLINGS:
        run.chain.cut()


def uncombine(coupling: Coupling, y: Tensor, h: Tensor, lost: Tensor | None = None) -> Tensor:
    # y is always the engine's own here (NOTE [ Layout ], rule 3).
    if coupling.keeps_lost:
        return coupling.uncombine_kept(y, h, lost)
    if coupling.x_factor is not None and torch.result_type(y, h) == y.dtype:
        return coupling.uncombine_(y, h)
    return coupling.uncombine(y, h)


def lost_of(coupling: Coupling, x: Tensor) -> Tensor | None:
    """What the coupling's inverse needs of ``x`` beyond its output (NOTE [ Exact
    reversibility ], rule 7), taken before ``x`` is combined (in place)."""
    return coupling.lost(x.detach()) if coupling.keeps_lost else None
