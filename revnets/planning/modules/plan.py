"""Plans of modules, for models torch.fx cannot trace: the model's own forward runs, and some of
the modules it calls run as checkpoints (NOTE [ Plans of whole modules ]): CheckpointedModules,
and the search that chooses them."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from revnets.memory import Predictor
from revnets.plan import Checkpoint, MemoryPlan, PartPlan, Reconstruct, Store
from revnets.planning.budget import LossFn, training_step
from revnets.planning.model_view import ModelView
from revnets.planning.modules.install import CheckpointedForwards, Part, is_inside, names_of
from revnets.planning.modules.profile import ModuleProfile, ModuleProfiler
from revnets.planning.search.budget import fits, no_fit
from revnets.reversible import ReversibleSequence

__all__ = ["CheckpointedModules", "plan_modules"]

# NOTE [ Plans of whole modules ]
# A model whose own forward torch.fx cannot trace (Python control flow on shapes: CrossViT) has
# no chain of steps to cut, but it has its modules, each called by its code. Its plan is a set
# of them that run as checkpoints, one inside another where one level is not enough (NOTE
# [ Nested checkpoints ] in install.py). For a step with grad enabled, each
# gets an instance attribute ``forward`` over its class's, which runs that forward as a
# checkpoint (revnets.checkpoint: generators, module state and the hooks of its submodules
# replayed), removed after. The module itself stays where it is: the model's code sees the same
# object (its type, its mode, its attributes, what it writes to it, ``self.modules()``), and its
# own hooks run once around the checkpoint, as ``nn.Module.__call__`` runs them around any
# forward, which reads as the module's own (its signature). (A stand-in module swapped in at its
# parent was seen by that code: ``isinstance`` failed, writes landed on the stand-in,
# ``modules()`` met both.) Only the thread running the step checkpoints: the forward goes back
# when the last step using it ends, unless the step set one of its own. A module whose input
# is written between its call and the loss, or a tensor its modules hold (replaced, or written
# in place), is never checkpointed: its recomputation would read the written value, or its
# replay refuse it. Other state they hold that code changes after the call (a config dict, a
# float the parent changes, transformers' ``config.problem_type`` its loss sets) is put back as
# the call found it for the recomputation (NOTE [ Replay ], rule 2).
# Its inputs go to torch's checkpoint as positional tensors, which torch checks for writes
# before it recomputes. A module is checkpointed whole (``Checkpoint()``: its inputs kept) or
# selectively (``Checkpoint(selective=True)``: the outputs of its matrix products and attention
# kept too, the rest recomputed: NOTE [ Selective recomputation ] in revnets/facts/operators.py),
# never selectively where the forward writes in place to such an output after making it.
# A prediction of the unplanned step profiles every module call: the storages it saves for
# backward besides its inputs and the model's state, what a checkpoint keeps instead (its
# inputs; selectively, the outputs of its products too), and what rerunning it costs, counted
# (the floating-point operations of its products and the elements its operators make; a
# selective checkpoint's without its products'), so that every call at one budget ranks the
# same plans the same way. For each depth of the call tree, its modules (and the leaves above
# it), ordered by bytes saved per cost, give plans of growing prefixes, checkpointed whole,
# selectively, or whole with the rest of the depth selective; a modelled peak (the unplanned
# peak, less what each saves, plus the largest recomputation) orders them, and an exact prediction
# accepts one, as for chains (NOTE [ Modelled search, exact acceptance ] in
# planning/search/options.py). The
# ``FLOORS`` plans of least modelled peak are predicted last, from the cheapest; where none
# fits, a refusal names the least of their exact peaks, which they meet again when asked for.

# NOTE [ Plans of modules compiled ]
# Under torch.compile the model's own code is compiled around the plan and a checkpointed
# module's forward is traced into the graph (NOTE [ Compiled checkpoints ] in checkpoint.py),
# its wrapper the same object at every step (NOTE [ Forwards made once ] in install.py), so
# nothing is compiled again after the first step. Code in a checkpointed forward that writes
# Python state outside it (transformers' Llama attention sets and resets a module-level
# variable of the ``kernels`` package around its rotary embedding) would make dynamo refuse to
# trace the region by default, and run it eagerly: the step's forward traces with dynamo's
# ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (a patch of dynamo's config, which is the
# patching thread's alone), so such writes happen once, in the
# forward: compiled code recomputes from its graph, not by rerunning Python, and module state,
# buffers included, is updated once by construction there.
# A run of modules runs eagerly: its checkpoint opens in one module's call and closes in
# another's, which dynamo cannot trace.
MAX_PREDICTIONS = 4  # exact predictions of plans within the budget as modelled, cheapest first
FLOORS = 3  # then those of least modelled peak
NESTED_FLOORS = 1  # below every floor, the least of them with checkpoints nested inside


class CheckpointedModules(ModelView):
    """A model whose steps with grad enabled run some modules it calls as checkpoints, its own
    forward around them (NOTE [ Plans of whole modules ]); without grad, the model as it is.
    ``decisions``: by module name, ``Checkpoint()`` (whole) or ``Checkpoint(selective=True)``;
    by a tuple of names, a run of modules checkpointed as one (``Checkpoint()``, NOTE [ Runs of
    modules ] in install.py); names alone are checkpointed whole. A part inside another (a
    layer's attention inside the layer) is checkpointed in the other's recomputation too, both
    whole (NOTE [ Nested checkpoints ] in install.py). It is the model itself to
    everything but its forward (NOTE [ A planned model is the model ]). The plan's peak is that
    of the training step planned, in the modes the modules had then."""

    memory_plan: MemoryPlan

    def __init__(self, model: nn.Module,
                 decisions: Mapping[Part, Checkpoint] | Sequence[Part]) -> None:
        super().__init__(model)
        if not isinstance(decisions, Mapping):
            decisions = dict.fromkeys(decisions, Checkpoint())
        seen: set[str] = set()
        for part, decision in decisions.items():
            run = not isinstance(part, str)
            if not isinstance(decision, Checkpoint) or decision.segments is not None or (
                    run and decision.selective):
                raise TypeError(
                    f"CheckpointedModules: {part!r} is given {decision!r}; a module is "
                    f"checkpointed whole or selectively: Checkpoint() or "
                    f"Checkpoint(selective=True), a run of modules (a tuple of names) whole: "
                    f"Checkpoint()")
            if run and (len(part) < 2 or not all(isinstance(name, str) for name in part)):
                raise TypeError(f"CheckpointedModules: a run is a tuple of two or more module "
                                f"names, got {part!r}")
            if seen & set(names_of(part)):
                raise ValueError(f"CheckpointedModules: {sorted(seen & set(names_of(part)))} "
                                 f"are in two parts of the plan; each module is in one")
            seen |= set(names_of(part))
        for part, decision in decisions.items():
            around = [other for other in decisions if is_inside(part, other)]
            if around and (decision.selective or decisions[around[0]].selective):
                raise TypeError(
                    f"CheckpointedModules: {part!r} is inside {around[0]!r}, and one of them "
                    f"is checkpointed selectively; a part inside another, and the part around "
                    f"it, are checkpointed whole: Checkpoint() (NOTE [ Nested checkpoints ] in "
                    f"planning/modules/install.py)")
        self._decisions = dict(sorted(decisions.items(), key=lambda item: names_of(item[0])))
        self._forwards = CheckpointedForwards(model, self._decisions)  # NOTE [ Forwards made once ]

    @property
    def names(self) -> tuple[str, ...]:
        """The modules checkpointed, or the model's own ``names`` where it has one."""
        return self.models_own("names", tuple(
            name for part in self._decisions for name in names_of(part)))

    @property
    def decisions(self) -> dict[Part, Checkpoint]:
        """How each module of ``names`` is checkpointed: whole, selectively, or in a run."""
        return dict(self._decisions)

    @property
    def memory(self) -> MemoryPlan:
        """``memory_plan``, or the model's own ``memory`` where it has one (the zoo's)."""
        return self.models_own("memory", self.memory_plan)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model[0]
        if not torch.is_grad_enabled():
            return model(*args, **kwargs)
        return self._step(model, args, kwargs)

    # Not traced by dynamo (it cannot enter the lock the forwards are installed under), the
    # model's own frames are: NOTE [ Plans of modules compiled ].
    @torch.compiler.disable(recursive=False, reason="installs the plan's forwards")
    def _step(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        with self._forwards.installed(), torch._dynamo.config.patch(
                skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return model(*args, **kwargs)


@dataclass(frozen=True)
class _Candidate:
    decisions: tuple[tuple[Part, Checkpoint], ...]
    cost: int
    modelled: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for part, _ in self.decisions for name in names_of(part))

    @property
    def runs(self) -> bool:
        return any(not isinstance(part, str) for part, _ in self.decisions)

    @property
    def order(self) -> tuple[tuple[tuple[str, ...], bool], ...]:
        """What ties between candidates are broken by."""
        return tuple((names_of(part), decision.selective) for part, decision in self.decisions)


_WHOLE, _SELECTIVE = Checkpoint(), Checkpoint(selective=True)


def _candidates(profiles: Sequence[ModuleProfile], runs: Sequence[tuple[str, ...]],
                unplanned: int, around: dict[str, set[str]]) -> list[_Candidate]:
    """Prefixes of each depth's modules, most bytes saved per cost first, none inside another
    (``around``: the names of the modules each is inside), checkpointed whole, selectively, or
    whole with the rest of the depth selective; and the runs of the depth's modules cut into
    runs of 2, 3, about the square root of the longest, half of it and all of it checkpointed
    as one, the rest of the depth whole; with their modelled
    peaks (NOTE [ Plans of whole modules ])."""
    found: dict[tuple[tuple[Part, Checkpoint], ...], _Candidate] = {}

    def add(chosen: Sequence[tuple[Sequence[ModuleProfile], Checkpoint]]) -> None:
        if not chosen:
            return
        # A part keeps its first module's inputs: a run's others are not kept.
        saving = sum(sum(p.saving_of(d) for p in ps) + sum(p.kept for p in ps[1:])
                     for ps, d in chosen)
        cost = sum(p.cost_of(d) for ps, d in chosen for p in ps)
        largest = max(sum(p.saved - (p.products if d.selective else 0) for p in ps)
                      for ps, d in chosen)
        decisions = tuple(sorted((((ps[0].name if len(ps) == 1 else tuple(p.name for p in ps)),
                                   d) for ps, d in chosen), key=lambda pd: names_of(pd[0])))
        found.setdefault(decisions, _Candidate(decisions, cost, unplanned - saving + largest))

    by_name = {p.name: p for p in profiles}
    for depth in sorted({p.depth for p in profiles}):
        level = [p for p in profiles if p.saving > 0 and not p.written and (
            p.depth == depth or (p.leaf and p.depth < depth))]
        # A module shared by two parents may be called at one depth and named inside another.
        names = {p.name for p in level}
        level = [p for p in level if not around[p.name] & names]
        whole = sorted(level, key=lambda p: (-p.saving / max(p.cost, 1), p.name))
        selective = sorted((p for p in level if p.selective_safe and p.saving_of(_SELECTIVE) > 0),
                           key=lambda p: (-p.saving_of(_SELECTIVE) / max(p.cost_of(_SELECTIVE), 1),
                                          p.name))
        for k in range(1, len(whole) + 1):
            add([([p], _WHOLE) for p in whole[:k]])
            add([([p], _SELECTIVE) for p in selective[:k]])
            first = {p.name for p in whole[:k]}
            add([([p], _WHOLE) for p in whole[:k]]
                + [([p], _SELECTIVE) for p in selective if p.name not in first])
        names = {p.name for p in level}
        cut = [piece for run in runs if by_name[run[0]].depth == depth
               for piece in _eligible(run, names)]
        inside = {name for run in cut for name in run}
        rest = [([p], _WHOLE) for p in whole if p.name not in inside]
        longest = max(map(len, cut), default=0)
        for length in sorted({2, 3, math.isqrt(longest), -(-longest // 2), longest} - {0, 1}):
            pieces = [[by_name[name] for name in run[i:i + length]]
                      for run in cut for i in range(0, len(run), length)]
            add([(piece, _WHOLE) for piece in pieces] + rest)
    return sorted(found.values(), key=lambda c: (c.cost, c.modelled, c.order))


def _nested(candidate: _Candidate, profiles: Mapping[str, ModuleProfile],
            runs: Sequence[tuple[str, ...]], around: dict[str, set[str]]) -> list[_Candidate]:
    """``candidate`` with the modules one level inside its parts checkpointed in them too (NOTE
    [ Nested checkpoints ] in install.py): each alone, or the runs they make as one (its parts
    whole). Modelled as ``candidate``, predicted exactly."""
    chosen = set(candidate.names)
    inner = [p for part, _ in candidate.decisions for name in names_of(part)
             for p in profiles.values() if p.depth == profiles[name].depth + 1
             and name in around[p.name] and p.saving > 0 and not p.written
             and p.name not in chosen]
    names = {p.name for p in inner}
    pieces = [piece for run in runs for piece in _eligible(run, names)]
    inside = {name for piece in pieces for name in piece}
    variants = [[(p.name, _WHOLE) for p in inner]]
    if pieces:
        variants.append([(piece, _WHOLE) for piece in pieces]
                        + [(p.name, _WHOLE) for p in inner if p.name not in inside])
    return [_Candidate(tuple(sorted((*candidate.decisions, *extra),
                                    key=lambda pd: names_of(pd[0]))),
                       candidate.cost + sum(profiles[name].cost for part, _ in extra
                                            for name in names_of(part)),
                       candidate.modelled)
            for extra in variants if extra]


def _eligible(run: tuple[str, ...], names: set[str]) -> list[tuple[str, ...]]:
    """The longest pieces of ``run``, two modules or more, of modules among ``names``."""
    pieces: list[list[str]] = [[]]
    for name in run:
        if name in names:
            pieces[-1].append(name)
        elif pieces[-1]:
            pieces.append([])
    return [tuple(piece) for piece in pieces if len(piece) > 1]


def plan_modules(
    model: nn.Module,
    example_input: Any,
    budget: int,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    untraceable: Exception,
    predictor: Predictor,
    compiled: bool = False,
) -> nn.Module:
    """``model`` set up to train within ``budget`` with whole modules checkpointed (NOTE
    [ Plans of whole modules ]), or ``model`` itself where it fits as it is. ``untraceable``:
    why it has no chain, for an error where its step cannot be predicted either; ``predictor``
    predicts every step. ``compiled``: the model will train under torch.compile, where a run
    of modules runs eagerly (NOTE [ Plans of modules compiled ]): no plan has runs."""
    profiler = ModuleProfiler()
    try:
        unplanned = predictor.predict(
            training_step, (model, example_input, loss_fn, optimizer), {}).peak_bytes
    except ValueError as error:  # the prediction's refusal: a tensor's value read
        raise TypeError(f"{untraceable}, and its training step cannot be predicted to plan "
                        f"its modules instead: {error}") from error
    stages = Reconstruct() if any(isinstance(m, ReversibleSequence) and isinstance(
        m.memory, Reconstruct) for m in model.modules()) else Store()
    if fits(unplanned, budget):
        model.memory_plan = MemoryPlan(stages, Store(), (PartPlan(type(model).__name__, Store()),),
                                       unplanned, budget)
        return model
    # Not the peak: code may run otherwise under saved-tensor hooks (a reversible sequence
    # stores what it would reconstruct).
    predictor.predict(profiler, (model, example_input, loss_fn, optimizer), {})
    profiles = {p.name: p for p in profiler.profiles()}
    around = _around(model)
    runs = [] if compiled else profiler.runs()
    candidates = _candidates(list(profiles.values()), runs, unplanned, around)
    if not candidates:
        raise no_fit(budget, unplanned, f"{type(model).__name__} as it is: no module it calls "
                                        f"saves memory checkpointed")
    # A run's recomputation is modelled as adding to the peak, which it does not where the
    # step peaks outside the run (at the logits): every plan with runs is a floor too.
    floors = sorted(candidates, key=lambda c: (c.modelled, c.cost, c.order))[:FLOORS]
    floors += [c for c in candidates if c.runs and c not in floors]
    tries = [c for c in candidates
             if fits(c.modelled, budget) and c not in floors][:MAX_PREDICTIONS]
    peaks: dict[_Candidate, int] = {}

    def first_fitting(chosen: Sequence[_Candidate]) -> CheckpointedModules | None:
        for candidate in chosen:
            planned = CheckpointedModules(model, dict(candidate.decisions))
            peaks[candidate] = predictor.predict(
                training_step, (planned, example_input, loss_fn, optimizer), {}).peak_bytes
            if fits(peaks[candidate], budget):
                parts = tuple(PartPlan(_label(part), decision,
                                       profiles[names_of(part)[0]].kept + (
                                           profiles[part].products if decision.selective else 0),
                                       math.nan)
                              for part, decision in candidate.decisions)
                planned.memory_plan = MemoryPlan(stages, Checkpoint(), parts, peaks[candidate],
                                                 budget)
                return planned
        return None

    by_cost = functools.partial(sorted, key=lambda c: (c.cost, c.modelled, c.order))
    if planned := first_fitting((*tries, *by_cost(floors))):
        return planned
    # Below every floor: the lowest floors with checkpoints inside their parts.
    whole = [c for c in floors if not any(d.selective for _, d in c.decisions)]
    lowest = sorted(whole, key=lambda c: (peaks[c], c.cost, c.order))[:NESTED_FLOORS]
    nested = [n for c in lowest for n in _nested(c, profiles, runs, around)]
    if planned := first_fitting(by_cost(nested)):
        return planned
    floors += nested
    lowest = min(floors, key=lambda c: (peaks[c], c.cost, c.order))
    if peaks[lowest] >= unplanned:
        raise no_fit(budget, unplanned, f"{type(model).__name__} as it is")
    parts = [part for part, _ in lowest.decisions]
    tops = [part for part in parts if not any(is_inside(part, other) for other in parts)]
    count = sum(len(names_of(part)) for part in tops)
    raise no_fit(budget, peaks[lowest], f"checkpoints of {count} whole modules"
                 + (f" in {len(tops)} parts" if len(tops) < count else "")
                 + f", {_listed([_label(part) for part in tops])}"
                 + (f", and {len(parts) - len(tops)} parts inside them (nested)"
                    if len(tops) < len(parts) else ""))


def _around(model: nn.Module) -> dict[str, set[str]]:
    """The names of the modules each module of ``model`` is inside (by its first name; a module
    registered under several parents is inside each)."""
    first = {id(m): name for name, m in model.named_modules()}
    above: dict[str, set[str]] = {name: set() for name in first.values()}

    def walk(module: nn.Module, path: frozenset[str]) -> None:
        for child in module.children():
            name = first[id(child)]
            if not path - above[name] and above[name]:
                continue  # reached this way already
            above[name] |= path
            walk(child, path | {name})

    walk(model, frozenset())
    return above


def _label(part: Part) -> str:
    """A part as a plan prints it: a module's name, or a run's first and last."""
    return part if isinstance(part, str) else f"{part[0]} .. {part[-1]}"


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:5])} .. {names[-1]}"
