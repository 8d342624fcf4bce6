"""What a hooked block's forward builds beside the engine: a graph of the hooks' own, which
begins at a node that refuses to be backpropagated into, and the same refusal on tensors the
forward stored as module attributes. Both mean a loss reached an activation inside a block,
which the reversible engine does not store or differentiate: an error naming the block, never
a silently missing gradient. Also the hooks a call of a block runs (and the one walk finding a
transform's parameters and hooks), and the refusal of blocks
that FSDP2 shards by hooks."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin

from revnets.replay import Recording
from revnets.replay.hooks import has_forward_hooks

__all__ = [
    "forward_hooks_of", "graph_start", "hooks_own_graph", "parameters_and_hooks",
    "refuse_gradients", "refuse_sharded", "trainable",
]


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@contextlib.contextmanager
def hooks_own_graph() -> Iterator[None]:
    """Grad enabled, and the graph built here the hooks' own: saved-tensor hooks around the
    sequence (a surrounding checkpoint) must not see it."""
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        yield


def graph_start(x: Tensor, where: str) -> Tensor:
    """``x`` cut from its graph, as the first node of a new one that refuses backpropagation."""
    return _NoGradientThroughForward.apply(x.detach().requires_grad_(), where)


def refuse_gradients(recording: Recording, where: str) -> None:
    """Tensors the forward stored as module attributes (an auxiliary loss, a router's
    load-balancing term) were computed without a graph: a loss on them raises, naming where they
    came from, instead of silently getting no gradient through the block."""
    for slot in recording.assigned:
        value = slot.current()
        if isinstance(value, Tensor) and value.is_floating_point() and not value.requires_grad:
            with torch.enable_grad():
                slot.put(graph_start(value, where))


class _NoGradientThroughForward(torch.autograd.Function):
    """Marks where the graph of a hooked block's forward pass begins; backpropagating into it
    means a loss used an activation that the reversible engine does not differentiate."""

    @staticmethod
    def forward(ctx, x: Tensor, where: str) -> Tensor:
        ctx.where = where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        raise RuntimeError(
            f"ReversibleSequence: a loss used an activation from inside {ctx.where} (captured by "
            "a forward hook or stored as a module attribute, for example an auxiliary loss). "
            "The reversible engine does not "
            "store or differentiate activations inside its blocks, so that term would get no "
            "gradient. Compute it from the sequence's output or its context, or run this "
            "sequence with memory=revnets.Store()."
        )


def refuse_sharded(block: nn.Module) -> None:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    name = next((name for name, m in block.named_modules() if isinstance(m, fsdp.FSDPModule)),
                None)
    if name is not None:
        raise RuntimeError(
            f"ReversibleSequence: {type(block).__name__}{'.' + name if name else ''} is sharded "
            f"with FSDP2's fully_shard, whose hooks gather and free its parameters around calls "
            f"the reversible engine does not make (it runs f and g, and differentiates them, "
            f"itself); apply fully_shard to the ReversibleSequence or a module containing it"
        )


def forward_hooks_of(block: nn.Module) -> tuple[list[tuple[Any, bool]], list[tuple[Any, bool]]]:
    """The forward pre-hooks and hooks a call of ``block`` runs, global ones first as
    ``Module.__call__`` runs them, each with whether it takes the keyword arguments."""
    module = nn.modules.module
    pre_hooks = [(hook, False) for hook in module._global_forward_pre_hooks.values()] + [
        (hook, key in block._forward_pre_hooks_with_kwargs)
        for key, hook in block._forward_pre_hooks.items()]
    hooks = [(hook, key in module._global_forward_hooks_with_kwargs)
             for key, hook in module._global_forward_hooks.items()] + [
        (hook, key in block._forward_hooks_with_kwargs)
        for key, hook in block._forward_hooks.items()]
    return pre_hooks, hooks


def parameters_and_hooks(root: nn.Module) -> tuple[list[Any], bool, bool]:
    """``state_tensors(root, buffers=False)`` (in its order), whether a module in it has a
    forward hook or pre-hook or a global one is registered, and whether a lazy module in it has
    not made its parameters yet; one walk (it runs for every block of every step). Lazy modules
    are told by their class, which torch.compile's tracing reads as a constant (an
    ``UninitializedParameter`` made dynamo restart its trace and fail at a block's first call)."""
    found: list[Any] = []
    hooked = has_forward_hooks(())  # the global ones
    lazy = False
    stack = [root]
    while stack:
        m = stack.pop()
        found += m._parameters.values()
        hooked = hooked or bool(m._forward_hooks or m._forward_pre_hooks)
        lazy = lazy or isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
        stack += [c for c in reversed(m._modules.values()) if c is not None]
    return found, hooked, lazy


def trainable(slots: list[Any]) -> list[nn.Parameter]:
    return list(dict.fromkeys(p for p in slots if p is not None and p.requires_grad))
