"""A plan the planner found, described as the :class:`~revnets.plan.MemoryPlan` users read: one
part per checkpointed segment, per run of stored steps and per reversible sequence, with what
each keeps and how long its recomputation takes."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from revnets.graph.step import step_name
from revnets.plan import Checkpoint, Decision, MemoryPlan, PartPlan, Reconstruct, Store
from revnets.planning.costs.layer_profile import LayerProfile
from revnets.planning.search.chain_model import SELECTIVE, Action
from revnets.planning.search.options import Segments
from revnets.reversible import ReversibleSequence

__all__ = [
    "checkpoint_decision",
    "describe_plan",
    "measured_seconds",
    "memory_plan",
]


def describe_plan(
    chain: nn.Sequential,
    sequences: dict[int, ReversibleSequence],
    original: dict[int, Decision],
    input_state: dict[str, int] | None,
    plan: Segments,
    profiles: list[LayerProfile],
    reconstructed: frozenset[int],
    peak: int,
    budget: int,
) -> MemoryPlan:
    """``plan``'s segments over ``chain`` as parts: each checkpointed segment (keeping its input
    state, and under selective checkpointing its kept outputs), each run of stored steps, and
    each reversible sequence (``original``: how it reconstructs where ``reconstructed`` has
    it)."""
    names = [step_name(step, i) for i, step in enumerate(chain)]
    parts: list[PartPlan] = []
    run: list[int] = []  # stored steps, across consecutive stored segments

    def stored_run() -> None:
        if run:
            parts.append(PartPlan(_span(names, run[0], run[-1] + 1), Store(),
                                  sum(profiles[j].saved_bytes for j in run), 0.0))
            run.clear()

    for start, stop, checkpointed in plan:
        if checkpointed:
            stored_run()
            state = input_state if start == 0 else profiles[start - 1].state
            kept = sum((state or {}).values())
            if checkpointed == SELECTIVE:
                kept += sum(p.selective_bytes for p in profiles[start:stop])
            rerun = [i for i in range(start, stop)
                     if checkpointed != SELECTIVE or not profiles[i].selective_bytes]
            parts.append(PartPlan(_span(names, start, stop), checkpoint_decision(checkpointed),
                                  kept, measured_seconds(profiles, rerun)))
        for i in range(start, stop):
            if i in sequences:
                stored_run()
                inside = " (inside the checkpoint)" if checkpointed else ""
                parts.append(PartPlan(
                    names[i] + inside,
                    original[i] if i in reconstructed else Store(),
                    profiles[i].saved_bytes,
                    measured_seconds(profiles, range(i, i + 1)) if i in reconstructed else 0.0,
                ))
            elif not checkpointed:
                run.append(i)
    stored_run()
    checkpointed = any(isinstance(part.decision, Checkpoint) for part in parts)
    return memory_plan(parts, reconstructed, checkpointed, peak, budget)


def checkpoint_decision(recompute: Action) -> Checkpoint:
    return Checkpoint(selective=recompute == SELECTIVE)


def memory_plan(
    parts: Sequence[PartPlan], reconstructed: frozenset[int], checkpointed: bool, peak: int,
    budget: int,
) -> MemoryPlan:
    return MemoryPlan(
        stages=Reconstruct() if reconstructed else Store(),
        rest=Checkpoint() if checkpointed else Store(),
        parts=tuple(parts),
        peak_bytes=peak,
        budget=budget,
    )


def _span(names: list[str], start: int, stop: int) -> str:
    return names[start] if stop - start == 1 else f"{names[start]} .. {names[stop - 1]}"


def measured_seconds(profiles: Sequence[LayerProfile], indices: Sequence[int]) -> float:
    """Forward seconds of some steps, NaN where they were not measured (on the meta device)."""
    return sum(profiles[i].forward_seconds for i in indices)
