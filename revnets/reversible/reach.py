"""What the reversible engine differentiates, and the refusal of anything else.

# NOTE [ What the engine differentiates ]
# A recomputed transform is differentiated with respect to its input half, the parameters of its
# module and the sequence's context arguments, and nothing else: the sequence is one autograd
# Function, which can hand gradients only to its own inputs. A transform whose graph reaches any
# other tensor that requires grad (an attribute, a closure, a parameter kept in a plain list) is
# refused by name (:func:`check_reached`), never left without its gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from revnets.replay import silenced_tensor_hooks
from revnets.replay.held import reached

__all__ = ["GradRoot", "check_reached"]


class GradRoot:
    """Where backpropagation through a recomputed transform starts, without keeping its output.

    Holding the output tensor itself would keep its storage alive for the whole backward through
    the transform; the gradient edge (its grad_fn) is all the engine needs.
    """

    __slots__ = ("edge", "dtype")

    def __init__(self, output: Tensor) -> None:
        self.edge = get_gradient_edge(output) if output.requires_grad else None
        self.dtype = output.dtype

    def vjp(self, inputs: Sequence[Tensor], grad_output: Tensor) -> list[Tensor | None]:
        """Vector-Jacobian product w.r.t. ``inputs`` (None where independent)."""
        if not inputs or self.edge is None:
            return [None] * len(inputs)
        if grad_output.dtype != self.dtype:
            # Plain autograd casts an incoming gradient to its producer's dtype (autocast outputs).
            grad_output = grad_output.to(self.dtype)
        with silenced_tensor_hooks(inputs):
            try:
                return list(torch.autograd.grad(self.edge, inputs, grad_output,
                                                allow_unused=True))
            except RuntimeError as error:
                if "use_reentrant=True" not in str(error):
                    raise
                raise RuntimeError(
                    "ReversibleSequence: f or g calls torch.utils.checkpoint with "
                    "use_reentrant=True, whose backward cannot run inside the reversible "
                    "engine's (it differentiates f and g with torch.autograd.grad); use "
                    "use_reentrant=False, or revnets.checkpoint"
                ) from error


def check_reached(h: Tensor, known: Sequence[Tensor], module: nn.Module, name: str) -> None:
    """Refuse a transform whose graph reaches a tensor requiring grad that the engine does not
    differentiate: its gradient would silently be dropped."""
    known_ids = {id(t) for t in known}
    stack = [h.grad_fn]
    parent: dict[Any, Any] = {h.grad_fn: None}
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, _AccumulateGrad):
            if id(node.variable) not in known_ids:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                raise _stray_tensor_error(node.variable, path, module, name)
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in parent:
                parent[child] = node
                stack.append(child)


_AccumulateGrad = torch._C._functions.AccumulateGrad


def _stray_tensor_error(
    leaf: Tensor, path: list[Any], module: nn.Module, name: str
) -> RuntimeError:
    """``path`` runs from the stray leaf's accumulator up to the transform's output; ``module``
    is a reversible block (``name`` "f" or "g" says which transform) or an invertible module
    (``name`` its place in the sequence)."""
    if name in ("f", "g"):
        fn = getattr(module, name)
        owner = f"ReversibleBlock.{name} ({type(fn).__name__})"
    else:
        fn, owner = module, f"{name} ({type(module).__name__})"
    attributes = _tensor_attributes(fn, name)
    described = attributes.get(id(leaf))
    for node in path[1:]:
        described = described or attributes.get(id(node))
    if described is None:
        reader = path[1].name() if len(path) > 1 else "returned as is"
        described = (
            f"a tensor of shape {tuple(leaf.shape)} and dtype {leaf.dtype} that is not one of "
            f"its parameters (read by {reader}; a parameter kept in a closure, or a tensor "
            "computed earlier in the model)"
        )
    return RuntimeError(
        f"{owner} reads {described}, which requires grad. "
        "The reversible engine differentiates only the block's input, the parameters of f and g "
        "and the context arguments, so its gradient would be silently dropped. Pass it as "
        "context (sequence(x, tensor) calls f(x2, tensor)), register it as a parameter of f or "
        "g, or run the sequence with memory=revnets.Store()."
    )


def _tensor_attributes(root: nn.Module, prefix: str) -> dict[int, str]:
    """Tensors held as attributes of ``root``'s modules, or in what those hold (NOTE [ What a
    module holds ]), by the id of the leaf itself or of the node that made it: ``"the
    attribute f.emb"``, ``"the attribute f.cfg.table[0]"``."""
    found: dict[int, str] = {}
    seen: set[int] = set()
    for module_name, module in root.named_modules(prefix=prefix):
        for key, value in vars(module).items():
            if key == "_parameters":  # the block's own, never stray
                continue
            for where, v in reached(value, seen, f"{module_name}.{key}"):
                if isinstance(v, Tensor):
                    found[id(v.grad_fn) if v.grad_fn is not None else id(v)] = (
                        f"the attribute {where}"
                    )
    return found
