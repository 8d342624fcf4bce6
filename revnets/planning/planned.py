"""The model auto_checkpoint returns: a traced chain that follows a memory plan in training."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from revnets.checkpoint import Checkpointed, checkpoint_forward
from revnets.graph.guard import Frozen, refuse_hooks
from revnets.graph.reads import TraceReads
from revnets.graph.step import GraphStep, step_name
from revnets.plan import Checkpoint, MemoryPlan
from revnets.planning.model_view import ModelView

__all__ = ["PlanChain", "PlannedModel"]


# NOTE [ Selective segments under compile ]
# Eagerly, a checkpoint recomputes its whole segment at once when the backward first needs it,
# so a selective segment's recomputed norms and activations are alive together; plans cut long
# runs into several selective segments to bound that, and the prediction counts it. Under
# torch.compile the partitioner instead recomputes each of a selective checkpoint's cheap steps
# just before its use in the backward, fused into the kernel that needs it, so the cuts bound
# nothing there and each costs the input it keeps. Compiled, consecutive selective segments
# therefore run as one checkpoint: it keeps the same products and no inputs between them. On
# ResNet-50 at a 70 % keep (benchmarks/frontier.py, docs/results.md) that took the plan's
# compiled step from above compile's own curve to below it. Eager steps, and so every
# prediction, are unchanged. A plain checkpoint among them keeps the values at its cuts again,
# and where its steps keep no product (a norm, an addition, an activation) it keeps and
# recomputes what a selective one does: plans for a compiled model make it selective
# (compiled_costs.selective_when_free), which took ResNet-50's plan at a 70 % keep from 227.7
# to 222.7 MiB compiled, below compile's own 0.7 budget (224.3 MiB; benchmarks/frontier.py).
# So are a plan's stored runs where that costs nothing (NOTE [ Stored runs under compile ]).


class PlanChain(nn.Sequential):
    """The steps of a plan, run in order as ``nn.Sequential`` runs them; under torch.compile,
    consecutive selective checkpoints run as one (NOTE [ Selective segments under compile ])."""

    def forward(self, x: Any) -> Any:
        if not (torch.compiler.is_dynamo_compiling() and self.training and torch.is_grad_enabled()):
            return super().forward(x)
        run: list[Checkpointed] = []
        for step in self:
            if _selective(step) and (not run or
                                     step.preserve_rng_state == run[0].preserve_rng_state):
                run.append(step)
                continue
            x = self._run_as_one(run, x)
            run = [step] if _selective(step) else []
            if not run:
                x = step(x)
        return self._run_as_one(run, x)

    def _run_as_one(self, run: list[Checkpointed], x: Any) -> Any:
        if len(run) < 2:
            return run[0](x) if run else x
        # The chain is the owner a replay follows where dynamo runs the region eagerly (NOTE
        # [ Compiled checkpoints ]); its steps' code is watched there.
        return checkpoint_forward(self, _InOrder(tuple(step.module for step in run)), (x,), {},
                                  run[0].preserve_rng_state, selective=True, watched=True)


def _selective(step: nn.Module) -> bool:
    return (isinstance(step, Checkpointed) and isinstance(step.memory, Checkpoint)
            and step.memory.selective)


class _InOrder:
    """Modules called one after the other, as one function for a checkpoint."""

    def __init__(self, modules: tuple[nn.Module, ...]) -> None:
        self.modules = modules

    def __call__(self, x: Any) -> Any:
        for module in self.modules:
            x = module(x)
        return x


class PlannedModel(ModelView):
    """A traced model and its checkpoint plan: the model itself to everything but its
    forward (NOTE [ A planned model is the model ]: state_dict keys, parameters' names, moves).

    Training steps (training mode, grad enabled) run the plan: the chain of graph nodes with
    checkpointed segments. Everything else (evaluation, inference) runs the model itself, since
    a trace may have frozen ``self.training`` checks of the mode it was traced in. A training
    step refuses hooks that would not run in it, and what the traced graph froze that has
    changed since (NOTE [ Traced modules run as their graph ]).
    """

    memory_plan: MemoryPlan

    def __init__(self, model: nn.Module, plan: nn.Sequential,
                 traced: Sequence[str] = ("",), reads: TraceReads = TraceReads()) -> None:
        super().__init__(model)
        self._plan = (plan,)  # unregistered: its modules are the model's
        # The modules the plan runs as their traced graph: those the trace went into
        # (``traced_by``), and any other its steps do not call (a ModuleList indexed, a block
        # run through another method, a module whose numbers its parent reads). A module the
        # steps call only through a plain list (a helper of kept-whole blocks) is among them
        # too: a hook registered on it would not fire where the trace went through it.
        entered = {id(model.get_submodule(name)) for name in traced}
        called = {id(m) for m in plan.modules()}
        self._traced = tuple((n, m) for n, m in model.named_modules()
                             if id(m) in entered or id(m) not in called)
        self._frozen = Frozen(model, self._traced, reads)
        # The model's tensors that steps read directly (parameters, buffers, plain attributes),
        # by owner and name. A constant torch.fx made of a tensor the forward makes (or
        # computed from others at trace time) is the steps' alone, kept as traced: eager runs
        # make it anew, untouched by moves and casts.
        self._reads = [(step, key, owner, name) for step in plan.modules()
                       for key, (path, name) in getattr(step, "reads", {}).items()
                       if getattr(owner := model.get_submodule(path), name, None)
                       is getattr(step, key)]
        refuse_hooks(self._traced)

    @staticmethod
    def traced_by(chain: nn.Sequential) -> tuple[str, ...]:
        """The modules a chain's trace went into (:func:`as_graph_chain`); of a plain
        ``nn.Sequential`` planned as itself, itself alone."""
        return chain.traced if len(chain) and isinstance(chain[0], GraphStep) else ("",)

    @staticmethod
    def reads_of(chain: nn.Sequential) -> TraceReads:
        """What a chain's trace read (``revnets/graph/reads.py``); of a plain
        ``nn.Sequential`` planned as itself, nothing."""
        return getattr(chain, "trace_reads", TraceReads())

    @property
    def plan(self) -> nn.Sequential:
        """The chain training steps run, or the model's own ``plan`` where it has one (NOTE
        [ A planned model is the model ]): ``PlannedModel.plan_of`` is always the chain."""
        return self.models_own("plan", self._plan[0])

    @staticmethod
    def plan_of(view: PlannedModel) -> nn.Sequential:
        """The chain ``view``'s training steps run, whatever attributes its model has."""
        return view._plan[0]

    @property
    def memory(self) -> MemoryPlan:
        """``memory_plan``, or the model's own ``memory`` where it has one (the zoo's)."""
        return self.models_own("memory", self.memory_plan)

    def timeline_parts(self) -> list[tuple[str, nn.Module]]:
        """The modules a training step calls, each named by its run of the plan: a checkpointed
        segment by its steps, the steps stored between two such as one run (``first .. last``);
        a memory timeline of the step attributes activations to them (revnets/memory/timeline.py),
        since most of the model's own modules are never called in it."""
        steps = list(self._plan[0])
        runs: list[list[int]] = []
        for i, step in enumerate(steps):
            alone = isinstance(step, Checkpointed)
            if alone or not runs or isinstance(steps[runs[-1][-1]], Checkpointed):
                runs.append([i])
            else:
                runs[-1].append(i)
        parts = []
        for run in runs:
            first, last = step_name(steps[run[0]], run[0]), step_name(steps[run[-1]], run[-1])
            name = first if len(run) == 1 else f"{first} .. {last}"
            parts += [(name, steps[i]) for i in run]
        return parts

    def train(self, mode: bool = True) -> PlannedModel:
        super().train(mode)
        self._plan[0].train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> PlannedModel:
        super()._apply(fn, recurse)
        self._follow()
        return self

    def _follow(self) -> None:
        """Point each step that reads a tensor of the model directly at the model's tensor of
        that name now (NOTE [ A planned model is the model ])."""
        for step, key, owner, name in self._reads:
            now = getattr(owner, name, None)
            if step._parameters.get(key, step._buffers.get(key)) is now:
                continue
            if not isinstance(now, torch.Tensor):
                raise RuntimeError(
                    f"auto_checkpoint: {type(owner).__name__}.{name}, which the plan reads, is "
                    f"{type(now).__name__} now, a tensor when planned; plan again "
                    f"(auto_checkpoint on the model as it is now)")
            step._parameters.pop(key, None)
            step._buffers.pop(key, None)
            table = step._parameters if isinstance(now, nn.Parameter) else step._buffers
            table[key] = now

    def _input_of(self, args: tuple, kwargs: dict) -> Any:
        """The input of a training step's call: its chain runs every optional argument at the
        default it was traced with, so one passed as another value is refused by name."""
        model = self._model[0]
        signature = inspect.signature(model.forward)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{type(model).__name__}: {error}") from error
        if not bound.arguments:
            raise TypeError(f"{type(model).__name__}: no input given")
        (_, value), *rest = bound.arguments.items()
        defaults = {name: p.default for name, p in signature.parameters.items()}
        other = [name for name, given in rest if given is not defaults[name] and not (
            type(given) in (bool, int, float, str) and given == defaults[name])]
        if other:
            raise TypeError(
                f"a planned training step of {type(model).__name__} runs {other} at the "
                f"defaults its chain was traced with; train with those, or plan a model that "
                f"takes them as they are given"
            )
        return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            refuse_hooks(self._traced)
            self._frozen.check()
            self._follow()
            return self._plan[0](self._input_of(args, kwargs))
        return self._model[0](*args, **kwargs)
