"""Outputs of the CPU's kernels where their meta kernels allocate otherwise, and the kernels
whose memory no fake kernel knows.

A prediction (:mod:`revnets.memory.predict`) runs each operator's meta kernel on fake tensors; for
the operators below, the CPU kernel's outputs differ in dtype, size or number, or the meta
kernel is a slow decomposition. Each maps an operator to its outputs as the CPU allocates them.
A prediction refuses the operators in ``UNKNOWN_KERNELS`` by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._prims_common import suggest_memory_format
from torch.utils._python_dispatch import _disable_current_modes

from revnets.memory.call_arguments import rebuilt

__all__ = ["CPU_KERNELS", "CPU_OUTPUTS", "UNKNOWN_KERNELS"]

# Kernels whose memory torch's fake kernels do not know, with what a refusal says of them.
UNKNOWN_KERNELS = {
    torch.ops.aten._cudnn_rnn.default: (
        "cuDNN's RNN kernel (nn.LSTM, nn.GRU or nn.RNN on CUDA) keeps a reserve of "
        "activations whose size torch's fake kernel does not know (it says 0)"
    ),
    torch.ops.aten._nested_tensor_from_mask.default: (
        "nn.TransformerEncoder's fast path (evaluation, no grad, enable_nested_tensor=True) "
        "packs a padded batch into a nested tensor by its src_key_padding_mask, whose size "
        "depends on the mask's values"
    ),
}


# NOTE [ CPU kernels that allocate unlike their meta kernels ]
# Fake tensors run the meta kernels, which give the shapes and dtypes of every output. Where the
# CPU kernel's outputs differ, the outputs are corrected here, exactly:
# - batch norm (native_batch_norm, and the operators compiled and exported graphs call), group
#   norm and layer norm on a reduced-precision input with float32 parameters (autocast) keep
#   their saved mean and inverse standard deviation in float32 (the meta kernels: the input's
#   dtype); native_group_norm_backward returns the input's gradient in the input's dtype (the
#   meta kernel: float32 when the parameters are);
# - native_layer_norm_backward returns the input's gradient contiguous (the meta kernel: in the
#   output gradient's strides, transposed where the norm's output was put back on a grid): a
#   view of it that the CPU's gradient allows then needs a copy of the fake one (a Linear's
#   backward, in timm's pvt_v2, predicted 32 KiB high);
# - mkldnn_rnn_layer (each layer and direction of nn.LSTM) returns a oneDNN workspace whose size
#   oneDNN computes from the shapes, the instruction set and its version (the meta kernel: empty).
#   Its size is asked of oneDNN itself: the layer runs once for real, on zeros of the same shapes,
#   and the size is remembered for those shapes and grad mode (with grad disabled it makes
#   none). Its backward returns the gradients of the two biases in two tensors (the meta
#   kernel: one).
# - im2col and col2im (``F.unfold`` and ``F.fold``, each the other's backward) make their output
#   like their input and resize it: it keeps a storage of the larger of the two sizes (a fold's
#   output the size of its columns, nine times its own for a 3x3 kernel at stride 1; the meta
#   kernels: the output's own size).
# - mse_loss, smooth_l1_loss, binary_cross_entropy and soft_margin_loss, reduced (mean or sum),
#   compute the unreduced loss into a tensor of the broadcast inputs' size and reduce it into
#   that same tensor, resized to a scalar: the scalar they return keeps the unreduced storage
#   (the meta kernels: a scalar's 4 bytes), alive as long as the loss is. Where the target's
#   dtype differs from the input's (a float64 target), their backward kernels, and soft margin's
#   and huber_loss's forward, return the input's dtype (the meta kernels: the promoted one,
#   which autograd then copies to the input's); binary_cross_entropy's forward and huber_loss's
#   backward refuse such a target, and so does a prediction.
# - mse_loss, smooth_l1_loss and huber_loss averaged over no elements (an empty batch): the CPU's
#   backward kernels divide by the count as a float and return an empty gradient; their meta
#   kernels divide by it in Python, and raise ZeroDivisionError. Those outputs are made directly
#   (CPU_OUTPUTS: NotImplemented where a function leaves the operator to its meta kernel).
# Batch norm's meta kernels are Python decompositions, which the fake mode runs op by op for
# every new shape (tens of milliseconds per layer of a DenseNet): its outputs are made directly,
# as the CPU kernels allocate them (the output and the input's gradient in the input's suggested
# memory format; the saved statistics per channel in training, empty in evaluation, in float32
# when mixed as above; the parameters' gradients in the weight's dtype; no input gradient where
# the input needs none), real statistics a closure holds included.


def _batch_norm(out: Any, args: tuple, kwargs: dict) -> Any:
    return _float32_statistics(out, args[0], args[1:5])


def _batch_norm_without_statistics(out: Any, args: tuple, kwargs: dict) -> Any:
    return _float32_statistics(out, args[0], args[1:3])


def _layer_norm(out: Any, args: tuple, kwargs: dict) -> Any:
    return _float32_statistics(out, args[0], args[2:4])


def _batch_norm_outputs(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, training: bool, momentum: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    channels = x.shape[1] if training else 0
    dtype = torch.float32 if _mixed(x, (weight, bias, running_mean, running_var)) else x.dtype
    return (_like_input(x), x.new_empty((channels,), dtype=dtype),
            x.new_empty((channels,), dtype=dtype))


def _batch_norm_backward_outputs(
    grad_out: Tensor, x: Tensor, weight: Tensor | None, *statistics: Any
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    mask = statistics[-1]
    per_channel = ((x.shape[1],), weight.dtype if weight is not None else x.dtype)
    return (_like_input(x) if mask[0] else None,
            x.new_empty(per_channel[0], dtype=per_channel[1]) if mask[1] else None,
            x.new_empty(per_channel[0], dtype=per_channel[1]) if mask[2] else None)


def _batch_norm_backward_with_reserve_outputs(
    grad_out: Tensor, x: Tensor, weight: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, save_mean: Tensor | None, save_var: Tensor | None,
    update: bool, eps: float, output_mask: list[bool], reserve: Tensor,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    return _batch_norm_backward_outputs(grad_out, x, weight, output_mask)


def _like_input(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=suggest_memory_format(x))


def _layer_norm_backward(out: Any, args: tuple, kwargs: dict) -> Any:
    grad_input = out[0]
    if grad_input is None or grad_input.is_contiguous():
        return out
    return (grad_input.new_empty(grad_input.shape), *out[1:])


def _group_norm(out: Any, args: tuple, kwargs: dict) -> Any:
    return _float32_statistics(out, args[0], args[1:3])


def _group_norm_backward(out: Any, args: tuple, kwargs: dict) -> Any:
    grad_input, x = out[0], args[1]
    if grad_input is None or grad_input.dtype == x.dtype:
        return out
    return (grad_input.new_empty(grad_input.shape, dtype=x.dtype), *out[1:])


def _mixed(x: Tensor, parameters: Sequence[Tensor | None]) -> bool:
    """A reduced-precision input with float32 parameters (autocast): float32 statistics."""
    return x.dtype in (torch.bfloat16, torch.float16) and any(
        t is not None and t.dtype == torch.float32 for t in parameters)


def _float32_statistics(out: Any, x: Tensor, parameters: Sequence[Tensor | None]) -> Any:
    if not _mixed(x, parameters):
        return out
    y, mean, invstd, *rest = out  # batch norm with update: its reserve too
    return (y, mean.new_empty(mean.shape, dtype=torch.float32),
            invstd.new_empty(invstd.shape, dtype=torch.float32), *rest)


_RNN_WORKSPACE: dict[tuple, int] = {}


def _rnn_layer(out: Any, args: tuple, kwargs: dict) -> Any:
    def key(value: Any) -> Any:
        if isinstance(value, Tensor):
            return (tuple(value.shape), value.dtype)
        if isinstance(value, (list, tuple)):
            return tuple(key(v) for v in value)
        return value

    signature = key((args, sorted(kwargs.items()), torch.is_grad_enabled()))
    if signature not in _RNN_WORKSPACE:
        def real(value: Any) -> Any:
            if isinstance(value, Tensor):
                return torch.zeros(value.shape, dtype=value.dtype)
            if isinstance(value, (list, tuple)):
                return rebuilt(value, (real(v) for v in value))
            return value

        with _disable_current_modes():
            workspace = torch.ops.aten.mkldnn_rnn_layer.default(
                *real(args), **real(kwargs)
            )[3]
        _RNN_WORKSPACE[signature] = 0 if workspace is None else workspace.numel()
    y, hy, cy, workspace = out
    return y, hy, cy, workspace.new_empty(_RNN_WORKSPACE[signature])


def _in_input_sized_storage(out: Any, args: tuple, kwargs: dict) -> Any:
    # Resizing down keeps the storage.
    return out.new_empty(max(args[0].numel(), out.numel())).resize_(out.shape)


def _rnn_layer_backward(out: Any, args: tuple, kwargs: dict) -> Any:
    # The meta kernel returns one tensor as the gradient of both biases; the CPU kernel returns
    # two, which the two parameters keep as their gradients.
    return (*out[:4], out[4].new_empty(out[4].shape), *out[5:])


def _reduced_in_unreduced_storage(
    reduction_at: int, in_input_dtype: bool = False
) -> Callable[[Any, tuple, dict], Any]:
    def outputs(out: Any, args: tuple, kwargs: dict) -> Any:
        reduction = (args[reduction_at] if len(args) > reduction_at
                     else kwargs.get("reduction", 1))  # torch's Reduction: None 0, Mean 1, Sum 2
        dtype = args[0].dtype if in_input_dtype else out.dtype
        if reduction == 0:
            return out if out.dtype == dtype else out.new_empty(out.shape, dtype=dtype)
        unreduced = torch.broadcast_shapes(args[0].shape, args[1].shape)
        # Resizing down keeps the storage.
        return out.new_empty(unreduced, dtype=dtype).resize_(out.shape)

    return outputs


def _loss_gradient(same_dtypes: bool = False) -> Callable[..., Any]:
    """A loss's gradient over no elements (an empty batch), made directly; ``same_dtypes``: a
    target of another dtype than the input's refused, as the CPU's kernel refuses it. Else
    NotImplemented: the meta kernel's."""
    def outputs(grad_output: Tensor, x: Tensor, target: Tensor, *rest: Any) -> Any:
        if same_dtypes:
            _refuse_other_dtypes(x, target)
        if x.numel():
            return NotImplemented
        return x.new_empty(torch.broadcast_shapes(grad_output.shape, x.shape, target.shape))

    return outputs


def _same_dtypes(x: Tensor, target: Tensor, *rest: Any, **kwargs: Any) -> Any:
    _refuse_other_dtypes(x, target)
    return NotImplemented


_SCALAR_TYPES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                 torch.bfloat16: "BFloat16"}


def _refuse_other_dtypes(x: Tensor, target: Tensor) -> None:
    if target.dtype != x.dtype:
        found, expected = (_SCALAR_TYPES.get(t.dtype, str(t.dtype)) for t in (target, x))
        raise RuntimeError(
            f"Found dtype {found} but expected {expected} (the CPU's kernel of this loss takes "
            f"a target of the input's dtype only; convert the target)"
        )


def _in_input_dtype(at: int) -> Callable[[Any, tuple, dict], Any]:
    def outputs(out: Any, args: tuple, kwargs: dict) -> Any:
        x = args[at]
        return out if out.dtype == x.dtype else out.new_empty(out.shape, dtype=x.dtype)

    return outputs


CPU_KERNELS: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    torch.ops.aten.mse_loss.default: _reduced_in_unreduced_storage(2),
    torch.ops.aten.smooth_l1_loss.default: _reduced_in_unreduced_storage(2),
    torch.ops.aten.soft_margin_loss.default: _reduced_in_unreduced_storage(2, in_input_dtype=True),
    torch.ops.aten.huber_loss.default: _in_input_dtype(0),
    torch.ops.aten.mse_loss_backward.default: _in_input_dtype(1),  # (grad_output, self, ...)
    torch.ops.aten.smooth_l1_loss_backward.default: _in_input_dtype(1),
    torch.ops.aten.soft_margin_loss_backward.default: _in_input_dtype(1),
    torch.ops.aten.binary_cross_entropy.default: _reduced_in_unreduced_storage(3),
    torch.ops.aten.mkldnn_rnn_layer_backward.default: _rnn_layer_backward,
    torch.ops.aten.native_batch_norm.default: _batch_norm,
    torch.ops.aten._native_batch_norm_legit.default: _batch_norm,
    torch.ops.aten._native_batch_norm_legit.no_stats: _batch_norm_without_statistics,
    torch.ops.aten._native_batch_norm_legit_no_training.default: _batch_norm,
    torch.ops.aten._batch_norm_with_update.default: _batch_norm,
    torch.ops.aten._batch_norm_no_update.default: _batch_norm,
    torch.ops.aten.native_layer_norm.default: _layer_norm,
    torch.ops.aten.native_layer_norm_backward.default: _layer_norm_backward,
    torch.ops.aten.native_group_norm.default: _group_norm,
    torch.ops.aten.native_group_norm_backward.default: _group_norm_backward,
    torch.ops.aten.mkldnn_rnn_layer.default: _rnn_layer,
    torch.ops.aten.im2col.default: _in_input_sized_storage,
    torch.ops.aten.col2im.default: _in_input_sized_storage,
}

CPU_OUTPUTS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.mse_loss_backward.default: _loss_gradient(),
    torch.ops.aten.smooth_l1_loss_backward.default: _loss_gradient(),
    torch.ops.aten.huber_loss_backward.default: _loss_gradient(same_dtypes=True),
    torch.ops.aten.binary_cross_entropy.default: _same_dtypes,
    torch.ops.aten.native_batch_norm.default: _batch_norm_outputs,
    torch.ops.aten.native_batch_norm_backward.default: _batch_norm_backward_outputs,
    torch.ops.aten.batch_norm_backward.default: _batch_norm_backward_with_reserve_outputs,
}
