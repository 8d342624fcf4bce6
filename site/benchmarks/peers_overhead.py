"""What each reversible-network library costs beyond the arithmetic: peers.py's stack on 2x2
images, where the convolutions are nearly free, so a step's time is mostly the libraries' own
Python (and the engine's bookkeeping).

    python benchmarks/peers_overhead.py   # writes results/peers_overhead-cpu-pt<ver>-fp32.{md,csv}

The difference to ordinary autograd (`none`) is what a library adds per step whatever the size
of the convolutions; on peers.py's real-size stack it is that many milliseconds of a step of
about half a second.
"""

from __future__ import annotations

import argparse
import functools

import torch
from peers import HALF, OURS, available, build, timed_step

from common import RESULTS, interleaved_times, provenance, results_stem, write_csv, write_markdown

PIXELS, BATCH = 2, 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--quick", action="store_true", help="5 repeats, printed only")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 5
    libraries = available([*OURS, "memcnn", "revlib", "revtorch"])
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 2 * HALF, PIXELS, PIXELS, generator=generator)
    target = torch.randint(0, 10, (BATCH,), generator=generator)
    models = {library: build(library, args.depth) for library in libraries}
    timings = interleaved_times(
        {library: functools.partial(timed_step, *models[library], x, target)
         for library in libraries},
        args.repeats, warmup=3,
    )
    median = {k: sorted(v)[len(v) // 2] for k, v in timings.seconds.items()}
    rows = [
        {"library": library, "step_ms": round(1e3 * median[library], 2),
         "over_none_ms": round(1e3 * (median[library] - median["none"]), 2),
         "per_block_ms": round(1e3 * (median[library] - median["none"]) / args.depth, 3)}
        for library in libraries
    ]
    for row in rows:
        print("  ", row, flush=True)
    if args.quick:
        return
    stem = results_stem("peers_overhead")
    write_csv(RESULTS / f"{stem}.csv", rows)
    lines = [
        "# Per-step cost of each reversible library beyond the arithmetic",
        "",
        provenance("peers_overhead.py"),
        "",
        f"peers.py's stack (f = g = conv3x3({HALF})-BatchNorm-ReLU, depth {args.depth}, the same "
        f"head, loss and SGD step) on {BATCH}x{2 * HALF}x{PIXELS}x{PIXELS} inputs, where the "
        "convolutions cost next to nothing: median of "
        f"{args.repeats} interleaved training steps (3 warm-up rounds). `over none`: the median "
        "step's excess over ordinary autograd on the same blocks, what the library adds to every "
        "step whatever the size of its convolutions.",
        "",
        "| library | step (ms) | over none (ms) | per block (ms) |",
        "|---|---|---|---|",
        *(f"| {r['library']} | {r['step_ms']:.2f} | {r['over_none_ms']:.2f} | "
          f"{r['per_block_ms']:.3f} |" for r in rows),
    ]
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main()
