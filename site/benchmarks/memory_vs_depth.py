"""Peak training memory against depth for the three memory strategies, on one set of weights.

A CIFAR RevNet (basic units, 32-32-64-128 channels) with n units per stage is trained one step at
batch 100, 32x32, under `none` (store everything), `checkpoint` (about sqrt(n) segments per stage)
and `reversible`. The peak above parameters, gradients and optimizer state is predicted on the meta
device for every depth, and measured on this CPU at a small batch for a few depths to show that
prediction and measurement agree. Expected growth: O(n), O(sqrt n) and O(1).

    pip install -e '.[bench]'                  # matplotlib, for the plot
    python benchmarks/memory_vs_depth.py       # writes results/memory_vs_depth-*.{csv,md,png}
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

import revnets
from revnets.models import ResidualNet

from common import (
    RESULTS,
    MiB,
    provenance,
    results_stem,
    train_step,
    write_csv,
    write_markdown,
)

STRATEGIES = ("none", "checkpoint", "reversible")


def build(units: int, strategy: str, device: str) -> ResidualNet:
    torch.manual_seed(0)
    with torch.device(device):
        return ResidualNet(units=(units,) * 3, channels=(32, 32, 64, 128), reversible=True,
                           memory=strategy)


def peak(units: int, strategy: str, batch: int, device: str) -> int:
    model = build(units, strategy, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    train_step(model, optimizer, x, y)  # optimizer state exists from here on
    return revnets.measure_memory(train_step, model, optimizer, x, y).above_model_state_bytes


def slope(depths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(depth): the exponent of the growth."""
    xs, ys = [math.log(d) for d in depths], [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--check-batch", type=int, default=4)
    parser.add_argument("--units", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--check-units", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args(argv)

    rows = []
    for units in args.units:
        depth = 4 * 3 * units + 2
        row = {"units_per_stage": units, "depth": depth}
        for strategy in STRATEGIES:
            row[f"{strategy}_mib"] = round(peak(units, strategy, args.batch, "meta") / MiB, 2)
        rows.append(row)
        print(row, flush=True)

    checks = []
    for units in args.check_units:
        for strategy in STRATEGIES:
            measured = peak(units, strategy, args.check_batch, "cpu")
            predicted = peak(units, strategy, args.check_batch, "meta")
            checks.append((units, strategy, measured, predicted))
            print(f"check n={units} {strategy}: measured {measured} B, predicted {predicted} B")

    depths = [r["depth"] for r in rows]
    slopes = {s: slope(depths, [r[f"{s}_mib"] for r in rows]) for s in STRATEGIES}
    tail = {s: slope(depths[-4:], [r[f"{s}_mib"] for r in rows[-4:]]) for s in STRATEGIES}
    print("log-log slopes (all depths / the four deepest):",
          {s: (round(slopes[s], 2), round(tail[s], 2)) for s in STRATEGIES})

    stem = results_stem("memory_vs_depth")
    write_csv(RESULTS / f"{stem}.csv", rows)
    lines = [
        "# Peak training memory against depth",
        "",
        provenance("memory_vs_depth.py")
        + f" Predicted on the meta device at batch {args.batch}, 32x32 (the meter counts the "
        f"same tensors as on CPU: checked at batch {args.check_batch} below). CIFAR RevNet, "
        "basic units, 32-32-64-128 "
        "channels, n units per stage, depth = 12 n + 2; peak of one SGD step above parameters, "
        "gradients and optimizer state, MiB.",
        "",
        "![memory vs depth](" + f"{stem}.png)",
        "",
        "| n | depth | none | checkpoint | reversible |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['units_per_stage']} | {r['depth']} | {r['none_mib']:.1f} | "
                     f"{r['checkpoint_mib']:.1f} | {r['reversible_mib']:.1f} |")
    lines += [
        "",
        "Growth exponent (least-squares slope of log memory against log depth), over all depths / "
        "over the four deepest: "
        + ", ".join(f"`{s}` {slopes[s]:.2f} / {tail[s]:.2f}" for s in STRATEGIES)
        + " (O(n) = 1, O(sqrt n) = 0.5, O(1) = 0).",
        "",
        f"Prediction against measurement on this CPU at batch {args.check_batch} (bytes):",
        "",
        "| n | strategy | measured | predicted |",
        "|---|---|---|---|",
        *[f"| {u} | {s} | {m} | {p} |" for u, s, m, p in checks],
    ]
    write_markdown(RESULTS / f"{stem}.md", lines)
    plot(rows, RESULTS / f"{stem}.png", args.batch)


def plot(rows: list[dict], path: Path, batch: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return
    fig, ax = plt.subplots(figsize=(6, 4.2))
    depths = [r["depth"] for r in rows]
    for strategy, marker in zip(STRATEGIES, "os^"):
        ax.loglog(depths, [r[f"{strategy}_mib"] for r in rows], marker=marker, label=strategy)
    ax.set_xlabel("depth (layers)")
    ax.set_ylabel("peak memory above model state (MiB)")
    ax.set_title(f"RevNet on CIFAR, batch {batch}, one SGD step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
