"""Choosing what to store: profiles, checkpoint plans and automatic selection under a budget."""

from revnets.planning.auto import PlanningError, auto_checkpoint, predict_training_peak
from revnets.planning.chain import budget_plan, candidate_plans, sqrt_plan
from revnets.planning.chain_graph import NotAChainError, as_chain
from revnets.planning.profile import LayerProfile, profile_chain

__all__ = [
    "LayerProfile",
    "NotAChainError",
    "PlanningError",
    "as_chain",
    "auto_checkpoint",
    "budget_plan",
    "candidate_plans",
    "predict_training_peak",
    "profile_chain",
    "sqrt_plan",
]
