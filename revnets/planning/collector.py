"""Python's cycle collector paused while planning, and what it does at the end."""

from __future__ import annotations

import contextlib
import gc
import traceback
from collections.abc import Iterator

from revnets.planning.budget import PlanningError

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector paused while planning: the predictions make and drop objects in
    cycles by the hundred thousand, and its passes over everything alive took a fifth of the
    time. At the end their cycles go, in one pass over the youngest generation (what planning
    made: milliseconds), and a refusal keeps no frame of the planner's: both held tensors the
    model held when planning began (a buffer it reassigns, a block's last output), alive past
    the model's next step until a collection ran, so that a step measured after planning
    counted them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    except PlanningError as refusal:
        error: BaseException | None = refusal
        while error is not None:  # the refusal, and what it was raised while handling
            traceback.clear_frames(error.__traceback__)
            error = error.__cause__ or error.__context__
        raise
    finally:
        gc.collect(0)
        if enabled:
            gc.enable()
