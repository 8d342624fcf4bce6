"""Choosing what to store: profiles, checkpoint plans and automatic selection under a budget."""

from revnets.planning.auto import (
    PlannedModel,
    PlanningError,
    auto_checkpoint,
    predict_training_peak,
)
from revnets.planning.chain import (
    budget_plan,
    candidate_plans,
    forbidden_cuts,
    modelled_peak,
    optimal_plan,
    recompute_cost,
    sqrt_plan,
)
from revnets.planning.chain_graph import NotAChainError, as_chain
from revnets.planning.graph_chain import GraphStep, as_graph_chain
from revnets.planning.nested import NestedSchedule, group_chain, nested_schedule
from revnets.planning.profile import LayerProfile, profile_chain

__all__ = [
    "GraphStep",
    "LayerProfile",
    "NestedSchedule",
    "NotAChainError",
    "PlannedModel",
    "PlanningError",
    "as_chain",
    "as_graph_chain",
    "auto_checkpoint",
    "budget_plan",
    "candidate_plans",
    "forbidden_cuts",
    "group_chain",
    "modelled_peak",
    "nested_schedule",
    "optimal_plan",
    "predict_training_peak",
    "profile_chain",
    "recompute_cost",
    "sqrt_plan",
]
