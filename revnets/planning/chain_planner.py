"""The search of :func:`revnets.auto_checkpoint` over one chain of steps: the candidate plans
of each choice of reconstructing sequences, modelled, and accepted by an exact prediction
(NOTE [ Modelled search, exact acceptance ] in planning/search/options.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from revnets.checkpoint import Checkpointed
from revnets.facts.tensors import device_of
from revnets.graph.step import sequence_of, step_name
from revnets.memory import Predictor
from revnets.memory.fake_copies import held_elsewhere
from revnets.plan import Checkpoint, Decision, MemoryPlan, PartPlan, Reconstruct, Store
from revnets.planning.budget import (
    LossFn,
    training_step,
)
from revnets.planning.costs.layer_profile import LayerProfile
from revnets.planning.costs.profile import (
    bytes_of,
    meta_like,
    on_meta,
    profile_chain,
)
from revnets.planning.costs.step_times import ForwardTimes, chain_times
from revnets.planning.describe import (
    checkpoint_decision,
    describe_plan,
    measured_seconds,
    memory_plan,
)
from revnets.planning.planned import PlanChain, PlannedModel
from revnets.planning.search.budget import fits, no_fit
from revnets.planning.search.chain import candidate_plans, modelled_peaks, selective_plans
from revnets.planning.search.chain_model import SELECTIVE, Action, ChainModel, Segment, listed
from revnets.planning.search.compiled_costs import (
    compiled_costs,
    selective_stored_runs,
    selective_when_free,
)
from revnets.planning.search.nested import (
    group_bounds,
    group_chain,
    most_frugal_schedule,
    nested_schedule,
)
from revnets.planning.search.options import (
    Option,
    Segments,
    lowest_floor,
    nested_candidates,
    search,
    search_nested,
)
from revnets.reversible import ReversibleSequence

__all__ = ["ROOM_RATIO", "SELECTIVE_SHARES", "ChainPlanner", "grid_rooms"]

NESTED_GROUPS = 48  # nested schedules cost O(n^3): longer chains are grouped into this many runs
NESTED_SLOTS = 512  # and O(slots): memory in 1/512ths of the room, each term rounded up
NESTED_MIN_GAIN = 0.001  # below the floors, the least share of the peak worth nesting for
# Selective candidates: for the rooms of one fixed grid, ROOM_RATIO apart, that lie within
# these shares of the budget left for activations (NOTE [ Modelled search, exact acceptance ]).
SELECTIVE_SHARES = (0.9, 1.1)
ROOM_RATIO = 2 ** (1 / 24)


class ChainPlanner:
    """The search of :func:`auto_checkpoint` over one chain."""

    def __init__(
        self,
        model: nn.Module,
        chain: nn.Sequential,
        example_input: Any,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        measure_time: bool | ForwardTimes,
        compiled: bool = False,
        predictor: Predictor | None = None,
    ) -> None:
        self.model, self.chain, self.example_input = model, chain, example_input
        self.loss_fn, self.optimizer, self.compiled = loss_fn, optimizer, compiled
        self.sequences = {i: s for i, step in enumerate(chain)
                          if (s := sequence_of(step)) is not None}
        self.original = {i: _decision_of(s) for i, s in self.sequences.items()}
        meta_input = meta_like(example_input)
        self.input_state = {_first_input(chain): bytes_of(meta_input)} if len(chain) else None
        # One profile with every reversible sequence stored, one with every one reconstructing
        # (when there are any); other steps profile the same in both. Sizes come from the meta
        # device, the chain's own modules running on meta copies of their tensors.
        self.profiles: dict[type, list[LayerProfile]] = {}
        with on_meta(list(chain)):
            for decision in (Store(), Reconstruct()) if self.sequences else (Store(),):
                for sequence in self.sequences.values():
                    sequence.set_memory(decision)
                try:
                    self.profiles[type(decision)] = profile_chain(
                        list(chain), meta_input,
                        kernels_of=device_of(example_input, torch.device("cpu")), loss_fn=loss_fn)
                except RuntimeError as error:
                    raise ValueError(
                        f"auto_checkpoint: the steps of {type(model).__name__} cannot run on "
                        f"the meta device, where planning finds their sizes ({error}). Check "
                        f"that example_input is an input the model takes (its shape, dtype); "
                        f"a forward that reads a tensor's value (.item(), bool(): a coin "
                        f"torch.rand(()) < p) cannot be sized without running it. Draw with "
                        f"Python's random module, which planning replays"
                    ) from error
        self.profiles.setdefault(Reconstruct, self.profiles[Store])
        # Once: times only order the plans (NOTE [ Times measured once ]).
        times = (measure_time.of(chain) if isinstance(measure_time, ForwardTimes)
                 else chain_times(chain, example_input).seconds
                 if measure_time and device_of(example_input).type != "meta" else None)
        self.timed = times is not None
        if times is not None:
            for kind, profiles in self.profiles.items():
                self.profiles[kind] = [replace(p, forward_seconds=seconds)
                                       for p, seconds in zip(profiles, times)]
        if compiled:  # NOTE [ Compiled costs ] in search/compiled_costs.py
            for kind, profiles in self.profiles.items():
                self.profiles[kind] = compiled_costs(profiles, self.sequences)
        # What a step holds besides activations and parameter gradients (which the chain model
        # counts, NOTE [ Gradients in flight ]): the first guess of what an exact peak adds to a
        # modelled one.
        tensors = (*chain.parameters(), *chain.buffers())
        self.model_state = sum(t.numel() * t.element_size() for t in tensors)
        self.predictions = 0
        # Every plan's parameters and buffers made fake once.
        self.predictor = predictor or Predictor(held_elsewhere([model], []))

    # -- predictions ------------------------------------------------------------------------
    def peak(self, module: nn.Module) -> int:
        """The exact peak of training ``module`` (a chain running a plan), as the model
        ``auto_checkpoint`` returns: with every tensor the model holds, those the plan never
        reads too (a buffer a trace folded into constants: NOTE [ A planned model is the
        model ]), or of the model itself."""
        self.predictions += 1
        if module is not self.model:
            module = PlannedModel(self.model, module, PlannedModel.traced_by(self.chain),
                                  PlannedModel.reads_of(self.chain))
        return self.predictor.predict(
            training_step, (module, self.example_input, self.loss_fn, self.optimizer), {}
        ).peak_bytes

    def _assign(self, reconstructed: frozenset[int]) -> list[LayerProfile]:
        """Set the sequences' decisions for ``reconstructed``; their profiles."""
        for i, sequence in self.sequences.items():
            decision = self.original[i] if i in reconstructed else Store()
            sequence.set_memory(decision)
        return self._profiles_of(reconstructed)

    def _profiles_of(self, reconstructed: frozenset[int]) -> list[LayerProfile]:
        stored, rebuilt = self.profiles[Store], self.profiles[Reconstruct]
        return [rebuilt[i] if i in reconstructed else p for i, p in enumerate(stored)]

    # -- search -----------------------------------------------------------------------------
    def fit(self, budget: int) -> tuple[nn.Module, MemoryPlan]:
        """The plan the modelled search picks (NOTE [ Modelled search, exact acceptance ]),
        nested checkpoints below what one level reaches."""
        stored, rebuilt = self.profiles[Store], self.profiles[Reconstruct]
        # Reconstruct the sequences that save the most first: one choice per prefix.
        order = sorted(self.sequences, key=lambda i: rebuilt[i].saved_bytes - stored[i].saved_bytes)
        options: list[Option] = []
        for reconstructed in (frozenset(order[:k]) for k in range(len(order) + 1)):
            profiles = self._profiles_of(reconstructed)
            extra = sum(_seconds(profiles, i) for i in reconstructed)
            candidates = self._candidates(profiles, reconstructed, budget)
            modelled = modelled_peaks([plan for plan, _ in candidates], profiles,
                                      self.input_state, whole_inputs=False)
            options += [Option(reconstructed, plan, self._recompute(plan, profiles) + extra,
                               peak, sized)
                        for (plan, sized), peak in zip(candidates, modelled)]
        # Of equal cost, plans that checkpoint nothing first: where storing everything fits,
        # the model itself, also compiled, where selective checkpoints cost nothing too.
        options.sort(key=lambda o: (o.cost, any(r for _, _, r in o.segments), o.modelled))
        found, peaks = search(options, budget, self._predict, self.model_state)
        if found is None:
            low = lowest_floor(options, peaks)
            return self._nested(frozenset(self.sequences), budget, low, peaks[low])
        if self.compiled:
            found = self._selective_throughout(self._refined(found, peaks, budget), peaks, budget)
        profiles = self._assign(found.reconstructed)
        planned = self._apply(found.segments)
        plan = describe_plan(self.chain, self.sequences, self.original, self.input_state,
                             found.segments, self._shown(profiles), found.reconstructed,
                             peaks[found], budget)
        return planned, plan

    def _refined(self, found: Option, peaks: dict[Option, int], budget: int) -> Option:
        """The cheapest selective plan for the room the found plan's own prediction measured
        (the candidates were made for the room the parameters and buffers leave), predicted
        where it recomputes less, and taken where it fits (NOTE [ Modelled search, exact
        acceptance ])."""
        chosen, profiles = found.reconstructed, self._profiles_of(found.reconstructed)
        room = budget - (peaks[found] - found.modelled)
        plans = {self._cut_around(p, chosen) for p in selective_plans(
            profiles, grid_rooms(room / ROOM_RATIO, room)[-1:], self.input_state)}
        plans -= {o.segments for o in peaks if o.reconstructed == chosen}  # predicted already
        extra = sum(_seconds(profiles, i) for i in chosen)
        plans = sorted(plans, key=listed)
        modelled = modelled_peaks(plans, profiles, self.input_state, whole_inputs=False)
        better = min((Option(chosen, plan, self._recompute(plan, profiles) + extra, peak,
                             sized=False)
                      for plan, peak in zip(plans, modelled)),
                     key=lambda o: (o.cost, o.modelled), default=None)
        if better is None or better.cost >= found.cost:
            return found
        peaks[better] = self._predict(better)
        return better if fits(peaks[better], budget) else found

    def _selective_throughout(self, found: Option, peaks: dict[Option, int],
                              budget: int) -> Option:
        """``found`` with its stored runs selective where that costs nothing, predicted and
        taken where it fits, if it checkpoints at all (NOTE [ Stored runs under compile ] in
        search/compiled_costs.py)."""
        profiles = self._profiles_of(found.reconstructed)
        segments = selective_stored_runs(found.segments, profiles, found.reconstructed)
        if segments == found.segments or not any(r for _, _, r in found.segments):
            return found
        modelled = modelled_peaks([segments], profiles, self.input_state, whole_inputs=False)[0]
        option = replace(found, segments=segments, modelled=modelled, sized=False)
        peaks[option] = self._predict(option)
        return option if fits(peaks[option], budget) else found

    def _predict(self, option: Option) -> int:
        """The exact peak of ``option``; with nothing checkpointed, of the model itself (which
        then runs the plan: its own code, the sequences' decisions set)."""
        self._assign(option.reconstructed)
        planned = self._apply(option.segments)
        return self.peak(self.model if planned is self.chain else planned)

    def _candidates(
        self, profiles: list[LayerProfile], reconstructed: frozenset[int], budget: int
    ) -> list[tuple[Segments, bool]]:
        """Candidate plans, each with whether it was chosen on sizes alone. Which plans can meet
        a budget at all (the floors, and the smallest budget a refusal names) depends on those
        only, so that it is the same from run to run; measured times order the candidates and
        add selective ones (NOTE [ Modelled search, exact acceptance ])."""
        unmeasured = _unmeasured(profiles)
        sized = {
            self._cut_around([(a, b, Action.CHECKPOINT if number < len(plan) - 1 else Action.STORE)
                              for number, (a, b) in enumerate(plan)],
                             reconstructed)
            for plan in candidate_plans(unmeasured, input_state=self.input_state)
        }
        # Selective plans for rooms near the budget asked, the parameters and buffers taken off
        # as a first guess of what an exact peak adds, with some slack for what the chain model
        # leaves out; the rooms of a fixed grid, never the budget's own (NOTE [ Modelled
        # search, exact acceptance ]).
        room = budget - self.model_state
        timed = {self._cut_around(plan, reconstructed) for plan in selective_plans(
            profiles, grid_rooms(*(share * room for share in SELECTIVE_SHARES)),
            self.input_state)}
        timed -= sized
        key = lambda p: (self._recompute(p, profiles), len(p))  # noqa: E731
        return [(p, True) for p in sorted(sized, key=key)] + [
            (p, False) for p in sorted(timed, key=key)]

    # A reconstructing sequence keeps neither its input nor its internals: checkpointing it would
    # keep its input and run it once more. So every plan cuts around it and runs it as is.
    # Compiled, checkpoints of steps that keep no product are selective (NOTE [ Selective
    # segments under compile ] in planned.py).
    def _cut_around(self, plan: Sequence[Segment], reconstructed: frozenset[int]) -> Segments:
        segments: list[Segment] = []
        for start, stop, recompute in plan:
            cuts = sorted({start, stop, *(c for i in reconstructed if start <= i < stop
                                          for c in (i, i + 1))})
            for a, b in zip(cuts, cuts[1:]):
                alone = b - a == 1 and a in reconstructed
                segments.append((a, b, Action.STORE if alone else recompute))
        return selective_when_free(segments, self.profiles[Store]) if self.compiled \
            else tuple(segments)

    @staticmethod
    def _recompute(plan: Segments, profiles: list[LayerProfile]) -> float:
        return sum(_seconds(profiles, i) for a, b, recompute in plan if recompute
                   for i in range(a, b)
                   if recompute != SELECTIVE or not profiles[i].selective_bytes)

    def _apply(self, plan: Segments) -> nn.Module:
        """The chain running ``plan``, over the same modules."""
        if not any(checkpointed for _, _, checkpointed in plan):
            return self.chain
        steps: list[nn.Module] = []
        for start, stop, recompute in plan:
            run = list(self.chain)[start:stop]
            if recompute:
                run = [Checkpointed(nn.Sequential(*run), checkpoint_decision(recompute))]
            steps += run
        return PlanChain(*steps)

    def _nested(
        self, reconstructed: frozenset[int], budget: int, floor: Option, floor_peak: int
    ) -> tuple[nn.Module, MemoryPlan]:
        """Below what one level of checkpoints reaches (``floor``, the lowest floor, which
        peaked at ``floor_peak``): checkpoints within recomputations (NOTE [ Modelled search,
        exact acceptance ])."""
        low_peak, how = floor_peak, (
            f"{len(floor.reconstructed)} reversible sequences reconstructing, segments "
            f"{[(a, b) for a, b, _ in floor.segments]}")
        profiles = self._assign(reconstructed)
        layers, grouped = group_chain(list(self.chain), profiles, NESTED_GROUPS)
        # Steps counted rather than timed: the schedules are the same in every run, so the
        # budget a refusal names plans when asked, whatever the times measured then.
        counted = group_chain(list(self.chain), _unmeasured(profiles), NESTED_GROUPS)[1]
        frugal = most_frugal_schedule(grouped)
        # No plan keeping the groups whole holds less, at some moment, than the chain model's
        # least for them. Where the lowest floor, as predicted and as modelled, is within
        # NESTED_MIN_GAIN of that, nested checkpoints are not searched: by the model they save
        # little (one of 85 refusals measured would have named 0.13 % less) and predictions
        # cost seconds on a large model (NOTE [ Modelled search, exact acceptance ]). Sizes
        # and the floor decide, never the budget.
        least = ChainModel.of(profiles, self.input_state).least_bytes(
            group_bounds(profiles, NESTED_GROUPS))
        above = max(low_peak - self.model_state, floor.modelled) - least
        if frugal is None or above < NESTED_MIN_GAIN * low_peak:
            raise no_fit(budget, low_peak, how)
        candidates = nested_candidates(
            frugal, lambda room: nested_schedule(counted, room, slots=NESTED_SLOTS))
        schedule, peak = search_nested(
            candidates, budget, lambda schedule: self.peak(schedule.apply(layers)))
        if not fits(peak, budget):
            if peak < low_peak:
                low_peak, how = peak, f"nested checkpoints {schedule.tree}"
            raise no_fit(budget, low_peak, how)
        parts = [*self._sequence_parts(self._shown(profiles), reconstructed),
                 PartPlan(f"nested checkpoints {schedule.tree}", Checkpoint(),
                          recompute_seconds=math.nan)]
        return schedule.apply(layers), memory_plan(parts, reconstructed, True, peak, budget)

    # -- the plan as an object --------------------------------------------------------------
    def _shown(self, profiles: list[LayerProfile]) -> list[LayerProfile]:
        """As a plan shows them: no seconds unmeasured (not operations: NOTE [ Compiled costs ])."""
        return profiles if self.timed else _unmeasured(profiles)

    def _sequence_parts(
        self, profiles: list[LayerProfile], reconstructed: frozenset[int]
    ) -> list[PartPlan]:
        return [
            PartPlan(step_name(self.chain[i], i),
                     self.original[i] if i in reconstructed else Store(),
                     profiles[i].saved_bytes,
                     measured_seconds(profiles, range(i, i + 1)) if i in reconstructed else 0.0)
            for i in self.sequences
        ]


def _unmeasured(profiles: Sequence[LayerProfile]) -> list[LayerProfile]:
    return [replace(p, forward_seconds=math.nan) for p in profiles]


def grid_rooms(low: float, high: float) -> list[int]:
    """The rooms of the fixed grid (``ROOM_RATIO ** k`` bytes) from ``low`` to ``high``."""
    if high < 1:
        return []
    first = math.ceil(math.log(max(low, 1), ROOM_RATIO) - 1e-9)
    last = math.floor(math.log(high, ROOM_RATIO) + 1e-9)
    return [int(ROOM_RATIO**k) for k in range(first, last + 1)]


def _decision_of(sequence: ReversibleSequence) -> Decision:
    """How a sequence reconstructs when the planner lets it (its own options kept)."""
    return sequence.memory if isinstance(sequence.memory, Reconstruct) else Reconstruct()


def _seconds(profiles: Sequence[LayerProfile], index: int) -> float:
    seconds = profiles[index].forward_seconds
    return 1.0 if math.isnan(seconds) else seconds  # unmeasured: every step counts one


def _first_input(chain: nn.Sequential) -> str:
    names = getattr(chain[0], "inputs", None) or ["input"]
    return names[0]
