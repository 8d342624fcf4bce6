"""Reversible residual blocks (Gomez et al. 2017) and the engine that backpropagates through a run
of them by reconstructing each block's input from its output instead of storing it.

A :class:`ReversibleBlock` splits its input into halves ``(x1, x2)`` and computes::

    y1 = combine(x1, f(x2))        additive: y1 = x1 + f(x2)
    y2 = combine(x2, g(y1))        additive: y2 = x2 + g(y1)

which is inverted exactly, whatever f and g are::

    x2 = uncombine(y2, g(y1))      additive: x2 = y2 - g(y1)
    x1 = uncombine(y1, f(x2))      additive: x1 = y1 - f(x2)

A :class:`ReversibleSequence` runs a list of blocks as one autograd Function. Its forward keeps
nothing but the final output. Its backward walks the blocks in reverse, recomputing g(y1) and
f(x2) once each with grad enabled; the same results serve both to reconstruct the block input and
to backpropagate, so f and g run twice per step in all (4/3 of the cost of ordinary backprop for
convolutional f and g), and activation memory does not grow with the number of blocks. The
backward works in the memory it is given where nobody else can see it: the top block is
reconstructed into the output's memory when nothing else holds the output, and the gradients are
added into the incoming one when nothing else holds that (:class:`_GradientMemory`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from revnets import reconstruction
from revnets.invertible import Invertible
from revnets.replay import (
    AutocastState,
    ModuleState,
    RandomDraws,
    RngState,
    forked_rng,
    has_forward_hooks,
    module_generators,
    recomputing,
    refusing_replaced_outputs,
    silenced_tensor_hooks,
    state_tensors,
)

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "Coupling",
    "ReversibleBlock",
    "ReversibleSequence",
]


class Coupling:
    """How a reversible block updates one half from a transform ``h`` of the other half.

    Write your own coupling by subclassing and implementing three methods:

    - ``combine(x, h) -> y``: differentiable in ``x`` and ``h``.
    - ``uncombine(y, h) -> x``: the inverse in ``x``, ``combine(uncombine(y, h), h) == y`` up to
      round-off. It runs under ``torch.no_grad``; keep it well-conditioned (never divide by ~0).
    - ``transform_shape(half_shape) -> shape``: the shape that f and g must return for an input
      half of ``half_shape`` (the default: the same shape).

    Couplings are stateless: learnable parts belong in f and g, whose parameters the reversible
    engine knows about.
    """

    #: The engine skips the extra ``combine`` in backward when it is a plain sum: its Jacobian is
    #: the identity in both arguments.
    is_additive: bool = False

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        raise NotImplementedError

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        raise NotImplementedError

    def transform_shape(self, half_shape: torch.Size) -> torch.Size:
        return half_shape

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AdditiveCoupling(Coupling):
    """``y = x + h``, the RevNet coupling: volume preserving and exactly invertible in exact
    arithmetic."""

    is_additive = True

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        return x + h

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        return y - h


class AffineCoupling(Coupling):
    """``y = x * s + t`` where f (or g) returns ``h = (r, t)`` stacked along ``dim`` and
    ``s = exp(m * tanh(r / m))`` with ``m = max_log_scale``.

    The soft clamp keeps ``s`` within ``[exp(-m), exp(m)]``: the inverse ``(y - t) / s`` never
    divides by a number near zero, and round-off in reconstruction stays bounded per block.
    f and g must return twice as many channels (along ``dim``) as the half they read.
    """

    def __init__(self, dim: int = 1, max_log_scale: float = 2.0) -> None:
        if max_log_scale <= 0:
            raise ValueError(f"AffineCoupling: max_log_scale must be positive, got {max_log_scale}")
        self.dim = dim
        self.max_log_scale = max_log_scale

    def _scale_shift(self, h: Tensor) -> tuple[Tensor, Tensor]:
        raw, shift = h.chunk(2, dim=self.dim)
        m = self.max_log_scale
        return torch.exp(m * torch.tanh(raw / m)), shift

    def combine(self, x: Tensor, h: Tensor) -> Tensor:
        scale, shift = self._scale_shift(h)
        return x * scale + shift

    def uncombine(self, y: Tensor, h: Tensor) -> Tensor:
        scale, shift = self._scale_shift(h)
        return (y - shift) / scale

    def transform_shape(self, half_shape: torch.Size) -> torch.Size:
        shape = list(half_shape)
        shape[self.dim] *= 2
        return torch.Size(shape)

    def __repr__(self) -> str:
        return f"AffineCoupling(dim={self.dim}, max_log_scale={self.max_log_scale})"


def _split(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"ReversibleBlock: split_dim={dim} does not exist for an input of shape "
            f"{tuple(x.shape)}"
        )
    if x.shape[dim] % 2:
        raise ValueError(
            f"ReversibleBlock: cannot split an input of shape {tuple(x.shape)} into two equal "
            f"halves along split_dim={dim} (size {x.shape[dim]} is odd)"
        )
    x1, x2 = x.chunk(2, dim=dim)
    return x1, x2


def _make_coupling(coupling: str | Coupling, split_dim: int) -> Coupling:
    if isinstance(coupling, Coupling):
        return coupling
    if coupling == "additive":
        return AdditiveCoupling()
    if coupling == "affine":
        return AffineCoupling(dim=split_dim)
    raise ValueError(
        f"unknown coupling {coupling!r}: use 'additive', 'affine' or a revnets.Coupling instance"
    )


class ReversibleBlock(nn.Module):
    """One reversible residual unit: ``y1 = combine(x1, f(x2))``, ``y2 = combine(x2, g(y1))``.

    Args:
        f: transform of the second half, added to the first. Must return the shape the coupling
            asks for (for ``"additive"``: the shape of its input) and must not modify its input.
        g: transform of the new first half, added to the second; same rules as f.
        coupling: ``"additive"`` (RevNet), ``"affine"`` or a :class:`Coupling` instance.
        split_dim: the dimension split into two equal halves (channels for NCHW images,
            the last dimension for transformer tokens).

    Calling the block runs it with ordinary autograd. Memory is saved by running blocks inside a
    :class:`ReversibleSequence`. ``block.inverse(y)`` reconstructs the input of ``block(y)``.

    Extra arguments are *context*, passed unchanged to every call of f and g after the half:
    ``block(x, t)`` computes ``f(x2, t)`` and ``g(y1, t)`` (a time or class embedding for FiLM,
    the encoder output for cross-attention). Tensors among them get exact gradients.
    """

    def __init__(
        self,
        f: nn.Module,
        g: nn.Module,
        coupling: str | Coupling = "additive",
        split_dim: int = 1,
    ) -> None:
        super().__init__()
        self.f = f
        self.g = g
        self.coupling = _make_coupling(coupling, split_dim)
        self.split_dim = split_dim

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The two halves of ``x`` along ``split_dim`` (views, no copy)."""
        return _split(x, self.split_dim)

    def merge(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.cat((a, b), dim=self.split_dim)

    def forward(self, x: Tensor, *context: Any) -> Tensor:
        return self.merge(*self.forward_halves(*self.split(x), *context))

    def inverse(self, y: Tensor, *context: Any) -> Tensor:
        return self.merge(*self.inverse_halves(*self.split(y), *context))

    def forward_halves(self, x1: Tensor, x2: Tensor, *context: Any) -> tuple[Tensor, Tensor]:
        y1 = self.coupling.combine(x1, self.transform("f", x2, *context))
        y2 = self.coupling.combine(x2, self.transform("g", y1, *context))
        return y1, y2

    def inverse_halves(self, y1: Tensor, y2: Tensor, *context: Any) -> tuple[Tensor, Tensor]:
        x2 = self.coupling.uncombine(y2, self.transform("g", y1, *context))
        x1 = self.coupling.uncombine(y1, self.transform("f", x2, *context))
        return x1, x2

    def transform(self, name: str, half: Tensor, *context: Any) -> Tensor:
        """Run ``f`` or ``g`` (by ``name``) on a half, checking what reversibility relies on."""
        fn = self.f if name == "f" else self.g
        # Inference tensors keep no version counter: an in-place change goes unseen there.
        version = None if half.is_inference() else half._version
        try:
            h = fn(half, *context)
        except (RuntimeError, NotImplementedError) as error:
            message = str(error)
            if half.is_leaf and half.requires_grad and "in-place operation" in message:
                raise self._modified_input_error(name, fn) from error
            if half.device.type == "cpu" and ("'Half'" in message or "Got Half" in message):
                raise TypeError(
                    f"ReversibleBlock.{name} ({type(fn).__name__}) uses an operation that has no "
                    "float16 kernel on CPU; use bfloat16 on CPU (torch.autocast('cpu', "
                    "dtype=torch.bfloat16)) or float32"
                ) from error
            raise
        if version is not None and half._version != version:
            raise self._modified_input_error(name, fn)
        if not isinstance(h, Tensor):
            raise TypeError(
                f"ReversibleBlock.{name} ({type(fn).__name__}) must return a single Tensor, "
                f"got {type(h).__name__}"
            )
        expected = self.coupling.transform_shape(half.shape)
        if h.shape != expected:
            raise ValueError(
                f"ReversibleBlock.{name} ({type(fn).__name__}) returned shape {tuple(h.shape)} for "
                f"an input half of shape {tuple(half.shape)}; {self.coupling!r} needs "
                f"{tuple(expected)}. A module that changes the shape (strided or "
                "channel-changing) is not invertible: keep it outside the reversible sequence "
                "(wrap it in revnets.Checkpointed to save its memory)"
            )
        return h

    @staticmethod
    def _modified_input_error(name: str, fn: nn.Module) -> RuntimeError:
        return RuntimeError(
            f"ReversibleBlock.{name} ({type(fn).__name__}) modified its input in place; a "
            "reversible block needs its input intact to be inverted (look for inplace=True "
            "on the first layer of f or g, or an in-place op such as add_ on the input)"
        )

    def extra_repr(self) -> str:
        return f"coupling={self.coupling!r}, split_dim={self.split_dim}"


class ReversibleSequence(nn.Module):
    """A run of :class:`ReversibleBlock` whose activations are reconstructed, not stored.

    Args:
        blocks: the blocks, applied in order. All must split along the same dimension.
        memory_efficient: the off switch. ``False`` runs the very same blocks with ordinary
            autograd (storing every activation), which is the reference the reversible path must
            match and the baseline its memory is compared with.
        preserve_rng_state: replay the random number generators so that dropout and any other
            randomness in f and g draw the same numbers in the backward recomputation.
        store_last_blocks: how many of the last blocks keep their autograd graphs from the
            forward pass instead of being recomputed in backward (``checkpoint_sequential``
            leaves its last segment unrecomputed for the same reason). The last block's graph
            would be rebuilt first thing in backward anyway, so it adds to the peak only where
            that falls in the forward pass. Each further one saves 1/depth of the
            recomputation for one more block's activations, whatever the depth: a dial from
            speed to memory that keeps memory flat in depth.
        keep_input_every: keep the true input of every k-th block (blocks 0, k, 2k, ...) and
            start backward's reconstruction afresh from it, so that no block input is more than
            k - 1 inverse steps from a true one. Bounds the round-off drift of very deep float32
            or bfloat16 runs (see :func:`revnets.check_reconstruction`) for depth / k stored
            inputs; ``None`` (the default) keeps none, and memory stays flat in depth.

    ``sequence(x, *context)`` passes the context arguments to every f and g after their half
    (``f(x2, *context)``), as conditioning (FiLM, time embeddings, cross-attention memory); tensors
    among them get exact gradients, summed over the blocks.

    The reversible path is taken in training mode with grad enabled. In eval mode or under
    ``torch.no_grad`` the blocks run as plain modules, with no overhead.

    .. note::
        Gradients flow to the input, the context and the parameters of f and g (shared
        parameters included). A tensor that f or g read any other way (an attribute, a closure, a
        parameter kept in a plain list) and that requires grad is refused in backward by name:
        pass it as context. Only the sequence's output is kept, and it is released during
        backward, so a second backward through the same forward (``retain_graph=True``) raises
        an error: run the forward again. Modifying parameters, buffers the forward read, the
        context or the output in place between forward and backward is an error too, as it would
        make the reconstruction wrong, and so is double backward (``create_graph=True``).

        The whole sequence is one autograd Function, so its blocks' parameter gradients reach
        autograd together when its backward ends (tensor hooks on parameters fire once, on the
        total). After ``zero_grad(set_to_none=True)`` (the default) they become the ``.grad``
        tensors at no extra cost; when accumulating into existing ``.grad`` tensors, a copy of
        the sequence's parameter gradients is briefly alive as well.
    """

    def __init__(
        self,
        blocks: Iterable[ReversibleBlock],
        memory_efficient: bool = True,
        preserve_rng_state: bool = True,
        store_last_blocks: int = 0,
        keep_input_every: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(store_last_blocks, int) or store_last_blocks < 0:
            raise ValueError(
                "ReversibleSequence: store_last_blocks must be a non-negative integer, got "
                f"{store_last_blocks!r}"
            )
        if keep_input_every is not None and (
            isinstance(keep_input_every, bool)
            or not isinstance(keep_input_every, int)
            or keep_input_every < 1
        ):
            raise ValueError(
                "ReversibleSequence: keep_input_every must be a positive integer or None, got "
                f"{keep_input_every!r}"
            )
        blocks = list(blocks)
        for i, block in enumerate(blocks):
            if isinstance(block, Invertible):
                continue
            if not isinstance(block, ReversibleBlock):
                raise TypeError(
                    f"ReversibleSequence: block {i} is a {type(block).__name__}, neither a "
                    "ReversibleBlock nor a revnets.Invertible. Only invertible blocks can sit in a "
                    "reversible sequence; run a non-invertible module before or after it (wrap "
                    "it in revnets.Checkpointed to save its memory)"
                )
            inner = {id(p) for transform in (block.f, block.g) for p in transform.parameters()}
            stray = [name for name, p in block.named_parameters() if id(p) not in inner]
            if stray:
                raise ValueError(
                    f"ReversibleSequence: block {i} has parameters outside f and g "
                    f"({', '.join(stray)}); the reversible backward computes gradients for the "
                    "parameters of f and g only. Move them into f or g"
                )
        split_dims = {block.split_dim for block in blocks if isinstance(block, ReversibleBlock)}
        if len(split_dims) > 1:
            raise ValueError(
                f"ReversibleSequence: all blocks must split along the same dimension, got "
                f"split_dim values {sorted(split_dims)}"
            )
        self.blocks = nn.ModuleList(blocks)
        self.split_dim = split_dims.pop() if split_dims else 1
        self.memory_efficient = memory_efficient
        self.preserve_rng_state = preserve_rng_state
        self.store_last_blocks = int(store_last_blocks)
        self.keep_input_every = keep_input_every

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[ReversibleBlock]:
        return iter(self.blocks)

    def __getitem__(self, index: int) -> ReversibleBlock:
        return self.blocks[index]

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The two halves the blocks work on (views along ``split_dim``)."""
        return _split(x, self.split_dim)

    def merge(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.cat((a, b), dim=self.split_dim)

    def forward(self, x: Tensor, *context: Any) -> Tensor:
        if not self.blocks:
            return x
        if not (self.memory_efficient and self.training and torch.is_grad_enabled()):
            return self.forward_plain(x, *context)
        # Looked up once per step: backward needs each block's own, and autograd needs them all.
        plans = [_BlockPlan(block) for block in self.blocks]
        if any(plan.lazy for plan in plans):
            # Lazy modules create their parameters in their first call, which must therefore be
            # an ordinary one: the engine hands autograd the parameters before running anything.
            return self.forward_plain(x, *context)
        params = list(dict.fromkeys(p for plan in plans for p in plan.params))
        needs_grad = x.requires_grad or params or any(_requires_grad(c) for c in context)
        if not needs_grad:
            return self.forward_plain(x, *context)
        return _ReversibleFunction.apply(x, self, plans, len(context), *context, *params)

    def forward_plain(self, x: Tensor, *context: Any) -> Tensor:
        """The blocks as ordinary modules (what autograd would store, it stores)."""
        x1, x2 = self.split(x)
        for block in self.blocks:
            if isinstance(block, Invertible):
                x1, x2 = self.split(block(self.merge(x1, x2)))
            elif block._forward_hooks or block._forward_pre_hooks:
                x1, x2 = self.split(block(self.merge(x1, x2), *context))
            else:
                x1, x2 = block.forward_halves(x1, x2, *context)
        return self.merge(x1, x2)

    def inverse(self, y: Tensor, *context: Any) -> Tensor:
        y1, y2 = self.split(y)
        for block in reversed(self.blocks):
            if isinstance(block, Invertible):
                y1, y2 = self.split(block.inverse(self.merge(y1, y2)))
            else:
                y1, y2 = block.inverse_halves(y1, y2, *context)
        return self.merge(y1, y2)

    def extra_repr(self) -> str:
        extra = f"memory_efficient={self.memory_efficient}"
        if self.store_last_blocks:
            extra += f", store_last_blocks={self.store_last_blocks}"
        if self.keep_input_every is not None:
            extra += f", keep_input_every={self.keep_input_every}"
        return extra


def _requires_grad(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


class _BlockPlan:
    """What the engine needs to know of one block for one step, looked up once per step."""

    __slots__ = ("block", "f_params", "g_params", "params", "generators", "hooked", "lazy")

    def __init__(self, block: ReversibleBlock | Invertible) -> None:
        self.block = block
        if isinstance(block, Invertible):
            f_slots, g_slots = state_tensors(block, buffers=False), []
        else:
            f_slots = state_tensors(block.f, buffers=False)
            g_slots = state_tensors(block.g, buffers=False)
        self.lazy = any(isinstance(p, nn.UninitializedParameter) for p in (*f_slots, *g_slots))
        self.f_params = _trainable(f_slots)  # an Invertible's own parameters
        self.g_params = _trainable(g_slots)
        self.params = list(dict.fromkeys((*self.f_params, *self.g_params)))
        modules = list(block.modules())
        self.generators = module_generators([block])
        # Hooks see the activations of an ordinary forward: intact and, like under autograd,
        # carrying a graph (which leads to an error rather than to a silently missing gradient).
        self.hooked = has_forward_hooks(modules)


def _trainable(slots: list[Any]) -> list[nn.Parameter]:
    return list(dict.fromkeys(p for p in slots if p is not None and p.requires_grad))


class _GradRoot:
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
            return list(torch.autograd.grad(self.edge, inputs, grad_output, allow_unused=True))


class _GradientMemory:
    """Which gradients the sequence's backward may add into in place, so that it runs in the
    memory of the gradient it was given plus one transient half instead of allocating a new one
    per block.

    Storage identity decides (data_ptr() is 0 for every meta tensor, and predictions on the meta
    device must take the real run's in-place path): two gradients on one storage may overlap
    (autograd passes a gradient through identities and views unchanged), except the two halves
    of the incoming gradient, which are disjoint. Gradients handed to autograd (the parameters'
    and the context's) are never written, nor the incoming gradient when others may hold it.
    """

    def __init__(self, incoming: Tensor, halves: Sequence[Tensor], unshared: bool) -> None:
        self.incoming = _storage_id(incoming)
        self.halves = {_region(h) for h in halves} if unshared else set()
        self.handed: set[int] = set() if unshared else {self.incoming}
        self.handed_halves: set[tuple] = set()

    def hand_out(self, grad: Tensor) -> None:
        storage = _storage_id(grad)
        if storage == self.incoming and _region(grad) in self.halves:
            self.handed_halves.add(_region(grad))
        else:
            self.handed.add(storage)

    def all_ours(self) -> bool:
        """Whether no gradient handed out shares the incoming gradient's memory (which can then
        be handed on whole, without one .grad becoming a view of another)."""
        return not self.handed_halves and self.incoming not in self.handed

    def overlap(self, a: Tensor, b: Tensor) -> bool:
        return _storage_id(a) == _storage_id(b) and self._regions_overlap(_region(a), _region(b))

    def _regions_overlap(self, a: tuple, b: tuple) -> bool:
        return a == b or not {a, b} <= self.halves

    def writable(self, a: Tensor, *others: Tensor | None) -> bool:
        storage = _storage_id(a)
        if storage in self.handed:
            return False
        if storage == self.incoming:
            region = _region(a)
            if any(self._regions_overlap(region, h) for h in self.handed_halves):
                return False
        return all(o is None or not self.overlap(a, o) for o in others)

    def _disjoint_elements(self, a: Tensor) -> bool:
        # A half of the incoming gradient is a strided view that the overlap test gives up on.
        if _storage_id(a) == self.incoming and _region(a) in self.halves:
            return True
        return a._base is None and torch._debug_has_internal_overlap(a) == 0

    def add(self, a: Tensor, b: Tensor | None, *live: Tensor | None) -> Tensor:
        """``a + b``, written into ``a`` or ``b`` where no other gradient shares its memory.
        ``a`` comes first: it may be a half of the incoming gradient, which stays alive anyway,
        while a fresh ``b`` is then freed."""
        if b is None:
            return a
        if (
            a.shape == b.shape
            and torch.result_type(a, b) == a.dtype
            and self._disjoint_elements(a)
            and self.writable(a, b, *live)
        ):
            return a.add_(b)
        if b._base is None and b.dtype == a.dtype and self.writable(b, a, *live):
            return b.add_(a)
        return a + b


def _storage_id(tensor: Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _region(tensor: Tensor) -> tuple:
    return (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def _combine(coupling: Coupling, x: Tensor, h: Tensor, in_place: bool) -> Tensor:
    # Updating x in place saves an allocation per half; only for intermediates the engine owns.
    if in_place and coupling.is_additive and torch.result_type(x, h) == x.dtype:
        return x.add_(h)
    return coupling.combine(x, h)


def _uncombine(coupling: Coupling, y: Tensor, h: Tensor, in_place: bool) -> Tensor:
    if in_place and coupling.is_additive and torch.result_type(y, h) == y.dtype:
        return y.sub_(h)
    return coupling.uncombine(y, h)


def _first_half(
    coupling: Coupling, y1: Tensor, h_f: Tensor, owned: bool, autocast: AutocastState
) -> Tensor:
    with torch.no_grad(), autocast():
        return _uncombine(coupling, y1, h_f, owned)


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
            "a forward hook, for example for an auxiliary loss). The reversible engine does not "
            "store or differentiate activations inside its blocks, so that term would get no "
            "gradient. Compute it from the sequence's output or its context, or run this "
            "sequence with memory_efficient=False."
        )


class _Context:
    """The context arguments of one forward, with the leaves that backward differentiates."""

    __slots__ = ("values", "leaves")

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = tuple(values)
        self.leaves = [v.detach().requires_grad_() for v in values if _requires_grad(v)]

    def args(self) -> tuple[Any, ...]:
        """The context as f and g receive it in a recomputation: grad-requiring tensors
        replaced by their leaves."""
        leaves = iter(self.leaves)
        return tuple(next(leaves) if _requires_grad(v) else v for v in self.values)


class _ReversibleFunction(torch.autograd.Function):
    """Forward: the blocks without a graph, output kept. Backward: reconstruct and backprop."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        sequence: ReversibleSequence,
        plans: list[_BlockPlan],
        num_context: int,
        *context_and_params: Any,
    ) -> Tensor:
        context = context_and_params[:num_context]
        blocks = sequence.blocks
        preserve_rng = sequence.preserve_rng_state
        report = reconstruction.active_report()
        true_inputs = [] if report is not None else None
        every = sequence.keep_input_every
        kept_inputs: dict[int, tuple[Tensor, Tensor, int, int]] = {}
        rng_states: list[Any] = []  # per recomputed transform, in forward order
        states: list[tuple[ModuleState, ModuleState]] = []
        autocast = AutocastState.capture(x.device.type)
        # Under saved-tensor hooks, what backward needs is handed to them once (see below). A
        # stored block's graph would be unpacked by several inner backward passes instead, and a
        # surrounding checkpoint would recompute everything for each: recompute every block.
        hooked_saving = _saved_tensor_hooks_active()
        first_stored = len(blocks) - (0 if hooked_saving else sequence.store_last_blocks)
        while any(isinstance(b, Invertible) for b in list(blocks)[first_stored:]):
            first_stored += 1  # only couplings keep their graphs
        stored: list[_StoredTransforms] = []
        generators = list({id(g): g for p in plans for g in p.generators}.values())
        end_rng = None

        x1, x2 = sequence.split(x)
        owned = False  # the halves are views of the caller's input until the first block has run
        for i, (block, plan) in enumerate(zip(blocks, plans)):
            if true_inputs is not None:
                true_inputs.append((x1, x2))
            if i >= first_stored:
                if preserve_rng and end_rng is None:
                    end_rng = RngState(x.device, generators)
                if not stored:
                    stored_context = _Context(context)
                stored.append(
                    _StoredTransforms(block, x1, x2, stored_context, autocast, i == len(blocks) - 1)
                )
                x1, x2 = stored[-1].y1.detach(), stored[-1].y2
                continue
            if every is not None and i % every == 0:
                kept_inputs[i] = (x1, x2, x1._version, x2._version)
                owned = False  # this block must leave them intact
            if isinstance(block, Invertible):
                state = ModuleState(block)
                draws = RandomDraws(x.device, generators) if preserve_rng else None
                merged = sequence.merge(x1, x2)
                strides = merged.stride()
                y = _invertible_forward(block, merged, i, plan.hooked)
                del merged
                rng_states.append(draws.finish() if draws is not None else None)
                state.forward_done()
                states.append((state, strides))
                x1, x2 = sequence.split(y)
                del y
                owned = true_inputs is None and not plan.hooked
                continue
            if plan.hooked:
                x1, x2 = _hooked_block_forward(block, x1, x2, context, i, rng_states, states,
                                               preserve_rng, generators)
                owned = False  # what the hooks saw stays intact
                continue
            state_f = ModuleState(block.f)
            draws = RandomDraws(x.device, generators) if preserve_rng else None
            y1 = _combine(block.coupling, x1, block.transform("f", x2, *context), owned)
            rng_states.append(draws.finish() if draws is not None else None)
            state_f.forward_done()
            state_g = ModuleState(block.g)
            draws = RandomDraws(x.device, generators) if preserve_rng else None
            y2 = _combine(block.coupling, x2, block.transform("g", y1, *context), owned)
            rng_states.append(draws.finish() if draws is not None else None)
            state_g.forward_done()
            states.append((state_f, state_g))
            x1, x2 = y1, y2
            owned = true_inputs is None  # kept true inputs must not be overwritten
        if preserve_rng and end_rng is None:
            end_rng = RngState(x.device, generators)
        if not stored:
            y = sequence.merge(x1, x2)
        else:
            y, stored[-1].output = stored[-1].output, None
        del x1, x2

        # Under saved-tensor hooks (save_on_cpu, a surrounding checkpoint) what backward needs is
        # handed to them. Otherwise the output is held directly rather than saved, so that
        # backward can let it go as soon as the top block is reconstructed (a saved tensor would
        # live until backward returns); its version counter still catches in-place changes.
        # A stored last block needs no output: its inputs are kept with its graph.
        context_tensors = [c for c in context if isinstance(c, Tensor)]
        kept = [t for i in sorted(kept_inputs) for t in kept_inputs[i][:2]]
        ctx.hooked_saving = hooked_saving
        if hooked_saving:
            output = [y] if not stored else []
            ctx.save_for_backward(*context_tensors, *output, *kept)
            ctx.output = None
        else:
            ctx.save_for_backward(*context_tensors)
            ctx.output = y.detach() if not stored else None
        ctx.num_context_tensors = len(context_tensors)
        ctx.output_version = y._version
        ctx.context = context
        ctx.stored = stored
        ctx.backward_done = False
        ctx.sequence = sequence
        ctx.plans = plans
        ctx.rng_states = rng_states
        ctx.end_rng = end_rng
        ctx.generators = generators
        ctx.states = states
        ctx.autocast = autocast
        ctx.report = report
        ctx.true_inputs = true_inputs
        ctx.kept_inputs = kept_inputs
        ctx.params = context_and_params[num_context:]
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        references = sys.getrefcount(grad_y)  # first, as in _unshared_gradient_references
        if torch.is_grad_enabled():
            # The engine enables grad here only for create_graph=True. The gradients below come
            # from torch.autograd.grad without a graph of their own, so derivatives of them
            # would silently miss every term through the blocks.
            raise RuntimeError(
                "ReversibleSequence: double backward (create_graph=True, as for gradient "
                "penalties or Hessian-vector products) is not supported: its backward "
                "reconstructs and differentiates without recording a graph. Use "
                "memory_efficient=False for this model."
            )
        if ctx.backward_done:
            raise RuntimeError(
                "ReversibleSequence: backward through the same forward a second time is not "
                "supported (after the first backward the output it reconstructs from is released "
                "to save memory). Run the forward again, or use memory_efficient=False."
            )
        ctx.backward_done = True
        saved = list(ctx.saved_tensors)
        context_tensors = iter(saved[: ctx.num_context_tensors])
        saved = saved[ctx.num_context_tensors :]
        context = _Context(
            [next(context_tensors) if isinstance(c, Tensor) else c for c in ctx.context]
        )
        ctx.context = None
        stored, ctx.stored = ctx.stored, []
        if ctx.hooked_saving:
            y = saved.pop(0) if not stored else None
            for i in sorted(ctx.kept_inputs):
                x1, x2 = saved.pop(0), saved.pop(0)
                ctx.kept_inputs[i] = (x1, x2, x1._version, x2._version)
        else:
            y, ctx.output = ctx.output, None
            if y is not None and y._version != ctx.output_version:
                raise RuntimeError(
                    "ReversibleSequence: its output was modified in place after the forward "
                    "pass; the inputs reconstructed from it would be wrong. Clone the output "
                    "before modifying it."
                )
        del saved
        blocks = ctx.sequence.blocks
        plans = ctx.plans
        position = {id(p): i for i, p in enumerate(ctx.params)}
        param_grads: list[Tensor | None] = [None] * len(ctx.params)
        context_grads: list[Tensor | None] = [None] * len(context.leaves)

        # [y1, y2, dy1, dy2] of the block being reversed; _reverse_block swaps in its input's.
        # A stored block knows its input already, and needs neither y2 nor a recomputation.
        sequence = ctx.sequence
        # A stored block's halves are the engine's own. The output is the caller's, unless
        # nothing but the engine refers to it any more (the usual case: the next layer's saved
        # tensors were released by its backward): then reconstructing the top block in place
        # spares a copy of the output, the largest tensor of the sequence's backward.
        if stored:
            owned = ctx.true_inputs is None and not plans[-1].hooked
        else:
            owned = ctx.true_inputs is None and y is not None and _only_reference(y)
        outputs = sequence.split(y) if not stored else (stored[-1].y1.detach(), None)
        unshared = _unshared_gradient(grad_y, references)  # before its halves are views of it
        grad_halves = sequence.split(grad_y)
        memory = _GradientMemory(grad_y, grad_halves, unshared)
        carry = [*outputs, *grad_halves]
        device = grad_y.device
        del y, outputs
        replay_rng = ctx.end_rng is not None and device.type != "meta"
        rng_guard = forked_rng(device, ctx.generators) if replay_rng else contextlib.nullcontext()
        rng_next = ctx.end_rng  # the generators' state after the transform being replayed
        with rng_guard, recomputing(blocks):
            for i in reversed(range(len(blocks))):
                need_input_grad = i > 0 or ctx.needs_input_grad[0]
                if isinstance(blocks[i], Invertible):
                    state, strides = ctx.states.pop()
                    rng = ctx.rng_states.pop()
                    rng_next = rng if rng is not None else rng_next
                    grads = _reverse_invertible(
                        sequence, i, carry, rng_next if replay_rng else None, state, strides,
                        ctx.autocast, _kept_input(ctx, i), need_input_grad, plans[i],
                    )
                else:
                    if stored:
                        transforms = stored.pop()
                    else:
                        state_f, state_g = ctx.states.pop()
                        rng_g, rng_f = ctx.rng_states.pop(), ctx.rng_states.pop()
                        # A transform that drew nothing left the generators as it found them: its
                        # state is the next one's (fork_rng inside it draws from that state too).
                        rng_g = rng_g if rng_g is not None else rng_next
                        rng_f = rng_f if rng_f is not None else rng_g
                        rng_next = rng_f
                        transforms = _Recomputation(
                            blocks[i],
                            i,
                            (rng_f, rng_g) if replay_rng else (None, None),
                            (state_f, state_g),
                            ctx.autocast,
                            _kept_input(ctx, i),
                        )
                    if owned and _same_storage(carry[0], carry[1]):
                        _own_halves(carry, top=i == len(blocks) - 1)
                    grads = _reverse_block(
                        blocks[i], carry, transforms, need_input_grad, owned, plans[i], context,
                        context_grads, memory,
                    )
                    del transforms
                owned = ctx.true_inputs is None  # reconstructions are ours, unless compared
                for p, grad in grads:
                    memory.hand_out(grad)
                    k = position[id(p)]
                    param_grads[k] = grad if param_grads[k] is None else param_grads[k] + grad
                if ctx.true_inputs is not None:
                    ctx.report.record(i, len(blocks), ctx.true_inputs[i], carry[0], carry[1])

        for grad in context_grads:
            if grad is not None:
                memory.hand_out(grad)
        if not ctx.needs_input_grad[0]:
            grad_x = None
        elif carry[2] is grad_halves[0] and carry[3] is grad_halves[1] and memory.all_ours():
            grad_x = grad_y  # every block added into the gradient it was given
        else:
            grad_x = sequence.merge(carry[2], carry[3])
        del grad_halves, grad_y
        grads_by_leaf = iter(context_grads)
        grad_context = [
            next(grads_by_leaf) if _requires_grad(c) else None for c in context.values
        ]
        return (grad_x, None, None, None, *grad_context, *param_grads)


def _saved_tensor_hooks_active() -> bool:
    if torch.compiler.is_compiling():
        return False  # the compiled graph saves what it needs itself
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _hooked_block_forward(
    block: ReversibleBlock,
    x1: Tensor,
    x2: Tensor,
    context: tuple[Any, ...],
    index: int,
    rng_states: list[Any],
    states: list[tuple[ModuleState, ModuleState]],
    preserve_rng: bool,
    generators: list[torch.Generator],
) -> tuple[Tensor, Tensor]:
    """The forward of a block with forward hooks on it or inside f and g: an ordinary forward
    (with a graph, not in place) that the hooks observe, its outputs then detached for the
    engine. The graph begins at a node that refuses to be backpropagated into."""
    where = f"block {index} of a ReversibleSequence"
    modules = list(block.modules())
    # The hooks' graph is the hooks' own: saved-tensor hooks around the sequence (a surrounding
    # checkpoint) must not see it, since the recomputation runs without forward hooks.
    own_saving = torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
    with torch.enable_grad(), own_saving, refusing_replaced_outputs(modules, where):
        x1 = _NoGradientThroughForward.apply(x1.detach().requires_grad_(), where)
        x2 = _NoGradientThroughForward.apply(x2.detach().requires_grad_(), where)
        pre_hooked = bool(block._forward_pre_hooks or block._forward_hooks)
        if pre_hooked:
            merged = block.merge(x1, x2)
            merged_version = merged._version
            for hook in block._forward_pre_hooks.values():
                if hook(block, (merged, *context)) is not None or merged._version != merged_version:
                    raise RuntimeError(
                        f"{where}: a forward pre-hook on the block replaced or modified its input; "
                        "the block could not be inverted. Register it on the sequence instead."
                    )
        state_f = ModuleState(block.f)
        draws = RandomDraws(x2.device, generators) if preserve_rng else None
        y1 = block.coupling.combine(x1, block.transform("f", x2, *context))
        rng_states.append(draws.finish() if draws is not None else None)
        state_f.forward_done()
        state_g = ModuleState(block.g)
        draws = RandomDraws(x2.device, generators) if preserve_rng else None
        y2 = block.coupling.combine(x2, block.transform("g", y1, *context))
        rng_states.append(draws.finish() if draws is not None else None)
        state_g.forward_done()
        states.append((state_f, state_g))
        if pre_hooked:
            output = block.merge(y1, y2)
            for hook in block._forward_hooks.values():
                result = hook(block, (merged, *context), output)
                if result is not None and result is not output:
                    raise RuntimeError(
                        f"{where}: a forward hook on the block returned a replacement for its "
                        "output; the sequence could not be inverted. Register it on the sequence "
                        "instead."
                    )
    return y1.detach(), y2.detach()


def _invertible_forward(module: Invertible, x: Tensor, index: int, hooked: bool) -> Tensor:
    """An invertible module's forward in the sequence's forward pass: without a graph, or, with
    hooks on it, as an ordinary forward whose graph refuses to be backpropagated into."""
    if not hooked:
        return module(x)
    where = f"block {index} of a ReversibleSequence"
    own_saving = torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
    modules = list(module.modules())
    with torch.enable_grad(), own_saving, refusing_replaced_outputs(modules, where):
        return module(_NoGradientThroughForward.apply(x.detach().requires_grad_(), where)).detach()


def _reverse_invertible(
    sequence: ReversibleSequence,
    index: int,
    carry: list,
    rng: RngState | None,
    state: ModuleState,
    strides: tuple[int, ...],
    autocast: AutocastState,
    kept_input: tuple[Tensor, Tensor] | None,
    need_input_grad: bool,
    plan: _BlockPlan,
) -> list[tuple[Tensor, Tensor]]:
    """Reconstruct an invertible module's input with its inverse and backpropagate through a
    recomputation of its forward; ``carry`` as in :func:`_reverse_block`. ``strides`` are the
    input's in the forward pass: random draws (dropout masks) follow the memory layout, so the
    recomputation must see the same one, which an inverse need not give (a space-to-depth
    inverse of 1x1 maps returns a view in channels-last order)."""
    module = sequence.blocks[index]
    state.check(
        "ReversibleSequence",
        "Or run it with memory_efficient=False there (ordinary autograd).",
        prefix=f"blocks.{index}.",
    )
    if kept_input is not None:
        x = sequence.merge(*kept_input)
    else:
        y = sequence.merge(carry[0], carry[1])
        if isinstance(rng, RngState):
            rng.restore()  # an inverse that runs a transform (i-RevNet's block) draws the same
        with torch.no_grad(), autocast(), state.replayed():
            x = module.inverse(y)
        del y
        if x.stride() != strides:
            x = torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)
    carry[0] = carry[1] = None
    x_leaf = x.detach().requires_grad_()
    del x
    if isinstance(rng, RngState):
        rng.restore()
    with torch.enable_grad(), autocast(), state.replayed():
        out = module(x_leaf)
    _check_reached(out, [x_leaf, *plan.params], module, f"blocks.{index}")
    root = _GradRoot(out)
    del out
    grad_out = sequence.merge(carry[2], carry[3])
    carry[2] = carry[3] = None
    inputs = [x_leaf, *plan.params] if need_input_grad else plan.params
    grads = root.vjp(inputs, grad_out)
    del root, grad_out
    grad_x = grads.pop(0) if need_input_grad else None
    x1, x2 = sequence.split(x_leaf.detach())
    carry[:] = [x1, x2, *(sequence.split(grad_x) if grad_x is not None else (None, None))]
    return [(p, grad) for p, grad in zip(plan.params, grads) if grad is not None]


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _kept_input(ctx, i: int) -> tuple[Tensor, Tensor] | None:
    """Block ``i``'s true input if ``keep_input_every`` kept it, checked to be unmodified."""
    kept = ctx.kept_inputs.pop(i, None)
    if kept is None:
        return None
    x1, x2, version1, version2 = kept
    if (x1._version, x2._version) != (version1, version2):
        # Block 0's is the caller's input; ordinary autograd would refuse the same change.
        raise RuntimeError(
            f"ReversibleSequence: the input of block {i}, kept by keep_input_every, was modified "
            "in place after the forward pass; backward would start from the changed values. "
            "Clone the input before modifying it."
        )
    return x1, x2


def _merged_like(block: ReversibleBlock, half: Tensor, dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor for two halves like ``half`` merged, in ``half``'s memory layout
    (channels_last stays channels_last, as ``torch.cat`` keeps it)."""
    shape = list(half.shape)
    shape[block.split_dim] *= 2
    if half.dim() == 4 and half.is_contiguous(memory_format=torch.channels_last):
        return torch.empty(
            shape, dtype=dtype, device=half.device, memory_format=torch.channels_last
        )
    if half.dim() == 5 and half.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.empty(
            shape, dtype=dtype, device=half.device, memory_format=torch.channels_last_3d
        )
    return torch.empty(shape, dtype=dtype, device=half.device)


class _Recomputation:
    """f and g of one block recomputed with grad enabled, as in the forward: the same random
    numbers, autocast state and module state, hooks silenced."""

    def __init__(
        self,
        block: ReversibleBlock,
        index: int,
        rng: tuple[Any, Any],
        states: tuple[ModuleState, ModuleState],
        autocast: AutocastState,
        kept_input: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        self.block = block
        self.index = index
        self.rng = dict(zip("fg", rng))
        self.states = dict(zip("fg", states))
        self.autocast = autocast
        self.kept_input = kept_input

    def g_input(self, y1: Tensor) -> Tensor:
        return y1.detach().requires_grad_()

    def f_input(self, y2: Tensor, h_g: Tensor, owned: bool) -> Tensor:
        if self.kept_input is not None:
            return self.kept_input[1].detach().requires_grad_()
        with torch.no_grad(), self.autocast():
            return _uncombine(self.block.coupling, y2, h_g, owned).requires_grad_()

    def first_half(self, y1: Tensor, h_f: Tensor, owned: bool) -> Tensor:
        """x1, reconstructed from y1 and f(x2), or the kept true one."""
        if self.kept_input is not None:
            return self.kept_input[0].detach()
        return _first_half(self.block.coupling, y1, h_f, owned, self.autocast)

    def transform(self, name: str, half: Tensor, context: _Context) -> Tensor:
        state = self.states[name]
        state.check(
            "ReversibleSequence",
            "Or run it with memory_efficient=False there (ordinary autograd).",
            prefix=f"blocks.{self.index}.{name}.",
        )
        rng = self.rng[name]
        if isinstance(rng, RngState):
            rng.restore()
        with torch.enable_grad(), self.autocast(), state.replayed():
            return self.block.transform(name, half, *context.args())


class _StoredTransforms:
    """One of the last blocks, f and g run with grad enabled in the forward pass, graphs kept.

    Backward then starts from these instead of recomputing them: the same leaves and outputs a
    :class:`_Recomputation` would produce, so the same code backpropagates through both.
    """

    def __init__(
        self,
        block: ReversibleBlock,
        x1: Tensor,
        x2: Tensor,
        context: _Context,
        autocast: AutocastState,
        last: bool,
    ) -> None:
        coupling = self.coupling = block.coupling
        self.autocast = autocast
        self.x2 = x2.detach().requires_grad_()
        args = context.args()
        with torch.enable_grad():
            self.h_f = block.transform("f", self.x2, *args)
        self.y1 = coupling.combine(x1, self.h_f.detach()).requires_grad_()
        with torch.enable_grad():
            self.h_g = block.transform("g", self.y1, *args)
        self.context = context
        self.y2 = self.output = None
        if not last:
            self.y2 = coupling.combine(x2, self.h_g.detach())  # the next block's x2 leaf
            return
        # The last y2 goes straight into the sequence's output: it is not needed again, and
        # building it apart and concatenating would hold it twice at the moment of peak memory.
        y2_dtype = torch.result_type(x2, self.h_g)
        self.output = _merged_like(block, x1, torch.promote_types(self.y1.dtype, y2_dtype))
        out1, out2 = block.split(self.output)
        out1.copy_(self.y1)
        if coupling.is_additive:
            torch.add(x2, self.h_g.detach(), out=out2)
        else:
            out2.copy_(coupling.combine(x2, self.h_g.detach()))

    def g_input(self, y1: Tensor) -> Tensor:
        return self.y1

    def f_input(self, y2: Tensor | None, h_g: Tensor, owned: bool) -> Tensor:
        return self.x2

    def first_half(self, y1: Tensor, h_f: Tensor, owned: bool) -> Tensor:
        # From the kept y1, exact, rather than from the (maybe reconstructed) one passed down.
        return _first_half(self.coupling, self.y1.detach(), h_f, owned, self.autocast)

    def transform(self, name: str, half: Tensor, context: _Context) -> Tensor:
        if name == "f":
            h, self.h_f = self.h_f, None
        else:
            h, self.h_g = self.h_g, None
        return h


def _check_reached(h: Tensor, known: Sequence[Tensor], module: nn.Module, name: str) -> None:
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
    if isinstance(module, ReversibleBlock):
        fn = module.f if name == "f" else module.g
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
        "g, or run the sequence with memory_efficient=False."
    )


def _tensor_attributes(root: nn.Module, prefix: str) -> dict[int, str]:
    """Tensors held as plain attributes of ``root``'s modules (also in lists, tuples and dicts),
    by the id of the leaf itself or of the node that made it: ``"the attribute f.emb"``."""
    found: dict[int, str] = {}
    for module_name, module in root.named_modules(prefix=prefix):
        for key, value in vars(module).items():
            values = list(value.values()) if isinstance(value, dict) else value
            values = values if isinstance(values, (list, tuple)) else [values]
            for v in values:
                if isinstance(v, Tensor):
                    where = f"the attribute {module_name}.{key}"
                    found[id(v.grad_fn) if v.grad_fn is not None else id(v)] = where
    return found


def _reverse_block(
    block: ReversibleBlock,
    carry: list,
    transforms: _Recomputation | _StoredTransforms,
    need_input_grad: bool,
    owned: bool,
    plan: _BlockPlan,
    context: _Context,
    context_grads: list[Tensor | None],
    memory: _GradientMemory,
) -> list[tuple[Tensor, Tensor]]:
    """Reconstruct the block's input from its output and backpropagate through it.

    ``carry`` holds ``[y1, y2, dy1, dy2]`` and is overwritten with ``[x1, x2, dx1, dx2]``; working
    on the caller's list lets each tensor be freed the moment it is no longer needed. ``owned``
    says whether ``y1`` and ``y2`` may be overwritten, ``memory`` which gradients may be. Returns
    the (parameter, gradient) pairs of f and g; the context's gradients are added to
    ``context_grads``.
    """
    coupling = block.coupling
    f_params, g_params = plan.f_params, plan.g_params
    if isinstance(transforms, _StoredTransforms):
        context = transforms.context
    leaves = context.leaves
    n = len(leaves)

    # Second half, y2 = combine(x2, g(y1)): one run of g gives both x2 and the gradients through g.
    y1 = transforms.g_input(carry[0])
    h = transforms.transform("g", y1, context)
    _check_reached(h, [y1, *g_params, *leaves], block, "g")
    x2 = transforms.f_input(carry[1], h, owned)
    carry[1] = None  # y2
    if coupling.is_additive:
        root = _GradRoot(h)
        del h
        grad_y1, *g_grads = root.vjp([y1, *leaves, *g_params], carry[3])
        grad_x2 = carry[3]
    else:
        x2_leaf = x2.detach().requires_grad_()
        with torch.enable_grad(), transforms.autocast():
            root = _GradRoot(coupling.combine(x2_leaf, h))
        del h
        grad_x2, grad_y1, *g_grads = root.vjp([x2_leaf, y1, *leaves, *g_params], carry[3])
        del x2_leaf
    del root, y1
    _accumulate(context_grads, g_grads[:n])
    g_grads = g_grads[n:]
    carry[3] = None  # dy2
    grad_y1 = memory.add(carry[2], grad_y1, grad_x2, *g_grads, *context_grads)
    carry[2] = None  # dy1

    # First half, y1 = combine(x1, f(x2)): one run of f gives both x1 and the gradients through f.
    h = transforms.transform("f", x2, context)
    _check_reached(h, [x2, *f_params, *leaves], block, "f")
    x1 = transforms.first_half(carry[0], h, owned)
    carry[0] = None  # y1
    inputs = [*leaves, *f_params]
    if coupling.is_additive:
        root = _GradRoot(h)
        del h
        grads = root.vjp([x2, *inputs] if need_input_grad else inputs, grad_y1)
        grad_x1 = grad_y1
    else:
        x1.requires_grad_()
        with torch.enable_grad(), transforms.autocast():
            root = _GradRoot(coupling.combine(x1, h))
        del h
        grads = root.vjp([x1, x2, *inputs] if need_input_grad else inputs, grad_y1)
        grad_x1 = grads.pop(0) if need_input_grad else None
    del root
    if need_input_grad:
        grad_x2 = memory.add(grad_x2, grads.pop(0), grad_x1, *grads, *g_grads, *context_grads)
    _accumulate(context_grads, grads[:n])
    f_grads = grads[n:]

    carry[:] = [x1.detach(), x2.detach(), grad_x1, grad_x2]
    pairs = list(zip(g_params, g_grads)) + list(zip(f_params, f_grads))
    return [(p, grad) for p, grad in pairs if grad is not None]


def _unshared_gradient(grad: Tensor, references: int) -> bool:
    """Whether the gradient handed to the sequence's backward is held by nothing else (no other
    branch it was passed through to, no tensor hook that kept it, no view of it), so that the
    backward may add into it. ``references``: its Python reference count on entering backward."""
    if torch.compiler.is_compiling() or grad._base is not None or not grad.is_contiguous():
        return False
    fresh = torch.empty(0, device=grad.device)
    return (
        references <= _UNSHARED_GRADIENT_REFERENCES
        and grad._use_count() == 1
        and _storage_use_count(grad) == _storage_use_count(fresh)
    )


def _unshared_gradient_references() -> int:
    """The Python reference count of a gradient nothing else holds, on entering a Function's
    backward: measured on this interpreter and torch rather than assumed, once at import (inside a
    backward the probe would run under whatever modes and hooks are active there)."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor) -> Tensor:
            return x * 2

        @staticmethod
        def backward(ctx, grad: Tensor):
            references = sys.getrefcount(grad)
            ctx.references = references
            return grad * 2

    x = torch.zeros(2, requires_grad=True)
    y = Probe.apply(x)
    node = y.grad_fn
    (y * x).sum().backward()
    return node.references


_UNSHARED_GRADIENT_REFERENCES = _unshared_gradient_references()


def _only_reference(tensor: Tensor) -> bool:
    """Whether ``tensor`` is the only tensor on its storage: no other holder of it or of a view
    of it (the caller's variables, saved tensors of a graph kept with ``retain_graph=True``)."""
    if torch.compiler.is_compiling() or tensor._base is not None:
        return False
    # The count includes the temporary storage object that asks, as it does for a fresh tensor.
    fresh = torch.empty(0, device=tensor.device)
    return _storage_use_count(tensor) == _storage_use_count(fresh)


def _storage_use_count(tensor: Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _own_halves(carry: list, top: bool) -> None:
    """Make the two halves ``carry[0]`` and ``carry[1]``, views of one tensor, writable one
    without the other. The top block reconstructs into the output's memory as it is; for the
    blocks below, copies in contiguous memory (freeing the tensor once both are made) spare every
    kernel of f and g a strided input, which they would copy anyway, unseen and slower."""
    if top:
        carry[0], carry[1] = _alias(carry[0]), _alias(carry[1])
    else:
        for k in (0, 1):
            half = carry[k].contiguous()
            carry[k] = half if half is not carry[k] else _alias(half)


def _alias(half: Tensor) -> Tensor:
    """``half``'s memory under a tensor with a version counter of its own. Two halves that are
    views of one tensor share its counter: writing into one would show in the other's, which a
    graph built on it checks."""
    return half.new_empty(0).set_(
        half.untyped_storage(), half.storage_offset(), half.size(), half.stride()
    )


def _same_storage(a: Tensor | None, b: Tensor | None) -> bool:
    return (
        a is not None
        and b is not None
        and a.untyped_storage()._cdata == b.untyped_storage()._cdata  # also on meta
    )


def _accumulate(total: list[Tensor | None], grads: Sequence[Tensor | None]) -> None:
    for k, grad in enumerate(grads):
        if grad is not None:
            total[k] = grad if total[k] is None else total[k] + grad
