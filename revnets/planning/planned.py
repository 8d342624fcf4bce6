"""The model auto_checkpoint returns: a traced chain that follows a memory plan in training."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from revnets.plan import MemoryPlan
from revnets.planning.trace import GraphStep
from revnets.planning.traced import Frozen, refuse_hooks

__all__ = ["PlannedModel"]


class PlannedModel(nn.Module):
    """A traced model and its checkpoint plan, sharing every parameter and buffer.

    Training steps (training mode, grad enabled) run the plan: the chain of graph nodes with
    checkpointed segments. Everything else (evaluation, inference) runs the model itself, since
    a trace may have frozen ``self.training`` checks of the mode it was traced in. Save and load
    weights through ``.model``, whose state_dict keys are the original ones. A training step
    refuses hooks that would not run in it, and what the traced graph froze that has changed
    since (NOTE [ Traced modules run as their graph ]).
    """

    memory_plan: MemoryPlan

    def __init__(self, model: nn.Module, plan: nn.Sequential) -> None:
        super().__init__()
        self.plan = plan
        self._model = (model,)  # not registered again: its modules are the plan's
        called = {
            id(m) for step in plan.modules() if isinstance(step, GraphStep)
            and step.op == "call_module" for m in step.module.modules()
        }
        # The modules the plan runs as their traced graph (the model itself among them).
        self._traced = tuple((n, m) for n, m in model.named_modules() if id(m) not in called)
        self._frozen = Frozen(self._traced)
        refuse_hooks(self._traced)

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
            refuse_hooks(self._traced)
            self._frozen.check()
            return self.plan(*args, **kwargs)
        return self.model(*args, **kwargs)
