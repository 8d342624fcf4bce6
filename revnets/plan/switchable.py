"""The zoo's memory setting: a :class:`~revnets.plan.MemoryPlan`, switchable on the same weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from revnets.checkpoint import checkpoint, run_checkpointed_segments
from revnets.plan.decisions import PRESETS, Checkpoint, MemoryPlan, parse_memory_plan

__all__ = ["SwitchableMemory"]


class SwitchableMemory:
    """Mixin for zoo models: ``memory`` is the plan in force, ``set_memory`` switches it (weights
    and state_dict keys stay the same). Models say which plans they cannot follow and why
    (``memory_problem``) and apply a plan to their modules (``apply_memory``)."""

    memory: MemoryPlan
    family: str = "model"

    def memory_problem(self, plan: MemoryPlan) -> str | None:
        return None

    def apply_memory(self, plan: MemoryPlan) -> None:
        raise NotImplementedError

    @property
    def memory_strategies(self) -> tuple[str, ...]:
        """The presets this model can follow."""
        return tuple(name for name, plan in PRESETS.items() if self.memory_problem(plan) is None)

    def set_memory(self, plan: MemoryPlan | str) -> Any:
        """Switch how training saves memory: a :class:`MemoryPlan` or a preset's name."""
        plan = parse_memory_plan(plan)
        problem = self.memory_problem(plan)
        if problem is not None:
            raise ValueError(
                f"memory plan {plan.name!r} does not fit a {self.family}: {problem}; presets "
                f"that do: {', '.join(self.memory_strategies)}"
            )
        self.memory = plan
        self.apply_memory(plan)
        return self

    def _saving(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _run_blocks(self, x: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        """Run blocks ``start:stop`` of the model's reversible sequence ``blocks`` as the plan
        says (a slice runs as a sequence of its own: reversibly between feature taps)."""
        blocks = self.blocks
        if start != 0 or stop not in (None, len(blocks)):
            blocks = self.blocks.sliced(start, stop)
        if isinstance(self.memory.stages, Checkpoint) and self._saving():
            segments = self.memory.stages.segments_for(len(blocks.plain_units()))
            return run_checkpointed_segments(
                blocks.plain_units(), x, segments, selective=self.memory.stages.selective
            )
        return blocks(x)

    def _maybe_checkpoint(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """Run a part of the rest (stem, transition, final activation) as the plan says."""
        if isinstance(self.memory.rest, Checkpoint) and self._saving():
            return checkpoint(fn, x, selective=self.memory.rest.selective)
        return fn(x)
