"""Where a training step's memory goes, over the step: a timeline, and its picture.

``nvidia-smi`` shows what the caching allocator reserved, which does not shrink, and PyTorch
deprecated its own category timeline (the profiler's ``export_memory_timeline``). A timeline here
is the live tensor storage after every operator of one call, as :func:`revnets.measure_memory`
counts it, split into parameters, gradients, optimizer state, inputs and activations, the
activations by the top-level module whose forward allocated them (the rest, allocated in backward,
by the loss or by the optimizer, as ``backward and other``). Its peak is measure_memory's peak.
:func:`plot_timelines` draws several side by side on one scale: a reversible model beside its
``none`` baseline shows what reconstruction saves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from revnets.facts import MiB
from revnets.memory.measure import (
    ACTIVATIONS,
    GRADIENTS,
    INPUTS,
    OPTIMIZER,
    PARAMETERS,
    MemoryReport,
    MemoryTracker,
    measure_call,
)
from revnets.memory.predict import predict_call

__all__ = [
    "MemoryTimeline",
    "cuda_allocator_history",
    "plot_timelines",
    "predict_timeline",
    "record_timeline",
]

OTHER = "backward and other"


@dataclass(frozen=True)
class MemoryTimeline:
    """Live bytes after each operator of one call (``series[layer][tick]``), by layer: the
    model-state categories, inputs, then ``activations: <module>`` for each top-level module and
    ``activations: backward and other``."""

    series: dict[str, list[int]]
    device: str

    @property
    def total(self) -> list[int]:
        return [sum(values) for values in zip(*self.series.values())]

    @property
    def peak_bytes(self) -> int:
        return max(self.total, default=0)

    @property
    def peak_tick(self) -> int:
        total = self.total
        return total.index(max(total)) if total else 0


def record_timeline(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[MemoryReport, MemoryTimeline]:
    """Run ``fn(*args, **kwargs)`` once, as :func:`revnets.measure_memory` does, and return its
    report with the timeline of the call."""
    trackers: list[MemoryTracker] = []
    report = measure_call(fn, args, kwargs, watch=_watching(trackers))
    return report, _timeline(trackers[0])


def predict_timeline(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[MemoryReport, MemoryTimeline]:
    """The timeline of ``fn(*args, **kwargs)`` on fake tensors, as
    :func:`revnets.predict_memory` predicts its memory: nothing is computed."""
    trackers: list[MemoryTracker] = []
    report = predict_call(fn, args, kwargs, watch=_watching(trackers))
    return report, _timeline(trackers[0])


def _watching(trackers: list[MemoryTracker]):
    @contextlib.contextmanager
    def watch(tracker: MemoryTracker, owners: list) -> Iterator[None]:
        trackers.append(tracker)
        model = next((o for o in owners if isinstance(o, nn.Module)), None)
        handles = []
        for name, child in _top_level(model):
            handles.append(child.register_forward_pre_hook(_enter(tracker, name)))
            handles.append(child.register_forward_hook(_leave(tracker), always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    return watch


def _top_level(model: nn.Module | None) -> list[tuple[str, nn.Module]]:
    """The modules activations are attributed to: the model's children, or the parts a model
    names with ``timeline_parts()`` where its training step calls others (a planned model runs
    its plan's steps: hooks on its own children would not fire there, and it refuses them)."""
    # Wrappers (DistributedDataParallel, torch.compile) hold the model as one child.
    while model is not None and len(model._modules) == 1 and hasattr(model, "module"):
        model = model.module
    while model is not None and hasattr(model, "_orig_mod"):
        model = model._orig_mod
    parts = getattr(model, "timeline_parts", None)
    if callable(parts):
        return list(parts())
    return [] if model is None else list(model.named_children())


def _enter(tracker: MemoryTracker, name: str):
    def hook(module: nn.Module, args: Any) -> None:
        tracker.module = name

    return hook


def _leave(tracker: MemoryTracker):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        tracker.module = None

    return hook


def _timeline(tracker: MemoryTracker) -> MemoryTimeline:
    ticks = tracker.clock + 1
    layers = [PARAMETERS, GRADIENTS, OPTIMIZER, INPUTS]
    changes: dict[str, list[int]] = {}
    for record in tracker.records():
        label = tracker.label(record)
        if label == ACTIVATIONS:
            label = f"{ACTIVATIONS}: {record.module or OTHER}"
        if label not in changes:
            changes[label] = [0] * (ticks + 1)
            if label not in layers:
                layers.append(label)
        # As in MemoryTracker.peak: a tick's frees happen after its allocations.
        changes[label][record.allocated] += record.nbytes
        if record.freed is not None:
            changes[label][record.freed + 1] -= record.nbytes
    series = {}
    for label in layers:
        live, values = 0, []
        for change in changes.get(label, [0] * (ticks + 1))[:ticks]:
            live += change
            values.append(live)
        series[label] = values
    return MemoryTimeline(series, str(tracker.device))


def plot_timelines(
    timelines: dict[str, MemoryTimeline], path: str | Path, title: str = ""
) -> Path:
    """Draw ``timelines`` side by side on one memory scale, one panel each (keyed by its
    caption), layers stacked, and write a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for t in timelines.values() for label in t.series))
    colors = dict(zip(labels, _palette(len(labels))))
    figure, axes = plt.subplots(
        1, len(timelines), figsize=(6 * len(timelines), 4.5), sharey=True, squeeze=False
    )
    for axis, (caption, timeline) in zip(axes[0], timelines.items()):
        present = [label for label in labels if label in timeline.series]
        values = [[v / MiB for v in timeline.series[label]] for label in present]
        axis.stackplot(range(len(values[0])), values, labels=present,
                       colors=[colors[label] for label in present], linewidth=0)
        axis.axhline(timeline.peak_bytes / MiB, color="black", linewidth=0.8, linestyle="--")
        axis.set_title(f"{caption}: peak {timeline.peak_bytes / MiB:.1f} MiB")
        axis.set_xlabel("operator")
    axes[0][0].set_ylabel(f"live tensor memory (MiB, {next(iter(timelines.values())).device})")
    handles, names = axes[0][-1].get_legend_handles_labels()
    figure.legend(handles[::-1], names[::-1], loc="center left", bbox_to_anchor=(1.0, 0.5),
                  fontsize="small")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def _palette(n: int) -> list[Any]:
    import matplotlib

    fixed = ["#4c72b0", "#dd8452", "#55a868", "#8c8c8c"]  # parameters, gradients, optimizer, inputs
    cmap = matplotlib.colormaps["tab20"]
    return fixed[:n] + [cmap(i % 20) for i in range(max(n - len(fixed), 0))]


@contextlib.contextmanager
def cuda_allocator_history(path: str | Path | None) -> Iterator[None]:
    """Within this context CUDA's caching allocator records its own history, saved at the end to
    ``path`` as a snapshot for https://pytorch.org/memory_viz (allocations with their stacks and
    the allocator's segments, beside the timeline's view). Does nothing without CUDA or path."""
    if path is None or not torch.cuda.is_available():
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
