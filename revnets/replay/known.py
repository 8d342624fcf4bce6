"""Transforms built only from torch.nn layers whose side effects are known, recorded without the
dispatcher's watch (NOTE [ Known layers ])."""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from revnets.replay.known_calls import CallKind, plain_parameters
from revnets.replay.state import CPU_STATE_BYTES, default_generator

__all__ = [
    "KnownRun", "KnownWalk", "known_code", "known_composite", "known_run", "names_run_by",
]

# NOTE [ Known layers ]
# The watch (watch.py) sees every operator a run calls, because user code can draw from any
# generator and write into any memory. torch.nn's own layers cannot: a layer of exactly one of the
# types below (not a subclass, no method of its own on the instance, no hooks, no
# parametrization, which changes the type) running code as torch made it (its classes,
# torch.nn.functional and the torch functions and Tensor methods they call, none patched) writes
# only into memory its run created and into batch norm's statistics, and draws only from its
# device's default generator. A transform made only of such layers, nested in plain
# nn.Sequential or in revnets' own composites (a ReversibleBlock with one of revnets' couplings,
# the steps of a traced graph calling known layers, functions and methods: NOTE [ Known calls ]
# in known_calls.py), is recorded without the watch: the recording keeps the device generator's
# state if a layer that draws is in training mode, and nothing else, which is what the watch
# would find. A composite shows KnownWalk every call its forward makes (``walk_known``), and its
# class is checked as made like torch's. Three cases still need the watch and fall back to it:
#   - a layer that writes into its input (``inplace=True``) with nothing before it in the chain
#     that made fresh memory (in a traced graph: a value no known step of the run made): it
#     would write into the caller's tensor;
#   - any hook, global or on a layer, and any TorchFunctionMode but torch's default device,
#     since they run user code;
#   - a norm given running statistics it does not track (InstanceNorm still updates them), and
#     norms in training and in eval mode together (one might read statistics the other updates).
# Everything else about the recording (module state by slot, scalars, the checks before a
# replay) is the same on both paths, but that a known run's slots are not compared on the way
# out: the layers assign no attribute and replace no tensor, so each slot holds what it held.

# Layers whose output is always fresh memory.
_FRESH = frozenset({
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Linear, nn.Bilinear, nn.Embedding,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
    nn.GELU, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Mish, nn.Softmax, nn.LogSoftmax, nn.PReLU,
})
# Layers that may return their input itself or a view of it, or whose kernels might for some
# sizes (Dropout in eval mode does too).
_PASSING = frozenset({
    nn.Identity, nn.Flatten, nn.Unflatten, nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle,
    nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
})
# Activations with an ``inplace`` flag: fresh memory unless it is set.
_ACTIVATIONS = frozenset({
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.SiLU, nn.Hardtanh,
    nn.Hardswish, nn.Hardsigmoid, nn.Threshold,
})
# Layers that draw random numbers in training mode, also with an ``inplace`` flag.
_DRAWING = frozenset({
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.FeatureAlphaDropout, nn.RReLU,
})
_KNOWN = _FRESH | _PASSING | _ACTIVATIONS | _DRAWING
# The code they run, as torch made it: a library that patches a layer's class or anything its
# forward calls (a helper method, a torch.nn.functional or torch function, a Tensor method:
# adapters, quantization, tracing tools) makes those layers user code again.
_MISSING = object()
# What a forward never runs: construction and serialisation (torch.compile patches
# Module.__init__ and __setstate__ to tag modules), and data.
_NOT_RUN = frozenset({
    "__init__", "__setstate__", "__getstate__", "__repr__", "extra_repr", "__dir__",
    "__annotations__", "__doc__", "___needs_generation_tag_patch",
})


class _AsMade:
    """Entries of a namespace as torch made them: all of them (``names`` None: a class, where an
    added method may shadow a base's), or those named (a module namespace, which gains
    submodules as they are imported)."""

    def __init__(self, namespace: Any, names: frozenset[str] | None = None,
                 made: frozenset[str] | None = None) -> None:
        self.namespace, self.names = namespace, names
        now = vars(namespace)
        self.keys = tuple(now if names is None else sorted(names & now.keys()))
        self.made = frozenset(self.keys) if made is None else made  # as torch made them
        self.contents = {key: now[key] for key in self.keys}
        self.values = tuple(self.contents.values())
        self.get = operator.itemgetter(*self.keys)

    def unchanged(self) -> bool:
        now = vars(self.namespace)
        try:
            if (now == self.contents) if self.names is None else (self.get(now) == self.values):
                return True
        except KeyError:
            return False
        # A changed entry that a forward does not run (a data attribute, a constructor) is no
        # patch: take it as made and compare quickly again.
        keys = (now.keys() | self.contents.keys()) if self.names is None else set(self.keys)
        for key in keys - _NOT_RUN:
            a, b = now.get(key, _MISSING), self.contents.get(key, _MISSING)
            if a is not b and (_is_code(a) or _is_code(b)) and not self._unread(key):
                return False
        self.__init__(self.namespace, self.names, self.made)
        return True


    def _unread(self, key: str) -> bool:
        """Whether ``key``, added to a class torch made (or taken away again), is one no code of
        torch's looks up: torch made no entry of that name there nor in a base class, and it is
        no special method (transformers adds a method ``smart_apply`` to ``nn.Module`` itself,
        which torch's layers never call)."""
        if key in self.made or self.names is not None or not isinstance(self.namespace, type):
            return False
        if key.startswith("__") and key.endswith("__"):
            return False
        # A base's entries as torch made them: one another library added to nn.Module since
        # (transformers' smart_apply, then shadowed on a layer's class) is none of torch's.
        return not any(key in (_CLASSES[base].made if base in _CLASSES else vars(base))
                       for base in self.namespace.__mro__[1:])


def _is_code(value: Any) -> bool:
    # An entry added or removed is code when the entry there is (the other side is _MISSING):
    # a data attribute copyreg adds on first pickling (Tensor.__slotnames__) is none.
    return value is not _MISSING and (callable(value) or hasattr(type(value), "__get__"))


def names_run_by(functions: Iterable[Any]) -> frozenset[str]:
    """Every global and attribute name the code of ``functions`` mentions (nested code too)."""
    names: set[str] = set()
    codes = [f.__code__ for f in functions if isinstance(f, types.FunctionType)]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return frozenset(names)


_CLASSES = {
    c: _AsMade(c) for kind in _KNOWN | {nn.Sequential} for c in kind.__mro__ if c is not object
}
_MRO = {
    kind: frozenset(_CLASSES[c] for c in kind.__mro__ if c is not object)
    for kind in _KNOWN | {nn.Sequential}
}
_RUN = names_run_by(
    [*vars(F).values(), *(f for c in _CLASSES for f in vars(c).values())]
)
_LIBRARY = [
    _AsMade(F, frozenset(vars(F))), _AsMade(torch, _RUN), _AsMade(torch._C._nn, _RUN),
    _AsMade(torch.Tensor),  # TensorBase, a C type, cannot be patched
    _AsMade(torch._VF),  # what F.dropout and others call: a patch adds an entry
]


def _user_code_everywhere(verified: set[Any] | None = None) -> bool:
    """Whether global hooks, a TorchFunctionMode (other than torch's default device) or a
    patched torch namespace run user code in every layer."""
    module = nn.modules.module
    return bool(
        module._global_forward_hooks or module._global_forward_pre_hooks
        or module._global_backward_hooks or module._global_backward_pre_hooks
    ) or _function_modes() or not _as_made(_LIBRARY, verified)


def _function_modes() -> bool:
    if not torch._C._len_torch_function_stack():
        return False
    return any(type(mode) is not DeviceContext for mode in _get_current_function_mode_stack())


def _as_made(namespaces: Iterable[_AsMade], verified: set[Any] | None) -> bool:
    """Whether every namespace is as torch made it; ``verified`` (a RecordingChain's) holds those
    already found so since the last user code ran, and gains those found now."""
    for namespace in namespaces:
        if verified is not None and namespace in verified:
            continue
        if not namespace.unchanged():
            return False
        if verified is not None:
            verified.add(namespace)
    return True


@functools.cache
def _made(kinds: frozenset[type]) -> frozenset[_AsMade]:
    """The class namespaces that layers of ``kinds`` run code from."""
    return frozenset().union(*(_MRO[kind] for kind in kinds))


def _keeps_statistics(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is not None


def _states_as_made(m: nn.Module) -> bool:
    """Whether a known layer's settings keep it within NOTE [ Known layers ]."""
    # A norm given running statistics it does not track (track_running_stats turned off after
    # construction) still updates them in some kernels (instance norm): the watch sees it.
    if isinstance(m, nn.modules.batchnorm._NormBase):
        return (m.running_mean is not None) == m.track_running_stats
    # An embedding with max_norm renormalises the rows it reads in place, in its weight.
    return type(m) is not nn.Embedding or m.max_norm is None


def known_run(
    roots: Sequence[nn.Module], device: torch.device | None, keep_random: bool,
    verified: set[Any] | None = None,
) -> KnownRun | None:
    """What the watch would record for ``roots``, without watching, when they are made only of
    known layers (NOTE [ Known layers ]); None when they are not, or the device is not given.
    ``keep_random``: whether the generator's state is kept for a replay. ``verified``: the
    namespaces already found as torch made them in this chain of recordings (RecordingChain)."""
    if device is None or _user_code_everywhere(verified):
        return None
    walk = KnownWalk()
    if not walk.modules(roots) or not _as_made(_made(frozenset(walk.kinds)), verified):
        return None
    statistics = {m.training for m in walk.layers if _keeps_statistics(m)}
    if len(statistics) > 1:
        return None  # an eval-mode norm might read what a training one updates
    return KnownRun(device if walk.draws and keep_random else None, walk.draws)


class KnownWalk:
    """The calls a forward makes, in order, while every one is known (NOTE [ Known layers ]).

    ``layers``: the known layers it calls; ``kinds``: the classes whose code runs; ``draws``:
    whether one may draw random numbers. ``fresh``: whether the value the next layer of a chain
    receives is memory the run made (a layer that writes into its input is known only then);
    ``fresh_values``: the same for the named values of a traced graph (known composites'
    ``walk_known`` keep them).
    """

    def __init__(self) -> None:
        self.layers: list[nn.Module] = []
        self.kinds: set[type] = {nn.Sequential}
        self.draws = False
        self.fresh = False
        self.fresh_values: set[tuple[object, str]] = set()  # (graph, value name)

    def modules(self, modules: Iterable[nn.Module]) -> bool:
        return all(self.module(m) for m in modules)

    def module(self, m: nn.Module) -> bool:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
        kind = type(m)
        code = _COMPOSITES.get(kind)
        attributes = vars(m)
        if any(callable(v) for k, v in attributes.items() if code is None or k not in code):
            return False  # a forward or helper method set on the instance
        if code is not None:
            self.kinds.add(kind)
            return m.walk_known(self)
        if kind is nn.Sequential:
            return self.modules(c for c in m._modules.values() if c is not None)
        if kind not in _KNOWN or m._modules or not _states_as_made(m) or not plain_parameters(m):
            return False
        # Known layers keep these flags as plain attributes (no getattr: a miss raises inside
        # nn.Module.__getattr__, which costs more than the rest of the walk).
        inplace = attributes.get("inplace", False)
        if inplace and not self.fresh:
            return False  # it would write into the caller's tensor
        if kind in _DRAWING:
            drawing = m.training and attributes.get("p", 1.0) != 0
            self.draws = self.draws or drawing
            self.fresh = self.fresh or (drawing and not inplace)
        elif kind in _FRESH or (kind in _ACTIVATIONS and not inplace):
            self.fresh = True
        self.layers.append(m)
        self.kinds.add(kind)
        return True

    def call(self, kind: CallKind | None, writes: bool, into_fresh: bool) -> bool | None:
        """A torch function or Tensor method of ``kind`` (known_calls.py; None: not known),
        writing into its first argument or not, whose first argument is memory the run made or
        not: whether its result is memory the run made, or None if the call is not known."""
        if kind is None or (writes and not into_fresh):
            return None
        self.draws = self.draws or kind.draws
        return into_fresh or kind.fresh


# Classes of revnets' own whose forward calls only what the walk is shown (their ``walk_known``),
# with the instance attributes allowed to hold code (a traced step's target function).
_COMPOSITES: dict[type, frozenset[str]] = {}


def known_code(cls: type) -> type:
    """Register a class of revnets' own whose methods a known run may call (a coupling): like
    torch's layer classes, its code must stay as revnets made it."""
    mro = [c for c in cls.__mro__ if c is not object]
    for c in mro:
        if c not in _CLASSES:
            _CLASSES[c] = _AsMade(c)
    _MRO[cls] = frozenset(_CLASSES[c] for c in mro)
    # The torch functions its code calls by name (torch.exp in a coupling) are checked too.
    names = names_run_by(f for c in mro for f in vars(c).values()) - _RUN
    if names & vars(torch).keys():
        _LIBRARY.append(_AsMade(torch, names))
    return cls


def known_composite(*code_attributes: str) -> Any:
    """Class decorator: a module of revnets' own (a reversible block, a traced graph's step)
    whose ``walk_known(walk)`` shows the walk every call its forward makes, in order, and returns
    whether all of them are known (NOTE [ Known layers ])."""

    def register(cls: type) -> type:
        known_code(cls)
        _COMPOSITES[cls] = frozenset(code_attributes)
        return cls

    return register


class KnownRun:
    """Stands in for the watch (same findings) over a transform of known layers."""

    def __init__(self, draws_on: torch.device | None, draws: bool = False) -> None:
        self.draws = draws  # a layer in training mode draws random numbers
        self.generators: dict[Any, tuple[Any, Tensor | None]] = {}
        if draws_on is not None:
            self.generators = {"default": kept_generator_state(draws_on)}
        self.written: dict[int, Tensor] = {}
        self.external: dict[int, tuple[Tensor, Tensor]] = {}
        self.params_written: list[Any] = []
        self.exempt_read = None

    def __enter__(self) -> KnownRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def kept_generator_state(device: torch.device, generator: Any = None) -> tuple[Any, Tensor]:
    """A generator (``device``'s default one unless given) with its state now, as a recording
    keeps it. Nothing is drawn on the meta device: there a placeholder the size of the CPU's
    state stands in, so that a prediction on meta counts what a real run keeps."""
    if device.type == "meta":
        return None, torch.empty(CPU_STATE_BYTES, dtype=torch.uint8, device="meta")
    if generator is None:
        generator = default_generator(device)
    # detach() shows the kept state to a memory tracker below (get_state is not an operator).
    return generator, generator.get_state().detach()
