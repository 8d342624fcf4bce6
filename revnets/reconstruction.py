"""Opt-in check of how far reconstructed activations drift from the true ones.

Reconstruction is exact in exact arithmetic only: ``x1 = (x1 + f(x2)) - f(x2)`` loses the low bits
of ``x1`` wherever ``f(x2)`` is larger, and the error is carried into every block below. In float32
over a few dozen blocks this is harmless; in bfloat16, or over a thousand blocks, look before you
trust the gradients::

    with revnets.check_reconstruction() as report:
        loss = model(x).sum()
        loss.backward()
    print(report.table())

While the check is on, every reversible sequence also keeps the true input of each block (so memory
grows with depth again) and compares it with the reconstruction in backward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["BlockDrift", "ReconstructionReport", "check_reconstruction"]

_ACTIVE: contextvars.ContextVar[ReconstructionReport | None] = contextvars.ContextVar(
    "revnets_reconstruction_report", default=None
)


@dataclass(frozen=True)
class BlockDrift:
    """Reconstruction error of one block's input.

    ``reconstructions`` counts the inverse steps between the sequence output and this input (1 for
    the last block): round-off accumulates along them.
    """

    block: int
    reconstructions: int
    max_abs_error: float
    max_rel_error: float  # max_abs_error divided by the largest magnitude of the true input


@dataclass
class ReconstructionReport:
    drifts: list[BlockDrift] = field(default_factory=list)

    def record(
        self, block: int, num_blocks: int, true: tuple[Tensor, Tensor], x1: Tensor, x2: Tensor
    ) -> None:
        with torch.no_grad():
            abs_error = max(
                (x1.double() - true[0].double()).abs().max().item(),
                (x2.double() - true[1].double()).abs().max().item(),
            )
            scale = max(true[0].abs().max().item(), true[1].abs().max().item())
        rel_error = abs_error / scale if scale > 0 else abs_error
        self.drifts.append(BlockDrift(block, num_blocks - block, abs_error, rel_error))

    @property
    def max_rel_error(self) -> float:
        return max((d.max_rel_error for d in self.drifts), default=0.0)

    def table(self) -> str:
        lines = ["block  reconstructions  max abs error  max rel error"]
        for d in sorted(self.drifts, key=lambda d: d.reconstructions):
            lines.append(
                f"{d.block:5d}  {d.reconstructions:15d}  {d.max_abs_error:13.3e}  "
                f"{d.max_rel_error:13.3e}"
            )
        return "\n".join(lines)


@contextlib.contextmanager
def check_reconstruction() -> Iterator[ReconstructionReport]:
    """Collect per-block reconstruction errors of every reversible forward/backward run inside."""
    report = ReconstructionReport()
    token = _ACTIVE.set(report)
    try:
        yield report
    finally:
        _ACTIVE.reset(token)


def active_report() -> ReconstructionReport | None:
    return _ACTIVE.get()
