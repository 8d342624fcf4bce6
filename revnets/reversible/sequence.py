"""The reversible sequence: a run of blocks whose activations are reconstructed, not stored."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from revnets.plan import Checkpoint, Decision, Reconstruct, Store
from revnets.replay.hooks import has_forward_hooks, hooked
from revnets.reversible import compiled, grid
from revnets.reversible.block import ReversibleBlock, split_halves
from revnets.reversible.coupling import (
    AdditiveCoupling,
    ExactAdditiveCoupling,
    ExactScaledCoupling,
    ScaledCoupling,
)
from revnets.reversible.function import ReversibleFunction
from revnets.reversible.invertible import Invertible
from revnets.reversible.steps import BlockPlan
from revnets.transforms import func_transforms

__all__ = ["ReversibleSequence", "SequenceOptions"]

# Options of earlier spellings (revnets' own, MemCNN's and revlib's habits), refused by name as
# keywords and as attributes: the value of ``memory`` that says the same.
_RENAMED = {
    "memory_efficient": "revnets.Store() (for memory_efficient=False)",
    "store_last_blocks": "revnets.Reconstruct(store_last_blocks=k)",
    "keep_input_every": "revnets.Reconstruct(keep_input_every=k)",
}


@dataclass(frozen=True)
class SequenceOptions:
    """How a :class:`ReversibleSequence` runs, as one record (the constructor's keywords of the
    same names say what each does). ``sequence.options`` reads it whole, and assigning a record
    sets it whole, checked before anything changes; each field is also an attribute of the
    sequence. Whoever switches a sequence for a while (the planner, a zoo model's memory plan)
    changes only the field it decides, ``replace(sequence.options, memory=...)``, and puts the
    record it found back whole, so no option is lost on the way."""

    memory: Reconstruct | Store = Reconstruct()
    exact: bool = False
    preserve_rng_state: bool = True
    reuse_memory: bool = True
    compile_transforms: bool | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.memory, (Reconstruct, Store)):
            hint = (
                "; a Checkpoint is carried out around the sequence (set_memory runs the blocks "
                "with Store() for it)" if isinstance(self.memory, Checkpoint) else ""
            )
            raise TypeError(
                "ReversibleSequence: memory must be revnets.Reconstruct(...) or revnets.Store(), "
                f"got {self.memory!r}{hint}"
            )
        for name in ("exact", "preserve_rng_state", "reuse_memory"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"ReversibleSequence: {name} must be True or False, got "
                    f"{getattr(self, name)!r}"
                )
        if not isinstance(self.compile_transforms, (bool, str, type(None))):
            raise TypeError(
                "ReversibleSequence: compile_transforms must be None, True, False or a backend's "
                f"name, got {self.compile_transforms!r}"
            )
        backends = (torch._dynamo.list_backends(exclude_tags=())
                    if isinstance(self.compile_transforms, str) else ())
        if isinstance(self.compile_transforms, str) and self.compile_transforms not in backends:
            raise ValueError(
                f"ReversibleSequence: compile_transforms={self.compile_transforms!r} is not a "
                f"backend of torch.compile; its backends: {', '.join(backends)}"
            )


def _option(name: str, doc: str) -> property:
    def get(sequence: ReversibleSequence) -> Any:
        return getattr(sequence._options, name)

    def put(sequence: ReversibleSequence, value: Any) -> None:
        sequence.options = replace(sequence._options, **{name: value})

    return property(get, put, doc=doc)


class ReversibleSequence(nn.Module):
    """A run of :class:`ReversibleBlock` (and :class:`~revnets.Invertible` modules) whose
    activations are reconstructed, not stored.

    Args:
        blocks: the blocks, applied in order. All must split along the same dimension.
        memory: :class:`~revnets.Reconstruct` (the default) or :class:`~revnets.Store`, the off
            switch: ``Store()`` runs the very same blocks with ordinary autograd (storing every
            activation), the reference the reversible path must match and the baseline its
            memory is compared with. ``Reconstruct`` has two dials:

            - ``store_last_blocks``: how many of the last blocks keep their autograd graphs from
              the forward pass instead of being recomputed in backward (``checkpoint_sequential``
              leaves its last segment unrecomputed for the same reason). Each saves 1/depth of
              the recomputation for one block's activations, whatever the depth: a dial from
              speed to memory that keeps memory flat in depth.
            - ``keep_input_every``: keep the true input of every k-th block (blocks 0, k, 2k,
              ...) and start backward's reconstruction afresh from it, so that no block input is
              more than k - 1 inverse steps from a true one. Bounds the round-off drift of very
              deep float32 or bfloat16 runs (see :func:`revnets.check_reconstruction`) for
              depth / k stored inputs.
        exact: grid arithmetic (NOTE [ Exact reversibility ] in revnets/reversible/grid.py):
            the streams are kept in float32 (float64 for a float64 input) on a fixed-point grid,
            the input and every update ``f(x2)``, ``g(y1)`` rounded to it (straight-through
            gradient), so that reconstruction is exact to the bit at any depth under any
            autocast precision, at no memory cost. It changes the function computed (by the
            rounding) whatever ``memory`` is: ``memory=Store(), exact=True`` is the reference
            the reversible path equals. It is the sequence's alone: no memory decision carries
            or changes it (a plan switching ``memory`` keeps it). It puts the blocks' couplings
            in their exact form, so blocks shared with another sequence are exact there too:
            build a reference of copies (``copy.deepcopy``), not of the same blocks. Additive
            couplings, and scaled ones with a scale +-2^-k (which keep the k bits per element
            their scaling drops, one byte each: rule 7); others, and invertible modules without
            ``exact = True``, are refused by name. The output is in the stream dtype.
        preserve_rng_state: replay the random number generators so that dropout and any other
            randomness in f and g draw the same numbers in the backward recomputation.
        reuse_memory: let backward add the blocks' gradients into the gradient it is given, where
            nothing else can see it (NOTE [ Gradient memory ]); ``False`` always allocates.
        compile_transforms: run f and g through functions torch.compile made (inductor) in the
            reversible path, where the replay allows it (known layers, no randomness, not exact,
            no autocast: NOTE [ Compiled transforms ] in revnets/reversible/compiled.py).
            ``None`` (the default): when the model runs under ``torch.compile`` on the CPU,
            where a block's whole backward step then runs as one compiled function and the
            compiled step is faster than eager (NOTE [ Compiled block backward ],
            docs/compile.md); on a GPU f and g stay eager (compiled transforms measured slower
            there, before the block backward was compiled as one function); ``False``: never;
            ``True``: always, also on a GPU and in an eager model; a backend's name
            (``"aot_eager"``): always, with that backend instead of inductor
            (``DEFAULT_BACKEND`` in revnets/reversible/compiled.py).

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
        blocks: Iterable[ReversibleBlock | Invertible],
        memory: Reconstruct | Store = Reconstruct(),
        *,
        exact: bool = False,
        preserve_rng_state: bool = True,
        reuse_memory: bool = True,
        compile_transforms: bool | str | None = None,
        **renamed: Any,
    ) -> None:
        super().__init__()
        if renamed:
            name = next(iter(renamed))
            raise TypeError(
                f"ReversibleSequence got an unexpected keyword argument {name!r}"
                + (f": use memory={_RENAMED[name]}" if name in _RENAMED else "")
            )
        if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise TypeError(
                f"ReversibleSequence takes a list of blocks, got one {type(blocks).__name__}; "
                f"pass [block]"
            )
        blocks = list(blocks)
        for i, block in enumerate(blocks):
            _check_block(i, block)
        split_dims = {block.split_dim for block in blocks if isinstance(block, ReversibleBlock)}
        if len(split_dims) > 1:
            raise ValueError(
                f"ReversibleSequence: all blocks must split along the same dimension, got "
                f"split_dim values {sorted(split_dims)}"
            )
        self.blocks = nn.ModuleList(blocks)
        self.split_dim = split_dims.pop() if split_dims else 1
        self._options = SequenceOptions()
        self.options = SequenceOptions(
            memory, exact, preserve_rng_state, reuse_memory, compile_transforms
        )

    @property
    def options(self) -> SequenceOptions:
        """How the sequence runs, one record (:class:`SequenceOptions`), read and set whole."""
        return self._options

    @options.setter
    def options(self, options: SequenceOptions) -> None:
        if not isinstance(options, SequenceOptions):
            raise TypeError(
                f"ReversibleSequence.options is a revnets.SequenceOptions, got {options!r}"
            )
        if options.exact != self._options.exact:
            _make_exact(self.blocks, options.exact)  # refuses before changing anything
        self._options = options

    memory = _option("memory", """How the sequence saves memory in training:
        :class:`~revnets.Reconstruct` or :class:`~revnets.Store`.""")
    exact = _option("exact", """Grid arithmetic, exact reconstruction (NOTE [ Exact
        reversibility ]): the sequence's own, which no memory decision changes.""")
    preserve_rng_state = _option("preserve_rng_state", "Randomness replayed in backward.")
    reuse_memory = _option("reuse_memory", "Backward adds into the gradient it is given.")
    compile_transforms = _option("compile_transforms", "f and g compiled in the reversible path.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _RENAMED:
            raise AttributeError(
                f"ReversibleSequence has no option {name!r}: set sequence.memory = "
                f"{_RENAMED[name]}"
            )
        super().__setattr__(name, value)

    def set_memory(self, decision: Decision) -> ReversibleSequence:
        """Follow a plan's decision for this sequence: reconstruct (with its options), or run the
        blocks with ordinary autograd, stored or checkpointed by whoever runs the sequence. Only
        ``memory`` changes: the arithmetic (``exact``) and every other option are kept."""
        self.memory = decision if isinstance(decision, Reconstruct) else Store()
        return self

    def sliced(self, start: int, stop: int | None = None) -> ReversibleSequence:
        """Blocks ``start:stop`` as a sequence of their own that runs as this one does (its
        options and training mode): a zoo model's run between feature taps."""
        part = ReversibleSequence(list(self.blocks)[start:stop])
        part.options = self._options
        part.training = self.training
        return part

    def plain_units(self) -> list[nn.Module]:
        """The sequence as consecutive modules that compute what :meth:`forward_plain` does (its
        blocks, led by the grid's entry where it is exact), for whoever checkpoints it in
        segments: a Checkpoint keeps the arithmetic."""
        return [grid.GridEntry(), *self.blocks] if self.exact else list(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[ReversibleBlock]:
        return iter(self.blocks)

    def __getitem__(self, index: int) -> ReversibleBlock:
        return self.blocks[index]

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The two halves the blocks work on (views along ``split_dim``)."""
        return split_halves(x, self.split_dim)

    def merge(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.cat((a, b), dim=self.split_dim)

    def forward(self, x: Tensor, *context: Any) -> Tensor:
        if not self.blocks:
            return x
        if self.exact:
            _refuse_low_precision_parameters(self)
            x = grid.enter_grid(x)
        if not (isinstance(self.memory, Reconstruct) and self.training and torch.is_grad_enabled()):
            return self.forward_plain(x, *context)
        _refuse_backward_hooks(self.blocks)
        _refuse_func_transforms()
        # Looked up once per step: backward needs each block's own, and autograd needs them all.
        plans = [BlockPlan(block) for block in self.blocks]
        if any(plan.lazy for plan in plans):
            # Lazy modules create their parameters in their first call, which must therefore be
            # an ordinary one: the engine hands autograd the parameters before running anything.
            return self.forward_plain(x, *context)
        params = list(dict.fromkeys(p for plan in plans for p in plan.params))
        _refuse_nested_context(context)
        needs_grad = x.requires_grad or params or any(_requires_grad(c) for c in context)
        if not needs_grad:
            return self.forward_plain(x, *context)
        # Decided here, where dynamo traces: the engine itself runs eagerly either way.
        option = self.compile_transforms
        if option is None:
            option = torch.compiler.is_dynamo_compiling() and x.device.type == "cpu"
        backend = compiled.DEFAULT_BACKEND if option is True else option or None
        return _reversible(self, x, plans, context, params, backend)

    def forward_plain(self, x: Tensor, *context: Any) -> Tensor:
        """The blocks as ordinary modules (what autograd would store, it stores)."""
        x1, x2 = self.split(x)
        for block in self.blocks:
            if isinstance(block, Invertible):
                x1, x2 = self.split(block(self.merge(x1, x2)))
            elif has_forward_hooks([block]) or hooked(block) or (
                    nn.modules.module._global_backward_hooks):  # a call of the block runs them
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
        return f"memory={self.memory}" + (", exact=True" if self.exact else "")


@torch.compiler.disable
def _reversible(
    sequence: ReversibleSequence, x: Tensor, plans: list[BlockPlan], context: tuple, params: list,
    compile_transforms: str | None,
) -> Tensor:
    # The engine runs user code under dispatch modes and replays it by hand: torch.compile runs
    # it eagerly between the graphs it compiles around the sequence (its f and g may run
    # compiled: NOTE [ Compiled transforms ]).
    return ReversibleFunction.apply(
        x, sequence, plans, compile_transforms, len(context), *context, *params
    )


def _make_exact(blocks: Iterable[nn.Module], exact: bool) -> None:
    """Put the blocks' additive couplings in their exact form (or back); refuse, by name, what
    has none, before changing anything."""
    blocks = list(blocks)
    if exact:
        for i, block in enumerate(blocks):
            if isinstance(block, Invertible):
                if not getattr(block, "exact", False):
                    raise TypeError(
                        f"ReversibleSequence(exact=True): block {i} is a {type(block).__name__}, "
                        "an invertible module whose inverse is not known to be exact on the grid "
                        "(NOTE [ Exact reversibility ]). Set exact = True on its class if its "
                        "inverse is exact for grid values (a permutation, zero padding), or "
                        "drop exact=True"
                    )
            elif (type(block.coupling) is ScaledCoupling
                  and grid.exact_shift(block.coupling.scale) is None):
                raise TypeError(
                    f"ReversibleSequence(exact=True): block {i} has the coupling "
                    f"{block.coupling!r}; a scaled coupling keeps the grid only with a scale "
                    f"+-2^-k, k = 0..8 (0.5, -0.25, ...: NOTE [ Exact reversibility ], rule 7). "
                    f"Use such a scale, or drop exact=True"
                )
            elif (not block.coupling.exact
                  and type(block.coupling) not in (AdditiveCoupling, ScaledCoupling)):
                raise TypeError(
                    f"ReversibleSequence(exact=True): block {i} has the coupling "
                    f"{block.coupling!r}, which has no exact form; exact reconstruction needs "
                    "coupling='additive' (or a Coupling of your own with exact = True)"
                )
    for block in blocks:
        if isinstance(block, ReversibleBlock):
            kind = type(block.coupling)
            if exact and kind is AdditiveCoupling:
                block.coupling = ExactAdditiveCoupling()
            elif exact and kind is ScaledCoupling:
                block.coupling = ExactScaledCoupling(block.coupling.scale)
            elif not exact and kind is ExactAdditiveCoupling:
                block.coupling = AdditiveCoupling()
            elif not exact and kind is ExactScaledCoupling:
                block.coupling = ScaledCoupling(block.coupling.scale)


def _refuse_low_precision_parameters(sequence: ReversibleSequence) -> None:
    # The grid keeps the streams in float32 (NOTE [ Exact reversibility ]); a model cast to
    # bfloat16 or float16 would meet them with low-precision weights.
    low = (torch.bfloat16, torch.float16)
    if any(p.dtype in low for p in sequence.parameters()):
        name, p = next((n, p) for n, p in sequence.named_parameters() if p.dtype in low)
        raise TypeError(
            f"ReversibleSequence(exact=True): parameter {name} is {p.dtype} (a model cast with "
            f".bfloat16() or .half()), while exact arithmetic keeps the streams on a float32 "
            f"grid. Keep the parameters in float32 (model.float()) and train in low precision "
            f"under torch.autocast(device_type, dtype=...), which exact reconstruction is made "
            f"for, or drop exact=True"
        )


def _refuse_backward_hooks(blocks: Iterable[nn.Module]) -> None:
    blocks, module = list(blocks), nn.modules.module
    if any(isinstance(block, ReversibleBlock) for block in blocks) and (
            module._global_backward_hooks or module._global_backward_pre_hooks):
        raise RuntimeError(
            "ReversibleSequence: a global module backward hook is registered "
            "(register_module_full_backward_hook or register_module_full_backward_pre_hook). The "
            "reversible engine differentiates f and g, never its blocks as modules, so the hook "
            "would never fire for them. Remove it while the sequence trains, or run the sequence "
            "with memory=revnets.Store()."
        )
    for i, block in enumerate(blocks):
        if isinstance(block, ReversibleBlock) and (
            block._backward_hooks or block._backward_pre_hooks
        ):
            raise RuntimeError(
                f"ReversibleSequence: block {i} has a backward hook (register_full_backward_hook "
                "or register_full_backward_pre_hook on the block itself). The reversible engine "
                "differentiates f and g, never the block as a module, so the hook would never "
                "fire. Register it on f or g, or run the sequence with memory=revnets.Store()."
            )


def _refuse_func_transforms() -> None:
    transforms = func_transforms()
    if transforms:
        raise RuntimeError(
            f"ReversibleSequence: reconstructing under torch.func ({', '.join(transforms)}), "
            f"which cannot run its engine (an autograd.Function whose backward reconstructs "
            f"the blocks' inputs). Differentiate with loss.backward() or "
            f"torch.autograd.grad, or run the sequence with memory=revnets.Store() there"
        )


def _check_block(i: int, block: nn.Module) -> None:
    if isinstance(block, Invertible):
        return
    if not isinstance(block, ReversibleBlock):
        raise TypeError(
            f"ReversibleSequence: block {i} is a {type(block).__name__}, neither a "
            "ReversibleBlock nor a revnets.Invertible. Only invertible blocks can sit in a "
            "reversible sequence; run a non-invertible module before or after it (wrap it in "
            "revnets.Checkpointed to save its memory)"
        )
    inner = {id(p) for transform in (block.f, block.g) for p in transform.parameters()}
    stray = [name for name, p in block.named_parameters() if id(p) not in inner]
    if stray:
        raise ValueError(
            f"ReversibleSequence: block {i} has parameters outside f and g ({', '.join(stray)}); "
            "the reversible backward computes gradients for the parameters of f and g only. "
            "Move them into f or g"
        )


def _requires_grad(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


def _refuse_nested_context(context: tuple) -> None:
    for i, value in enumerate(context):
        if not isinstance(value, Tensor) and any(
                _requires_grad(t) for t in torch.utils._pytree.tree_leaves(value)):
            raise ValueError(
                f"ReversibleSequence: context argument {i} is a {type(value).__name__} holding a "
                f"tensor that requires grad; the reversible engine differentiates context "
                f"tensors passed as arguments of their own: pass each one so "
                f"(sequence(x, a, b) calls f(x2, a, b)), or run the sequence with "
                f"memory=revnets.Store()"
            )
