"""Checkpoint plans for a chain of layers (Chen et al. 2016) and their selection under a budget.

A plan is a list of (start, stop) segments covering the chain; every segment but the last is
checkpointed (only its input is kept; its internals are recomputed in backward). Chen's budgeted
plan walks the layers accumulating what each would keep for backward and cuts a new segment when
the budget ``b`` for one segment would be exceeded; searching ``b`` trades memory for recompute.
Which plan fits a memory budget is decided by predicting each candidate's peak exactly on the meta
device (the memory meter counts the same tensors there as on a real device).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from revnets.checkpoint import segment_bounds
from revnets.planning.profile import LayerProfile

__all__ = [
    "Plan",
    "budget_plan",
    "candidate_plans",
    "forbidden_cuts",
    "modelled_peak",
    "optimal_plan",
    "recompute_cost",
    "respect_inplace",
    "sqrt_plan",
]

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


def forbidden_cuts(profiles: Sequence[LayerProfile]) -> set[int]:
    """Cuts a checkpoint must not be placed at: between a value's producer and a layer that
    overwrites it in place, the checkpoint would keep a value that is changed before the
    recomputation reads it (ReLU(inplace=True) right after a cut; ``out += identity``)."""
    forbidden: set[int] = set()
    for p in profiles:
        if p.mutates_from is not None:
            forbidden.update(range(p.mutates_from + 1, p.index + 1))
    return forbidden


def respect_inplace(plan: Plan, profiles: Sequence[LayerProfile]) -> Plan:
    """Move every cut off the :func:`forbidden_cuts` (to the next allowed one)."""
    n = len(profiles)
    forbidden = forbidden_cuts(profiles)
    cuts = []
    for start, _ in plan[1:]:
        while start < n and start in forbidden:
            start += 1
        if start < n and (not cuts or start > cuts[-1]):
            cuts.append(start)
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))


def _step_costs(profiles: Sequence[LayerProfile]) -> list[float]:
    """Measured forward seconds per layer; one per layer when not measured (meta device)."""
    if any(math.isnan(p.forward_seconds) for p in profiles):
        return [1.0] * len(profiles)
    return [p.forward_seconds for p in profiles]


def recompute_cost(plan: Plan, profiles: Sequence[LayerProfile]) -> float:
    """What a plan recomputes in backward: the forward time of every checkpointed segment
    (in layers, when times were not measured)."""
    costs = _step_costs(profiles)
    return sum(sum(costs[a:b]) for a, b in plan[:-1])


def optimal_plan(
    profiles: Sequence[LayerProfile], budget: int, input_state: dict[str, int] | None = None
) -> Plan | None:
    """The plan recomputing the least (measured forward time) whose modelled peak fits ``budget``.

    Dynamic programming over the cuts, exact for this model of one-level checkpointing: while
    segment ``[i, k)`` is recomputed and backpropagated, memory holds every checkpoint up to
    ``i`` (the union of the live values at those cuts: a value crossing several cuts is one
    tensor), what ``[i, k)`` saves for backward, and the gradient arriving at ``k``; the last
    segment is not checkpointed. Each cut keeps a Pareto front of (checkpoint bytes, recompute
    time). Returns None when no plan fits. The model ignores transient buffers, so callers check
    the chosen plan's real peak (``revnets.predict_memory``) and tighten ``budget`` if needed.
    """
    n = len(profiles)
    if n == 0:
        return [(0, 0)]
    costs = _step_costs(profiles)
    forbidden = forbidden_cuts(profiles)
    saved_prefix = [0]
    time_prefix = [0.0]
    for p, cost in zip(profiles, costs):
        saved_prefix.append(saved_prefix[-1] + p.saved_bytes)
        time_prefix.append(time_prefix[-1] + cost)
    states = [input_state or {"input": 0}] + [p.state for p in profiles]
    first_seen: dict[str, int] = {}
    for c, state in enumerate(states):
        for name in state:
            first_seen.setdefault(name, c)
    # For cut k: the values live there sorted by the cut they first appeared at, so that what a
    # checkpoint at k adds to one at i (values that appeared after i) is a suffix sum.
    appeared, added_after = [], []
    for state in states:
        pairs = sorted((first_seen[name], nbytes) for name, nbytes in state.items())
        appeared.append([c for c, _ in pairs])
        suffix = [0] * (len(pairs) + 1)
        for j in range(len(pairs) - 1, -1, -1):
            suffix[j] = suffix[j + 1] + pairs[j][1]
        added_after.append(suffix)
    state_bytes = [sum(state.values()) for state in states]

    def added(i: int, k: int) -> int:
        return added_after[k][bisect.bisect_right(appeared[k], i)]

    # fronts[i]: (kept bytes, recompute time, previous cut, index in its front), Pareto-optimal.
    fronts: list[list[tuple[int, float, int, int]]] = [[] for _ in range(n + 1)]
    fronts[0] = [(state_bytes[0], 0.0, -1, -1)]
    best: tuple[float, int, int] | None = None
    for i in range(n):
        fronts[i] = _pareto(fronts[i])
        for j, (kept, spent, _, _) in enumerate(fronts[i]):
            if kept + saved_prefix[n] - saved_prefix[i] <= budget and (
                best is None or spent < best[0]
            ):
                best = (spent, i, j)  # [i, n) as the last, stored segment
            for k in range(i + 1, n):
                internal = kept + saved_prefix[k] - saved_prefix[i]
                if internal > budget:
                    break
                if k in forbidden or internal + state_bytes[k] > budget:
                    continue
                fronts[k].append(
                    (kept + added(i, k), spent + time_prefix[k] - time_prefix[i], i, j)
                )
    if best is None:
        return None
    _, i, j = best
    cuts = [n, i]
    while i > 0:
        _, _, i, j = fronts[i][j]
        cuts.append(i)
    bounds = cuts[::-1]
    return list(zip(bounds, bounds[1:]))


def modelled_peak(
    plan: Plan, profiles: Sequence[LayerProfile], input_state: dict[str, int] | None = None
) -> int:
    """The activation peak of ``plan`` in the model :func:`optimal_plan` minimises over."""
    states = [input_state or {"input": 0}] + [p.state for p in profiles]
    kept: dict[str, int] = {}
    peak = 0
    for number, (start, stop) in enumerate(plan):
        kept.update(states[start])
        internal = sum(kept.values()) + sum(p.saved_bytes for p in profiles[start:stop])
        last = number == len(plan) - 1
        peak = max(peak, internal + (0 if last else sum(states[stop].values())))
    return peak


def _pareto(points: list[tuple[int, float, int, int]]) -> list[tuple[int, float, int, int]]:
    front: list[tuple[int, float, int, int]] = []
    for point in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or point[1] < front[-1][1]:
            front.append(point)
    return front


def recomputed_layers(plan: Plan) -> int:
    return sum(stop - start for start, stop in plan[:-1])


def candidate_plans(
    profiles: Sequence[LayerProfile],
    steps: int = 24,
    input_state: dict[str, int] | None = None,
) -> list[Plan]:
    """Distinct plans from no checkpointing to one layer a segment, in order of increasing
    recomputation (measured time, else layers): Chen's budgeted plan over a geometric grid of
    segment budgets, sqrt(n), and :func:`optimal_plan` over a geometric grid of peak budgets."""
    n = len(profiles)
    total = sum(p.saved_bytes for p in profiles) or 1
    smallest = max(min(p.saved_bytes for p in profiles), 1)
    proposals = [[(0, n)], sqrt_plan(n), [(i, i + 1) for i in range(n)]]
    for k in range(steps + 1):
        budget = smallest * (total / smallest) ** (k / steps)
        proposals.append(budget_plan(profiles, int(budget)))
    low = max(max(sum(p.state.values()) for p in profiles), 1)
    high = max(total, low)
    for k in range(steps + 1):
        plan = optimal_plan(profiles, int(low * (high / low) ** (k / steps)), input_state)
        if plan is not None:
            proposals.append(plan)
    plans = {tuple(respect_inplace(p, profiles)) for p in proposals}
    return sorted(
        (list(p) for p in plans),
        key=lambda p: (recompute_cost(p, profiles), recomputed_layers(p), len(p)),
    )
