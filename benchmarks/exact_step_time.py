"""The cost of ``exact=True``: training-step time of the reversible stack with the default
arithmetic against the same stack with ``reversible(exact=true)``, interleaved in one run, in
float32 and under bfloat16 autocast.

The stack is reversible_stack.py's (additive blocks, f = g = conv3x3-BatchNorm-ReLU), here 16
blocks of 32 channels per half on 32x32 inputs, batch 16 by default. Both plans share the weights.

    python benchmarks/exact_step_time.py                # about a minute on 2 cores
    python benchmarks/exact_step_time.py --quick        # a check that it runs, printed only
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from common import (
    RESULTS,
    interleaved_times,
    provenance,
    ratio_summary,
    results_stem,
    train_step,
    write_csv,
    write_markdown,
)
from reversible_stack import Stack

# The default arithmetic, then exact=True (the sequence's own, NOTE [ Exact reversibility ]).
PLANS = {"reversible": False, "reversible, exact=True": True}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--half", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--quick", action="store_true", help="tiny and printed, nothing written")
    args = parser.parse_args(argv)
    if args.quick:
        args.depth, args.half, args.size, args.batch, args.repeats = 4, 8, 8, 2, 1
    torch.manual_seed(0)
    model = Stack(args.depth, args.half)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # small: the weights stay sane
    x = torch.randn(args.batch, 2 * args.half, args.size, args.size)
    target = torch.randint(0, 10, (args.batch,))

    def step(plan: str, dtype: torch.dtype | None):
        def run() -> None:
            model.blocks.exact = PLANS[plan]
            autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
            with autocast:
                train_step(model, optimizer, x, target)
        return run

    steps = {(plan, name): step(plan, dtype) for name, dtype in PRECISIONS.items()
             for plan in PLANS}
    timings = interleaved_times(steps, args.repeats)
    rows = []
    for name in PRECISIONS:
        baseline = timings.seconds[("reversible", name)]
        for plan in PLANS:
            rows.append({"precision": name, "plan": plan,
                         **ratio_summary(timings.seconds[(plan, name)], baseline)})
            print(rows[-1], flush=True)
    if args.quick:
        return
    stem = results_stem("exact_step_time", precision="fp32-bf16")
    write_csv(RESULTS / f"{stem}.csv", rows)
    lines = [
        "# Step time of exact=True against the default reversible step",
        "",
        provenance("exact_step_time.py").replace(", float32.", ", float32 and bfloat16 autocast."),
        "",
        f"Reversible stack, {args.depth} blocks, {args.half} channels per half, "
        f"{args.size}x{args.size}, batch {args.batch}; {args.repeats} interleaved steps each. "
        "ratio: median step time over the default plan's in the same precision; ratio_min / "
        "ratio_median / ratio_max: of steps timed in the same round.",
        "",
        "| precision | plan | median step s | ratio | ratio min | ratio median | ratio max |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['plan']} | {r['median_step_s']} | {r['ratio']} | "
            f"{r['ratio_min']} | {r['ratio_median']} | {r['ratio_max']} |"
        )
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main()
