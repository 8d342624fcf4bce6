"""Checkpoint plans for a chain of layers (Chen et al. 2016) and their selection under a budget.

A plan is a list of (start, stop) segments covering the chain; every segment but the last is
checkpointed (only its input is kept; its internals are recomputed in backward). Chen's budgeted
plan walks the layers accumulating what each would keep for backward and cuts a new segment when
the budget ``b`` for one segment would be exceeded; searching ``b`` trades memory for recompute.
Which plan fits a memory budget is decided by predicting each candidate's peak exactly on the meta
device (the memory meter counts the same tensors there as on a real device).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from revnets.checkpoint import segment_bounds
from revnets.planning.costs.layer_profile import LayerProfile
from revnets.planning.search.chain_model import (
    NO_MOMENT,
    SELECTIVE,
    Action,
    ChainModel,
    Segment,
    forbidden_cuts,
    step_costs,
)

__all__ = [
    "Plan",
    "budget_plan",
    "candidate_plans",
    "forbidden_cuts",
    "modelled_peak",
    "modelled_peaks",
    "optimal_plan",
    "optimal_segments",
    "recompute_cost",
    "respect_inplace",
    "segment_cost",
    "selective_plans",
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


def recompute_cost(plan: Plan, profiles: Sequence[LayerProfile]) -> float:
    """What a plan recomputes in backward: the forward time of every checkpointed segment
    (in layers, when times were not measured)."""
    costs = step_costs(profiles)
    return sum(sum(costs[a:b]) for a, b in plan[:-1])


def optimal_plan(
    profiles: Sequence[LayerProfile], budget: int, input_state: dict[str, int] | None = None
) -> Plan | None:
    """The plan recomputing the least (measured forward time) whose modelled peak fits ``budget``.

    Dynamic programming over the cuts, exact for this model of one-level checkpointing: while
    segment ``[i, k)`` is recomputed and backpropagated, memory holds every checkpoint up to
    ``i`` (the union of the live values at those cuts: a value crossing several cuts is one
    tensor), what ``[i, k)`` saves for backward (a storage two steps save once) and the
    gradients in flight (``memory_model.ChainModel.peak``); the last segment is not
    checkpointed. Each cut keeps a Pareto front of (checkpoint bytes, recompute
    time). Returns None when no plan fits. The model ignores transient buffers, so callers check
    the chosen plan's real peak (``revnets.predict_memory``) and tighten ``budget`` if needed.
    """
    return _one_level(_optimal(ChainModel.of(profiles, input_state), budget, mixed=False))


def _one_level(segments: list[Segment] | None) -> Plan | None:
    return None if segments is None else [(a, b) for a, b, _ in segments]


def optimal_segments(
    profiles: Sequence[LayerProfile], budget: int, input_state: dict[str, int] | None = None
) -> list[Segment] | None:
    """Like :func:`optimal_plan`, where a segment before the last may also be stored (its steps
    keep what they save, nothing of it is recomputed) or checkpointed selectively (NOTE
    [ Selective recomputation ]: it keeps the outputs of its matrix products, convolutions and
    attention, and recomputes only the cheap steps): ``(start, stop, recompute)`` segments.
    The model counts the values live at every cut as kept, a stored segment's input too (its
    steps save what they need of it: a slight over-count, on the safe side), and each front is
    thinned to ``FRONT_CAP`` points, so it is exact only for short chains."""
    return _lowest_of_cheapest(ChainModel.of(profiles, input_state), budget)


def segment_cost(profiles: Sequence[LayerProfile], start: int, stop: int,
                 recompute: Action) -> float:
    """What one segment recomputes in backward (seconds, or layers when not measured)."""
    if not recompute:
        return 0.0
    costs = step_costs(profiles)
    return sum(costs[i] for i in range(start, stop)
               if recompute != SELECTIVE or not profiles[i].selective_bytes)


# NOTE [ Of equal cost, the lowest ]
# Under torch.compile a checkpoint's cheap steps are recomputed inside fused kernels for free,
# so a selective checkpoint of a run costs what storing it does, and many plans under a budget
# recompute equally little while holding very different bytes. Of those, the mixed programme
# returns one holding the least: it minimises time alone, so it is asked again under lower
# budgets, halving DESCENT_STEPS times the range between one where the answer costs more (or
# nothing fits) and the lowest peak found at the least cost. Each answer is the cheapest under
# its budget, so the last is the lowest of the cheapest to a 4096th of that range (exact where
# the fronts are; stepping down a byte below each plan's peak instead ran hundreds of
# programmes on a long chain). This runs only where some step that saves bytes costs nothing
# (ChainModel.saves_for_free): with measured eager times, plans tie only over free steps
# (views), which hold alike. A compiled ResNet-50 at keep 0.7 stored its later half whole where
# a selective checkpoint of it cost the same, and peaked higher compiled than the lowest of the
# cheapest does (benchmarks/frontier.py, docs/results.md).
def _lowest_of_cheapest(chain: ChainModel, budget: int,
                        cuts: Sequence[int] | None = None) -> list[Segment] | None:
    """The mixed programme's plan under ``budget``, the lowest of the cheapest (NOTE [ Of equal
    cost, the lowest ])."""
    plan = _optimal(chain, budget, mixed=True, cuts=cuts)
    if plan is None or not chain.saves_for_free:
        return plan
    cost = chain.cost(plan)
    # Budgets between one no plan fits and the found plan's peak, halved DESCENT_STEPS times.
    low, high = chain.end_bytes - 1, chain.peak(plan)
    for _ in range(DESCENT_STEPS):
        if high - low <= 1:
            break
        middle = (low + high) // 2
        lower = _optimal(chain, middle, mixed=True, cuts=cuts)
        if lower is not None and chain.cost(lower) <= cost + 1e-9 * abs(cost):
            plan, high = lower, min(middle, chain.peak(lower))
        else:
            low = middle
    return plan


def _optimal(chain: ChainModel, budget: int, mixed: bool,
             cuts: Sequence[int] | None = None) -> list[Segment] | None:
    """The programme of :func:`optimal_plan` (``mixed``: of :func:`optimal_segments`), over
    every allowed cut or only ``cuts``."""
    n = chain.n
    if n == 0:
        return [(0, 0, Action.STORE)]
    forbidden, saved, times = chain.forbidden, chain.first_saved, chain.times
    kept_prefix, skipped_prefix = chain.kept_prefix, chain.skipped_prefix
    unsafe_prefix, state_bytes = chain.unsafe_prefix, chain.state_bytes
    appeared, added_after = chain.appeared, chain.added_after
    moments, summing = chain.moments, chain.summing
    if state_bytes[0] + chain.grads_after[0] > budget:  # the end of the backward does not fit
        return None
    # The chain model's segment [i, k) (planning/search/chain_model.py): once run, it holds
    # saved[k] - saved[i] - Y(i, k); backpropagating its step j, backward[j] (then summing[j])
    # less saved[i] + Y(i, j + 1) (then Y(i, j)). So each point carries its kept bytes less
    # saved at its cut (base) and the most of those over its segment so far (top), which only
    # grows; live[i] is Y(i, j + 1) for the step j reached.
    live = np.zeros(n + 1, dtype=np.int64)
    values = 0  # of chain.value_first, the values whose first saving step is reached
    last_limit = budget - chain.last_backpropagated  # [k, n) stored, the last segment

    # Every Pareto point found, in the order the cuts are reached (then by bytes): the cut it
    # ends at, kept bytes, recompute time, base, top, the point it came from and how the
    # segment that ended there runs.
    # The points live in buffers that grow by doubling (concatenating at every cut copied them
    # all, quadratic in the chain's length).
    points = _Points(4 * n)
    cut, kept, spent, base, top, parent, kind = points.arrays
    cut[0], kept[0], spent[0], parent[0], kind[0] = 0, state_bytes[0], 0.0, -1, Action.STORE
    base[0], top[0] = kept[0] - saved[0], NO_MOMENT
    active = np.array([0], dtype=np.int64)  # points whose next segment can still end ahead
    tails = chain.last_backpropagated
    best = _best_last_segment(None, kept[:1], spent[:1], last_limit[0], int(tails[0]), 0)
    step = 0  # the next step to fold into the points' tops
    stops = not mixed and bool(np.all(np.diff(times) >= 0))
    for k in range(1, n) if cuts is None else cuts:
        # One level deep every segment but the last is recomputed, so every point at cut k
        # has spent the forward up to k: once that costs more than the best plan found,
        # nothing after beats it where no step costs less than nothing (a tie in time is
        # still visited: it may end lower).
        if stops and best is not None and times[k] > best[0] * (1 + 1e-9):
            break
        while step < k:  # steps between events (first saves of live values) fold at once
            if values < len(chain.value_first) and chain.value_first[values] == step:
                top[active] = np.maximum(top[active], summing[step] - live[cut[active]])
            while values < len(chain.value_first) and chain.value_first[values] == step:
                live[chain.value_seen[values]:step + 1] += chain.value_bytes[values]
                values += 1
            following = chain.value_first[values] if values < len(chain.value_first) else k
            end = max(min(int(following), k), step + 1)
            top[active] = np.maximum(top[active], moments[step:end].max() - live[cut[active]])
            step = end
        # Segment [cut, k) from a point: it fits while base + top <= budget, and top grows
        # with k, so a point that cannot reach k cannot reach anything after it.
        active = active[base[active] + top[active] <= budget]
        if k in forbidden or not len(active):
            continue
        fits = active
        at = cut[fits]
        after = np.searchsorted(appeared[k], at, side="right")
        adds = added_after[k][after]
        new_kept = kept[fits] + adds
        new_spent = spent[fits] + times[k] - times[at]
        new_parent, new_kind = fits, np.full(len(fits), Action.CHECKPOINT)
        if mixed:
            # The same segments stored (what they hold stays, nothing is recomputed), and
            # selective where no kept output is modified in place.
            selective = fits[unsafe_prefix[k] == unsafe_prefix[at]]
            s_at = cut[selective]
            # What it keeps of the values live at k is what a checkpoint at k keeps.
            s_after = np.searchsorted(appeared[k], s_at, side="right")
            s_adds = added_after[k][s_after] - chain.kept_after[k][s_after]
            new_kept = np.concatenate([
                # live[at] = Y(at, k); what it saves of the values live at k, the checkpoint's
                new_kept, new_kept + saved[k] - saved[at] - live[at] - chain.saved_after[k][after],
                kept[selective] + s_adds + kept_prefix[k] - kept_prefix[s_at]])
            new_spent = np.concatenate([
                new_spent, spent[fits],
                spent[selective] + times[k] - times[s_at]
                - (skipped_prefix[k] - skipped_prefix[s_at])])
            new_parent = np.concatenate([fits, fits, selective])
            new_kind = np.concatenate([new_kind, np.full(len(fits), Action.STORE),
                                       np.full(len(selective), Action.SELECTIVE)])
        front = _pareto_front(new_kept, new_spent)
        if mixed and len(front) > FRONT_CAP:
            # Three ways per segment multiply the fronts: keep the fastest point at each of
            # FRONT_CAP levels of bytes, from the fewest to the fastest (the search is then
            # approximate; exact predictions still decide).
            ordered = new_kept[front]
            at_levels = np.searchsorted(ordered, _levels(ordered[0], ordered[-1]),
                                        side="right") - 1
            front = front[at_levels[np.r_[True, at_levels[1:] != at_levels[:-1]]]]
        if mixed:
            active = active[_undominated(kept[active], spent[active],
                                         new_kept[front], new_spent[front])]
        first = points.size
        cut, kept, spent, base, top, parent, kind = points.grow(len(front))
        added = slice(first, points.size)
        cut[added] = k
        kept[added] = new_kept[front]
        spent[added] = new_spent[front]
        base[added] = kept[added] - saved[k]
        top[added] = NO_MOMENT
        parent[added] = new_parent[front]
        kind[added] = new_kind[front]
        active = np.concatenate([active, np.arange(first, points.size)])
        best = _best_last_segment(
            best, new_kept[front], new_spent[front], last_limit[k], int(tails[k]), first)
    if best is None:
        return None
    point = best[2]
    segments = [(int(cut[point]), n, Action.STORE)]
    while parent[point] >= 0:
        segments.append((int(cut[parent[point]]), int(cut[point]), Action(int(kind[point]))))
        point = int(parent[point])
    # Consecutive stored segments stay apart: they run alike, but the model counts the values
    # live at the cut between them as kept there, not held (NOTE [ A storage saved twice is
    # held once ]), so joined they could model above the budget they were chosen for.
    return segments[::-1]


class _Points:
    """The dynamic programme's points (cut, kept bytes, time, base, top, parent, kind) in
    buffers that double when full."""

    def __init__(self, capacity: int) -> None:
        capacity = max(capacity, 16)
        self.arrays = [np.empty(capacity, dtype=t) for t in
                       (np.int64, np.int64, np.float64, np.int64, np.int64, np.int64, np.int64)]
        self.size = 1

    def grow(self, added: int) -> list[np.ndarray]:
        while self.size + added > len(self.arrays[0]):
            self.arrays = [np.concatenate([a, np.empty_like(a)]) for a in self.arrays]
        self.size += added
        return self.arrays


FRONT_CAP = 8  # points kept per cut by optimal_segments
_FRONT_STEPS = np.arange(FRONT_CAP, dtype=np.float64)
_KEY_LIMIT = 1 << 62
DESCENT_STEPS = 12  # programmes run for the lowest of the cheapest (a 4096th of the range)
# Selective plans are listed checkpointed segments first, then stored, then selective ones.
_LISTED = (Action.CHECKPOINT, Action.STORE, Action.SELECTIVE)


def _undominated(kept: np.ndarray, spent: np.ndarray, front_kept: np.ndarray,
                 front_spent: np.ndarray) -> np.ndarray:
    """Which earlier points no point of a later cut's front beats: a later point with no more
    bytes and no more time does at least as well from there on (its segments are shorter), so
    the earlier one can be dropped. ``front_kept`` ascends, ``front_spent`` descends."""
    at = np.searchsorted(front_kept, kept, side="right") - 1
    beaten = (at >= 0) & (front_spent[np.maximum(at, 0)] <= spent)
    return ~beaten


def _levels(low: int, high: int) -> np.ndarray:
    """``np.linspace(low, high, FRONT_CAP)``, the same numbers, at a fifth of its cost."""
    levels = _FRONT_STEPS * ((float(high) - float(low)) / (FRONT_CAP - 1)) + float(low)
    levels[-1] = high
    return levels


def _pareto_front(kept: np.ndarray, spent: np.ndarray) -> np.ndarray:
    """Indices of the points no other beats in both bytes and time, by bytes; among equal points
    the first (they arrive in the order of the points they extend)."""
    # One stable sort by bytes (two keys sorted twice as long): a point of equal bytes that
    # passes the running minimum before a faster one of the same bytes is dropped after. The
    # stable order is that of unique keys, bytes then arrival, which an unstable sort finds in a
    # third of the time (a third of the mixed programme's), where they fit in 63 bits.
    arrival = 1 << max(len(kept) - 1, 1).bit_length()
    if len(kept) and 0 <= kept.min() and kept.max() < _KEY_LIMIT // arrival:
        order = np.argsort(kept * arrival + np.arange(len(kept)), kind="quicksort")
    else:
        order = np.argsort(kept, kind="stable")
    ordered = spent[order]
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = ordered[1:] < np.minimum.accumulate(ordered)[:-1]
    front = order[keep]
    same = kept[front]
    last = np.ones(len(front), dtype=bool)
    last[:-1] = same[:-1] != same[1:]
    return front[last]


def _best_last_segment(
    best: tuple[float, int, int] | None, kept: np.ndarray, spent: np.ndarray, limit: int,
    tail: int, first: int,
) -> tuple[float, int, int] | None:
    """The cheapest point so far from which the rest of the chain can be the last, stored
    segment (holding ``tail`` bytes at its most): (time, the plan's bytes at its end, point
    index). Of equal times the one ending lower wins (a compiled model's plans recompute its
    cheap steps for free, so many cost the same), then the earliest."""
    fitting = np.nonzero(kept <= limit)[0]
    if not len(fitting):
        return best
    j = fitting[np.lexsort((kept[fitting], spent[fitting]))[0]]
    found = (float(spent[j]), int(kept[j]) + tail, first + int(j))
    if best is None or found[:2] < best[:2]:
        return found
    return best


def modelled_peak(
    plan: Plan, profiles: Sequence[LayerProfile], input_state: dict[str, int] | None = None
) -> int:
    """The peak of ``plan`` in the model :func:`optimal_plan` minimises over (activations and
    parameter gradients, NOTE [ Gradients in flight ])."""
    return ChainModel.of(profiles, input_state).peak(
        [(a, b, Action.CHECKPOINT if number < len(plan) - 1 else Action.STORE)
         for number, (a, b) in enumerate(plan)])


def modelled_peaks(
    plans: Sequence[Sequence[Segment]], profiles: Sequence[LayerProfile],
    input_state: dict[str, int] | None = None, whole_inputs: bool = True,
) -> list[int]:
    """The peak of each of ``plans`` (segments) in the model :func:`optimal_segments`
    minimises over, the chain's arrays made once; without ``whole_inputs``, a stored segment
    keeping only what it needs of its input (``ChainModel.peak``)."""
    chain = ChainModel.of(profiles, input_state)
    return [chain.peak(plan, whole_inputs) for plan in plans]


def selective_plans(
    profiles: Sequence[LayerProfile], budgets: Sequence[int],
    input_state: dict[str, int] | None = None,
) -> list[list[Segment]]:
    """Distinct :func:`optimal_segments` for each of ``budgets`` (modelled activation bytes);
    none when times were not measured (then every step costs alike and nothing is worth keeping
    selectively)."""
    if not profiles or any(math.isnan(p.forward_seconds) for p in profiles):
        return []
    chain = ChainModel.of(profiles, input_state)
    cuts = chain.distinct_cuts()
    plans = {tuple(plan) for budget in budgets
             if (plan := _lowest_of_cheapest(chain, budget, cuts)) is not None}
    return sorted((list(p) for p in plans),
                  key=lambda p: [(a, b, _LISTED.index(r)) for a, b, r in p])


def recomputed_layers(plan: Plan) -> int:
    return sum(stop - start for start, stop in plan[:-1])


def candidate_plans(
    profiles: Sequence[LayerProfile],
    steps: int = 24,
    input_state: dict[str, int] | None = None,
) -> list[Plan]:
    """Distinct plans from no checkpointing to one layer a segment, in order of increasing
    recomputation (measured time, else layers): Chen's budgeted plan over a geometric grid of
    segment budgets, sqrt(n), and :func:`optimal_plan` over a geometric grid of peak budgets
    and at the least budget any plan fits (the floor of this model)."""
    n = len(profiles)
    total = sum(p.saved_bytes for p in profiles) or 1
    smallest = max(min(p.saved_bytes for p in profiles), 1)
    proposals = [[(0, n)], sqrt_plan(n), [(i, i + 1) for i in range(n)]]
    for k in range(steps + 1):
        budget = smallest * (total / smallest) ** (k / steps)
        proposals.append(budget_plan(profiles, int(budget)))
    low = max(max(sum(p.state.values()) for p in profiles), 1)
    high = max(total, low)
    chain = ChainModel.of(profiles, input_state)
    proposals += [p for p in _optimal_over_grid(chain, low, high, steps) if p is not None]
    plans = {tuple(respect_inplace(p, profiles)) for p in proposals}
    return sorted(
        (list(p) for p in plans),
        key=lambda p: (recompute_cost(p, profiles), recomputed_layers(p), len(p)),
    )


def _optimal_over_grid(chain: ChainModel, low: int, high: int, steps: int) -> list[Plan | None]:
    """:func:`optimal_plan` at each of ``steps + 1`` budgets from ``low`` to ``high`` (a
    geometric grid), solving only where a plan can differ: where two budgets get the same plan,
    every budget between them gets a plan of the same recompute cost (it is no slower than the
    lower one's plan, which fits it, and no faster than the higher one's, which it would then
    beat), and the lower one's, fitting the smaller budget, stands for them all."""
    # Over the activations: the gradients made by the end of the backward come on top.
    budgets = [int(low * (high / low) ** (k / steps)) + int(chain.grads_after[0])
               for k in range(steps + 1)]
    found: dict[int, Plan | None] = {}

    def solve(k: int) -> Plan | None:
        if k not in found:
            found[k] = _one_level(_optimal(chain, budgets[k], mixed=False))
        return found[k]

    def between(lo: int, hi: int) -> None:
        if hi - lo > 1 and solve(lo) != solve(hi):
            middle = (lo + hi) // 2
            between(lo, middle)
            between(middle, hi)

    between(0, steps)
    plans = [found[k] for k in sorted(found)]
    first = next((k for k in sorted(found) if found[k] is not None), 0)
    if first > 0:  # the lowest fitting budget solved can lie grid steps above the floor
        unfit = max(k for k in found if k < first)
        plans.append(_floor_plan(chain, budgets[unfit], budgets[first], found[first]))
    return plans


FLOOR_PRECISION = 1000  # the least modelled peak is found to within a thousandth


def _floor_plan(chain: ChainModel, unfit: int, fit: int, plan: Plan) -> Plan:
    """The plan of :func:`optimal_plan` at the least budget any plan fits in the model, to
    within ``fit / FLOOR_PRECISION``, by bisection between a budget no plan fits (``unfit``)
    and one ``plan`` fits: the lowest one-level plan there is, where a search looks when the
    budget asked is close to it."""
    while fit - unfit > max(fit // FLOOR_PRECISION, 1):
        middle = (unfit + fit) // 2
        found = _one_level(_optimal(chain, middle, mixed=False))
        if found is None:
            unfit = middle
        else:
            fit, plan = middle, found
    return plan
