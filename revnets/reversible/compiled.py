"""f and g compiled inside the reversible engine, where the replay's guarantees survive compiling
(NOTE [ Compiled transforms ])."""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch import Tensor, nn

from revnets.compiling import compile_options
from revnets.replay import Recording

__all__ = ["DEFAULT_BACKEND", "TransformCompiler", "compiled_call"]

# NOTE [ Compiled transforms ]
# The engine runs eagerly, also inside a compiled model (torch.compiler.disable: it runs user code
# under dispatch modes and saves only the sequence's output, neither of which a traced graph
# can do). Its f and g need not: where the replay needs nothing that a compiled graph would hide
# from it, the engine calls them through a function torch.compile made (inductor), in the
# forward (an inference graph, no grad) and in the recomputation (a training graph, whose
# backward gives the gradients). That is where
#   1. the transform is made of torch.nn's known layers (NOTE [ Known layers ]): the recording
#      needs no dispatcher watch, which would not see the operators inside a compiled graph;
#   2. it draws no random numbers (no dropout in training mode): inductor makes its own random
#      numbers, not eager's (unless fallback_random), and although its inference and training
#      graphs drew the same mask from the same generator state where checked (docs/compile.md),
#      nothing guarantees it in general; such a transform stays eager;
#   3. the sequence is not exact (NOTE [ Exact reversibility ]): the two graphs fuse and round
#      differently, so f's output in the recomputation may differ from the forward's in the last
#      bits. Reconstruction by subtraction is already exact only to round-off, of that same
#      order; on the grid a last-bit difference can round to another grid point, and exact
#      sequences promise the bit: they stay eager;
#   4. autocast is off and every context argument is a tensor (what was checked);
#   5. it was asked for: ``ReversibleSequence.compile_transforms`` is None and the sequence
#      runs inside a compiled model (the forward dynamo traced asks), or it is True or a
#      backend's name. The default, False, keeps f and g eager (see Speed below).
# What dynamo cannot compile (it raises while compiling, before anything ran) runs eagerly, with
# a warning: never a different computation.
# Batch norm's running statistics: the compiled inference graph writes them back once, as eager
# does; the replay sets momentum to 0 (frozen_running_stats), which the training graph reads
# like eager code (dynamo guards on it or takes it as an input), so it blends in nothing.
# The forward and the recomputation make the same choice for each transform (the step keeps it).
#
# Dynamo keeps compiled code per code object, and its recompile limit (8) counts per code object:
# one function compiled for every transform would reach it on any deep model (shapes, grad mode).
# So each kind of call gets a function of its own code object: one per transform structure
# (its repr: layer types and sizes), input shape, dtype, device and grad mode. Blocks built
# alike share one, so a stage of identical blocks compiles once for the forward and once for the
# recomputation.
#
# Speed: convolutional f and g gain nothing, so it is opt-in (docs/compile.md). On CPU inductor
# runs their convolutions with eager's kernels, and a compiled call's own cost (guards, the
# AOTAutograd wrappers) is about what fusing their batch norms and ReLUs saves. On an H200 the
# compiled revnet38 step under ``reversible`` took 1.23x the eager step with them compiled and
# 1.04x with them eager (batch 4): a step there is bound by the CPU launching kernels, and each
# compiled call adds to that.


# What ``compile_transforms=True`` (or None, under a compiled model) compiles with.
DEFAULT_BACKEND = "inductor"
_MISSING = object()
_TEMPLATE = (lambda module, half, *context: module(half, *context)).__code__


class TransformCompiler:
    """The compiled functions of this process, one per kind of call (see the NOTE)."""

    def __init__(self) -> None:
        self._functions: dict[tuple, Callable[..., Tensor]] = {}
        self._structure: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.calls = 0  # transforms run compiled so far (what the tests count)

    def runner(self, backend: str) -> Callable[..., Tensor]:
        """``call(fn, half, *context)`` for :meth:`ReversibleBlock.transform`, compiling with
        ``backend``."""
        return functools.partial(self, backend)

    def __call__(self, backend: str, module: nn.Module, half: Tensor, *context: Any) -> Tensor:
        structure = self._structure.get(module)
        if structure is None:
            structure = self._structure[module] = repr(module)
        # Inductor keeps f's and g's layout as the model's (NOTE [ Layout under torch.compile ]).
        options = compile_options(module) if backend == "inductor" else {}
        key = (
            backend, tuple(options.items()), structure, tuple(half.shape), half.stride(),
            half.dtype, half.device,
            torch.is_grad_enabled(),
            tuple((tuple(c.shape), c.stride(), c.dtype, c.requires_grad) for c in context),
        )
        function = self._functions.get(key, _MISSING)
        if function is _MISSING:
            code = _TEMPLATE.replace(co_name=f"revnets_transform_{len(self._functions)}")
            function = torch.compile(
                types.FunctionType(code, globals()), backend=backend, dynamic=False,
                **({"options": options} if options else {}),
            )
            self._functions[key] = function
        if function is None:
            return module(half, *context)
        try:
            h = function(module, half, *context)
        except torch._dynamo.exc.TorchDynamoException as error:
            # Raised while compiling, before anything ran: this kind of call runs eagerly from
            # now on (the recomputation of a compiled forward then differs from it by round-off
            # only, rule 3).
            warnings.warn(
                f"revnets: {type(module).__name__} could not be compiled inside the reversible "
                f"engine ({type(error).__name__}: {str(error).splitlines()[0][:200]}); it runs "
                "eagerly", stacklevel=2,
            )
            self._functions[key] = None
            return module(half, *context)
        self.calls += 1
        return h

    def clear(self) -> None:
        """Forget the compiled functions (after ``torch._dynamo.reset()``, say) and the count."""
        self._functions.clear()
        self.calls = 0


compiled_call = TransformCompiler()


def compilable(recording: Recording, context: tuple, autocast_enabled: bool) -> bool:
    """Whether a transform recorded by ``recording`` may run compiled (rules 1, 2 and 4 of the
    NOTE; rules 3 and 5 are the sequence's)."""
    return (
        recording.known
        and not recording.known_draws
        and not autocast_enabled
        and all(isinstance(c, Tensor) for c in context)
    )
