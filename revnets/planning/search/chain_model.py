"""The chain model: what a segmentation of a chain holds at its peak, from the chain's profiles.

A search ranks plans by this model and exact predictions decide (NOTE [ Modelled search, exact
acceptance ] in ``options.py``); the closer it follows the real step, the fewer predictions a
search needs and the more alike its errors are from plan to plan.

# NOTE [ A storage saved twice is held once ]
# A value passed between steps may be saved by several of them (ReLU saves its output and the
# next convolution its input; the step after a cut saves, as its input, the value the checkpoint
# at that cut keeps). It is one tensor. The model counts each such storage once: a segment
# [a, b) holds what its steps save of the values made from cut a on, once each, and what they
# save of their own intermediates; the values live at cut a are the checkpoint's. In prefix
# sums, held(a, b) = G[b] - G[a] - Y(a, b): G[k] counts each saved storage at the first step
# that saves it (intermediates at their step), Y(a, b) the storages live at cut a that one of
# steps a..b-1 is the first to save (a squeeze-excitation block's input, saved by its last
# multiplication; a ViT's input, saved by the patch embedding several steps on). Likewise the
# other way: of a value live at cut k, what the segment ending there holds already (a stored
# segment's ReLU saves its output, a selective one keeps its convolution's output) is the
# checkpoint's too, counted once with the values live at k. Counted twice, such plans were
# modelled a value high, and a search passed over them for dearer ones: a smaller budget got
# a higher peak (tests/test_step_times.py).
#
# NOTE [ What a stored segment alone holds ]
# A value live at a stored segment's start that no checkpoint keeps and its caller does not
# hold (the output of a checkpointed segment before it) is held only by what the segment's
# steps save of it, and is freed once the first of them is backpropagated: a block's input that
# a checkpoint passed on, saved by the block's first convolution and its shortcut, is gone
# before the two parts of its gradient are summed (NOTE [ Gradients in flight ]). ``peak``
# counts such a value (``freed``) from that first saving step on, as if the step had made it:
# G counts it there, or, where a step before the segment saved it first, the segment adds it
# at its own first saver. Counted as kept for the whole segment instead, plans storing from
# such a cut were modelled a value high (tests/test_memory_model.py). The programmes
# (chain.py) still count every value live at a stored segment's start as kept, on the safe
# side.
#
# NOTE [ Gradients in flight ]
# A training step starts from freed gradients. While step j of segment [a, b) is
# backpropagated, the segment still holds what steps a..j saved (what the steps after j first
# saved is freed), the parameter gradients of steps j.. exist (grads_after[j], each gradient
# counted at the last step that uses its parameter, whose backward runs first), and so do the
# gradients of the values live after step j and the parts it makes of those it reads (a stem's
# gradients inside a segment outweigh the one arriving at its end), each tensor once: an
# addition hands its output's gradient to both operands, a view a view of it, and a residual
# that step j only passes on has one gradient, not two (``gradient_flow`` in costs/gradients.py,
# plan-independent). A value several steps read gets its gradient in parts, the later
# reader's first (a downsampling block's input: its shortcut's, then its first convolution's).
# Under a TorchDispatchMode, as measure_memory and predict_memory run a step, autograd adds
# each further part out of place (plain eager adds in place): just after step j's backward,
# the gradient so far, the part and their sum exist together, while what step j first saved
# and its outputs' gradients are freed (``summing``). Left out, such a moment was modelled a
# value low and the plans peaking there ranked too low: a smaller budget got a higher measured
# peak (ResNet-18, tests/test_memory_model.py). The model takes the most of these moments
# over j; after the whole backward, every parameter gradient and the input. Before
# the last step's backward comes the loss's, while the chain holds all it saved: the last
# profile carries the most the loss holds (``loss_bytes``, measured on the meta device with
# the planner's loss function), which a wide head's cross-entropy makes several times its
# output.
# Counting the gradients as a constant instead made the model's error depend on where the peak
# falls: a ResNet's last stage holds most of its parameters, whose gradients are made while
# the early stages' activations still wait for their backward.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from revnets.planning.costs.gradients import NO_MOMENT, GradientFlow, gradient_flow
from revnets.planning.costs.layer_profile import LayerProfile

__all__ = ["NO_MOMENT", "SELECTIVE", "Action", "ChainModel", "Segment", "forbidden_cuts", "listed",
           "step_costs"]

# A segment: (start, stop, recompute), recompute False (stored), True (checkpointed) or
# "selective" (a selective checkpoint).


class Action(enum.IntEnum):
    """What a plan does with a segment's activations, from the search to the plan described:
    store them, checkpoint the segment (keep its input, run it again in backward), or
    checkpoint it selectively (keep its products too: NOTE [ Selective recomputation ] in
    revnets/facts/operators.py). An integer where the dynamic programme's arrays hold it, false
    only for STORE (a segment that recomputes nothing); how a reversible sequence runs is the
    plan's other choice (``Option.reconstructed``), not a segment's action."""

    STORE = 0
    CHECKPOINT = 1
    SELECTIVE = 2


SELECTIVE = Action.SELECTIVE
Segment = tuple[int, int, Action]  # (start, stop, action)
_SPELLED = {Action.STORE: False, Action.CHECKPOINT: True, Action.SELECTIVE: "selective"}


def listed(segments: Sequence[Segment]) -> str:
    """The order a set of plans is listed in where nothing else orders them: their segments'
    text as it always was (an action spelled False, True or 'selective'), so that of equal
    cost and peak the same plan comes first."""
    return repr(tuple((a, b, _SPELLED[Action(r)]) for a, b, r in segments))


def forbidden_cuts(profiles: Sequence[LayerProfile]) -> set[int]:
    """Cuts a checkpoint must not be placed at: between a value's producer and a layer that
    overwrites it in place, the checkpoint would keep a value that is changed before the
    recomputation reads it (ReLU(inplace=True) right after a cut; ``out += identity``)."""
    forbidden: set[int] = set()
    for p in profiles:
        if p.mutates_from is not None:
            forbidden.update(range(p.mutates_from + 1, p.index + 1))
    return forbidden


def step_costs(profiles: Sequence[LayerProfile]) -> list[float]:
    """Measured forward seconds per layer; one per layer when not measured (meta device)."""
    if any(math.isnan(p.forward_seconds) for p in profiles):
        return [1.0] * len(profiles)
    return [p.forward_seconds for p in profiles]


@dataclass(frozen=True)
class ChainModel:
    """What a plan of a chain holds, as arrays made once for the many plans and budgets a
    search asks about: prefix sums over the steps of what they save (NOTE [ A storage saved
    twice is held once ]), their parameter gradients (NOTE [ Gradients in flight ]), cost, what
    they keep selectively and skip recomputing, and for each cut the values live there."""

    n: int
    forbidden: frozenset[int]
    step_saved: np.ndarray  # what each step saves, counted alone
    saves_nothing: list[bool]  # not even a parameter
    first_saved: np.ndarray  # G
    # The storages saved of values live at a cut before the step first saving them: that step,
    # the first cut they are live at, their bytes; by that step (Y of the NOTE).
    value_first: np.ndarray
    value_seen: np.ndarray
    value_bytes: np.ndarray
    value_names: np.ndarray
    grads_after: np.ndarray
    flow: GradientFlow
    # While step j is backpropagated: G[j + 1] + grads_after[j] + the value gradients in flight;
    # just after it, where it summed a gradient's parts (NO_MOMENT elsewhere), G[j] + ... .
    backward: np.ndarray
    summing: np.ndarray
    times: np.ndarray
    kept_prefix: np.ndarray
    skipped_prefix: np.ndarray
    unsafe_prefix: np.ndarray
    # For cut k: the values live there sorted by the cut they first appeared at, so that what a
    # checkpoint at k adds to one at i (values that appeared after i) is a suffix sum.
    appeared: list[np.ndarray]
    added_after: list[np.ndarray]
    # Alike, of the same values what the step making each keeps of it in a selective checkpoint
    # (one storage with what a checkpoint at k keeps: NOTE [ A storage saved twice is held
    # once ]).
    kept_after: list[np.ndarray]
    saved_after: list[np.ndarray]  # and what the steps before k save of them
    saved_live: list[dict[str, tuple[int, int]]]  # the same by value: (first cut, bytes)
    states: list[dict[str, int]]
    state_bytes: list[int]
    saved_names: list[frozenset[str]]  # per step: the values whose storages it saves
    saved_storages: list[dict[tuple[str, int], int]]  # and those storages, with their bytes
    selective_bytes: np.ndarray
    kept_values: list[dict[str, int]]  # per step: of what it keeps, its values', by name

    @classmethod
    def of(
        cls, profiles: Sequence[LayerProfile], input_state: dict[str, int] | None
    ) -> ChainModel:
        n = len(profiles)
        costs = step_costs(profiles)
        selective = [p.selective_bytes for p in profiles]
        states = [input_state or {"input": 0}] + [p.state for p in profiles]
        first_seen: dict[str, int] = {}
        for c, state in enumerate(states):
            for name in state:
                first_seen.setdefault(name, c)
        counted = []  # per step: its intermediates and the storages it is the first to save
        first_step: set[tuple[str, int]] = set()
        # (first saving step, live from cut, bytes, value)
        live: list[tuple[int, int, int, str]] = []
        saved_of: dict[str, list[tuple[int, int]]] = {}  # by value: (first saving step, bytes)
        for p in profiles:
            new = 0
            for key, nbytes in p.saved_values.items():
                if key not in first_step:
                    first_step.add(key)
                    new += nbytes
                    saved_of.setdefault(key[0], []).append((p.index, nbytes))
                    seen = first_seen.get(key[0], 0)
                    if seen <= p.index:  # live at cuts seen..p.index, first saved by p
                        live.append((p.index, seen, nbytes, key[0]))
            counted.append(p.saved_bytes - sum(p.saved_values.values()) + new)
        # Of each value live at a cut, what the steps before the cut save of it (a ReLU its
        # output), and what the step making it keeps in a selective checkpoint: one storage
        # with what a checkpoint at the cut keeps.
        kept_values = [{name: min(nbytes, states[p.index + 1].get(name, nbytes))
                        for name, nbytes in p.selective_values.items()} for p in profiles]
        appeared, added_after, saved_after, kept_after = [], [], [], []
        saved_live: list[dict[str, tuple[int, int]]] = []
        for k, state in enumerate(states):
            rows = sorted((first_seen[name], nbytes,
                           sum(b for step, b in saved_of.get(name, ()) if step < k),
                           kept_values[first_seen[name] - 1].get(name, 0) if first_seen[name]
                           else 0, name) for name, nbytes in state.items())
            appeared.append(np.array([row[0] for row in rows], dtype=np.int64))
            for column, sums in ((1, added_after), (2, saved_after), (3, kept_after)):
                nbytes = np.array([row[column] for row in rows] + [0], dtype=np.int64)
                sums.append(np.cumsum(nbytes[::-1])[::-1])
            saved_live.append({row[4]: (row[0], row[2]) for row in rows if row[2]})
        live.sort()
        first_saved = np.cumsum([0, *counted], dtype=np.int64)
        grads_after = np.cumsum([0] + [p.grad_bytes for p in profiles][::-1],
                                dtype=np.int64)[::-1]
        state_bytes = np.array([sum(state.values()) for state in states], dtype=np.int64)
        flow = gradient_flow(states, profiles)  # NOTE [ Gradients in flight ]
        backward = first_saved[1:] + grads_after[:-1] + flow.during
        summing = np.where(flow.after > NO_MOMENT,
                           first_saved[:-1] + grads_after[:-1] + flow.after, NO_MOMENT)
        if n:
            # The loss's backward, before the last step's: all the chain saved, and the most the
            # loss holds, measured from a leaf output, less that output's gradient (made as the
            # loss's own temporaries go; the last step's moment counts it).
            loss = first_saved[n] + profiles[-1].loss_bytes - state_bytes[n]
            backward[-1] = max(backward[-1], loss)
        return cls(
            n=n,
            forbidden=frozenset(forbidden_cuts(profiles)),
            step_saved=np.array([p.saved_bytes for p in profiles], dtype=np.int64),
            saves_nothing=[p.saves_nothing for p in profiles],
            first_saved=first_saved,
            value_first=np.array([v[0] for v in live], dtype=np.int64),
            value_seen=np.array([v[1] for v in live], dtype=np.int64),
            value_bytes=np.array([v[2] for v in live], dtype=np.int64),
            value_names=np.array([v[3] for v in live], dtype=object),
            grads_after=grads_after,
            flow=flow,
            backward=backward,
            summing=summing,
            times=np.cumsum([0.0, *costs], dtype=np.float64),
            kept_prefix=np.cumsum([0, *selective], dtype=np.int64),
            skipped_prefix=np.cumsum(
                [0.0] + [cost if b else 0.0 for b, cost in zip(selective, costs)]),
            unsafe_prefix=np.cumsum([0] + [not p.selective_safe for p in profiles]),
            appeared=appeared,
            added_after=added_after,
            kept_after=kept_after,
            saved_after=saved_after,
            saved_live=saved_live,
            states=states,
            saved_names=[frozenset(name for name, _ in p.saved_values) for p in profiles],
            saved_storages=[p.saved_values for p in profiles],
            state_bytes=state_bytes.tolist(),
            selective_bytes=np.array(selective, dtype=np.int64),
            kept_values=kept_values,
        )

    def live_saved(self, a: int, b: int, freed: frozenset[str] = frozenset()) -> int:
        """Y(a, b) of the NOTE: what steps a..b-1 are the first to save of the values live at
        cut a (but of ``freed``: NOTE [ What a stored segment alone holds ])."""
        return int(self.value_bytes[self._inside(a, b, freed)].sum())

    def _inside(self, a: int, b: int, freed: frozenset[str]) -> np.ndarray:
        inside = (self.value_seen <= a) & (self.value_first >= a) & (self.value_first < b)
        if freed:
            inside &= ~np.isin(self.value_names, list(freed))
        return inside

    def _saved_before(self, a: int, b: int, freed: frozenset[str]) -> np.ndarray:
        """By step of [a, b): of ``freed``, what the first step saving each there saves of it,
        where a step before ``a`` saved it first (G counts it there)."""
        saving = np.zeros(b - a, dtype=np.int64)
        for name in freed:
            nbytes = self.saved_live[a].get(name, (0, 0))[1]
            if nbytes:
                saving[next(j for j in range(a, b) if name in self.saved_names[j]) - a] += nbytes
        return saving

    @functools.cached_property
    def moments(self) -> np.ndarray:
        """Per step, the more of ``backward`` and ``summing``: one array where no first save of
        a value live at a cut tells them apart (``_optimal`` in chain.py)."""
        return np.maximum(self.backward, self.summing)

    @functools.cached_property
    def last_backpropagated(self) -> np.ndarray:
        """while_backpropagated(k, n) for every cut k before the end: the last segment's."""
        return np.array([self.while_backpropagated(k, self.n) for k in range(self.n)],
                        dtype=np.int64)

    @property
    def end_bytes(self) -> int:
        """What the step holds once backpropagated, whatever the plan: every parameter
        gradient and the input."""
        return int(self.state_bytes[0] + self.grads_after[0])

    def least_bytes(self, cuts: Sequence[int] | None = None) -> int:
        """What every plan that cuts the chain only at ``cuts`` (0 and n among them; every cut
        where None) holds at some moment, in this model: once backpropagated, every parameter
        gradient and the input (``end_bytes``); while step j of the run [a, b) between two
        cuts is backpropagated, what steps a..j save (each storage once: the run is stored or
        recomputed whole before its backward), the parameter gradients of step j and the steps
        after it, the value gradients in flight (but the input's: ``GradientFlow``), and the
        chain's input, which its caller holds throughout."""
        cuts = range(self.n + 1) if cuts is None else cuts
        inputs = self.states[0]
        least = self.end_bytes
        for a, b in zip(cuts, cuts[1:]):
            saved: set[tuple[str, int]] = set()
            held = 0  # what steps a..j save, each storage once
            of_inputs = dict.fromkeys(inputs, 0)  # what they save of the input's storages
            for j in range(a, b):
                storages = self.saved_storages[j]
                held += int(self.step_saved[j]) - sum(storages.values())  # intermediates
                for key, nbytes in storages.items():
                    if key not in saved:
                        saved.add(key)
                        held += nbytes
                        if key[0] in of_inputs:
                            of_inputs[key[0]] += nbytes
                held_inputs = sum(max(0, nbytes - of_inputs[name])
                                  for name, nbytes in inputs.items())
                # The input's gradient may not exist (data needs none): its value counts.
                moment = (held + held_inputs + int(self.grads_after[j])
                          + int(self.flow.during[j]) - (int(self.flow.made[j]) if not j else 0))
                least = max(least, moment)
        return least

    def held(self, a: int, b: int, freed: frozenset[str] = frozenset()) -> int:
        """What segment [a, b) holds once it has run forward (NOTE [ A storage saved twice is
        held once ]; ``freed``: NOTE [ What a stored segment alone holds ])."""
        saving = int(self._saved_before(a, b, freed).sum()) if freed else 0
        return int(self.first_saved[b] - self.first_saved[a]) - self.live_saved(a, b, freed) \
            + saving

    def while_backpropagated(self, a: int, b: int, freed: frozenset[str] = frozenset()) -> int:
        """The most segment [a, b) holds with the gradients in flight while it is
        backpropagated (NOTE [ Gradients in flight ]); of the values live at ``a``, those in
        ``freed`` as it saves them (NOTE [ What a stored segment alone holds ])."""
        if a == b:
            return self.held(a, b) + self.state_bytes[b]
        # While step j is backpropagated the segment holds G[j + 1] - G[a] - Y(a, j + 1).
        inside = self._inside(a, b, freed)
        checkpointed = np.zeros(b - a, dtype=np.int64)  # Y(a, j + 1) - Y(a, j), by step j
        np.add.at(checkpointed, self.value_first[inside] - a, self.value_bytes[inside])
        if freed:
            checkpointed -= self._saved_before(a, b, freed)
        before = np.cumsum(checkpointed)
        during = (self.backward[a:b] - before).max()
        # Once step j is, what it first saved is freed: Y(a, j).
        after = (self.summing[a:b] - before + checkpointed).max()
        return int(max(during, after) - self.first_saved[a])

    @functools.cached_property
    def saves_for_free(self) -> bool:
        """Whether some step saves bytes and costs no time to recompute (a compiled model's cheap
        steps): then plans holding different bytes cost the same (NOTE [ Of equal cost, the
        lowest ] in ``chain.py``)."""
        return bool(np.any((self.step_saved > 0) & (np.diff(self.times) == 0)))

    def cost(self, segments: Sequence[Segment]) -> float:
        """What ``segments`` recompute: each checkpointed segment's time, a selective one's
        less its kept steps'."""
        total = 0.0
        for a, b, recompute in segments:
            if recompute:
                total += float(self.times[b] - self.times[a])
            if recompute == SELECTIVE:
                total -= float(self.skipped_prefix[b] - self.skipped_prefix[a])
        return total

    def peak(self, segments: Sequence[Segment], whole_inputs: bool = True) -> int:
        """The peak of ``segments`` (activations and the parameter gradients in flight): while
        a segment is recomputed (or first run, if stored) and backpropagated, the values live at
        every cut so far (a value crossing several cuts is one tensor; but a checkpoint whose
        steps save nothing keeps nothing: its saved tensors hold its inputs), what stored segments
        before it save and selective ones keep, and what it holds while it is backpropagated,
        with the gradients in flight; after the backward, every parameter gradient and the
        input. The programmes count every value live at a stored segment's start as kept (on
        the safe side, and a point's bytes then do not depend on the segment after it); without
        ``whole_inputs``, only those the segment saves or passes on are (``_needed``), as a
        search ranks its options; but the chain's input, which its caller holds throughout."""
        kept: dict[str, int] = {}
        held = peak = 0
        for start, stop, recompute in segments:
            freed: frozenset[str] = frozenset()
            if recompute and start and all(self.saves_nothing[start:stop]):
                pass  # it saves nothing: nothing holds its checkpoint's inputs
            elif recompute or whole_inputs or not start:
                kept.update(self.states[start])
            else:
                saved = frozenset().union(*self.saved_names[start:stop])
                needed = self._needed(start, stop, saved)
                # NOTE [ What a stored segment alone holds ]
                freed = frozenset(name for name in needed if name in saved and name not in kept)
                kept.update({name: nbytes for name, nbytes in needed.items() if name not in freed})
            peak = max(peak, sum(kept.values()) + held
                       + self.while_backpropagated(start, stop, freed))
            if recompute == SELECTIVE:  # what it keeps stays until its backward
                values = {name: nbytes for i in range(start, stop)
                          for name, nbytes in self.kept_values[i].items()}
                held += int(self.selective_bytes[start:stop].sum()) - sum(values.values())
                kept.update(values)  # values live at a later cut: one storage with what it keeps
            elif not recompute:
                values = {name: nbytes for name, (seen, nbytes) in self.saved_live[stop].items()
                          if seen > start}
                held += self.held(start, stop, freed) - sum(values.values())
                kept.update(values)
        return max(peak, self.end_bytes)

    def _needed(self, start: int, stop: int, saved: frozenset[str]) -> dict[str, int]:
        """Of the values live at ``start``, those stored segment [start, stop) leaves alive once
        run: what its steps save (``saved``), and what is still live at ``stop`` (the rest is
        freed as its forward goes on: a Linear's output that the Tanh after it does not save)."""
        return {name: nbytes for name, nbytes in self.states[start].items()
                if name in saved or name in self.states[stop]}

    def distinct_cuts(self) -> list[int]:
        """The cuts worth a mixed plan's choosing: of each run of cuts joined by free steps
        (steps that save, keep, make and change nothing for backward: views, reshapes), the
        allowed one with the fewest live bytes, and of those the one whose live values the
        steps after it save the most of (a segment starting there holds them once). Where free
        steps pass on their input's storage (views), any cut of a run bounds segments of the
        same saved and kept bytes (the free steps only move from one segment to the next), so
        the others bound the same segments with no fewer bytes live at the cut, or save the
        free steps' few microseconds of recomputation; where one copies (``contiguous``), the
        choice is a good one, not always the best. Long traced chains are mostly such steps
        (1,158 of MaxViT-T's 1,587), and the mixed programme's work grows with the square of
        the cuts it visits."""
        free = ((self.step_saved == 0) & (np.diff(self.kept_prefix) == 0)
                & (np.diff(self.unsafe_prefix) == 0) & (np.diff(self.grads_after) == 0))
        chosen: list[int] = []
        run: list[int] = []
        for k in range(1, self.n + 1):
            if k < self.n and k not in self.forbidden:
                run.append(k)
            if k == self.n or not free[k]:  # step k is not free: the run of cuts ends at k
                if run:
                    chosen.append(min(run, key=lambda c: (
                        self.state_bytes[c], -self.live_saved(c, self.n))))
                run = []
        return chosen
