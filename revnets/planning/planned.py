"""The model auto_checkpoint returns: a traced chain that follows a memory plan in training."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from revnets.plan import MemoryPlan

__all__ = ["PlannedModel"]


class PlannedModel(nn.Module):
    """A traced model and its checkpoint plan, sharing every parameter and buffer.

    Training steps (training mode, grad enabled) run the plan: the chain of graph nodes with
    checkpointed segments. Everything else (evaluation, inference) runs the model itself, since
    a trace may have frozen ``self.training`` checks of the mode it was traced in. Save and load
    weights through ``.model``, whose state_dict keys are the original ones.
    """

    memory_plan: MemoryPlan

    def __init__(self, model: nn.Module, plan: nn.Sequential) -> None:
        super().__init__()
        self.plan = plan
        self._model = (model,)  # not registered again: its modules are the plan's

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    @property
    def memory(self) -> MemoryPlan:
        return self.memory_plan

    def train(self, mode: bool = True) -> PlannedModel:
        super().train(mode)
        self.model.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            return self.plan(*args, **kwargs)
        return self.model(*args, **kwargs)
