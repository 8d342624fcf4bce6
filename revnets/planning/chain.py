"""Checkpoint plans for a chain of layers (Chen et al. 2016) and their selection under a budget.

A plan is a list of (start, stop) segments covering the chain; every segment but the last is
checkpointed (only its input is kept; its internals are recomputed in backward). Chen's budgeted
plan walks the layers accumulating what each would keep for backward and cuts a new segment when
the budget ``b`` for one segment would be exceeded; searching ``b`` trades memory for recompute.
Which plan fits a memory budget is decided by predicting each candidate's peak exactly on the meta
device (the memory meter counts the same tensors there as on a real device).
"""

from __future__ import annotations

from collections.abc import Sequence

from revnets.checkpoint import segment_bounds
from revnets.planning.profile import LayerProfile

__all__ = ["Plan", "budget_plan", "candidate_plans", "respect_inplace", "sqrt_plan"]

Plan = list[tuple[int, int]]


def sqrt_plan(n: int) -> Plan:
    """About sqrt(n) segments of about sqrt(n) layers."""
    return segment_bounds(n)


def budget_plan(profiles: Sequence[LayerProfile], segment_budget: int) -> Plan:
    """Chen's greedy plan: each segment keeps at most ``segment_budget`` bytes for backward (a
    single layer above the budget gets a segment of its own)."""
    plan, start, used = [], 0, 0
    for p in profiles:
        if used and used + p.saved_bytes > segment_budget:
            plan.append((start, p.index))
            start, used = p.index, 0
        used += p.saved_bytes
    plan.append((start, len(profiles)))
    return plan


def respect_inplace(plan: Plan, profiles: Sequence[LayerProfile]) -> Plan:
    """Move every cut off in-place layers: a segment starting with one would overwrite the input
    its checkpoint keeps (ReLU(inplace=True) right after a cut)."""
    n = len(profiles)
    cuts = []
    for start, _ in plan[1:]:
        while start < n and profiles[start].inplace:
            start += 1
        if start < n and (not cuts or start > cuts[-1]):
            cuts.append(start)
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))


def recomputed_layers(plan: Plan) -> int:
    return sum(stop - start for start, stop in plan[:-1])


def candidate_plans(profiles: Sequence[LayerProfile], steps: int = 24) -> list[Plan]:
    """Distinct plans from no checkpointing to one layer a segment, in order of increasing
    recomputation: Chen's budgeted plan over a geometric grid of segment budgets, plus sqrt(n)."""
    n = len(profiles)
    total = sum(p.saved_bytes for p in profiles) or 1
    smallest = max(min(p.saved_bytes for p in profiles), 1)
    proposals = [[(0, n)], sqrt_plan(n), [(i, i + 1) for i in range(n)]]
    for k in range(steps + 1):
        budget = smallest * (total / smallest) ** (k / steps)
        proposals.append(budget_plan(profiles, int(budget)))
    plans = {tuple(respect_inplace(p, profiles)) for p in proposals}
    return sorted((list(p) for p in plans), key=lambda p: (recomputed_layers(p), len(p)))
