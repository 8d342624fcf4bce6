"""A tensor's identity, as every wing keys it.

# NOTE [ Tensor identity ]
# Two tensors share memory when they share a storage: ``storage_key`` is the storage's own
# address (``untyped_storage()._cdata``, also for fake and meta tensors), the one key by which
# the replay, the engine and the planner tell storages apart. Storage-less tensors (sparse,
# nested, a lazy module's parameter before its first call) have none. ``version_of`` reads the
# counter autograd checks for in-place writes; inference tensors and uninitialised parameters
# keep none. (A MemoryTracker keys the live storage objects it holds weak references to by the
# objects themselves: what it follows is when each object dies.)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils._pytree import tree_leaves

__all__ = ["MiB", "device_of", "nbytes", "storage_key", "storage_uses", "version_of"]

MiB = 2**20  # bytes: every size revnets reports in MiB


def storage_key(tensor: Tensor) -> int | None:
    """The storage ``tensor`` views (NOTE [ Tensor identity ]); None where it has none."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, ValueError):
        return None


def version_of(tensor: Tensor) -> int | None:
    """``tensor``'s version counter; None for inference tensors and uninitialised parameters."""
    if isinstance(tensor, UninitializedTensorMixin) or tensor.is_inference():
        return None
    return tensor._version


def storage_uses(tensor: Tensor) -> int:
    """How many tensors hold ``tensor``'s storage (all of it, as far as anyone can tell, for a
    storage-less tensor)."""
    try:
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return sys.maxsize


def device_of(value: Any, default: torch.device | None = None) -> torch.device | None:
    """The device of the first tensor among ``value``'s leaves (its lists, tuples, dicts and
    registered containers); ``default`` where it holds none."""
    return next((t.device for t in tree_leaves(value) if isinstance(t, Tensor)), default)


def nbytes(tensor: Tensor) -> int:
    """The bytes of ``tensor``'s elements (not of its storage)."""
    return tensor.numel() * tensor.element_size()
