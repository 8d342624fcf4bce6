"""What the trainer reports at the end: memory against the non-reversible baseline, speed,
quality."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from revnets.facts import MiB
from revnets.memory import MemoryReport, MemoryTimeline, plot_timelines, predict_timeline
from revnets.plan import PRESETS, MemoryPlan
from revnets.training.factory import create_model
from revnets.training.optim import build_optimizer
from revnets.training.settings import Settings

__all__ = ["MemoryComparison", "predict_baseline", "summary_table", "write_timelines"]



@dataclass(frozen=True)
class MemoryComparison:
    report: MemoryReport  # the run's own first step, measured
    baseline: MemoryReport  # the same model with strategy "none", predicted on the meta device
    timeline: MemoryTimeline | None = None  # of the measured step
    baseline_timeline: MemoryTimeline | None = None
    rank_peaks: tuple[int, ...] = ()  # under torchrun: every rank's measured peak
    unsharded: MemoryReport | None = None  # under FSDP: one rank's step without sharding

    @property
    def ratio(self) -> float:
        return self.baseline.peak_bytes / max(self.report.peak_bytes, 1)


def predict_baseline(
    settings: Settings,
    step: Callable[..., Any],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    tokens: bool,
    plan: MemoryPlan = PRESETS["none"],
) -> tuple[MemoryReport, MemoryTimeline]:
    """Peak memory of one step of the same model in one process on a batch shaped as
    ``inputs`` and ``targets`` (images, or ``tokens``), on meta tensors, and its timeline: with
    every memory saving off, or under ``plan``."""
    model = create_model(settings.model, settings.data.num_classes, "meta", memory=plan,
                         image_size=None if tokens else inputs.shape[-1], tokens=tokens)
    optimizer = build_optimizer(settings.optim, model)
    micro = inputs.shape[0] // settings.trainer.accumulate
    x = torch.empty(micro, *inputs.shape[1:], dtype=inputs.dtype, device="meta")
    y = torch.empty(micro, *targets.shape[1:], dtype=torch.long, device="meta")
    return predict_timeline(step, model, optimizer, x, y)


def write_timelines(
    settings: Settings, plan: str, memory: MemoryComparison, path: Path
) -> Path:
    """The measured step's timeline beside the baseline's, on one scale, as a PNG; ``plan``
    names the run's memory plan."""
    return plot_timelines(
        {
            f"{settings.model.name} ({plan}), measured": memory.timeline,
            f"{settings.model.name} (none), predicted": memory.baseline_timeline,
        },
        path,
        title=f"memory of one training step, batch {settings.data.batch_size}",
    )


def summary_table(
    settings: Settings,
    plan: str,
    memory: MemoryComparison | None,
    step_time: float,
    result: dict[str, Any],
) -> str:
    header = ["model", "memory", "peak MiB", "baseline (none) MiB", "ratio", "step ms",
              "val loss", "val acc"]
    if memory is not None:
        peak = f"{memory.report.peak_bytes / MiB:.1f}"
        base = f"{memory.baseline.peak_bytes / MiB:.1f}"
        ratio = f"{memory.ratio:.2f}x"
    else:
        peak = base = ratio = "-"
    row = [
        settings.model.name,
        plan,
        peak,
        base,
        ratio,
        "-" if math.isnan(step_time) else f"{1000 * step_time:.0f}",
        f"{result['val_loss']:.4f}",
        f"{result['val_accuracy']:.3f}",
    ]
    widths = [max(len(h), len(c)) for h, c in zip(header, row)]
    lines = [
        " | ".join(h.ljust(w) for h, w in zip(header, widths)),
        "-+-".join("-" * w for w in widths),
        " | ".join(c.ljust(w) for c, w in zip(row, widths)),
    ]
    if memory is not None:
        lines.append(
            f"peak = all live tensor memory of one training step on {memory.report.device} "
            f"({memory.report.method}); activations above model state: "
            f"{memory.report.above_model_state_bytes / MiB:.1f} MiB vs baseline "
            f"{memory.baseline.above_model_state_bytes / MiB:.1f} MiB (baseline predicted on the "
            "meta device" + (", in float32" if settings.trainer.precision != "fp32" else "")
            + ")"
        )
        if memory.rank_peaks:
            peaks = ", ".join(f"rank {r}: {b / MiB:.1f}" for r, b in enumerate(memory.rank_peaks))
            lines.append(f"peak per rank ({settings.trainer.distributed}), MiB: {peaks}")
        if memory.unsharded is not None:
            saved = memory.unsharded.peak_bytes - max(memory.rank_peaks)
            # Negative for small models: FSDP's gathered copies and communication buffers
            # outweigh what the shards save.
            lines.append(
                f"without sharding one rank's step would peak at "
                f"{memory.unsharded.peak_bytes / MiB:.1f} MiB (predicted on the meta device): "
                f"sharding {'saved' if saved >= 0 else 'added'} {abs(saved) / MiB:.1f} MiB per "
                "rank"
            )
    return "\n".join(lines)
