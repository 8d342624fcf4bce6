"""The autograd Function a reversible sequence runs as: its forward records the tape, its backward
walks the tape's steps in reverse. Everything a block does lives in its step (steps/)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

from revnets import reconstruction
from revnets.replay import AutocastState
from revnets.reversible import gradient_memory
from revnets.reversible.gradient_memory import GradientMemory
from revnets.reversible.grid import GridWatch
from revnets.reversible.invertible import Invertible
from revnets.reversible.steps import (
    Backward,
    BlockPlan,
    BlockStep,
    CouplingStep,
    ForwardRun,
    InvertibleStep,
    StoredCouplingStep,
)
from revnets.reversible.tape import Carry, Context, Tape, memory_format

__all__ = ["ReversibleFunction"]


def _record(
    sequence: Any, plans: list[BlockPlan], x: Tensor, context: Context,
    compile_transforms: str | None,
) -> tuple[Tensor, Tape]:
    """Run the blocks forward without a graph, one step each on the tape; return the output."""
    blocks = list(sequence.blocks)
    plan = sequence.memory
    report = reconstruction.active_report()
    tape = Tape(
        autocast=AutocastState.capture(x.device.type),
        memory_format=memory_format(x),
        report=report,
        true_inputs=[] if report is not None else None,
    )
    run = ForwardRun(
        x.device, sequence.preserve_rng_state, tape.memory_format, tape.autocast,
        GridWatch() if sequence.exact else None,
        compile_transforms=None if sequence.exact else compile_transforms,
    )
    # Under saved-tensor hooks, what backward needs is handed to them once (see below). A
    # stored block's graph would be unpacked by several inner backward passes instead, and a
    # surrounding checkpoint would recompute everything for each: recompute every block.
    stored = 0 if saved_tensor_hooks_active() else plan.store_last_blocks
    first_stored = max(len(blocks) - stored, 0)
    while any(isinstance(b, Invertible) for b in blocks[first_stored:]):
        first_stored += 1  # only couplings keep their graphs
    every = plan.keep_input_every
    x1, x2 = sequence.split(x)
    mine = False  # the halves are views of the caller's input
    for i, block_plan in enumerate(plans):
        step: BlockStep
        if isinstance(block_plan.block, Invertible):
            step = InvertibleStep(i, block_plan, sequence.merge, sequence.split)
        elif i >= first_stored and not block_plan.block_hooked:
            step = StoredCouplingStep(i, block_plan, context, last=i == len(blocks) - 1)
        else:
            step = CouplingStep(i, block_plan)
        if tape.true_inputs is not None:
            tape.true_inputs.append((x1, x2))
            mine = False  # compared with their reconstructions in backward
        if every is not None and i % every == 0 and i < first_stored:
            step.keep_input(x1, x2)
        x1, x2, mine = step.forward(x1, x2, mine, context, run)
        tape.steps.append(step)
    if run.grid is not None:
        run.grid.check()
    last = tape.steps[-1]
    if isinstance(last, StoredCouplingStep) and last.output is not None:
        y, last.output = last.output, None
    else:
        y = sequence.merge(x1, x2)
    return y, tape


def saved_tensor_hooks_active() -> bool:
    if torch.compiler.is_dynamo_compiling():
        return False  # the compiled graph saves what it needs itself
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class ReversibleFunction(torch.autograd.Function):
    """Forward: the blocks without a graph, output kept. Backward: reconstruct and backprop."""

    @staticmethod
    def forward(
        ctx, x: Tensor, sequence: Any, plans: list[BlockPlan], compile_transforms: str | None,
        num_context: int, *context_and_params: Any,
    ) -> Tensor:
        context = Context(context_and_params[:num_context])
        y, tape = _record(sequence, plans, x, context, compile_transforms)
        # Under saved-tensor hooks (save_on_cpu, a surrounding checkpoint) what backward needs is
        # handed to them. Otherwise the output is held directly rather than saved, so that
        # backward can let it go as soon as the top block has taken its halves (a saved tensor
        # would live until backward returns); its version counter still catches in-place changes.
        # A stored last block needs no output: its inputs are kept with its graph.
        stored_last = isinstance(tape.steps[-1], StoredCouplingStep)
        context_tensors = [c for c in context.values if isinstance(c, Tensor)]
        ctx.hooked_saving = saved_tensor_hooks_active()
        ctx.kept_steps = [s for s in tape.steps if s.kept is not None]
        if ctx.hooked_saving:
            kept = [t for s in ctx.kept_steps for t in s.kept[:2]]
            ctx.save_for_backward(*context_tensors, *([] if stored_last else [y]), *kept)
            ctx.output = None
        else:
            ctx.save_for_backward(*context_tensors)
            ctx.output = None if stored_last else y.detach()
        ctx.num_context_tensors = len(context_tensors)
        ctx.output_version = y._version
        ctx.context = context.values
        ctx.sequence = sequence
        ctx.tape = tape
        ctx.params = context_and_params[num_context:]
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        references = sys.getrefcount(grad_y)  # first: NOTE [ Gradient memory ], rule 1
        if torch.is_grad_enabled():
            # The engine enables grad here only for create_graph=True. The gradients below come
            # from torch.autograd.grad without a graph of their own, so derivatives of them
            # would silently miss every term through the blocks.
            raise RuntimeError(
                "ReversibleSequence: double backward (create_graph=True, as for gradient "
                "penalties or Hessian-vector products) is not supported: its backward "
                "reconstructs and differentiates without recording a graph. Use "
                "memory=revnets.Store() for this model."
            )
        tape: Tape = ctx.tape
        if tape.used:
            raise RuntimeError(
                "ReversibleSequence: backward through the same forward a second time is not "
                "supported (after the first backward the output it reconstructs from is released "
                "to save memory). Run the forward again, or use memory=revnets.Store()."
            )
        tape.used = True
        y, context = _unpack(ctx)
        sequence = ctx.sequence
        # Before its halves exist: they are views of it, and would count as holders.
        unshared = gradient_memory.unshared(grad_y, references, sequence.reuse_memory)
        grad_halves = sequence.split(grad_y)
        memory = GradientMemory(grad_y, grad_halves, unshared)
        carry = Carry(*(sequence.split(y) if y is not None else (None, None)), *grad_halves)
        del y
        back = Backward(context, [None] * len(context.leaves), memory, tape.autocast)
        position = {id(p): i for i, p in enumerate(ctx.params)}
        param_grads: list[Tensor | None] = [None] * len(ctx.params)
        for step in reversed(tape.steps):
            need_input_grad = step.index > 0 or ctx.needs_input_grad[0]
            for p, grad in step.reverse(carry, back, need_input_grad):
                memory.hand_out(grad)
                k = position[id(p)]
                param_grads[k] = grad if param_grads[k] is None else param_grads[k] + grad
            if tape.true_inputs is not None:
                x1, x2 = tape.true_inputs[step.index]
                tape.report.record(step.index, len(tape.steps), (x1, x2), carry.y1, carry.y2)
        tape.steps = []
        for grad in back.context_grads:
            if grad is not None:
                memory.hand_out(grad)
        if not ctx.needs_input_grad[0]:
            grad_x = None
        elif carry.dy1 is grad_halves[0] and carry.dy2 is grad_halves[1] and memory.all_ours():
            grad_x = grad_y  # every block added into the gradient it was given
        else:
            grad_x = sequence.merge(carry.dy1, carry.dy2)
        del grad_halves, grad_y, carry
        context_grads = context.gradients(back.context_grads)
        return (grad_x, None, None, None, None, *context_grads, *param_grads)


def _unpack(ctx) -> tuple[Tensor | None, Context]:
    """The output (None after a stored last block) and the context, from what the forward left."""
    saved = list(ctx.saved_tensors)
    context_tensors = iter(saved[: ctx.num_context_tensors])
    saved = saved[ctx.num_context_tensors :]
    context = Context([next(context_tensors) if isinstance(c, Tensor) else c for c in ctx.context])
    ctx.context = None
    stored_last = isinstance(ctx.tape.steps[-1], StoredCouplingStep)
    if ctx.hooked_saving:
        y = None if stored_last else saved.pop(0)
        for step in ctx.kept_steps:
            step.keep_input(saved.pop(0), saved.pop(0))
    else:  # saved tensors check their own versions
        y, ctx.output = ctx.output, None
        if y is not None and y._version != ctx.output_version:
            raise RuntimeError(
                "ReversibleSequence: its output was modified in place after the forward pass; "
                "the inputs reconstructed from it would be wrong. Clone the output before "
                "modifying it."
            )
    ctx.kept_steps = []
    return y, context
