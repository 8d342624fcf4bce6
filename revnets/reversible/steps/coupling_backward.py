"""The backward of a coupling, shared by the recomputed and the stored steps: one run of g and
one of f give the input halves and the gradients through them, scaled by the coupling's
``x_factor`` where it declares one instead of differentiating ``combine`` again."""

from __future__ import annotations

import abc

import torch
from torch import Tensor

from revnets.reversible.block import ReversibleBlock
from revnets.reversible.reach import GradRoot, check_reached
from revnets.reversible.steps.step import Backward, BlockStep
from revnets.reversible.tape import Carry, Context

__all__ = ["CouplingBackward"]


class CouplingBackward(BlockStep):
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
