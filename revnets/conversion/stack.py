"""A pretrained stack of layers run as one reversible stage, its layers where they were (NOTE
[ Reversible conversion ] in the package's face)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from revnets.conversion.construction import Construction, Difference, construction_of
from revnets.conversion.drift import warn_of_drift
from revnets.plan import Reconstruct, Store
from revnets.reversible import ReversibleBlock, ReversibleSequence, grid
from revnets.reversible.coupling import ScaledCoupling

__all__ = ["LayerUpdate", "Pending", "ReversibleLayers", "Zero"]


class LayerUpdate(nn.Module):
    """``h(x) = c.layer * layer(x, *arguments) + c.skip * x``: a pretrained layer as the
    transform of a coupling ``y = c.stream * x1 + h(x2)`` (rule 1; ``c`` the construction,
    construction.py). Each layer's own arguments come in the
    context: a layout (per layer of the stage, the pytree spec of its arguments and which
    leaves are theirs) and then the leaves, each once, so that tensors among them get their
    gradients from the engine."""

    def __init__(self, layer: nn.Module, construction: Construction, position: int) -> None:
        super().__init__()
        self.layer = layer
        self.factor, self.skip = construction.layer, construction.skip
        self.position = position  # its place in the stage's layout

    def forward(self, x: Tensor, layout: tuple | None = None, *leaves: Any) -> Tensor:
        args, kwargs = (), {}
        if layout is not None:
            spec, picks = layout[self.position]
            args, kwargs = tree_unflatten([leaves[i] for i in picks], spec)
        out = self.layer(x, *args, **kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"make_reversible: {type(self.layer).__name__} returns {type(out).__name__}, "
                f"not the hidden state alone; a converted layer maps a tensor to a tensor of its "
                f"shape (transformers 5's decoder layers and timm's blocks do)")
        if out.shape != x.shape:
            raise ValueError(
                f"make_reversible: {type(self.layer).__name__} maps shape {tuple(x.shape)} to "
                f"{tuple(out.shape)}; a converted layer keeps its input's shape, so convert only "
                f"layers that keep it (a ResNet stage's blocks after its first: name them)")
        if self.factor != 1:
            out = out * self.factor
        return torch.add(out, x, alpha=self.skip) if self.skip else out  # no skip * x held

    def extra_repr(self) -> str:
        return f"factor={self.factor}, skip={self.skip}"


class Zero(nn.Module):
    """The update of the missing second layer of a stack with an odd number of layers."""

    def forward(self, x: Tensor, *context: Any) -> Tensor:
        return torch.zeros_like(x)


class Pending:
    """What the model's loop holds between the layers of a converted stack before its last
    layer is called (rule 3): it passes from layer to layer and answers for the hidden state's
    shape, dtype and device; anything else done with it (arithmetic, a write, a norm, any torch
    function) is refused, since the hidden state there is not computed. Not a tensor: one made
    from the hidden state would be a fake tensor's subclass in a prediction."""

    def __init__(self, hidden: Tensor) -> None:
        for name in ("shape", "dtype", "device", "requires_grad"):
            object.__setattr__(self, name, getattr(hidden, name))

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _refusal(getattr(func, "__name__", str(func)))

    def __getattr__(self, name: str) -> Any:
        raise _refusal(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _refusal(f"setting {name}")

    def __repr__(self) -> str:
        return f"<the hidden state between layers of a converted stack, {tuple(self.shape)}>"


def _operation(name: str) -> Any:
    def refused(self: Pending, *args: Any) -> Any:
        raise _refusal(name)
    return refused


for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "matmul",
              "rmatmul", "neg", "pow", "getitem", "setitem", "iadd", "isub", "imul", "len",
              "iter", "float", "bool", "lt", "le", "gt", "ge", "array"):
    setattr(Pending, f"__{_name}__", _operation(_name))


def _refusal(name: str) -> RuntimeError:
    return RuntimeError(
        f"make_reversible: {name} on the hidden state between two layers of a converted stack, "
        f"which is not computed: the stack runs as one reversible stage when its last layer is "
        f"called, and its layers' own outputs are not the converted streams. Read the hidden "
        f"state after the stack (intermediate features, hidden states of every layer, a layer "
        f"called alone, a write between layers need the stack unconverted)")


@dataclass
class _Run:
    """A run of the stack's layers the model's loop is calling (rule 3)."""

    start: int
    x: Tensor
    token: Pending
    calls: list[tuple[tuple, dict]] = field(default_factory=list)


class ReversibleLayers(nn.ModuleList):
    """The layers of a pretrained stack, under their own names, run as one reversible stage
    (NOTE [ Reversible conversion ]): called (``blocks(x)``) or iterated by the model's own loop
    (``for layer in self.layers: hidden = layer(hidden, ...)``), its layers compute the
    converted function with activation memory flat in their number. Its state_dict is the
    stack's, key for key."""

    planning_unit = True  # auto_checkpoint keeps the stage whole: it is reversible already

    def __init__(self, layers: Sequence[tuple[str, nn.Module]],
                 construction: Construction = Difference(), dim: int = -1,
                 memory: Reconstruct | Store = Reconstruct(), exact: bool = False) -> None:
        super().__init__()
        for name, layer in layers:  # the stack's own names (a named nn.Sequential's too)
            self.add_module(name, layer)
        _check(construction, exact)
        self._construction, self._dim, self._exact = construction, dim, exact
        # Unregistered (rule 3): the blocks hold the layers, which are this module's children.
        # Each stage is built for its layers and for (construction, dim, exact), its key.
        self._stages: dict[tuple[int, int], tuple[tuple, ReversibleSequence]] = {}
        self._memory = memory
        self._run: _Run | None = None
        self.sequence(0, len(self))  # refuses a bad option now, not in the first step
        warn_of_drift(construction, len(self), memory, exact, stacklevel=3)  # from make_reversible

    # What the stage computes. Each may be set after a forward and takes effect at the next:
    # the stages are keyed on them (sequence), so the stack and a copy of it compute alike.
    @property
    def construction(self) -> Construction:
        """How the stack writes its two streams (construction.py)."""
        return self._construction

    @construction.setter
    def construction(self, value: Construction) -> None:
        _check(value, self._exact)
        self._construction = value
        warn_of_drift(value, len(self), self._memory, self._exact, stacklevel=3)

    @property
    def dim(self) -> int:
        """Where the two streams are stacked."""
        return self._dim

    @dim.setter
    def dim(self, value: int) -> None:
        self._dim = value

    @property
    def exact(self) -> bool:
        """Whether the stage runs on the fixed-point grid (rule 4)."""
        return self._exact

    @exact.setter
    def exact(self, value: bool) -> None:
        _check(self._construction, value)
        self._exact = value
        warn_of_drift(self._construction, len(self), self._memory, value, stacklevel=3)

    @property
    def memory(self) -> Reconstruct | Store:
        """``Reconstruct()`` (the reversible engine) or ``Store()`` (the same blocks with ordinary
        autograd: the reference, and the baseline of its memory)."""
        return self._memory

    @memory.setter
    def memory(self, decision: Reconstruct | Store) -> None:
        self._memory = decision
        for _, stage in self._stages.values():
            stage.set_memory(decision)
        warn_of_drift(self._construction, len(self), decision, self._exact, stacklevel=3)

    def sequence(self, start: int, stop: int) -> ReversibleSequence:
        """The reversible sequence of layers ``start:stop``: layers ``2k`` and ``2k + 1`` of it
        are f and g of block k (rule 1)."""
        layers = list(self._modules.values())[start:stop]
        # A layer replaced or added since, or another construction: built anew.
        key = (tuple(map(id, layers)), self._construction, self._dim, self._exact)
        found = self._stages.get((start, stop))
        if found is None or found[0] != key:
            updates: list[nn.Module] = [LayerUpdate(layer, self.construction, i)
                                        for i, layer in enumerate(layers)]
            if len(updates) % 2:
                updates.append(Zero())
            stream = self.construction.stream
            coupling = "additive" if stream == 1 else ScaledCoupling(stream)
            blocks = [ReversibleBlock(updates[i], updates[i + 1], coupling, split_dim=self.dim)
                      for i in range(0, len(updates), 2)]
            stage = ReversibleSequence(blocks, Store() if isinstance(self._memory, Store)
                                       else self._memory, exact=self.exact)
            self._stages[start, stop] = found = (key, stage)
        return found[1]

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self.run(0, x, [(args, kwargs)] * len(self))

    def run(self, start: int, x: Tensor, calls: list[tuple[tuple, dict]]) -> Tensor:
        """Layers ``start:start + len(calls)`` on ``x`` as one stage, layer ``start + i`` given
        the arguments ``calls[i]``."""
        _refuse_recorded_hidden_states()
        _refuse_sharded_layers(self)
        stage = self.sequence(start, start + len(calls))
        _set_mode(stage, self.training)
        if isinstance(stage.memory, Reconstruct) and self.training and torch.is_grad_enabled():
            calls = [_without_caches(call) for call in calls]  # rule 5
        leaves: list[Any] = []  # each once: the mask and rotary embeddings every layer gets
        where: dict[int, int] = {}
        layout = []
        for call in calls:
            found, spec = tree_flatten(call)
            for leaf in found:
                if id(leaf) not in where:
                    where[id(leaf)] = len(leaves)
                    leaves.append(leaf)
            layout.append((spec, tuple(where[id(leaf)] for leaf in found)))
        context = (tuple(layout), *leaves)
        start = self.construction.start
        older = x if start == 1 else x * start
        y1, y2 = stage.split(stage(torch.cat((older, x), dim=self.dim), *context))
        return y2 if len(calls) % 2 == 0 else y1

    # -- the model's own loop (rule 3) ----------------------------------------------------------
    def __iter__(self) -> Iterator[nn.Module]:
        return iter(_Layer(self, i, len(self)) for i in range(len(self)))

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("a converted stack runs its layers in order: no step")
            return _Slice(self, start, stop)
        return _Layer(self, range(len(self))[index], len(self))

    def layer(self, index: int) -> nn.Module:
        """The pretrained layer ``index`` itself (indexing gives the stand-in the loop calls)."""
        return list(self._modules.values())[index]

    def call_layer(self, index: int, stop: int, hidden: Tensor | Pending, args: tuple,
                   kwargs: dict) -> Tensor | Pending:
        """Layer ``index`` of a loop over layers ``..stop`` called (rule 3): a real tensor starts
        a run, the run's token continues it; the last layer runs the run as one stage."""
        run = self._run
        if isinstance(hidden, Pending):
            if run is None or hidden is not run.token:
                raise RuntimeError(
                    f"make_reversible: layer {index} of a converted stack was given the hidden "
                    f"state of another run of its layers; call them in one loop, in order")
            expected = run.start + len(run.calls)
            if index < expected:
                raise RuntimeError(
                    f"make_reversible: layer {index} of a converted stack was called again after "
                    f"layer {expected - 1}; a converted stack runs every layer of its run once, "
                    f"in order")
            if index != expected:
                raise RuntimeError(
                    f"make_reversible: layer {index} of a converted stack was called after layer "
                    f"{expected - 1}; layers {expected}..{index - 1} were skipped (LayerDrop, "
                    f"early exit). A converted stack runs every layer of its run once, in "
                    f"order: turn layer dropping off (e.g. config.layerdrop=0)")
            run.calls.append((args, kwargs))
        else:
            if not isinstance(hidden, Tensor):
                raise TypeError(f"make_reversible: layer {index} of a converted stack takes the "
                                f"hidden state first, got {type(hidden).__name__}")
            _refuse_sharded_loop(self)
            token = Pending(hidden)
            self._run = run = _Run(index, hidden, token, [(args, kwargs)])
        if index < stop - 1:
            return run.token
        self._run = None
        return self.run(run.start, run.x, run.calls)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_run"] = None  # a loop under way is not the module's state
        return state

    __repr__ = nn.Module.__repr__  # of the layers, not what iterating gives

    def extra_repr(self) -> str:
        return (f"{self._construction}, dim={self._dim}, memory={self._memory}"
                + (", exact=True" if self._exact else ""))


class _Slice:
    """``layers[a:b]``, which the model's loop iterates (Llama's ``self.layers[:n]``)."""

    def __init__(self, owner: ReversibleLayers, start: int, stop: int) -> None:
        self.owner, self.start, self.stop = owner, start, stop

    def __iter__(self) -> Iterator[_Layer]:
        return iter(_Layer(self.owner, i, self.stop) for i in range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> _Layer:
        return _Layer(self.owner, range(self.start, self.stop)[index], self.stop)


class _Layer:
    """Layer ``index`` of a converted stack as the model's loop over layers ``..stop`` meets it
    (rule 3). Its attributes are the layer's (``layers[0].self_attn``), read and set."""

    def __init__(self, owner: ReversibleLayers, index: int, stop: int) -> None:
        self.__dict__.update(_owner=owner, _index=index, _stop=stop)

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor | Pending:
        if args:
            hidden, args = args[0], args[1:]
        elif "hidden_states" in kwargs:  # a layer called with its hidden state by keyword
            hidden = kwargs.pop("hidden_states")
        else:
            raise TypeError(f"make_reversible: layer {self._index} of a converted stack was "
                            f"called without a hidden state")
        return self._owner.call_layer(self._index, self._stop, hidden, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner.layer(self._index), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._owner.layer(self._index), name, value)

    def __repr__(self) -> str:
        kind = type(self._owner.layer(self._index)).__name__
        return f"<layer {self._index} of a converted stack: {kind}>"


def _check(construction: object, exact: bool) -> None:
    construction = construction_of(construction)
    if exact and grid.exact_shift(construction.stream) is None:
        raise ValueError(
            f"make_reversible: exact=True needs a stream scale +-2^-k, k = 0..8 (scale=1, "
            f"0.5, 0.25, ...; Momentum(0.5), MEFT(0.5, 0.5)); {construction} multiplies a "
            f"stream by {construction.stream}, which leaves the fixed-point grid "
            f"(NOTE [ Reversible conversion ], rule 4)")


def _set_mode(stage: ReversibleSequence, training: bool) -> None:
    """The stage's own modules (its blocks, their couplings' transforms) in the stack's mode;
    the layers' submodules keep theirs (a frozen BatchNorm, dropout kept on for sampling)."""
    stage.training = stage.blocks.training = training
    for block in stage.blocks:
        block.training = block.f.training = block.g.training = training


# FSDP2 (fully_shard) gathers a sharded module's parameters in hooks around its calls. The
# stage runs each layer itself, again in backward, so a layer sharded alone is refused; the
# stack sharded gathers them when it is called whole, and a module holding it, always.
SHARD_HOLDER = ("shard the converted stack where the model calls it whole (fully_shard(stack), "
                "then fully_shard(model)), or the model holding it alone (fully_shard(model))")


def _refuse_sharded_layers(stack: ReversibleLayers) -> None:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    for name, module in stack.named_modules():
        if module is not stack and isinstance(module, fsdp.FSDPModule):
            raise RuntimeError(
                f"make_reversible: layer {name} of a converted stack is sharded with FSDP2's "
                f"fully_shard, whose hooks gather and free its parameters around calls the "
                f"reversible stage does not make (it runs each layer itself, and again in "
                f"backward); {SHARD_HOLDER}")


def _refuse_sharded_loop(stack: ReversibleLayers) -> None:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(stack, fsdp.FSDPModule):
        raise RuntimeError(
            "make_reversible: a converted stack sharded with FSDP2's fully_shard gathers its "
            "parameters in hooks when it is called whole, but this model's own loop calls its "
            "layers one by one, which runs none; shard the model holding it alone "
            "(fully_shard(model)), whose hooks gather the stack's parameters with its own")


def _refuse_recorded_hidden_states() -> None:
    """transformers' ``output_hidden_states=True`` records each layer's output with a hook on
    the layer: here that is the layer's own output, not the converted stream (rule 3)."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    if isinstance(collected, dict) and "hidden_states" in collected:
        raise RuntimeError(
            "make_reversible: output_hidden_states=True asks for every layer's hidden state, "
            "which a converted stack does not compute (its layers' own outputs are not the "
            "converted streams); read last_hidden_state, or use the stack unconverted")


def _without_caches(tree: Any) -> Any:
    """``tree`` with an empty Hugging Face cache replaced by None; one already filled is
    refused (rule 5)."""
    transformers = sys.modules.get("transformers")
    cache = getattr(transformers, "Cache", None) if transformers is not None else None
    if cache is None:
        return tree
    leaves, spec = tree_flatten(tree, is_leaf=lambda leaf: isinstance(leaf, cache))
    found = [leaf for leaf in leaves if isinstance(leaf, cache)]
    for given in found:
        if given.get_seq_length() > 0:
            raise RuntimeError(
                "make_reversible: a training step with gradients got a key-value cache holding "
                f"{given.get_seq_length()} positions; a converted stack runs each layer again in "
                "backward and cannot read or fill a cache there. Run the step without one "
                "(use_cache=False), under torch.no_grad(), or with the stack's memory=Store()")
    if found:
        warnings.warn("make_reversible: a training step with gradients runs the converted "
                      "stack's layers without the key-value cache it was given, which stays "
                      "empty (as transformers' checkpointing turns use_cache off); pass "
                      "use_cache=False", stacklevel=4)
    return tree_unflatten([None if isinstance(leaf, cache) else leaf for leaf in leaves], spec)
