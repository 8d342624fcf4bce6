"""Choosing what to store: profiles, checkpoint plans and automatic selection under a budget."""

from revnets.planning.auto import PlannedModel, PlanningError, auto_checkpoint
from revnets.planning.chain import (
    budget_plan,
    candidate_plans,
    forbidden_cuts,
    modelled_peak,
    modelled_peaks,
    optimal_plan,
    optimal_segments,
    recompute_cost,
    segment_cost,
    selective_plans,
    sqrt_plan,
)
from revnets.planning.graph_step import GraphStep
from revnets.planning.memory_model import ChainModel
from revnets.planning.module_plan import CheckpointedModules
from revnets.planning.nested import NestedSchedule, group_chain, nested_schedule
from revnets.planning.profile import LayerProfile, profile_chain
from revnets.planning.step_times import ForwardTimes, forward_times
from revnets.planning.trace import NotAChainError, as_graph_chain

__all__ = [
    "ChainModel",
    "CheckpointedModules",
    "ForwardTimes",
    "GraphStep",
    "LayerProfile",
    "NestedSchedule",
    "NotAChainError",
    "PlannedModel",
    "PlanningError",
    "as_graph_chain",
    "auto_checkpoint",
    "budget_plan",
    "candidate_plans",
    "forbidden_cuts",
    "forward_times",
    "group_chain",
    "modelled_peak",
    "modelled_peaks",
    "nested_schedule",
    "optimal_plan",
    "optimal_segments",
    "profile_chain",
    "recompute_cost",
    "segment_cost",
    "selective_plans",
    "sqrt_plan",
]
