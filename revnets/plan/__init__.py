"""How a model spends memory on activations: a typed plan, one decision per part (decisions.py),
and the mixin a zoo model follows one with, switched on its weights (switchable.py: import it
from ``revnets.plan.switchable``; this face imports only the decisions, which
``revnets.checkpoint`` reads, so that the mixin, which checkpoints, can import that in turn)."""

from revnets.plan.decisions import (
    EXACT_HOME,
    PRESETS,
    Checkpoint,
    Decision,
    MemoryPlan,
    PartPlan,
    Reconstruct,
    Store,
    parse_memory_plan,
    plan_from_options,
    preset_options,
)

__all__ = [
    "EXACT_HOME",
    "PRESETS",
    "Checkpoint",
    "Decision",
    "MemoryPlan",
    "PartPlan",
    "Reconstruct",
    "Store",
    "parse_memory_plan",
    "plan_from_options",
    "preset_options",
]
