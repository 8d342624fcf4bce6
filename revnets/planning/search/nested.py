"""Nested (multi-level) checkpointing of a chain: the optimal schedule by dynamic programming.

One-level plans (:func:`revnets.planning.optimal_plan`) recompute each layer at most once and
cannot go below about the memory of sqrt(n) checkpoints. Recomputing a checkpointed segment with
checkpoints of its own goes further (Chen et al.'s recursion, O(log n) memory in the limit) for
more recomputation. Which layers to store, checkpoint or recompute at which level is the problem
rotor (Beaumont et al. 2019, "Optimal checkpointing for heterogeneous chains") solves by dynamic
programming over memory discretised into slots::

    cost(s, t, m) = least forward time to run layers s..t forward and backward, their input kept,
                    with m slots for everything else
                  = min( forward(s) + cost(s+1, t, m - saved(s) - out(s))        keep layer s whole
                         min over s < k <= t of
                           forward(s..k-1) + cost(k, t, m - out(k-1))             checkpoint at k,
                           + cost(s, k-1, m)                                     recompute s..k-1 )

A schedule is applied as nested modules: a checkpointed run is a ``Checkpointed`` segment whose
own contents are the schedule of its recomputation (non-reentrant checkpoints nest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from torch import nn

from revnets.checkpoint import Checkpointed
from revnets.planning.costs.layer_profile import LayerProfile
from revnets.planning.search.chain_model import forbidden_cuts

__all__ = [
    "NestedSchedule", "group_bounds", "group_chain", "most_frugal_schedule", "nested_schedule",
]

INFEASIBLE = math.inf


class NestedSchedule:
    """The optimal nested schedule of a chain for a memory budget (see :func:`nested_schedule`).

    ``tree`` describes it: a list of items, each either an int (a layer kept whole) or a list
    (a checkpointed run, itself a schedule of its recomputation). ``apply(layers)`` builds it.
    """

    def __init__(self, tree: list, recompute_cost: float, modelled_bytes: int | None = None
                 ) -> None:
        self.tree = tree
        self.recompute_cost = recompute_cost
        self.modelled_bytes = modelled_bytes  # what it needs in rotor's model, where known

    def apply(self, layers: Sequence[nn.Module]) -> nn.Sequential:
        """An ``nn.Sequential`` over the same layers that runs this schedule."""

        def build(items: list) -> list[nn.Module]:
            modules = []
            for item in items:
                if isinstance(item, int):
                    modules.append(layers[item])
                else:
                    modules.append(Checkpointed(nn.Sequential(*build(item))))
            return modules

        return nn.Sequential(*build(self.tree))

    def depth(self) -> int:
        """How many levels of checkpoints nest (0: nothing checkpointed)."""

        def level(items: list) -> int:
            return max((1 + level(i) for i in items if isinstance(i, list)), default=0)

        return level(self.tree)

    def __repr__(self) -> str:
        return f"NestedSchedule({self.tree}, recompute_cost={self.recompute_cost:.3g})"


def nested_schedule(
    profiles: Sequence[LayerProfile], budget: int, slots: int = 64
) -> NestedSchedule | None:
    """The schedule recomputing the least forward time (measured, else layers counted) whose
    activations fit ``budget`` bytes in rotor's model: what each kept layer saves, each
    checkpoint's output, the gradients of a layer's input and output during its backward,
    memory rounded up to ``budget / slots``. None if nothing fits.

    Runs in O(n^3 * slots) (numpy over the slots): meant for chains of up to a few hundred
    layers; group longer ones first. Callers check the real peak, as for every planner here.
    """
    n = len(profiles)
    if n == 0 or budget <= 0:
        return None
    slot = budget / slots
    forbidden = forbidden_cuts(profiles)
    times = [p.forward_seconds for p in profiles]
    if any(math.isnan(t) for t in times):
        times = [1.0] * n
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    out = [math.ceil(sum(p.state.values()) / slot) if p.state else math.ceil(p.output_bytes / slot)
           for p in profiles]
    # Keeping a layer whole adds what it saves besides its input (kept already) and its output.
    whole = [math.ceil(p.saved_intermediate_bytes / slot) + out[i] for i, p in enumerate(profiles)]
    memory = np.arange(slots + 1)
    out_array = np.array(out, dtype=np.int64)

    # cost[s, t]: array over m = 0..slots; choice[s, t]: per m, -1 = keep s whole, k = checkpoint
    # layers s..k-1 and continue from k. All checkpoints k of one (s, t) at once, as rows.
    cost = np.full((n, n, slots + 1), INFEASIBLE)
    choice = np.full((n, n, slots + 1), -1, dtype=np.int64)
    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length - 1
            if s == t:
                # Its backward also holds the gradients of its output and of its input.
                needed = whole[s] + out[s] + (out[s - 1] if s else 0)
                cost[s, t] = np.where(memory >= needed, times[s], INFEASIBLE)
                continue
            # Keep layer s whole: it saves its activations, and its output feeds s+1.
            shifted = np.full(slots + 1, INFEASIBLE)
            if whole[s] <= slots:
                shifted[whole[s]:] = cost[s + 1, t, : slots + 1 - whole[s]]
            best = times[s] + shifted
            # A checkpointed run starting at a forbidden cut would keep a value overwritten later.
            if s not in forbidden:
                ks = np.arange(s + 1, t + 1)
                kept = out_array[ks - 1]
                # after[r, m]: the rest from k = ks[r] with the checkpoint's output held.
                index = memory[None, :] - kept[:, None]
                after = np.where(
                    index >= 0,
                    cost[ks, t][np.arange(len(ks))[:, None], np.maximum(index, 0)],
                    INFEASIBLE,
                )
                candidates = (prefix[ks] - prefix[s])[:, None] + after + cost[s, ks - 1]
                row = candidates.argmin(axis=0)  # the first k of the least cost
                least = candidates[row, memory]
                better = least < best
                cost[s, t] = np.where(better, least, best)
                choice[s, t] = np.where(better, ks[row], -1)
            else:
                cost[s, t] = best
    total = cost[0, n - 1][slots]
    if not math.isfinite(total):
        return None

    def tree(s: int, t: int, m: int) -> list:
        if s > t:
            return []
        k = int(choice[s, t][m])
        if s == t:
            return [s]
        if k == -1:
            return [s, *tree(s + 1, t, m - whole[s])]
        return [tree(s, k - 1, m), *tree(k, t, m - out[k - 1])]

    forward_once = float(prefix[n])
    return NestedSchedule(tree(0, n - 1, slots), float(total) - forward_once)


def group_bounds(profiles: Sequence[LayerProfile], groups: int) -> list[int]:
    """The cuts :func:`group_chain` merges a chain of ``profiles`` at: 0, at most ``groups - 1``
    cuts about evenly apart (never a forbidden one), and the chain's length."""
    n = len(profiles)
    if n <= groups:
        return list(range(n + 1))
    forbidden = forbidden_cuts(profiles)
    bounds = [0]
    for g in range(1, groups):
        cut = max(round(g * n / groups), bounds[-1] + 1)
        while cut < n and cut in forbidden:
            cut += 1
        if cut < n and cut > bounds[-1]:
            bounds.append(cut)
    bounds.append(n)
    return bounds


def group_chain(
    layers: Sequence[nn.Module], profiles: Sequence[LayerProfile], groups: int
) -> tuple[list[nn.Module], list[LayerProfile]]:
    """Merge a long chain into at most ``groups`` runs of consecutive layers (never split at a
    forbidden cut: :func:`group_bounds`), so that :func:`nested_schedule` stays fast; returns
    the runs and their profiles (sums of the layers', the state of the last)."""
    if len(layers) <= groups:
        return list(layers), list(profiles)
    bounds = group_bounds(profiles, groups)
    merged_layers, merged_profiles = [], []
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        run = profiles[start:stop]
        merged_layers.append(nn.Sequential(*layers[start:stop]))
        merged_profiles.append(
            LayerProfile(
                index,
                "Sequential",
                run[-1].output_bytes,
                sum(p.saved_bytes for p in run),
                # Unmeasured (meta) layers count one each, as everywhere else.
                sum(1.0 if math.isnan(p.forward_seconds) else p.forward_seconds for p in run),
                state=run[-1].state,
                # Inside a run, every output but the last is an intermediate.
                saved_intermediate_bytes=sum(
                    p.saved_intermediate_bytes + p.output_bytes for p in run[:-1]
                ) + run[-1].saved_intermediate_bytes,
            )
        )
    return merged_layers, merged_profiles


def most_frugal_schedule(profiles: Sequence[LayerProfile]) -> NestedSchedule | None:
    """The nested schedule of the least memory in rotor's model (the recursion of
    :func:`nested_schedule`, in bytes rather than slots), every layer counting one unit of time;
    of the schedules needing that least memory, one recomputing few layers. It depends on the
    sizes alone, so a budget a refusal names after it plans when asked for.

    One pass of the recursion over the least memory itself, instead of a search over budgets
    that each run the whole recursion: with ``need(s, t)`` the least memory that runs layers
    ``s..t`` forward and backward, their input kept,

        need(s, t) = min( whole(s) + need(s+1, t),                         keep layer s whole
                          min over s < k <= t of
                            max(out(k-1) + need(k, t), need(s, k-1)) )      checkpoint at k
    """
    n = len(profiles)
    if n == 0:
        return None
    forbidden = forbidden_cuts(profiles)
    out = np.array([sum(p.state.values()) if p.state else p.output_bytes for p in profiles],
                   dtype=np.int64)
    whole = np.array([p.saved_intermediate_bytes for p in profiles], dtype=np.int64) + out
    need = np.zeros((n, n), dtype=np.int64)
    steps = np.zeros((n, n), dtype=np.int64)  # forward runs of layers, recomputations included
    choice = np.full((n, n), -1, dtype=np.int64)
    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length - 1
            if s == t:  # its backward also holds the gradients of its output and of its input
                need[s, t] = whole[s] + out[s] + (out[s - 1] if s else 0)
                steps[s, t] = 1
                continue
            best = (int(whole[s] + need[s + 1, t]), int(1 + steps[s + 1, t]))
            if s not in forbidden:  # a run starting at a forbidden cut: see nested_schedule
                ks = np.arange(s + 1, t + 1)
                memory = np.maximum(out[ks - 1] + need[ks, t], need[s, ks - 1])
                runs = (ks - s) + steps[ks, t] + steps[s, ks - 1]
                least = memory.min()
                row = int(np.flatnonzero(memory == least)[runs[memory == least].argmin()])
                if (int(least), int(runs[row])) < best:
                    best, choice[s, t] = (int(least), int(runs[row])), ks[row]
            need[s, t], steps[s, t] = best

    def tree(s: int, t: int) -> list:
        if s == t:
            return [s]
        k = int(choice[s, t])
        if k == -1:
            return [s, *tree(s + 1, t)]
        return [tree(s, k - 1), *tree(k, t)]

    return NestedSchedule(tree(0, n - 1), float(steps[0, n - 1] - n), int(need[0, n - 1]))
