"""What planning may change on a user's model, kept so that a failed plan leaves none of it.

The search configures the model's own reversible sequences (it predicts and times candidate
plans on them) and switches zoo models between memory plans; whatever ends it (no plan fits, an
error in the user's loss function, an interrupt), the model must be as it was handed over.
"""

from __future__ import annotations

from torch import nn

from revnets.models.switchable import SwitchableMemory
from revnets.reversible import ReversibleSequence, SequenceOptions

__all__ = ["ModelState"]

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
