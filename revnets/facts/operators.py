"""Facts about aten operators that several parts of revnets decide by: which are the products
a selective checkpoint keeps (NOTE [ Selective recomputation ]), which are norms, the autograd
nodes those products leave (NOTE [ Norms in a compiled selective checkpoint ]), and the
floating-point operations of a product (flops_of)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

__all__ = ["KEPT_PRODUCERS", "NORMS", "SELECTIVE_OPS", "flops_of"]


# NOTE [ Selective recomputation ]
# A selective checkpoint keeps, besides its input, the outputs of the operators that cost the most
# to run again for what they keep: matrix products, convolutions and attention (SELECTIVE_OPS),
# and recomputes the rest (norms, activations, dropout, additions), as torch's selective
# activation checkpointing does (torch.utils.checkpoint.create_selective_checkpoint_contexts,
# whose contexts run inside the replay's). The autograd graph of the recomputation is whole: a
# kept operator is recorded as usual and returns its kept output instead of computing it, so its
# backward reads recomputed inputs. A kept output that the forward then modifies in place
# (ReLU(inplace=True) right after a convolution) is refused by torch in backward; the planner
# never makes such a segment selective (LayerProfile.selective_safe).
SELECTIVE_OPS = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
})


# NOTE [ Norms in a compiled selective checkpoint ]
# Under torch.compile a selective checkpoint's tags go to the partitioner, which must recompute
# what is tagged PREFER_RECOMPUTE: a norm so tagged is recomputed whole in the backward, its
# statistics included (a batch norm's reductions over the batch), where compile's own
# partitioner keeps the few statistics and recomputes only the pointwise normalisation, fused
# into the backward's kernels. That pays where the norm's input is kept anyway: the output of a
# product the checkpoint keeps (conv -> batch norm). Such a norm is tagged PREFER_SAVE there,
# which leaves the choice to the partitioner, and it keeps the statistics, not the output
# (ResNet-50 planned for compile, benchmarks/frontier.py: level with compile's curve, where it
# was 4 % above). A norm whose input the checkpoint recomputes (a pre-activation block's batch
# norm, a transformer's layer norm after a residual sum) stays PREFER_RECOMPUTE: the partitioner
# would keep its output, more than the plan counts (checked by hand on both). Eagerly
# PREFER_SAVE would keep the output: the eager policy recomputes every norm.
NORMS = frozenset({
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit.no_stats,
    torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten.native_layer_norm.default,
    torch.ops.aten.native_group_norm.default,
})
# The autograd nodes of the matrix products and convolutions SELECTIVE_OPS keeps: a norm's
# input made by one is kept (attention's output reaches a norm through a projection).
KEPT_PRODUCERS = frozenset({
    "MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "ConvolutionBackward0",
})

# torch's FLOP formulas (those of torch.utils.flop_counter), by operator; the CPU's flash
# attention has no formula of its own: it computes what the other attention kernels do.
_FLOP_FORMULAS = {**flop_registry, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
                  flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]}


def flops_of(func: Any, args: Any, kwargs: dict, out: Any) -> int:
    """The floating-point operations of one call of the aten operator ``func`` that returned
    ``out``; 0 for an operator without a formula (all but products, convolutions, attention)."""
    formula = _FLOP_FORMULAS.get(func.overloadpacket)
    return 0 if formula is None else int(formula(*args, **kwargs, out_val=out))
