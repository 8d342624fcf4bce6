"""Attention profiled on the meta device as the real device runs it.

# NOTE [ Attention on the meta device ]
# Sizes are profiled on the meta device (profile.py), where ``F.scaled_dot_product_attention``
# has no fused kernel to choose and runs its math decomposition: it saves the L x L attention
# matrix and its softmax. The CPU runs a fused flash kernel for the same call, which saves the
# query, key, value, output and the log-sum-exp, far less. Profiled on math, a transformer's
# attention looked several times its size to the chain model, which then ranked plans wrong (a
# GPT's lowest plan stored its last block whole, 9 MiB above checkpointing it). While a profile
# runs on meta, this mode asks the real device which kernel it would choose (with tensors of one
# row each, the strides of the last dimension kept: what the choice reads) and runs that kernel's
# meta version, which saves what the real one saves. Only a run inside the mode changes: no
# function of torch is replaced. Cases it does not follow run as before (sizes only rank plans;
# exact predictions, on fake tensors of the real device, decide): a CUDA device's kernels,
# grouped-query attention, attention under autocast, torch.nn's MultiheadAttention. The mode sees
# every torch function a profile calls, a quarter of a DenseNet-201's profile: it is entered
# only for chains with a step that may attend (``may_attend``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["AttentionAsOn", "may_attend"]

_FLASH = 1  # torch.nn.attention.SDPBackend.FLASH_ATTENTION, the value _fused_sdp_choice returns
# torch.nn's own modules and functions that attend.
_ATTENDING = (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder,
              nn.TransformerDecoder, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_ATTENTION = (F.scaled_dot_product_attention, F.multi_head_attention_forward)
_LIBRARY = frozenset({"torch", "_operator", "builtins", "math"})


def may_attend(layer: nn.Module) -> bool:
    """Whether running ``layer`` (a chain's step) may call ``F.scaled_dot_product_attention``:
    anything but torch.nn's own modules that do not attend, and graph steps calling those, torch's
    functions that do not, Python's operators and tensor methods. The mode costs a few
    microseconds on every torch function a profile calls (a quarter of a DenseNet-201's), so it
    is entered only where it may serve."""
    op = getattr(layer, "op", None)
    if op == "call_function":
        target = layer.target
        package = (getattr(target, "__module__", None) or "").partition(".")[0]
        return target in _ATTENTION or package not in _LIBRARY
    if op == "call_method":
        return False
    modules = layer.module.modules() if op == "call_module" else layer.modules()
    return any(isinstance(m, _ATTENDING) or not type(m).__module__.startswith("torch.nn.")
               for m in modules)


class AttentionAsOn(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` on meta tensors runs the kernel
    ``device`` would choose (NOTE [ Attention on the meta device ])."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = self._fused(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)

    def _fused(
        self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor | None:
        if (self.device.type != "cpu" or query.device.type != "meta" or enable_gqa
                or torch.is_autocast_enabled("cpu")):
            return None
        # Outside any dispatch mode: a profile's mode turns every tensor it sees to meta.
        with _disable_current_modes():
            probes = [_probe(t, self.device) for t in (query, key, value)]
            mask = None if attn_mask is None else _probe(attn_mask, self.device)
            choice = torch._fused_sdp_choice(*probes, mask, dropout_p, is_causal, scale=scale)
        if choice != _FLASH:
            return None
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # As the CPU kernel's caller does: an additive mask of the query's dtype.
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device="meta").masked_fill(
                attn_mask.logical_not(), float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _probe(tensor: Tensor, device: torch.device) -> Tensor:
    """A tensor on ``device`` of ``tensor``'s shape, dtype, last stride and ``requires_grad``
    over one row of storage (the device named: a profile may run under a default one)."""
    last = tensor.stride(-1) if tensor.dim() else 1
    rows = (tensor.shape[-1] - 1) * last + 1 if tensor.dim() else 1
    strides = (0,) * max(tensor.dim() - 1, 0) + ((last,) if tensor.dim() else ())
    probe = torch.zeros(max(rows, 1), dtype=tensor.dtype, device=device).as_strided(
        tensor.shape, strides)
    # The choice reads it too: a mask that needs a gradient (a learnt position bias) goes to
    # the math path, the fused kernel having no gradient for it.
    return probe.requires_grad_(tensor.requires_grad)
