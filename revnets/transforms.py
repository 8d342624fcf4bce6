"""The tracers and function transforms a checkpoint's replay or a reversible sequence's engine
cannot run under, told apart so that those calls are refused by name: make_fx and AOTAutograd
outside torch.compile, and torch.func's transforms (``grad``, ``vjp``, ``jvp``, ``vmap``)."""

from __future__ import annotations

import torch

__all__ = ["aot_traced", "func_transforms"]

# torch's checkpoint asks for dispatch-mode contexts whenever a proxy mode is active
# (``torch.utils.checkpoint._is_compiling``), which a replay is not; AOTAutograd first runs the
# function under a functional mode alone, to collect its outputs' metadata, where a replay reads
# real generator states into fake tensors.
_TRACING = (torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FUNCTIONAL)


def aot_traced() -> bool:
    """Whether make_fx or AOTAutograd is tracing this call outside torch.compile (a non-strict
    export runs Python as it is, and is not)."""
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING) and (
        not torch.compiler._is_non_strict_tracing())


def func_transforms() -> list[str]:
    """The torch.func transforms this call runs under, outermost first (``"grad"`` for grad,
    vjp, jacrev and hessian; ``"jvp"``, ``"vmap"``, ``"functionalize"``); empty outside them,
    and where dynamo traces (it runs torch.func's transforms its own way, and would break its
    graph on the interpreter stack)."""
    if torch.compiler.is_dynamo_compiling():
        return []
    stack = torch._C._functorch.get_interpreter_stack() or []
    return [interpreter.key().name.lower() for interpreter in stack]
