"""torch functions and Tensor methods whose effects are known, for the steps of a traced graph
recorded without the watch (NOTE [ Known layers ], NOTE [ Known calls ])."""

from __future__ import annotations

import functools
import inspect
import operator
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.immutable_collections
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from revnets.facts.tensors import device_of

__all__ = ["CallKind", "bound_arguments", "call_kind", "plain", "plain_device", "plain_parameters"]

# NOTE [ Known calls ]
# A traced graph's step (revnets.graph.trace.GraphStep) calls a torch.nn layer, a function or
# a Tensor method. A function is known by identity: the graph holds the function object torch
# made (a patch made after tracing does not reach it, one made before is another object). It
# is known only if it is one of torch's compiled functions, an operator, or a function of
# torch.nn.functional, whose namespace the known-layers check already compares with what torch
# made. A method is known by name, looked up on torch.Tensor, whose namespace is compared too.
# What a known call does, besides computing its result:
#   - ``fresh``: it returns memory it allocated; otherwise it may return its first argument or
#     a view of it (a reshape, a dropout in eval mode), which is memory the run made only if
#     that argument was;
#   - ``draws``: it may draw from its input device's default generator (dropout, attention with
#     dropout), and only from it: a ``generator=`` or ``device=`` argument makes any call
#     unknown, and nothing known moves a tensor to another device;
#   - a write into its first argument (an in-place method, ``inplace=True``, ``+=``), known only
#     where that argument is memory the run made (KnownWalk.call), as for in-place layers; a
#     write anywhere else (``out=``, an embedding's ``max_norm``) makes the call unknown.
# Nothing here reads or writes module state: a step reading a buffer directly is not known.
# Values: a method is looked up by name on whatever its receiver is, and an operator calls its
# operands' own methods, so a known call's arguments must be plain values (``plain``: tensors
# of torch's own types, a prediction's fake tensors among them, Python's scalars and strings,
# torch's dtypes, devices and sizes, and tuples, lists, dicts and slices of them), never an
# object whose methods are user code (a module returning a result type of its own with ``mul``
# or ``__add__``). A known run's inputs are checked when it starts (``plain_device``: the watch
# runs where one is not plain), the constants a traced step holds when it is first walked, and
# its parameters on each walk; known calls and layers map plain values to plain values, so
# every value in between is plain too.


@dataclass(frozen=True)
class CallKind:
    fresh: bool
    draws: bool = False


FRESH, PASSING = CallKind(True), CallKind(False)
DRAWING, DRAWING_FRESH = CallKind(False, draws=True), CallKind(True, draws=True)


def _builtins(namespace: Any, names: str) -> list[Any]:
    # torch's compiled functions only: one written in Python looks up names that no check covers.
    found = [getattr(namespace, n) for n in names.split()]
    return [f for f in found if isinstance(f, types.BuiltinFunctionType)]


_FUNCTIONS: dict[Any, CallKind] = {
    **dict.fromkeys(_builtins(torch, """
        add sub mul div true_divide matmul mm bmm baddbmm addmm einsum cat concat stack softmax
        log_softmax sigmoid tanh relu exp log sqrt rsqrt pow abs neg mean sum cumsum amax amin
        maximum minimum clamp where masked_fill erf sin cos outer layer_norm group_norm
        arange zeros ones full zeros_like ones_like full_like empty empty_like roll flip
        repeat_interleave tril triu"""), FRESH),
    **dict.fromkeys(_builtins(torch, """
        flatten reshape transpose permute chunk unbind squeeze unsqueeze narrow select
        movedim swapaxes t"""), PASSING),
    **dict.fromkeys(_builtins(torch, "dropout"), DRAWING),
    **dict.fromkeys(_builtins(torch, "bernoulli rand_like randn_like"), DRAWING_FRESH),
    **dict.fromkeys([
        operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
        operator.mod, operator.pow, operator.neg, operator.matmul,
        operator.iadd, operator.isub, operator.imul, operator.itruediv,
        F.relu, F.relu6, F.gelu, F.silu, F.mish, F.elu, F.selu, F.celu, F.leaky_relu,
        F.hardtanh, F.hardswish, F.hardsigmoid, F.softplus, F.sigmoid, F.tanh, F.softmax,
        F.log_softmax, F.layer_norm, F.group_norm, F.rms_norm, F.normalize, F.linear,
        F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
        F.conv_transpose3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.max_pool1d,
        F.max_pool2d, F.max_pool3d, F.embedding, F.glu, F.one_hot,
    ], FRESH),
    **dict.fromkeys([
        operator.getitem, getattr, F.pad, F.interpolate, F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
        F.adaptive_max_pool2d, F.adaptive_max_pool3d, F.pixel_shuffle, F.pixel_unshuffle,
    ], PASSING),
    **dict.fromkeys([
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
        F.feature_alpha_dropout,
    ], DRAWING),
    F.scaled_dot_product_attention: DRAWING_FRESH,
}
_METHODS: dict[str, CallKind] = {
    **dict.fromkeys("""
        add sub mul div matmul mm bmm softmax log_softmax sigmoid tanh relu exp log sqrt rsqrt
        pow abs neg mean sum cumsum amax amin clamp masked_fill clone repeat flip roll var std
        norm erf sin cos tril triu __add__ __sub__ __mul__ __truediv__ __matmul__ __neg__
        __radd__ __rsub__ __rmul__""".split(), FRESH),
    **dict.fromkeys("""
        view reshape flatten unflatten permute transpose contiguous size dim chunk split unbind
        unsqueeze squeeze expand expand_as view_as reshape_as t narrow select movedim
        float double half bfloat16 __getitem__""".split(), PASSING),
}
# In-place methods whose out-of-place form is known, and those that only fill their argument.
_WRITING_METHODS = frozenset({
    *(f"{name}_" for name, kind in _METHODS.items() if kind.fresh and not name.startswith("__")),
    "zero_", "fill_", "copy_", "masked_fill_", "clamp_",
})


def call_kind(op: str, target: Any, args: tuple, kwargs: dict) -> CallKind | None:
    """What a graph's ``call_function`` or ``call_method`` does (NOTE [ Known calls ]), or None
    when it is not known. Arguments that are values of the graph stand for anything."""
    if not _UNKNOWN_ARGUMENTS.isdisjoint(kwargs):
        return None
    if op == "call_method":
        return _METHODS.get(target) or (PASSING if target in _WRITING_METHODS else None)
    try:
        kind = _FUNCTIONS.get(target)
    except TypeError:  # an unhashable callable
        return None
    if target is F.embedding:
        if bound_arguments(target, args, kwargs).get("max_norm", 0) is not None:
            return None  # it renormalises the weight's rows in place
    if kind is None or not kind.draws:
        return kind
    return kind if _may_draw(target, args, kwargs) else CallKind(kind.fresh)


# Arguments that make any call unknown: a generator of the caller's (only the watch finds it), a
# device (a tensor made or moved there: a later draw uses that device's generator), an ``out``
# tensor written into.
_UNKNOWN_ARGUMENTS = frozenset({"generator", "device", "out"})


def bound_arguments(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, defaults included; {} where the signature is unknown."""
    try:
        signature = _signature(target)
    except TypeError:  # unhashable: not cached
        signature = _signature.__wrapped__(target)
    if signature is None:
        return {}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return {}
    bound.apply_defaults()
    return bound.arguments


@functools.lru_cache(maxsize=4096)
def _signature(target: Any) -> inspect.Signature | None:
    # Parsing a builtin's text signature takes a third of a millisecond, and a chain of a
    # thousand steps asks for the same few targets again and again.
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def _may_draw(target: Any, args: tuple, kwargs: dict) -> bool:
    """False only where the arguments say it does not draw (training off, a rate of 0);
    attention returns fresh memory either way, a dropout in eval mode its input."""
    # A builtin without a signature (attention) is read by its keywords alone.
    found = bound_arguments(target, args, kwargs) or kwargs
    if not found:
        return True
    if "dropout_p" in found:
        return _constant(found["dropout_p"]) != 0
    flag = found.get("training", found.get("train", True))
    return _constant(flag) is not False and _constant(found.get("p", 1.0)) != 0


def _constant(value: Any) -> Any:
    # A graph value (a Ref) is not a bool or a number: it may be anything.
    return value if isinstance(value, (bool, int, float)) else True


_TENSORS = frozenset({Tensor, nn.Parameter, FakeTensor})
_PLAIN = _TENSORS | frozenset({
    int, float, bool, complex, str, type(None), type(...), torch.dtype,
    torch.device, torch.Size, torch.memory_format, torch.layout,
})
_SEQUENCES = frozenset({
    tuple, list, torch.fx.immutable_collections.immutable_list,
})


def plain(value: Any, also: type | tuple[type, ...] = ()) -> bool:
    """Whether ``value`` is a plain value (NOTE [ Known calls ]); ``also``: types that count as
    plain here (a traced graph's references to its values, checked where they are made)."""
    kind = type(value)
    if kind in _PLAIN or isinstance(value, also):
        return True
    if kind in _SEQUENCES or kind.__module__ == "torch.return_types":
        return all(plain(v, also) for v in value)
    if kind is dict or kind is torch.fx.immutable_collections.immutable_dict:
        return all(plain(v, also) for v in value.values())
    if kind is slice:
        return all(plain(v, also) for v in (value.start, value.stop, value.step))
    return False


def plain_device(args: Any) -> torch.device | None:
    """The device of the first tensor in ``args`` where every value in them is plain (NOTE
    [ Known calls ]), for a recording that may run without the watch; None otherwise."""
    if not plain(args):  # not tree_leaves alone: it would open a user's registered container
        return None
    return device_of(args)


def plain_parameters(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters and buffers are of torch's own tensor types (NOTE
    [ Known calls ]; a prediction's fakes among them): a subclass's methods are user code."""
    return all(
        type(t) in _TENSORS
        for t in (*module._parameters.values(), *module._buffers.values()) if t is not None
    )
