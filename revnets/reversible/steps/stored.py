"""The step of one of the last blocks (``store_last_blocks``): f's and g's graphs kept from the
forward, backward starting from them instead of recomputing."""

from __future__ import annotations

import torch
from torch import Tensor

from revnets.reversible.block import ReversibleBlock
from revnets.reversible.steps.arithmetic import lost_of, uncombine
from revnets.reversible.steps.coupling_backward import CouplingBackward
from revnets.reversible.steps.step import BlockPlan
from revnets.reversible.tape import Context

__all__ = ["StoredCouplingStep"]


class StoredCouplingStep(CouplingBackward):
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
        self.lost = lost_of(coupling, x1)  # x2 is kept: only x1 is reconstructed
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
            return uncombine(self.block.coupling, y1.detach(), h, lost)  # new where kept

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
