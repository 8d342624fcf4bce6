"""Choosing what to store: profiles, checkpoint plans and automatic selection under a budget.

Three floors, each importing only those below it (docs/layout.md): ``costs/`` (what each step of
a chain costs: profiles, gradients in flight, forward times), ``search/`` (the chain model and
the searches over it), and this package's own modules on top (``auto_checkpoint`` and what it
orchestrates); the model's trace (``revnets.graph``) is below all three."""

from revnets.graph.step import GraphStep
from revnets.graph.trace import NotAChainError, as_graph_chain
from revnets.planning.auto import PlannedModel, auto_checkpoint
from revnets.planning.costs.layer_profile import LayerProfile
from revnets.planning.costs.profile import profile_chain
from revnets.planning.costs.step_times import ForwardTimes
from revnets.planning.model_chain import forward_times
from revnets.planning.modules.plan import CheckpointedModules
from revnets.planning.search.budget import PlanningError
from revnets.planning.search.chain import (
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
from revnets.planning.search.chain_model import ChainModel
from revnets.planning.search.nested import NestedSchedule, group_chain, nested_schedule

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
