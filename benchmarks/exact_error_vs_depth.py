"""Gradient error of the reversible path against ordinary autograd, by depth, with and without
``exact=True``, in float32 and under bfloat16 and float16 autocast.

The stack is the issue's: conv + GroupNorm + GELU couplings (4 channels per half, 4x4 pixels,
batch 2, CPU). For each depth and precision, the same sequence runs its reversible path
(``Reconstruct``) and ordinary autograd (``Store``) in the same arithmetic (``exact`` as given);
the error is the relative global norm of the difference of all gradients (input and parameters).
With ``exact=True`` they are equal (error 0, plotted at the floor).

    python benchmarks/exact_error_vs_depth.py              # 16..1000 blocks, ~30 min on 2 cores
    python benchmarks/exact_error_vs_depth.py --depths 16 64
    python benchmarks/exact_error_vs_depth.py --replot    # the plot again, from the CSV
    python benchmarks/exact_error_vs_depth.py --quick     # 8 blocks, printed only
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn

from revnets import Reconstruct, ReversibleBlock, ReversibleSequence, Store

from common import RESULTS, provenance, read_csv, results_stem, write_csv, write_markdown

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOOR = 1e-12  # where an error of exactly 0 is drawn on the log scale


def stack(depth: int, exact: bool, half: int = 4) -> ReversibleSequence:
    torch.manual_seed(0)

    def branch() -> nn.Module:
        return nn.Sequential(nn.Conv2d(half, half, 3, padding=1), nn.GroupNorm(2, half), nn.GELU())

    return ReversibleSequence(
        [ReversibleBlock(branch(), branch()) for _ in range(depth)], exact=exact
    )


def gradients(sequence: ReversibleSequence, x: torch.Tensor, dtype: torch.dtype | None):
    sequence.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    with autocast:
        y = sequence(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return torch.cat([x.grad.flatten().double()]
                     + [p.grad.flatten().double() for p in sequence.parameters()])


def error(depth: int, precision: str, exact: bool) -> float:
    sequence = stack(depth, exact)
    x = torch.randn(2, 8, 4, 4, generator=torch.Generator().manual_seed(1))
    dtype = PRECISIONS[precision]
    sequence.memory = Reconstruct()
    reversible = gradients(sequence, x, dtype)
    sequence.memory = Store()  # the same arithmetic, ordinary autograd
    stored = gradients(sequence, x, dtype)
    return ((reversible - stored).norm() / stored.norm()).item()


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = {"fp32": "tab:blue", "bf16": "tab:red", "fp16": "tab:green"}
    for precision in PRECISIONS:
        for exact in (False, True):
            points = [r for r in rows if r["precision"] == precision and r["exact"] == exact]
            if not points:
                continue
            ax.plot(
                [r["blocks"] for r in points],
                [max(r["relative_error"], FLOOR) for r in points],
                color=colors[precision], linestyle="-" if exact else "--",
                marker="o" if exact else "x",
                label=f"{precision}, exact=True" if exact else f"{precision}, default",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("blocks")
    ax.set_ylabel("gradient relative error vs ordinary autograd")
    ax.set_title(f"conv+GroupNorm+GELU stack, cpu ({FLOOR:g}: exactly 0)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[16, 64, 256, 1000])
    parser.add_argument("--replot", action="store_true", help="redraw the plot from the CSV")
    parser.add_argument("--quick", action="store_true", help="8 blocks, printed, nothing written")
    args = parser.parse_args(argv)
    stem = results_stem("exact_error_vs_depth", precision="fp32-bf16-fp16")
    if args.replot:
        rows = read_csv(RESULTS / f"{stem}.csv")
        for row in rows:
            row["exact"] = row["exact"] == "True"
        plot(rows, RESULTS / f"{stem}.png")
        return
    if args.quick:
        args.depths = [8]
    rows = []
    for depth in args.depths:
        for precision in PRECISIONS:
            for exact in (False, True):
                rows.append({"blocks": depth, "precision": precision, "exact": exact,
                             "relative_error": error(depth, precision, exact)})
                print(rows[-1], flush=True)
    if args.quick:
        return
    write_csv(RESULTS / f"{stem}.csv", rows)
    plot(rows, RESULTS / f"{stem}.png")
    lines = [
        "# Gradient error of the reversible path vs depth, with and without exact=True",
        "",
        provenance("exact_error_vs_depth.py").replace(", float32.", ", fp32 / bf16 / fp16 "
                                                       "autocast."),
        "",
        "Relative error (global norm) of all gradients against ordinary autograd of the same "
        "network in the same arithmetic (`memory=Store()`), conv + GroupNorm + GELU couplings. "
        f"Plot: `{stem}.png`.",
        "",
        "| blocks | " + " | ".join(f"{p} default | {p} exact" for p in PRECISIONS) + " |",
        "|---|" + "---|---|" * len(PRECISIONS),
    ]
    for depth in args.depths:
        cells = []
        for precision in PRECISIONS:
            for exact in (False, True):
                value = next(r["relative_error"] for r in rows if r["blocks"] == depth
                             and r["precision"] == precision and r["exact"] == exact)
                cells.append("0" if value == 0 else f"{value:.1e}")
        lines.append(f"| {depth} | " + " | ".join(cells) + " |")
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main()
