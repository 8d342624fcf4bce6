"""The usual step of a coupling: f and g run without a graph in the forward (observed by forward
hooks where there are any) and are recomputed, each once, in backward."""

from __future__ import annotations

import torch
from torch import Tensor

from revnets.replay import Recording
from revnets.replay.known_calls import plain
from revnets.reversible.compiled import compilable, compiled_call, compiled_reverse
from revnets.reversible.hooked import (
    forward_hooks_of,
    graph_start,
    hooks_own_graph,
    refuse_gradients,
)
from revnets.reversible.inverse_check import check_uncombine_once
from revnets.reversible.steps.arithmetic import combine, lost_of, uncombine, user_code_ran
from revnets.reversible.steps.coupling_backward import CouplingBackward
from revnets.reversible.steps.step import REMEDY, BlockPlan, ForwardRun
from revnets.reversible.tape import Layout, dense

__all__ = ["CouplingStep"]


class CouplingStep(CouplingBackward):
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
        self.lost["f"] = lost_of(block.coupling, x1)
        y1 = dense(combine(block.coupling, x1, h, mine), True, run.memory_format)
        del h
        user_code_ran(block.coupling, run)
        h = self._run("g", y1, context.values, run)
        self.lost["g"] = lost_of(block.coupling, x2)
        y2 = combine(block.coupling, x2, h, True)
        user_code_ran(block.coupling, run)
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
            self.lost["f"] = lost_of(block.coupling, x1)
            y1 = block.coupling.combine(x1, h)
            del h
            self.lost["g"] = lost_of(block.coupling, x2)
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
            return uncombine(self.block.coupling, y2, h, lost).requires_grad_()

    def _first_half(self, y1, h, back):
        lost = self.lost.pop("f", None)
        if self._kept is not None:
            return self._kept[0].detach()
        with torch.no_grad(), back.autocast():
            return uncombine(self.block.coupling, y1.detach(), h, lost)

    def _finish(self, carry):
        carry.mine = (self._kept is None, self._kept is None)
        self._kept = None
        self.lost.clear()
