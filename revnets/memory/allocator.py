"""The allocator's own count of a step's peak: a second meter beside
:func:`revnets.measure_memory`, for code a dispatch-level meter cannot follow (``torch.compile``'s
generated kernels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["allocator_peak"]


def allocator_peak(step: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """The highest the allocator's live bytes rise above where they were when ``step`` started:
    on the CPU from torch.profiler's memory events (every allocation and free), on a GPU the
    caching allocator's peak. Unlike :func:`measure_memory`, which follows tensors at the
    dispatcher, it sees what compiled code allocates (Inductor's buffers), and runs ``step``
    without a dispatch mode, so that ``torch.compile`` compiles it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
