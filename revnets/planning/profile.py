"""Per-layer costs of a chain: output size, what autograd saves for backward, forward time."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["LayerProfile", "profile_chain"]


@dataclass(frozen=True)
class LayerProfile:
    index: int
    name: str
    output_bytes: int  # what a checkpoint at this layer's output keeps
    saved_bytes: int  # what autograd keeps for this layer's backward (model state excluded)
    forward_seconds: float  # NaN when profiled on the meta device
    inplace: bool = False  # modifies its input: a checkpointed segment must not start here


def _nbytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def profile_chain(layers: Sequence[nn.Module], example_input: Tensor) -> list[LayerProfile]:
    """Run ``layers`` one after the other on ``example_input`` (training mode, grad on) and record
    each layer's costs. On the meta device only sizes are known; elsewhere times are measured too.
    """
    # Parameters and buffers (BatchNorm's running statistics) are model state, not activations.
    params = {
        id(t.untyped_storage()) for layer in layers for t in (*layer.parameters(), *layer.buffers())
    }
    timed = example_input.device.type != "meta"
    leaf = example_input.detach().requires_grad_()
    profiles = []
    for index, layer in enumerate(layers):
        saved: dict[int, int] = {}  # storages by identity: views of one storage count once

        def pack(t: Tensor) -> Tensor:
            storage = t.untyped_storage()
            if id(storage) not in params:
                saved[id(storage)] = storage.nbytes()
            return t

        x = leaf.clone()  # not a leaf, so in-place layers (ReLU(inplace=True)) work as in a chain
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
        seconds = time.perf_counter() - start if timed else math.nan
        profiles.append(
            LayerProfile(
                index,
                type(layer).__name__,
                _nbytes(y),
                sum(saved.values()),
                seconds,
                bool(getattr(layer, "inplace", False)),
            )
        )
        leaf = y.detach().requires_grad_()
    return profiles
