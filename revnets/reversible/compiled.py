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
from torch.utils._python_dispatch import _get_current_dispatch_mode

from revnets.compiling import compile_options
from revnets.replay import Recording

__all__ = ["DEFAULT_BACKEND", "BlockBackwardCompiler", "TransformCompiler", "compiled_backward",
           "compiled_call", "compiled_reverse"]

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
#   5. it was asked for: ``ReversibleSequence.compile_transforms`` is None (the default) and the
#      sequence runs inside a compiled model on the CPU (the forward dynamo traced asks), or it
#      is True or a backend's name (also on a GPU, and in an eager model). See Speed below.
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
# Speed: compiled separately, convolutional f and g gained nothing: on the CPU inductor runs
# their convolutions with eager's kernels, and a compiled call's own cost (guards, the
# AOTAutograd wrappers) is about what fusing their batch norms and ReLUs saves; on an H200 the
# compiled revnet38 step under ``reversible`` took 1.23x the eager step with them compiled and
# 1.04x with them eager (batch 4), a step there being bound by the CPU launching kernels. What
# pays is the block's whole backward step as one compiled function (NOTE [ Compiled block
# backward ]), which is why the default compiles on the CPU, where that was measured
# (docs/compile.md), and not on a GPU, where it was not.


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

    def structure(self, module: nn.Module) -> str:
        """What identical transforms share: their layers' types and sizes (the repr)."""
        structure = self._structure.get(module)
        if structure is None:
            structure = self._structure[module] = repr(module)
        return structure

    def __call__(self, backend: str, module: nn.Module, half: Tensor, *context: Any) -> Tensor:
        structure = self.structure(module)
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


# NOTE [ Compiled block backward ]
# Where both f and g of an additive coupling ran compiled in the forward (NOTE [ Compiled
# transforms ]: known layers, no random draws, not exact, no autocast) and the block takes no
# context and keeps no input, its whole backward step runs as one compiled function:
#     h = g(y1); x2 = y2 - h; dy1 += vjp of g;   h = f(x2); x1 = y1 - h; dx2 = dy2 + vjp of f
# (h times the block's drop-path scale where it drops paths: the scales the forward drew are
# inputs, NOTE [ Drop path outside the transforms ])
# (torch.func.vjp over torch.func.functional_call, compiled without graph breaks). Inductor then
# fuses the reconstruction and the gradient additions into f's and g's kernels, and one call
# replaces two compiled training graphs, their AOTAutograd wrappers and the autograd engine's
# two backward passes: on this project's CPU the compiled RevNet and i-RevNet steps under
# ``reversible`` went from level with eager or slower to faster than eager with it
# (benchmarks/compile_speed.py; the numbers are in docs/compile.md).
# The replay's rules hold as in the separately compiled transforms: the recordings are checked
# (nothing changed since the forward) and their replay entered; a batch norm in training mode
# runs on batch statistics with its running statistics left out (functional_call with None in
# their place), so they are updated once, by the forward, as eager's replay does with momentum
# 0; any other buffer is read, never written (torch.func refuses a write, and the step then runs
# the ordinary way, with a warning). Parameters that do not require grad are read as constants.
# The step's outputs are fresh tensors the engine owns (carry.mine), so the block below may
# reconstruct into them in place; the gradient-memory reuse of the ordinary step (NOTE
# [ Gradient memory ]) is not done inside the compiled function.
# Each kind of call (structures of f and g, their modules' modes, shapes, dtype, device) gets a
# function of its own code object, as the transforms do, so dynamo's recompile limit is never
# approached.

_BATCH_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
_BLOCK_TEMPLATE = (lambda *args: _block_backward(*args)).__code__


def _scaled(h: Tensor, scale: Tensor | None) -> Tensor:
    return h if scale is None else h * scale.to(h.dtype)


def _block_backward(
    f: nn.Module, g: nn.Module, f_params: dict, g_params: dict, f_fixed: dict, g_fixed: dict,
    y1: Tensor, y2: Tensor, dy1: Tensor, dy2: Tensor, f_scale: Tensor | None,
    g_scale: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, dict, dict]:
    h, g_vjp = torch.func.vjp(
        lambda z, p: _scaled(torch.func.functional_call(g, (p, g_fixed), (z,)), g_scale),
        y1, g_params)
    x2 = y2 - h
    grad_y1, g_grads = g_vjp(dy2)
    grad_y1 = dy1 + grad_y1
    h, f_vjp = torch.func.vjp(
        lambda x, p: _scaled(torch.func.functional_call(f, (p, f_fixed), (x,)), f_scale),
        x2, f_params)
    x1 = y1 - h
    grad_x2, f_grads = f_vjp(grad_y1)
    return x1, x2, grad_y1, dy2 + grad_x2, f_grads, g_grads


def _split(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor | None]]:
    """``module``'s trainable parameters, and what it reads as constants: other parameters, and
    buffers, batch statistics of a training-mode batch norm left out (None)."""
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    fixed: dict[str, Tensor | None] = {
        n: p for n, p in module.named_parameters() if not p.requires_grad}
    for prefix, m in module.named_modules():
        batch_statistics = (isinstance(m, nn.modules.batchnorm._NormBase) and m.training
                            and m.track_running_stats)
        for name, buffer in m.named_buffers(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            fixed[key] = None if batch_statistics and name in _BATCH_STATISTICS else buffer
    return trainable, fixed


class BlockBackwardCompiler:
    """The compiled block backward steps of this process, one per kind of call (NOTE
    [ Compiled block backward ])."""

    def __init__(self) -> None:
        self._functions: dict[tuple, Callable[..., Any] | None] = {}
        self.calls = 0  # block steps run compiled so far (what the tests count)

    def __call__(
        self, backend: str, f: nn.Module, g: nn.Module, y1: Tensor, y2: Tensor, dy1: Tensor,
        dy2: Tensor, f_scale: Tensor | None = None, g_scale: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[tuple[nn.Parameter, Tensor]]] | None:
        """x1, x2, their gradients and (parameter, gradient) pairs; None where this kind of
        call could not be compiled, or runs under a dispatch mode (a memory meter, a fake-tensor
        prediction), which dynamo does not compile under: the caller then runs the step the
        ordinary way."""
        if _get_current_dispatch_mode() is not None:
            return None
        options = compile_options(f) if backend == "inductor" else {}
        key = (
            backend, tuple(options.items()), compiled_call.structure(f),
            compiled_call.structure(g),
            tuple(m.training for m in f.modules()), tuple(m.training for m in g.modules()),
            *((tuple(t.shape), t.stride()) for t in (y1, y2, dy1, dy2)), y1.dtype, y1.device,
            f_scale is None, g_scale is None,
        )
        function = self._functions.get(key, _MISSING)
        if function is _MISSING:
            code = _BLOCK_TEMPLATE.replace(co_name=f"revnets_block_backward_{len(self._functions)}")
            function = self._functions[key] = torch.compile(
                types.FunctionType(code, globals()), backend=backend, dynamic=False,
                fullgraph=True, **({"options": options} if options else {}),
            )
        if function is None:
            return None
        (f_params, f_fixed), (g_params, g_fixed) = _split(f), _split(g)
        try:
            x1, x2, dx1, dx2, f_grads, g_grads = function(
                f, g, f_params, g_params, f_fixed, g_fixed, y1, y2, dy1, dy2, f_scale, g_scale)
        except (torch._dynamo.exc.TorchDynamoException, RuntimeError) as error:
            # Raised while compiling (or by torch.func refusing a write), before any result:
            # this kind of call runs the ordinary way from now on.
            warnings.warn(
                f"revnets: the backward step of a reversible block ({type(f).__name__}, "
                f"{type(g).__name__}) could not be compiled as one function "
                f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); it runs "
                "the ordinary way", stacklevel=2,
            )
            self._functions[key] = None
            return None
        self.calls += 1
        pairs = [(g_params[n], grad) for n, grad in g_grads.items()]
        pairs += [(f_params[n], grad) for n, grad in f_grads.items()]
        return x1, x2, dx1, dx2, pairs

    def clear(self) -> None:
        self._functions.clear()
        self.calls = 0


compiled_backward = BlockBackwardCompiler()


def compiled_reverse(step: Any, carry: Any, context: Any, remedy: str) -> list | None:
    """A recomputed coupling step's backward as one compiled function (NOTE [ Compiled block
    backward ]), in the replay of f's and g's forward runs, leaving the block's input and its
    gradient in ``carry``; None, with ``carry`` as found, where the step does not qualify or
    could not be compiled (the caller then runs it the ordinary way)."""
    backend = step.compiled.get("f")
    if (backend is None or step.compiled.get("g") != backend
            or not step.block.coupling.is_additive or context.values or step.kept is not None
            or carry.dy1 is None or carry.dy2 is None):
        return None
    runs = step.runs
    for name in ("g", "f"):
        runs[name].check("ReversibleSequence", remedy, prefix=f"blocks.{step.index}.{name}.")
    y1, y2 = carry.own(step.layouts["g"], step.layouts["f"])
    with runs["g"].replayed(), runs["f"].replayed():
        done = compiled_backward(backend, step.block.f, step.block.g, y1, y2, carry.dy1,
                                 carry.dy2, step.scales["f"], step.scales["g"])
    carry.mine = (True, True)  # copies the engine made, or fresh outputs: its own
    if done is None:
        carry.y1, carry.y2 = y1, y2
        return None
    carry.y1, carry.y2, carry.dy1, carry.dy2, pairs = done
    runs.clear()
    step.compiled.clear()
    step.scales.clear()
    return pairs
