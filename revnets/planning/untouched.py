"""What planning may change on a user's model, kept so that a failed plan leaves none of it, and
Python's cycle collector, paused while planning and left as it was.

The search configures the model's own reversible sequences (it predicts and times candidate
plans on them) and switches zoo models between memory plans; whatever ends it (no plan fits, an
error in the user's loss function, an interrupt), the model must be as it was handed over.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from collections.abc import Iterator

from torch import nn

from revnets.plan.switchable import SwitchableMemory
from revnets.planning.search.budget import PlanningError
from revnets.reversible import ReversibleSequence, SequenceOptions

__all__ = ["ModelState", "collector_paused"]

class ModelState:
    """How ``model`` and its modules run (memory plan, sequences' options, training flags), as
    they were at construction. It holds no tensors: an exception kept by the caller (and with it
    this state) keeps no memory alive."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.memory = model.memory if isinstance(model, SwitchableMemory) else None
        self.sequences: list[tuple[ReversibleSequence, SequenceOptions]] = [
            (m, m.options) for m in model.modules() if isinstance(m, ReversibleSequence)
        ]
        self.training = [(m, m.training) for m in model.modules()]

    def restore(self) -> None:
        if self.memory is not None and self.model.memory is not self.memory:
            self.model.set_memory(self.memory)
        for sequence, options in self.sequences:
            sequence.options = options  # the record whole (SequenceOptions)
        for module, training in self.training:
            module.training = training


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
