"""Forward times measured once, for any number of plans of one model.

# NOTE [ Times measured once ]
# What fits a budget is decided on sizes alone; measured forward times only order the candidate
# plans by what they recompute, and make the selective ones (NOTE [ Modelled search, exact
# acceptance ] in planning/search/options.py). Measured anew in every call of
# ``auto_checkpoint``, they bring that
# measurement's noise into the order: two calls at one budget can take different plans, and a
# sweep of budgets can get a higher peak at a smaller one. Planned on one ``ForwardTimes``, every
# call ranks the same plans the same way, and a smaller budget's candidates are the larger
# one's, or the cheapest plans for smaller rooms of the same grid: it gets the same plan, or one
# that fitted where the larger budget's did not, as far as the modelled ranking finds them
# (``benchmarks/budget_sweep.py --measured``). The times are a value the caller holds and
# passes, never one that planning keeps between calls.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from revnets.facts.tensors import device_of
from revnets.graph.step import sequence_of, step_name
from revnets.graph.trace_state import Attributes
from revnets.plan import Store
from revnets.planning.costs.profile import as_leaf, clock, timing_input, writable, writes_its_input
from revnets.replay import frozen_running_stats

__all__ = ["ForwardTimes", "chain_times"]


@dataclass(frozen=True)
class ForwardTimes:
    """The forward seconds of each step of the chain a model is planned as, by the step's name
    (NOTE [ Times measured once ]). Pass it as ``auto_checkpoint``'s ``measure_time``."""

    steps: tuple[str, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "seconds", tuple(self.seconds))
        if len(self.seconds) != len(self.steps):
            raise ValueError(f"ForwardTimes: {len(self.seconds)} seconds for "
                             f"{len(self.steps)} steps; give one for each step")
        bad = next((s for s in self.seconds if not isinstance(s, numbers.Real)
                    or isinstance(s, bool) or not 0 <= s < math.inf), None)  # NaN too
        if bad is not None:
            raise ValueError(f"ForwardTimes: seconds must be finite numbers, at least 0 "
                             f"(got {bad!r})")

    def of(self, chain: Sequence[nn.Module]) -> list[float]:
        """The seconds of ``chain``'s steps; a chain of other steps is refused by name."""
        names = tuple(step_name(step, i) for i, step in enumerate(chain))
        if names != self.steps:
            other = next((i for i, (a, b) in enumerate(zip(names, self.steps)) if a != b),
                         min(len(names), len(self.steps)))
            raise ValueError(
                f"auto_checkpoint: measure_time holds the forward times of another chain "
                f"({len(self.steps)} steps; this model is planned as {len(names)}, the first "
                f"unlike one at step {other}); measure them on this model: "
                f"revnets.forward_times(model, example_input)"
            )
        return list(self.seconds)

    def __repr__(self) -> str:
        return (f"ForwardTimes({len(self.steps)} steps, "
                f"{sum(self.seconds) * 1e3:.3f} ms forward)")


def chain_times(chain: nn.Sequential, example_input: Any) -> ForwardTimes:
    """The forward times of ``chain``'s steps, its reversible sequences left storing, and what
    its modules hold as it was (an average a forward updates, a kept-whole module's counter or
    cache: ``Attributes``)."""
    for step in chain:
        if (sequence := sequence_of(step)) is not None:
            sequence.set_memory(Store())
    kept = Attributes(chain.modules())
    timed = timing_input(example_input)
    try:
        with frozen_running_stats(list(chain)):
            try:
                seconds = _forward_seconds(chain, timed)
            except RuntimeError:
                if timed is example_input:
                    raise
                # It runs at its own batch size only (a constant shaped to the batch).
                seconds = _forward_seconds(chain, example_input)
    finally:
        kept.restore()
    return ForwardTimes(tuple(step_name(step, i) for i, step in enumerate(chain)),
                        tuple(seconds))


def _forward_seconds(chain: nn.Sequential, example_input: Any) -> list[float]:
    """Each step's forward time, run once on what the step before made, as a leaf (each step's
    graph its own, as the planner's profile runs it), with copies, made before the clock
    starts, of what it writes in place. Timed bare: the profile's bookkeeping around each step
    (its saved tensors, its kept outputs) took as long again as the forward."""
    device = device_of(example_input, torch.device("cpu"))
    now = clock(device)
    leaf = tree_map(as_leaf, example_input)
    seconds = []
    for step in chain:
        copies = writes_its_input(step)
        x = writable(step, leaf) if copies else leaf
        start = now()
        try:
            y = step(x)
        except RuntimeError:  # writes its input in place somewhere inside
            if copies:
                raise
            x = writable(step, leaf, everything=True)
            start = now()
            y = step(x)
        seconds.append(now() - start)
        leaf = tree_map(as_leaf, y)
    return seconds

