"""The settings a forward ran under, re-entered for its replay (autocast), and those both runs
change (parametrizations' caches, NOTE [ Replay ], rule 5)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.utils import parametrize

__all__ = ["AutocastState", "uncached_parametrizations"]


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


@contextlib.contextmanager
def uncached_parametrizations() -> Iterator[None]:
    """Parametrizations' caches suspended (NOTE [ Replay ], rule 5)."""
    enabled = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled
