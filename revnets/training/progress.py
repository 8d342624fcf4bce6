"""What the trainer shows while it runs: a progress bar on a terminal, plain lines elsewhere.

A terminal gets a tqdm bar for training (loss, accuracy, samples/s, peak memory) and one for each
evaluation. Anything else (a CI log, a file, a pipe) gets one plain line per logging interval,
which reads well in a log and never fills it with carriage returns. Images/s counts training
steps only: evaluation, checkpoint writes and the first, measured step are not in it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["Progress", "Throughput"]


class Throughput:
    """Images per second over the training steps since the last reading."""

    def __init__(self) -> None:
        self.images = 0
        self.seconds = 0.0

    def add(self, images: int, seconds: float) -> None:
        self.images += images
        self.seconds += seconds

    def take(self) -> float | None:
        """Images/s since the last call (None if no step was timed), and start a new window."""
        rate = self.images / self.seconds if self.seconds > 0 else None
        self.images, self.seconds = 0, 0.0
        return rate


class Progress:
    """Training progress on ``stream`` (standard output by default), shown by the main process
    only: a bar if ``stream`` is a terminal, else plain lines."""

    def __init__(
        self, total_steps: int, start: int = 0, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.total_steps = total_steps
        self.interactive = enabled and self.stream.isatty()
        self.bar = None
        if self.interactive:
            self.bar = tqdm(total=total_steps, initial=start, desc="train", file=self.stream,
                            dynamic_ncols=True, leave=True)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, record: dict[str, Any]) -> None:
        """One logging interval's numbers: the bar's postfix, or a plain line."""
        if not self.enabled:
            return
        memory = f" | mem {record['peak_mib']:.1f} MiB" if "peak_mib" in record else ""
        rate = record["samples_per_s"]
        rate = "-" if rate is None else f"{rate:.0f}"  # "-": only the measured first step ran
        if self.bar is not None:
            postfix = {"loss": f"{record['loss']:.4f}", "acc": f"{record['accuracy']:.3f}",
                       "samples/s": rate}
            if "peak_mib" in record:
                postfix["mem"] = f"{record['peak_mib']:.1f} MiB"
            self.bar.set_postfix(postfix, refresh=True)
            return
        width = len(str(self.total_steps))
        print(
            f"step {step:>{width}}/{self.total_steps} | loss {record['loss']:.4f} | "
            f"acc {record['accuracy']:.3f} | {rate} samples/s{memory}",
            file=self.stream,
            flush=True,
        )

    def evaluation(self, batches: Iterable[Any], total: int | None = None) -> Iterator[Any]:
        """Iterate over the evaluation batches, with a bar of their own on a terminal."""
        if not self.interactive:
            yield from batches
            return
        with tqdm(batches, total=total, desc="eval", file=self.stream, leave=False,
                  dynamic_ncols=True) as bar:
            yield from bar

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
