"""Any torch.fx-traceable model as a chain of its graph nodes, so that chain planners can cut it
anywhere, including inside blocks with branches and concatenations.

A cut in an arbitrary graph is a point in a topological order of its nodes; what a checkpoint at
that point must keep is every value computed before it and used after it (the *live set*), which
is the lower-set view of checkpointing of Feng & Huang (2018). ``as_graph_chain`` makes that
literal: step ``k`` runs node ``k`` and passes the live set on as a tuple. A checkpointed segment
then stores its input tuple (tensors shared with earlier checkpoints are the same storages, kept
once) and recomputes its nodes in backward. For a DenseNet this puts cuts between the layers of a
dense block, where the concatenated features live anyway and only the wide BatchNorm and ReLU
outputs of each layer need recomputing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from revnets.graph.reads import (
    AttributesRead,
    TraceReads,
    ValuesRead,
    classes_closed_over,
)
from revnets.graph.step import GraphKey, GraphStep
from revnets.graph.trace_state import (
    Attributes,
    Draws,
    code_by_module,
    drop_specialisation_checks,
    grad_and_autocast,
    modes_flipped,
    mutated_argument,
    own_code,
    steering_defaults,
)
from revnets.graph.values import substitute
from revnets.replay.hooks import hooked
from revnets.reversible import ReversibleSequence
from revnets.reversible.invertible import Invertible

__all__ = ["NotAChainError", "as_graph_chain"]


class NotAChainError(ValueError):
    """The model cannot be called as one chain of steps (several required inputs, nothing to
    compute)."""


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, also keeping whole:

    - every torch layer without submodules (a primitive layer: nothing to cut inside);
    - every normalisation and dropout layer: their behaviour depends on ``training``, which must
      be read when the step runs, not frozen when the model is traced;
    - reversible sequences and invertible modules: the planner decides how they run (reconstruct
      or store), which a trace through the engine would freeze;
    - any module with ``planning_unit = True`` (the zoo's residual units): the planner cuts
      between such units, not inside them, which keeps a 1000-layer chain short;
    - every module with hooks, and the modules named in ``whole``: those found untraceable,
      drawing random numbers or assigning attributes by an earlier trace (see
      :func:`_trace`; NOTE [ Traced modules run as their graph ] in graph/trace_state.py).
    """

    def __init__(self, whole: frozenset[str], attributes: Attributes, locate: bool,
                 draws: Draws | None) -> None:
        super().__init__()
        self.whole, self.attributes, self.locate, self.draws = whole, attributes, locate, draws
        self.changing: dict[str, str] = {}  # found when locating: module name, what it changed
        self.tracing: list[tuple[str, nn.Module]] = [("", nn.Module())]  # modules being traced
        self.entered: list[str] = []  # every module traced into, by name
        self.values: ValuesRead | None = None  # recording the tensors whose values it reads

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        if qualified_name in self.whole or hooked(m):
            return True
        if isinstance(m, nn.Sequential):
            return False
        # torch's own layers; one made elsewhere (timm's LayerNorm) is traced, its calls then
        # known ones where they are (NOTE [ Known calls ]), or kept whole where it cannot be
        primitive = next(m.children(), None) is None and type(m).__module__.startswith("torch.")
        mode_dependent = isinstance(
            m, (nn.modules.batchnorm._NormBase, nn.modules.dropout._DropoutNd)
        ) or _reads_its_mode(m)
        whole = isinstance(m, (ReversibleSequence, Invertible))
        whole = whole or getattr(m, "planning_unit", False)
        return primitive or mode_dependent or whole or super().is_leaf_module(m, qualified_name)

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> torch.fx.Node:
        # A graph records operations, not the grad mode or autocast they ran under: code that
        # changes either (``with torch.no_grad(): scale = x.amax()``) must run as itself.
        if grad_and_autocast() != self.modes:
            module = self.tracing[-1][0]
            if module:
                raise _KeepWhole(module, "changes the grad mode or autocast in its forward")
            raise NotAChainError(
                "as_graph_chain: the forward of the model changes the grad mode or autocast "
                "(torch.no_grad, enable_grad, inference_mode, autocast), which a traced graph "
                "does not record. Move that code into a submodule (kept whole)"
            )
        return super().create_node(kind, target, args, kwargs, name, type_expr)

    def trace(self, root: Any, concrete_args: Any = None) -> torch.fx.Graph:
        self.modes = grad_and_autocast()
        self.names: dict[bool, dict[int, str]] | None = None
        if concrete_args is None and isinstance(root, nn.Module):
            concrete_args = steering_defaults(root)
        graph = super().trace(root, concrete_args)
        drop_specialisation_checks(graph)
        return graph

    # torch.fx names a parameter or buffer it meets by walking all of the root's, at every
    # access: a third of tracing a model of a few hundred layers. Looked up by identity here,
    # each name checked against the model as it is then; what is not found takes fx's walk.
    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        name = self._name_of(attr_val)
        if name is None or not (isinstance(attr_val, nn.Parameter)
                                or self.proxy_buffer_attributes):
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def create_arg(self, a: Any) -> Any:
        name = self._name_of(a)
        if name is None and isinstance(a, torch.Tensor) and self.values is not None:
            self.values.constant(a)
        return super().create_arg(a) if name is None else self.create_node("get_attr", name, (), {})

    def _name_of(self, value: Any) -> str | None:
        """The name fx's walk finds for a parameter (among the root's parameters) or another
        tensor (among its buffers), or None."""
        if not isinstance(value, torch.Tensor) or not isinstance(getattr(self, "root", None),
                                                                 nn.Module):
            return None
        if self.names is None:
            self.names = {True: {}, False: {}}
            for parameters, named in ((True, self.root.named_parameters()),
                                      (False, self.root.named_buffers())):
                for name, tensor in named:  # the first name of a shared one, as fx's walk
                    self.names[parameters].setdefault(id(tensor), name)
        parameter = isinstance(value, nn.Parameter)
        name = self.names[parameter].get(id(value))
        if name is None:
            return None
        owner, _, slot = name.rpartition(".")
        try:
            module = self.root.get_submodule(owner)
        except AttributeError:  # moved or removed since (by a forward): fx's walk decides
            return None
        slots = vars(module)["_parameters" if parameter else "_buffers"]
        return name if slots.get(slot) is value else None  # reassigned since: fx's walk decides

    def get_fresh_qualname(self, prefix: str) -> str:
        # The name of a constant torch.fx stores on the model for its graph to read.
        name = super().get_fresh_qualname(prefix)
        self.attributes.tracer_names.add(name)
        return name

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        name = self.path_of_module(m)
        # What changed since the last call began or ended, the code of the module around it
        # changed (its name, "" for the model's own forward).
        self._locate(*self.tracing[-1], own=True)
        if self.is_leaf_module(m, name):
            return super().call_module(m, forward, args, kwargs)
        drawn = self.draws.states() if self.draws is not None else None
        self.tracing.append((name, m))
        self.entered.append(name)
        try:
            out = super().call_module(m, forward, args, kwargs)
        except _KeepWhole:
            raise
        except Exception as error:  # torch.fx raises many kinds on code it cannot trace
            raise _KeepWhole(name, f"cannot be traced ({error})") from error
        finally:
            self.tracing.pop()
        if drawn is not None and self.draws.drew_since(drawn):
            # A number drawn now would be frozen into the graph: the module must run as itself.
            raise _KeepWhole(name, "draws random numbers")
        self._locate(name, m, own=False)
        return out

    def _locate(self, name: str, module: nn.Module, own: bool) -> None:
        """Find what changed in the state ``module`` holds (``own``), or in any of its
        submodules' too, and keep ``module`` whole if anything did."""
        if not self.locate or not name:  # the model's own code: found after the whole trace
            return
        modules = [module] if own else list(module.modules())
        changed = self.attributes.changed(modules)
        if changed is not None:  # done once, on proxies, and never again: kept whole
            self.changing[name] = changed
            self.attributes.restore(modules)  # so that no module around it is found too


def _reads_its_mode(m: nn.Module) -> bool:
    """Whether ``m`` has no submodules and its forward reads ``training`` (stochastic depth:
    torchvision's StochasticDepth, timm's DropPath): its traced code would all but surely
    depend on its mode, found by a second pair of traces (NOTE [ A mode frozen in the model's
    own code ]; 0.2 to 0.4 s of planning a model with stochastic depth in every block). Kept
    whole from the first; where its code does not depend on it, it is one step rather than its
    operations, and runs as itself."""
    if next(m.children(), None) is not None:
        return False
    code = getattr(type(m).forward, "__code__", None)
    return code is not None and "training" in code.co_names


class _KeepWhole(Exception):
    """A module found, while tracing, to be one the chain must run whole."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.name, self.why = name, why


# NOTE [ A mode frozen in the model's own code ]
# A trace runs ``self.training`` as a constant. A submodule whose traced code reads it is kept
# whole, called as itself by its step, so it reads its mode when it runs; the model's own code
# cannot be (it is the chain). Where only the model's own code depends on its mode (timm's
# GhostNet: ``F.dropout(x, p, training=self.training)`` before its head), the chain is the trace
# in the mode the model is in, which must be training: a PlannedModel runs its plan in training
# steps only (evaluation runs the model itself), so the frozen branch is the one each of those
# steps would take (a third trace in that mode must give the same code: a value unlike in
# every trace, a counter kept outside the model, is refused, not frozen). Every step of such a
# chain checks, when it runs, that it and the model are both still in that mode. Where the
# model's code reads other modules' modes too (``if self.bn.training``: a fourth trace, every
# module but the model flipped, changes its code), the first step also checks that every module
# is in the mode it was traced in; where it reads only its own, its modules may change theirs
# (a frozen BatchNorm). Any other mode raises: a chain used on its own, or a model or a module
# it reads switched to eval under a training PlannedModel, never runs the training branch in
# evaluation silently.
def _trace(
    model: nn.Module,
) -> tuple[torch.fx.Graph, set[str], bool | None, bool, tuple[str, ...], TraceReads]:
    """``model``'s graph, tracing into every module it can: a module whose code torch.fx cannot
    trace, that draws random numbers (:class:`Draws`), assigns attributes (NOTE [ Traced modules
    run as their graph ]) or whose traced code depends on ``training`` stays whole, called as a
    module by its step (a coarser chain), reading its mode when it runs; the model's own
    forward must trace. Returns the graph, the names of the constants the traces stored on the
    model (its graph reads them), the mode the model's own code was traced in where it depends
    on it, else None, whether that code reads other modules' modes too (NOTE [ A mode frozen
    in the model's own code ]), the names of the modules the graph's trace went into, the
    model's own ("") first, and what that trace read (graph/reads.py)."""
    whole: frozenset[str] = frozenset()
    locate = False  # check attributes after each module's trace, to find the one assigning
    draws, watched = Draws(model), False  # and the generators, to find the one drawing
    attributes = Attributes(model.modules())
    try:
        while True:
            drawn = draws.states()
            tracer, flipped_tracer = (_Tracer(whole, attributes, locate,
                                              draws if watched else None) for _ in range(2))
            # What this trace reads: earlier ones entered more.
            tracer.values = ValuesRead()
            attributes_read = AttributesRead(
                attributes.plain_classes() | classes_closed_over(model.modules()))
            try:
                with tracer.values, attributes_read:
                    graph = tracer.trace(model)
                read = attributes_read.reads(tracer.values)
                drew = draws.drew_since(drawn)
                if drew and not watched:
                    watched = True  # trace again, checking each module
                    attributes.restore()
                    continue
                assigned = attributes.changed()
                # A trace freezes each mode it reads: the same trace in the other modes shows
                # where.
                with modes_flipped(model):
                    flipped = flipped_tracer.trace(model)
                assigned = assigned or attributes.changed()
            except _KeepWhole as found:
                attributes.restore()
                whole = whole | {found.name}
                continue
            changing = tracer.changing.keys() | flipped_tracer.changing.keys()
            if changing or assigned is not None:
                attributes.restore()
                whole = whole | changing
                if changing or not locate:
                    locate = True  # trace again, checking after each module
                    continue
                raise NotAChainError(
                    f"as_graph_chain: the forward of {type(model).__name__} assigns {assigned}, "
                    "which a planned step, running its traced graph, would never do again. "
                    "Assign it inside a submodule (kept whole) or return it from the forward"
                )
            if drew:
                raise NotAChainError(
                    f"as_graph_chain: the forward of {type(model).__name__} draws random "
                    "numbers while it is traced (Python's random, numpy's, or torch's "
                    "generators for a tensor not made from its input: torch.rand(()) < p); a "
                    "trace would freeze what it drew. Draw inside a submodule (kept whole and "
                    "replayed by checkpoints), or from the input (torch.rand_like(x))"
                )
            depends = {name for name, _ in
                       code_by_module(graph, model, attributes.tracer_names)
                       ^ code_by_module(flipped, model, attributes.tracer_names)}
            if not depends:
                return graph, attributes.tracer_names, None, False, _entered(tracer), read
            if depends == {""}:
                # Only the mode, if the same mode traced again gives the same code (NOTE).
                again = _Tracer(whole, attributes, locate, None).trace(model)
                if own_code(again, model, attributes.tracer_names) != \
                        own_code(graph, model, attributes.tracer_names):
                    raise NotAChainError(
                        f"as_graph_chain: the forward of {type(model).__name__} builds a value "
                        "unlike in each trace (a number it keeps outside the model, a time), "
                        "which a trace would freeze. Move that code into a submodule (kept "
                        "whole, running its code each time)"
                    )
                if model.training:
                    with modes_flipped(model):  # every module's mode but the model's own
                        model.training = not model.training
                        others = _Tracer(whole, attributes, locate, None).trace(model)
                        model.training = not model.training
                    reads_others = own_code(others, model, attributes.tracer_names) != \
                        own_code(graph, model, attributes.tracer_names)
                    return (graph, attributes.tracer_names, True, reads_others, _entered(tracer),
                            read)
                raise NotAChainError(
                    f"as_graph_chain: the forward of {type(model).__name__} depends on "
                    "self.training, which a trace freezes, and the model is in eval mode: "
                    "plan it in training mode (its chain then runs training steps only), or "
                    "move that code into a submodule (kept whole, running its code each time)"
                )
            # The innermost first: a module calling one that depends on its mode (a layer
            # dropped in training) looks as if it did too, and may not once that one is whole.
            whole = whole | {
                name for name in depends - {""}
                if not any(other.startswith(name + ".") for other in depends)
            }
    finally:
        draws.restore()  # tracing ran the user's draws: they never happened
        attributes.restore()


def _entered(tracer: _Tracer) -> tuple[str, ...]:
    return tuple(dict.fromkeys(["", *tracer.entered]))


def as_graph_chain(model: nn.Module) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of :class:`GraphStep`, one per node of its torch.fx graph.

    The steps share the model's modules, parameters and buffers: the chain computes the same
    function with the same weights, and checkpointing any run of steps keeps gradients and
    BatchNorm statistics those of the model. Raises :class:`NotAChainError` for models with
    several inputs or whose own forward draws random numbers, and torch.fx's errors
    for a forward of the model itself it cannot trace (data-dependent control flow); submodules
    it cannot trace are kept whole (:func:`_trace`). Where the model's own forward depends on
    its mode, the chain runs in training mode only (NOTE [ A mode frozen in the model's own
    code ]). The chain's ``traced`` names the modules whose forward the trace went into, the
    model's own ("") first: the modules a planned step runs as their graph, never calling them
    (NOTE [ Traced modules run as their graph ]); its ``trace_reads`` what that trace read.
    """
    graph, stored, frozen_mode, reads_others, traced, read = _trace(model)
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    # Optional arguments (attention masks and the like) keep their defaults, **kwargs none.
    required = [n for n in placeholders if not n.args and not str(n.target).startswith("**")]
    if len(placeholders) == 0 or required[1:] or (required and required[0] is not placeholders[0]):
        raise NotAChainError(
            f"as_graph_chain: the forward of {type(model).__name__} takes "
            f"{[str(n.target) for n in required]} without defaults; only a model called with "
            f"a single input (the rest optional) can be planned as a chain"
        )
    defaults = {n.name: n.args[0] if n.args else {} for n in placeholders[1:]}
    output = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op in ("call_module", "call_function", "call_method")]
    if not compute:
        raise NotAChainError(f"as_graph_chain: {type(model).__name__} computes nothing")
    position = {placeholders[0].name: -1, **{n.name: i for i, n in enumerate(compute)}}
    last_use: dict[str, int] = {}
    for i, node in enumerate(compute):
        for arg in node.all_input_nodes:
            last_use[arg.name] = i
    for arg in output.all_input_nodes:
        last_use[arg.name] = len(compute)

    steps: list[nn.Module] = []
    live = [placeholders[0].name]
    graph_key = GraphKey()
    for i, node in enumerate(compute):
        produced = [node.name] if last_use.get(node.name, -1) > i else []
        after = [name for name in live if last_use.get(name, -1) > i] + produced
        is_last = i == len(compute) - 1
        step = GraphStep(
            node, model, list(live), None if is_last else after,
            output.args[0] if is_last else None, graph_key,
        )
        step.args, step.kwargs = substitute((step.args, step.kwargs), defaults)
        step.takes_model_input = i == 0
        if frozen_mode is not None:
            step.frozen_mode, step.root = frozen_mode, (model,)
        mutated = mutated_argument(node, model)
        if mutated is not None and mutated.name in position:
            step.mutates_from = position[mutated.name]
            step.mutated = mutated.name
            step.inplace = step.mutates_from == i - 1
        steps.append(step)
        live = after
    for name in stored & vars(model).keys():  # the steps hold them now: every trace adds some
        delattr(model, name)
    if reads_others:  # NOTE [ A mode frozen in the model's own code ]
        steps[0].frozen_modes = tuple((m, m.training) for m in model.modules())
    chain = nn.Sequential(*steps)
    chain.traced, chain.trace_reads = traced, read
    return chain
