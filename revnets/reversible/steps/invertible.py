"""The step of an :class:`~revnets.Invertible` module in a reversible sequence (the interface in
step.py): inverted with its ``inverse``."""

from __future__ import annotations

from typing import Any

import torch

from revnets.replay import Recording
from revnets.reversible.hooked import graph_start, hooks_own_graph, refuse_gradients
from revnets.reversible.inverse_check import check_inverse_once
from revnets.reversible.invertible import InjectivePad, Invertible, SpaceToDepth
from revnets.reversible.reach import GradRoot, check_reached
from revnets.reversible.steps.step import REMEDY, BlockPlan, BlockStep
from revnets.reversible.tape import Layout

__all__ = ["InvertibleStep"]


class InvertibleStep(BlockStep):
    """An invertible module: reconstructed with its inverse (run with the state its forward left)
    and backpropagated through a recomputation of its forward (run with the state it found)."""

    def __init__(self, index: int, plan: BlockPlan, merge: Any, split: Any) -> None:
        super().__init__(index, plan)
        self.module: Invertible = plan.block
        self.merge, self.split = merge, split
        self.recording: Recording | None = None
        self.layout: Layout | None = None

    def forward(self, x1, x2, mine, context, run):
        where = f"block {self.index} of a ReversibleSequence"
        x = self.merge(x1, x2)
        self.layout = Layout.of(x)
        self.recording = Recording(
            [self.module], run.preserve_rng, keep_left_state=True, root_owner=where,
            chain=run.chain, prefix=f"blocks.{self.index}.",
        )
        with self.recording:
            if self.plan.hooked:
                with hooks_own_graph():
                    y = self.module(graph_start(x, where)).detach()
            else:
                y = self.module(x)
        if not self.plan.hooked:
            refuse_gradients(self.recording, where)
        # NOTE [ A user's inverse is checked once ]: revnets' own are tested.
        if self.kept is None and type(self.module) not in (SpaceToDepth, InjectivePad):
            recording = self.recording

            def inverse_of_forward() -> torch.Tensor:
                with recording.left_state():  # as reconstruction runs it
                    return self.module.inverse(y)

            check_inverse_once(self.module, f"{where} ({type(self.module).__name__})", x,
                               inverse_of_forward, met=[y])
        y1, y2 = self.split(y)
        return y1, y2, False

    def reverse(self, carry, back, need_input_grad):
        module, plan = self.module, self.plan
        recording = self.recording
        recording.check("ReversibleSequence", REMEDY, prefix=f"blocks.{self.index}.")
        kept = self.kept_input()
        if kept is not None:
            x = self.merge(*kept)
        else:
            y = self.merge(carry.y1, carry.y2)
            with torch.no_grad(), back.autocast(), recording.left_state():
                x = module.inverse(y)
            del y
            if not self.layout.holds(x):
                x = self.layout.copy(x)
        carry.y1 = carry.y2 = None
        x_leaf = x.detach().requires_grad_()
        del x
        with torch.enable_grad(), back.autocast(), recording.replayed():
            out = module(x_leaf)
        check_reached(out, [x_leaf, *plan.params], module, f"blocks.{self.index}")
        root = GradRoot(out)
        del out
        dy1, dy2 = carry.take_gradients()
        grad_out = self.merge(dy1, dy2)
        del dy1, dy2
        inputs = [x_leaf, *plan.params] if need_input_grad else plan.params
        grads = root.vjp(inputs, grad_out)
        del root, grad_out
        grad_x = grads.pop(0) if need_input_grad else None
        x1, x2 = self.split(x_leaf.detach())
        carry.y1, carry.y2 = x1, x2
        carry.dy1, carry.dy2 = self.split(grad_x) if grad_x is not None else (None, None)
        carry.mine = (False, False)  # halves of one tensor (or the kept input)
        self.recording = None
        return [(p, grad) for p, grad in zip(plan.params, grads) if grad is not None]
