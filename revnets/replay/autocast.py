"""The autocast settings a forward ran under, re-entered for its replay."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["AutocastState"]


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings in force when a forward ran, to be re-entered for its replay."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        if not torch.amp.is_autocast_available(device_type):  # e.g. the meta device
            return cls(device_type, False, torch.float32, False)
        return cls(
            device_type=device_type,
            enabled=torch.is_autocast_enabled(device_type),
            dtype=torch.get_autocast_dtype(device_type),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )

    def __call__(self) -> contextlib.AbstractContextManager:
        if not torch.amp.is_autocast_available(self.device_type):
            return contextlib.nullcontext()
        if not self.enabled:
            if not torch.is_autocast_enabled(self.device_type):
                return contextlib.nullcontext()
            # Replay must also switch autocast *off* if backward happens to run inside one.
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(
            self.device_type, dtype=self.dtype, enabled=True, cache_enabled=self.cache_enabled
        )
