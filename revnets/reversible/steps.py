"""One step per block: how each kind of block runs in the forward pass, what it records on the tape,
and how its backward reconstructs its input and backpropagates through it.

Every step implements :class:`BlockStep`: ``forward`` takes the block's input halves and returns
its output halves, ``reverse`` takes a :class:`~revnets.reversible.tape.Carry` of the block's
output and its gradient and leaves the block's input and its gradient in it. Three kinds:

- :class:`CouplingStep`: a coupling recomputed in backward, the usual case;
- :class:`StoredCouplingStep`: one of the last blocks, whose graphs are kept from the forward;
- :class:`~revnets.reversible.invertible_step.InvertibleStep`: a :class:`~revnets.Invertible`
  module, inverted with its ``inverse`` (in invertible_step.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from revnets.replay import (
    AutocastState,
    Recording,
    RecordingChain,
    has_forward_hooks,
    submodules,
)
from revnets.replay.known_calls import plain
from revnets.reversible.block import ReversibleBlock
from revnets.reversible.compiled import compilable, compiled_call, compiled_reverse
from revnets.reversible.coupling import STOCK_COUPLINGS, Coupling
from revnets.reversible.gradient_memory import GradientMemory
from revnets.reversible.grid import GridWatch
from revnets.reversible.hooked import (
    forward_hooks_of,
    graph_start,
    hooks_own_graph,
    parameters_and_hooks,
    refuse_gradients,
    refuse_sharded,
    trainable,
)
from revnets.reversible.inverse_check import check_uncombine_once
from revnets.reversible.invertible import Invertible
from revnets.reversible.reach import GradRoot, check_reached
from revnets.reversible.tape import Carry, Context, Layout, dense

__all__ = [
    "Backward",
    "BlockPlan",
    "BlockStep",
    "CouplingStep",
    "StoredCouplingStep",
]

REMEDY = "Or run it with memory=revnets.Store() there (ordinary autograd)."

Pairs = list[tuple[nn.Parameter, Tensor]]


class BlockPlan:
    """What the engine needs to know of one block for one step, looked up once per step."""

    __slots__ = ("block", "f_params", "g_params", "params", "hooked", "block_hooked", "lazy")

    def __init__(self, block: ReversibleBlock | Invertible) -> None:
        self.block = block
        # Hooks see the activations of an ordinary forward: intact and, like under autograd,
        # carrying a graph (which leads to an error rather than to a silently missing gradient).
        # One walk over f and one over g find both their parameters and their hooks.
        if isinstance(block, Invertible):
            (f_slots, hooked, lazy), g_slots = parameters_and_hooks(block), []
            block_hooked = hooked
        else:
            f_slots, f_hooked, f_lazy = parameters_and_hooks(block.f)
            g_slots, g_hooked, g_lazy = parameters_and_hooks(block.g)
            lazy = f_lazy or g_lazy
            others = [m for m in block._modules.values() if m is not block.f and m is not block.g]
            block_hooked = has_forward_hooks(
                [block, *(m for other in others if other is not None for m in submodules(other))]
            )
            hooked = f_hooked or g_hooked or block_hooked
        if hooked:  # FSDP2 shards by hooks
            refuse_sharded(block)
        self.hooked = hooked
        self.block_hooked = block_hooked  # run by CouplingStep's hooked forward, not a stored one
        self.lazy = lazy
        self.f_params = trainable(f_slots)  # an Invertible's own parameters
        self.g_params = trainable(g_slots)
        self.params = list(dict.fromkeys((*self.f_params, *self.g_params)))


@dataclass
class Backward:
    """What the steps of one backward share: the context's leaves and their gradients so far, the
    gradient memory policy and the forward's autocast state."""

    context: Context
    context_grads: list[Tensor | None]
    memory: GradientMemory
    autocast: AutocastState

    def add_context_grads(self, grads: list[Tensor | None]) -> None:
        for k, grad in enumerate(grads):
            if grad is not None:
                total = self.context_grads[k]
                self.context_grads[k] = grad if total is None else total + grad


class BlockStep(abc.ABC):
    """One block on the tape."""

    def __init__(self, index: int, plan: BlockPlan) -> None:
        self.index = index
        self.plan = plan
        self.kept: tuple[Tensor, Tensor, int, int] | None = None

    @abc.abstractmethod
    def forward(
        self, x1: Tensor, x2: Tensor, mine: bool, context: Context, run: ForwardRun
    ) -> tuple[Tensor, Tensor, bool]:
        """The block's output halves, and whether the engine may write into them."""

    @abc.abstractmethod
    def reverse(self, carry: Carry, back: Backward, need_input_grad: bool) -> Pairs:
        """Turn ``carry`` from the block's output into its input; return the parameters'
        gradients."""

    def keep_input(self, x1: Tensor, x2: Tensor) -> None:
        """Keep the block's true input (``keep_input_every``), to start its backward from."""
        self.kept = (x1, x2, x1._version, x2._version)

    def kept_input(self) -> tuple[Tensor, Tensor] | None:
        if self.kept is None:
            return None
        x1, x2, version1, version2 = self.kept
        self.kept = None
        if (x1._version, x2._version) != (version1, version2):
            # Block 0's is the caller's input; ordinary autograd would refuse the same change.
            raise RuntimeError(
                f"ReversibleSequence: the input of block {self.index}, kept by keep_input_every, "
                "was modified in place after the forward pass; backward would start from the "
                "changed values. Clone the input before modifying it."
            )
        return x1, x2


@dataclass
class ForwardRun:
    """What every step of one forward shares."""

    device: torch.device
    preserve_rng: bool
    memory_format: torch.memory_format
    autocast: AutocastState
    grid: GridWatch | None = None  # the range check of an exact sequence (NOTE [ Exact ... ])
    # The backend that compiles f and g where they allow it, or None: eager (NOTE [ Compiled
    # transforms ]).
    compile_transforms: str | None = None
    # Python's and numpy's generator states between consecutive recordings; a step that runs
    # user code outside a recording cuts it.
    chain: RecordingChain = field(default_factory=RecordingChain)


# -- couplings -------------------------------------------------------------------------------------


def _combine(coupling: Coupling, x: Tensor, h: Tensor, in_place: bool) -> Tensor:
    # Updating x in place saves an allocation per half; only into memory the engine owns.
    if in_place and coupling.x_factor is not None and torch.result_type(x, h) == x.dtype:
        return coupling.combine_(x, h)
    return coupling.combine(x, h)


def _user_code_ran(coupling: Coupling, run: ForwardRun) -> None:
    # The couplings revnets defines draw no random numbers; any other is user code between two
    # recordings (NOTE [ Replay ], RecordingChain).
    if type(coupling) not in STOCK_COUPLINGS:
        run.chain.cut()


def _uncombine(coupling: Coupling, y: Tensor, h: Tensor, lost: Tensor | None = None) -> Tensor:
    # y is always the engine's own here (NOTE [ Layout ], rule 3).
    if coupling.keeps_lost:
        return coupling.uncombine_kept(y, h, lost)
    if coupling.x_factor is not None and torch.result_type(y, h) == y.dtype:
        return coupling.uncombine_(y, h)
    return coupling.uncombine(y, h)


def _lost(coupling: Coupling, x: Tensor) -> Tensor | None:
    """What the coupling's inverse needs of ``x`` beyond its output (NOTE [ Exact
    reversibility ], rule 7), taken before ``x`` is combined (in place)."""
    return coupling.lost(x.detach()) if coupling.keeps_lost else None


class _CouplingBackward(BlockStep):
    """The backward of a coupling, shared by recomputed and stored blocks, which differ only in
    where g's and f's outputs and the input halves come from."""

    block: ReversibleBlock

    def _context(self, back: Backward) -> Context:
        return back.context

    @abc.abstractmethod
    def _outputs(self, carry: Carry) -> tuple[Tensor, Tensor | None]:
        """y1 (g's input) and y2 to reconstruct x2 from (None where x2 is known)."""

    @abc.abstractmethod
    def _transform(self, name: str, half: Tensor, back: Backward) -> Tensor:
        """f's or g's output, with a graph back to ``half``, the parameters and the context."""

    @abc.abstractmethod
    def _second_half(self, y2: Tensor | None, h: Tensor, back: Backward) -> Tensor:
        """x2 = uncombine(y2, g(y1)), or the known one: f's input, requiring grad."""

    @abc.abstractmethod
    def _first_half(self, y1: Tensor, h: Tensor, back: Backward) -> Tensor:
        """x1 = uncombine(y1, f(x2)), or the known one."""

    @abc.abstractmethod
    def _finish(self, carry: Carry) -> None:
        """Set ``carry.mine`` for the reconstructed halves and drop what the step kept."""

    def reverse(self, carry, back, need_input_grad):
        block, coupling, plan = self.block, self.block.coupling, self.plan
        factor = coupling.x_factor  # y = factor * x + h: no combine to differentiate
        leaves = self._context(back).leaves
        n = len(leaves)
        y1, y2 = self._outputs(carry)
        dy1, dy2 = carry.take_gradients()

        # Second half, y2 = combine(x2, g(y1)): one run of g gives x2 and the gradients through g.
        h = self._transform("g", y1, back)
        check_reached(h, [y1, *plan.g_params, *leaves], block, "g")
        x2 = self._second_half(y2, h, back)
        del y2
        if factor is not None:
            root = GradRoot(h)
            del h
            grad_y1, *g_grads = root.vjp([y1, *leaves, *plan.g_params], dy2)
            grad_x2 = dy2 if factor == 1 else dy2 * factor
        else:
            x2_leaf = x2.detach().requires_grad_()
            with torch.enable_grad(), back.autocast():
                root = GradRoot(coupling.combine(x2_leaf, h))
            del h
            grad_x2, grad_y1, *g_grads = root.vjp([x2_leaf, y1, *leaves, *plan.g_params], dy2)
            del x2_leaf
        del root, dy2
        back.add_context_grads(g_grads[:n])
        g_grads = g_grads[n:]
        grad_y1 = back.memory.add(dy1, grad_y1, grad_x2, *g_grads, *back.context_grads)
        del dy1

        # First half, y1 = combine(x1, f(x2)): one run of f gives x1 and the gradients through f.
        h = self._transform("f", x2, back)
        check_reached(h, [x2, *plan.f_params, *leaves], block, "f")
        x1 = self._first_half(y1, h, back)
        del y1
        inputs = [*leaves, *plan.f_params]
        if factor is not None:
            root = GradRoot(h)
            del h
            grads = root.vjp([x2, *inputs] if need_input_grad else inputs, grad_y1)
            grad_x1 = grad_y1 if factor == 1 else grad_y1 * factor
        else:
            x1.requires_grad_()
            with torch.enable_grad(), back.autocast():
                root = GradRoot(coupling.combine(x1, h))
            del h
            grads = root.vjp([x1, x2, *inputs] if need_input_grad else inputs, grad_y1)
            grad_x1 = grads.pop(0) if need_input_grad else None
        del root
        if need_input_grad:
            grad_x2 = back.memory.add(
                grad_x2, grads.pop(0), grad_x1, *grads, *g_grads, *back.context_grads
            )
        back.add_context_grads(grads[:n])
        f_grads = grads[n:]
        carry.y1, carry.y2, carry.dy1, carry.dy2 = x1.detach(), x2.detach(), grad_x1, grad_x2
        self._finish(carry)
        pairs = list(zip(plan.g_params, g_grads)) + list(zip(plan.f_params, f_grads))
        return [(p, grad) for p, grad in pairs if grad is not None]


class CouplingStep(_CouplingBackward):
    """A coupling whose f and g run without a graph in the forward and are recomputed, each once,
    in backward: the same results serve to reconstruct the input and to backpropagate."""

    def __init__(self, index: int, plan: BlockPlan) -> None:
        super().__init__(index, plan)
        self.block = plan.block
        self.runs: dict[str, Recording] = {}
        self.layouts: dict[str, Layout] = {}
        # f's or g's compiling backend where it ran compiled; the recomputation runs alike.
        self.compiled: dict[str, str | None] = {}
        # f's and g's drop-path scales (NOTE [ Drop path outside the transforms ]).
        self.scales: dict[str, Tensor | None] = {}
        # The bits the couplings' scaling dropped of x1 ("f") and x2 ("g"), where kept.
        self.lost: dict[str, Tensor | None] = {}
        self._kept: tuple[Tensor, Tensor] | None = None

    def forward(self, x1, x2, mine, context, run):
        block = self.block
        if self.kept is not None:
            mine = False  # the kept input must stay intact
        x2 = dense(x2, mine, run.memory_format)
        if self.plan.hooked:
            y1, y2 = self._hooked_forward(x1, x2, context.values, run)
            return y1, y2, False  # what the hooks saw stays intact
        self.scales = block.drop_path_scales(x1)
        h = self._run("f", x2, context.values, run)
        if self.kept is None:
            check_uncombine_once(block.coupling, x1, h)
        self.lost["f"] = _lost(block.coupling, x1)
        y1 = dense(_combine(block.coupling, x1, h, mine), True, run.memory_format)
        del h
        _user_code_ran(block.coupling, run)
        h = self._run("g", y1, context.values, run)
        self.lost["g"] = _lost(block.coupling, x2)
        y2 = _combine(block.coupling, x2, h, True)
        _user_code_ran(block.coupling, run)
        if run.grid is not None:
            run.grid.watch(self.index, y1, y2)
        return y1, y2, True

    def _run(self, name: str, half: Tensor, context: tuple, run: ForwardRun) -> Tensor:
        self.layouts[name] = Layout.of(half)
        recording = self.runs[name] = Recording(
            [getattr(self.block, name)], run.preserve_rng, chain=run.chain,
            prefix=f"blocks.{self.index}.{name}.",
            # Context that is not plain is watched (NOTE [ Known calls ]).
            device=run.device if not context or plain(context) else None,
        )
        with recording:
            backend = run.compile_transforms
            if backend is not None and not compilable(recording, context, run.autocast.enabled):
                backend = None
            self.compiled[name] = backend
            call = None if backend is None else compiled_call.runner(backend)
            h = self.block.transform(name, half, *context, call=call, scale=self.scales[name])
        if not torch.is_grad_enabled():
            refuse_gradients(recording, f"block {self.index} of a ReversibleSequence")
        return h

    def _hooked_forward(self, x1, x2, context, run) -> tuple[Tensor, Tensor]:
        """An ordinary forward (with a graph, not in place) that forward hooks observe, its
        outputs then detached for the engine. The graph begins at a node that refuses to be
        backpropagated into. The hooks' graph is the hooks' own: saved-tensor hooks around the
        sequence (a surrounding checkpoint) must not see it."""
        block = self.block
        where = f"block {self.index} of a ReversibleSequence"
        run.chain.cut()  # the hooks run outside the recordings
        with hooks_own_graph():
            x1, x2 = graph_start(x1, where), graph_start(x2, where)
            pre_hooks, hooks = forward_hooks_of(block)
            hooked = bool(pre_hooks or hooks)
            if hooked:
                merged = block.merge(x1, x2)
                version = merged._version
                for hook, kwargs in pre_hooks:
                    args = (block, (merged, *context), *(({},) if kwargs else ()))
                    if hook(*args) is not None or merged._version != version:
                        raise RuntimeError(
                            f"{where}: a forward pre-hook on the block replaced or modified its "
                            "input; the block could not be inverted. Register it on the sequence "
                            "instead."
                        )
            self.scales = block.drop_path_scales(x1)  # after the pre-hooks, as block(x) draws
            h = self._run("f", x2, context, run)
            if self.kept is None:
                check_uncombine_once(block.coupling, x1.detach(), h.detach())
            self.lost["f"] = _lost(block.coupling, x1)
            y1 = block.coupling.combine(x1, h)
            del h
            self.lost["g"] = _lost(block.coupling, x2)
            y2 = block.coupling.combine(x2, self._run("g", y1, context, run))
            if hooked:
                output = block.merge(y1, y2)
                version = output._version
                for hook, kwargs in hooks:
                    result = hook(block, (merged, *context), *(({},) if kwargs else ()), output)
                    if (result is not None and result is not output) or output._version != version:
                        raise RuntimeError(
                            f"{where}: a forward hook on the block replaced or changed its "
                            "output; the sequence could not be inverted. Register it on a module "
                            "inside f or g (it is replayed in backward) or on the sequence."
                        )
        run.chain.cut()
        return y1.detach(), y2.detach()

    def reverse(self, carry, back, need_input_grad):
        pairs = compiled_reverse(self, carry, back.context, REMEDY)
        return pairs if pairs is not None else super().reverse(carry, back, need_input_grad)

    def _outputs(self, carry):
        self._kept = self.kept_input()
        if self._kept is not None:  # x2 is known: y2 is not needed
            carry.y2 = None
            y1 = carry.own(self.layouts["g"], None)[0]
            return y1.requires_grad_(), None
        y1, y2 = carry.own(self.layouts["g"], self.layouts["f"])
        return y1.requires_grad_(), y2

    def _transform(self, name, half, back):
        recording = self.runs.pop(name)
        recording.check("ReversibleSequence", REMEDY, prefix=f"blocks.{self.index}.{name}.")
        backend = self.compiled.pop(name, None)
        call = None if backend is None else compiled_call.runner(backend)
        scale = self.scales.pop(name)
        with torch.enable_grad(), back.autocast(), recording.replayed():
            return self.block.transform(name, half, *back.context.args(), call=call, scale=scale)

    def _second_half(self, y2, h, back):
        lost = self.lost.pop("g", None)
        if self._kept is not None:
            return self._kept[1].detach().requires_grad_()
        with torch.no_grad(), back.autocast():
            return _uncombine(self.block.coupling, y2, h, lost).requires_grad_()

    def _first_half(self, y1, h, back):
        lost = self.lost.pop("f", None)
        if self._kept is not None:
            return self._kept[0].detach()
        with torch.no_grad(), back.autocast():
            return _uncombine(self.block.coupling, y1.detach(), h, lost)

    def _finish(self, carry):
        carry.mine = (self._kept is None, self._kept is None)
        self._kept = None
        self.lost.clear()


class StoredCouplingStep(_CouplingBackward):
    """One of the last blocks (``store_last_blocks``): f and g run with grad enabled in the
    forward pass and their graphs are kept, so backward starts from them instead of recomputing."""

    def __init__(self, index: int, plan: BlockPlan, context: Context, last: bool) -> None:
        super().__init__(index, plan)
        self.block = plan.block
        self.context = context  # the leaves these graphs were built on
        self.last = last
        self.output: Tensor | None = None
        self.mine = False
        self.lost: Tensor | None = None  # the bits the coupling's scaling dropped of x1

    def forward(self, x1, x2, mine, context, run):
        block, coupling = self.block, self.block.coupling
        args = self.context.args()
        run.chain.cut()  # f and g run here without a recording
        self.mine = mine
        self.x2 = x2.detach().requires_grad_()
        scales = block.drop_path_scales(x1)
        with torch.enable_grad():
            self.h = {"f": block.transform("f", self.x2, *args, scale=scales["f"])}
        self.lost = _lost(coupling, x1)  # x2 is kept: only x1 is reconstructed
        self.y1 = coupling.combine(x1, self.h["f"].detach()).requires_grad_()
        with torch.enable_grad():
            self.h["g"] = block.transform("g", self.y1, *args, scale=scales["g"])
        if not self.last:
            return self.y1.detach(), coupling.combine(x2, self.h["g"].detach()), True
        # The last y2 goes straight into the sequence's output: it is not needed again, and
        # building it apart and concatenating would hold it twice at the moment of peak memory.
        y2_dtype = torch.result_type(x2, self.h["g"])
        self.output = _merged_like(block, x1, torch.promote_types(self.y1.dtype, y2_dtype))
        out1, out2 = block.split(self.output)
        out1.copy_(self.y1)
        if coupling.is_additive and not coupling.exact:
            torch.add(x2, self.h["g"].detach(), out=out2)
        else:
            out2.copy_(coupling.combine(x2, self.h["g"].detach()))
        return out1, out2, False

    def _context(self, back):
        return self.context

    def _outputs(self, carry):
        carry.y1 = carry.y2 = None  # the kept y1 and x2 are exact: nothing to reconstruct
        y1, self.y1 = self.y1, None
        return y1, None

    def _transform(self, name, half, back):
        return self.h.pop(name)

    def _second_half(self, y2, h, back):
        x2, self.x2 = self.x2, None
        return x2

    def _first_half(self, y1, h, back):
        with torch.no_grad(), back.autocast():
            # y1 is the step's own (made out of place in the forward), unless hooks saw it.
            lost, self.lost = self.lost, None
            if self.plan.hooked and lost is None:
                return self.block.coupling.uncombine(y1.detach(), h)
            return _uncombine(self.block.coupling, y1.detach(), h, lost)  # new where kept

    def _finish(self, carry):
        carry.mine = (not self.plan.hooked, self.mine)


def _merged_like(block: ReversibleBlock, half: Tensor, dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor for two halves like ``half`` merged, in ``half``'s memory layout
    (channels_last stays channels_last, as ``torch.cat`` keeps it)."""
    shape = list(half.shape)
    shape[block.split_dim] *= 2
    for fmt, dim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if half.dim() == dim and half.is_contiguous(memory_format=fmt):
            return torch.empty(shape, dtype=dtype, device=half.device, memory_format=fmt)
    return torch.empty(shape, dtype=dtype, device=half.device)
