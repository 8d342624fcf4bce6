"""The picture of where a training step's memory goes: RevNet-110 beside ResNet-110.

    python benchmarks/memory_timeline.py   # writes results/memory_timeline-cpu-pt<ver>-fp32.png

One SGD step (momentum 0.9) at batch 32 on CIFAR-shaped input, measured on this CPU as live tensor
storage after every operator (revnets.memory.record_timeline), split into parameters,
gradients, optimizer state, the batch, and activations by the top-level module whose forward made
them; both panels on one scale. The trainer draws the same picture for its first step.
"""

from __future__ import annotations

import sys

import timm
import torch

from revnets.memory import plot_timelines, record_timeline

from common import (
    RESULTS,
    results_stem,
    train_step,
)

BATCH = 32


def timeline(name: str):
    torch.manual_seed(0)
    model = timm.create_model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))
    train_step(model, optimizer, x, y)  # gradients and momentum exist, as in every later step
    report, line = record_timeline(train_step, model, optimizer, x, y)
    print(f"  {name} ({model.memory}): peak {report.peak_bytes / 2**20:.1f} MiB", flush=True)
    return f"{name} ({model.memory})", line


def main(argv: list[str] | None = None) -> None:
    timelines = dict(timeline(name) for name in ("revnet110", "resnet110"))
    path = RESULTS / f"{results_stem('memory_timeline')}.png"
    plot_timelines(timelines, path, title=f"one training step, batch {BATCH}, 32x32, CPU")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
