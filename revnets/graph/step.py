"""One step of a model's traced graph, as the chain planners cut (:func:`as_graph_chain` in
trace.py): it runs its node on the live values before it and passes on those after it."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx
from torch import nn

from revnets.graph.trace_state import writes_in_place
from revnets.graph.values import Attr, Ref, resolve
from revnets.replay.known import KnownWalk, known_composite
from revnets.replay.known_calls import call_kind, plain, plain_parameters
from revnets.replay.structure import structure_unchanged_by_runs
from revnets.reversible import ReversibleSequence

__all__ = ["GraphKey", "GraphStep"]

_ATOMIC = (type(None), bool, int, float, str)


@structure_unchanged_by_runs
@known_composite("target")
class GraphStep(nn.Module):
    """One node of a traced graph: takes the live values before it, returns those after it.

    ``state_names`` names the values of the tuple it returns (the model's output for the last
    step); ``mutates_from`` is the index of the step that produced a value this node overwrites
    in place (None if it overwrites nothing): no checkpoint may be cut between the two.
    """

    # What the planner built and running never changes (names, lookups it caches, the hook
    # tables of a module no code registers hooks on), holding none of the model's state: a
    # snapshot of what a run may change (traced.Attributes) and a census of a checkpoint leave
    # it out (NOTE [ What runs never change ] in replay/structure.py), a dozen containers a step
    # (MaxViT-T's chain: 1,587 steps). Its target (a callable object of the user's: a
    # counter ``torch.fx.wrap`` keeps a leaf), arguments (constants the graph reads: the model's
    # plain objects too), parameters, buffers, module and root are the model's, and are in.
    structure = frozenset({"graph", "op", "label", "reads", "takes", "inputs", "outputs",
                           "takes_model_input", "state_names", "mutates_from", "mutated", "inplace",
                           "writes_in_place", "_call_kind", "frozen_mode", "_known_arguments",
                           "_non_persistent_buffers_set",
                           *(key for key in vars(nn.Module()) if "hooks" in key)})

    def __init__(
        self,
        node: torch.fx.Node,
        root: nn.Module,
        inputs: list[str],
        outputs: list[str] | None,
        result: Any = None,
        graph: object | None = None,
    ) -> None:
        super().__init__()
        self.graph = graph  # shared by the steps of one traced graph
        self.op, self.target, self.label = node.op, node.target, node.name
        self.reads: dict[str, tuple[str, str]] = {}  # key: (owner's path, name), _reference
        # The live values its node takes (of ``inputs``): their gradients its backward makes.
        self.takes = frozenset(n.name for n in node.all_input_nodes if n.op != "get_attr")

        def reference(n: torch.fx.Node) -> Any:
            return self._reference(n, root)

        self.args = torch.fx.node.map_arg(node.args, reference)
        self.kwargs = torch.fx.node.map_arg(dict(node.kwargs), reference)
        self.result = torch.fx.node.map_arg(result, reference)
        if self.op == "call_module":
            self.module = root.get_submodule(node.target)
        self.inputs, self.outputs = inputs, outputs  # outputs None: the last step, ``result``
        # The first step takes the model's input as it is (a tuple too: one argument); every
        # other one the tuple of live values the step before returns.
        self.takes_model_input = False
        self.state_names = outputs if outputs is not None else [node.name]
        self.mutates_from: int | None = None
        self.mutated: str | None = None  # the name of the value it overwrites
        self.inplace = False
        self.writes_in_place = writes_in_place(node, root)
        self._call_kind: Any = False  # not looked up yet (call_kind gives a kind or None)
        # NOTE [ A mode frozen in the model's own code ]: the mode it was traced in, the model
        # (not registered: its modules are the chain's) and, the first step's, every module's.
        self.frozen_mode: bool | None = None
        self.root: tuple[nn.Module, ...] = ()
        self.frozen_modes: tuple[tuple[nn.Module, bool], ...] = ()
        self._known_arguments: bool | None = None  # whether its constants are plain values

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphStep:
        # What the generic copy does (a new object over a deep copy of its attributes), without
        # copying the attributes' names and the numbers and strings among them one call each: a
        # prediction copies the whole chain (MaxViT-T's: 1,587 steps, 0.1 s of its copy).
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({key: value if type(value) in _ATOMIC else copy.deepcopy(value, memo)
                                for key, value in vars(self).items()})
        return copied

    def _reference(self, node: torch.fx.Node, root: nn.Module) -> Any:
        if node.op != "get_attr":
            return Ref(node.name)
        # A parameter or buffer the graph reads directly: registered here too (the same object),
        # so that moving or copying the chain moves it with the step that reads it.
        owner, _, name = node.target.rpartition(".")
        value = getattr(root.get_submodule(owner), name)
        key = f"attr_{node.name}"
        if isinstance(value, nn.Parameter):
            self.register_parameter(key, value)
        elif isinstance(value, torch.Tensor):
            self.register_buffer(key, value)
        else:
            return value
        self.reads[key] = (owner, name)
        return Attr(key)

    def forward(self, state: Any) -> Any:
        if self.frozen_mode is not None:
            self._check_mode()
        env = dict(zip(self.inputs, (state,) if self.takes_model_input else state))
        args = resolve(self.args, env, self)
        kwargs = resolve(self.kwargs, env, self)
        if self.op == "call_module":
            value = self.module(*args, **kwargs)
        elif self.op == "call_function":
            value = self.target(*args, **kwargs)
        else:  # call_method
            value = getattr(args[0], self.target)(*args[1:], **kwargs)
        env[self.label] = value
        if self.outputs is None:
            return resolve(self.result, env, self)
        return tuple(env[name] for name in self.outputs)

    def _check_mode(self) -> None:
        model = self.root[0]
        if (self.training is not self.frozen_mode or model.training is not self.frozen_mode
                or any(m.training is not mode for m, mode in self.frozen_modes)):
            raise RuntimeError(
                f"the forward of {type(model).__name__} depends on self.training, and its "
                f"chain of steps runs in the modes it was traced in only (the model in "
                f"{'training' if self.frozen_mode else 'eval'} mode), where a PlannedModel "
                f"runs it; anywhere else, run the model itself")

    def walk_known(self, walk: KnownWalk) -> bool:
        """Whether this step calls only known code (NOTE [ Known layers ], NOTE [ Known calls ]),
        following which of the graph's values are memory the walked run made."""
        if self._buffers:
            return False  # read directly, a buffer might be statistics a norm updates
        if self._known_arguments is None:  # constants never change (NOTE [ Known calls ])
            self._known_arguments = plain((self.args, self.kwargs), also=Ref)
        if not self._known_arguments or not plain_parameters(self):
            return False
        first = self.args[0] if self.args else None
        # Values are named per graph: chains of two graphs may share names.
        into_fresh = type(first) is Ref and (self.graph, first.name) in walk.fresh_values
        if self.op == "call_module":
            walk.fresh = into_fresh
            if not walk.module(self.module):
                return False
            fresh = walk.fresh
        else:
            if self._call_kind is False:  # the target and its constant arguments never change
                self._call_kind = call_kind(self.op, self.target, self.args, self.kwargs)
            fresh = walk.call(self._call_kind, self.writes_in_place, into_fresh)
            if fresh is None:
                return False
        if fresh:
            walk.fresh_values.add((self.graph, self.label))
        walk.fresh = False  # what follows a step in a chain gets a tuple of values, or its result
        return True

    def extra_repr(self) -> str:
        target = self.target if isinstance(self.target, str) else self.target.__name__
        return f"{self.label}: {self.op} {target}"


class GraphKey:
    """Names the graph a step's values belong to (copied once with a copied chain)."""

    __slots__ = ()


def sequence_of(step: nn.Module) -> ReversibleSequence | None:
    """The reversible sequence a chain step runs, if it runs one."""
    if isinstance(step, ReversibleSequence):
        return step
    if isinstance(step, GraphStep) and isinstance(getattr(step, "module", None),
                                                    ReversibleSequence):
        return step.module
    return None


def step_name(step: nn.Module, index: int) -> str:
    """A chain step's name: a graph step's label, else its place and class."""
    return step.label if isinstance(step, GraphStep) else f"{index}:{type(step).__name__}"
