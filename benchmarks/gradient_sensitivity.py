"""How far a zoo model's float32 gradient moves when its input moves by one float32 rounding.

The scale against which compile_speed's gradient columns are read: two float32 runs that round
differently (inductor's fused kernels, eager's) cannot be expected to agree better than one eager
run agrees with itself on an input perturbed by float32's own round-off. For each model and plan,
one training step's gradients (same weights, batch, seed) of

- eager float32 on the batch ``x``,
- eager float32 on ``x * (1 + 2**-23)`` (every entry moved by about one unit in its last place),
- eager float64 on ``x``,

compared as compile_speed compares them (``gradient_error``: worst parameter, relative to its
largest gradient entry, floored at 1e-4 of the model's largest).

    python benchmarks/gradient_sensitivity.py
    python benchmarks/gradient_sensitivity.py --models revnet38,revnet110 --plans none
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from compile_speed import INPUT, build, gradient_error
from torch import nn

from common import RESULTS, provenance, results_stem, write_csv, write_markdown

DEFAULT_MODELS = ("revnet38", "resnet110", "revnet110", "revnet164", "irevnet163")


def gradients(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> nn.Module:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    F.cross_entropy(model(x), target).backward()
    return model


def measure(name: str, plan: str, batch: int) -> dict | None:
    model = build(name, plan)
    if model is None:
        return None
    generator = torch.Generator().manual_seed(2)
    size = INPUT.get(name, 32)
    x = torch.randn(batch, 3, size, size, generator=generator)
    target = torch.randint(0, 10, (batch,), generator=generator)
    exact = gradients(copy.deepcopy(model).double(), x.double(), target)
    moved = gradients(copy.deepcopy(model), x * (1 + 2**-23), target)
    eager = gradients(model, x, target)
    return {
        "model": name,
        "plan": plan,
        "batch": batch,
        "eager_vs_float64": float(f"{gradient_error(eager, exact):.2e}"),
        "moved_input_vs_eager": float(f"{gradient_error(moved, eager):.2e}"),
        "moved_input_vs_float64": float(f"{gradient_error(moved, exact):.2e}"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--plans", default="none,checkpoint")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", default=None, help="results file stem (default: timm-style)")
    args = parser.parse_args(argv)
    rows = [row for name in args.models.split(",") for plan in args.plans.split(",")
            if (row := measure(name, plan, args.batch)) is not None]
    for row in rows:
        print(row, flush=True)
    stem = args.out or results_stem("gradient_sensitivity")
    write_csv(args.results / f"{stem}.csv", rows)
    command = " ".join(["gradient_sensitivity.py", *(sys.argv[1:] if argv is None else argv)])
    write_markdown(args.results / f"{stem}.md", [
        "# Float32 gradients: how far one rounding of the input moves them",
        "",
        provenance(command),
        "",
        "Each column: `gradient_error` as in compile_speed (worst parameter, relative to its "
        "largest gradient entry, floored at 1e-4 of the model's largest), one training step, "
        f"batch {args.batch}, same weights and seed. `moved input`: the batch times "
        "(1 + 2^-23), about one float32 rounding of every entry.",
        "",
        "| model | plan | eager vs float64 | moved input vs eager | moved input vs float64 |",
        "|---|---|---|---|---|",
        *[f"| {r['model']} | {r['plan']} | {r['eager_vs_float64']:.1e} | "
          f"{r['moved_input_vs_eager']:.1e} | {r['moved_input_vs_float64']:.1e} |" for r in rows],
    ])


if __name__ == "__main__":
    main(sys.argv[1:])
