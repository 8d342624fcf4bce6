"""The plan auto_checkpoint prints for a hand-built model with reversible stages (see
docs/checkpointing.md).

A stem, a reversible stage of 8 blocks at 32x32, a strided transition, a second reversible stage at
16x16 and a linear head; batch 64, SGD with momentum, a 90 MiB budget that reconstructing alone
does not meet.

    python benchmarks/plan_example.py   # writes results/plan_example-cpu-pt<ver>-fp32.md
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

import revnets

from common import RESULTS, MiB, provenance, results_stem, write_markdown

BUDGET = 90 * MiB


def half(channels: int) -> nn.Module:
    return nn.Sequential(
        nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False)
    )


def stage(channels: int, blocks: int) -> revnets.ReversibleSequence:
    return revnets.ReversibleSequence(
        revnets.ReversibleBlock(half(channels), half(channels)) for _ in range(blocks)
    )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        self.stage1 = stage(32, 8)  # 64 channels: two streams of 32
        self.down = nn.Sequential(
            nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU()
        )
        self.stage2 = stage(64, 8)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main(argv: list[str] | None = None) -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(64, 3, 32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    planned = revnets.auto_checkpoint(model, x, budget=BUDGET, optimizer=optimizer)
    table = str(planned.memory_plan)
    print(table)
    write_markdown(RESULTS / f"{results_stem('plan_example')}.md", [
        "# A plan auto_checkpoint makes for a hand-built model with reversible stages",
        "",
        provenance("plan_example.py") + " Recompute times measured on this CPU.",
        "",
        "```",
        table,
        "```",
    ])


if __name__ == "__main__":
    main(sys.argv[1:])
