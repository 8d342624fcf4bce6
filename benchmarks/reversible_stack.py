"""A reversible stack against its ordinary-autograd twin: memory, speed and gradient accuracy.

The stack is the one of the core acceptance test: N additive blocks with f = g =
conv3x3(64)-BatchNorm-ReLU on a 128-channel 32x32 input (64 channels per half), batch 32, followed
by a small classification head (global average pooling, linear, cross-entropy). A training step is
forward, backward and an SGD step.

    python benchmarks/reversible_stack.py            # full run, writes results/
    python benchmarks/reversible_stack.py --quick    # the demo the README names: small, prints only
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

import revnets
from revnets.checkpoint import segment_bounds
from revnets.plan.switchable import SwitchableMemory

from common import (
    RESULTS,
    MiB,
    interleaved_times,
    provenance,
    ratio_summary,
    results_stem,
    train_step,
    write_csv,
    write_markdown,
)

BLOCKS_FORWARD = "blocks_forward"  # the blocks' forward alone, without a graph
# The memory plans compared, as a user writes them (timm keyword, Hydra, command line).
PLANS = ["none", "checkpoint", "reversible", "reversible(store_last_blocks=1)",
         "reversible(store_last_blocks=2)", "reversible(store_last_blocks=3)"]


def unit(channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
    )


class Stack(SwitchableMemory, nn.Module):
    """Reversible blocks plus a head, following a memory plan the way the zoo's models do."""

    family = "reversible stack"

    def __init__(self, depth: int, half: int, coupling: str = "additive", classes: int = 10):
        super().__init__()
        width = 2 * half if coupling == "affine" else half
        self.blocks = revnets.ReversibleSequence(
            revnets.ReversibleBlock(
                _transform(half, width, coupling), _transform(half, width, coupling), coupling
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(2 * half, classes)
        self.set_memory("reversible")

    def apply_memory(self, plan: revnets.MemoryPlan) -> None:
        self.blocks.set_memory(plan.stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._run_blocks(x).mean((2, 3)))


def recomputed_share(plan: revnets.MemoryPlan, depth: int) -> float:
    """The share of the blocks whose forward runs again in backward under ``plan``."""
    stages = plan.stages
    if isinstance(stages, revnets.Reconstruct):
        return max(0.0, 1 - stages.store_last_blocks / depth)
    if isinstance(stages, revnets.Checkpoint):  # every segment but the last
        start, stop = segment_bounds(depth, stages.segments_for(depth))[-1]
        return 1 - (stop - start) / depth
    return 0.0


def _transform(half: int, width: int, coupling: str) -> nn.Module:
    if coupling == "additive":
        return unit(half)
    return nn.Sequential(nn.Conv2d(half, width, 3, padding=1), nn.Tanh())


def make(depth: int, half: int, batch: int, size: int, strategy: str, seed: int = 0):
    torch.manual_seed(seed)
    model = Stack(depth, half)
    model.set_memory(strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 2 * half, size, size)
    target = torch.randint(0, 10, (batch,))
    train_step(model, optimizer, x, target)  # warm-up: optimizer state exists from now on
    return model, optimizer, x, target


def memory_table(depths, half, batch, size, strategies) -> list[dict]:
    rows = []
    for depth in depths:
        for strategy in strategies:
            model, optimizer, x, target = make(depth, half, batch, size, strategy)
            report = revnets.measure_memory(train_step, model, optimizer, x, target)
            rows.append(
                {
                    "depth": depth,
                    "strategy": strategy,
                    "peak_above_model_state_mib": round(report.above_model_state_bytes / MiB, 1),
                    "peak_total_mib": round(report.peak_bytes / MiB, 1),
                }
            )
            print(f"  memory  depth {depth:3d}  {strategy:<23} "
                  f"{rows[-1]['peak_above_model_state_mib']:8.1f} MiB above model state")
    return rows


def speed_table(
    depth, half, batch, size, strategies, repeats, trial, condition: str
) -> list[dict]:
    """Step-time ratios to `none` over all repetitions, and the best and worst median ratio over
    consecutive trials of ``trial`` repetitions (each one a complete measurement on its own)."""
    setups = {s: make(depth, half, batch, size, s) for s in strategies}
    # The same weights for every strategy, so only the memory strategy differs.
    reference = setups["none"][0].state_dict()
    for model, *_ in setups.values():
        model.load_state_dict(reference)
    steps = {s: functools.partial(train_step, *setup) for s, setup in setups.items()}
    # What recomputation costs at least: one more forward of the blocks, timed alongside.
    forward_model, _, forward_x, _ = make(depth, half, batch, size, "none")
    forward_model.load_state_dict(reference)
    steps[BLOCKS_FORWARD] = functools.partial(
        forward_without_graph, forward_model.blocks, forward_x
    )
    timings = interleaved_times(steps, repeats)
    times = timings.seconds
    forward_share = statistics.median(times[BLOCKS_FORWARD]) / statistics.median(times["none"])
    shares = {s: recomputed_share(revnets.parse_memory_plan(s), depth) for s in strategies}
    trials = [slice(start, start + trial) for start in range(0, repeats - trial + 1, trial)]
    rows = []
    for strategy in strategies:
        trial_ratios = [
            ratio_summary(times[strategy][t], times["none"][t])["ratio"] for t in trials
        ]
        rows.append(
            {
                "condition": condition,
                "strategy": strategy,
                **ratio_summary(times[strategy], times["none"]),
                "trials": len(trials),
                "trial_ratio_best": min(trial_ratios),
                "trial_ratio_worst": max(trial_ratios),
                "page_faults_per_step": int(statistics.median(timings.page_faults[strategy])),
                "recompute_floor": round(1 + shares[strategy] * forward_share, 3),
            }
        )
        print(f"  speed   {condition:<6} {strategy:<23} {rows[-1]['ratio']:.3f}x (paired min "
              f"{rows[-1]['ratio_min']}, max {rows[-1]['ratio_max']}; trials of {trial}: "
              f"{min(trial_ratios):.3f}-{max(trial_ratios):.3f}; "
              f"{rows[-1]['page_faults_per_step']} page faults per step; floor "
              f"{rows[-1]['recompute_floor']})")
    return rows


def forward_without_graph(blocks: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        blocks(x)


def _gradients(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    inp = x.clone().requires_grad_()
    F.cross_entropy(model(inp), target).backward()
    return [inp.grad, *(p.grad for p in model.parameters())]


def _relative_errors(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    """Norm of the difference over the norm of the reference, per gradient tensor."""
    return [
        ((g.double() - r.double()).norm() / r.double().norm()).item()
        for g, r in zip(grads, reference)
        if r.norm() > 0
    ]


def gradient_errors(
    depth: int,
    coupling: str,
    dtype: torch.dtype,
    keep_input_every: int | None = None,
    half: int = 8,
) -> dict:
    """Relative gradient errors (input and every parameter) of the reversible stack in ``dtype``.

    The reference is ordinary autograd on the same weights in float64. In float64 that is the
    exactness check; in lower precision ordinary autograd is measured against it too, so that
    the error reconstruction adds is told apart from the round-off every backprop has.
    ``keep_input_every`` is passed on to the reversible sequence. ``torch.bfloat16`` means
    float32 weights under ``torch.autocast("cpu", torch.bfloat16)``, as mixed precision runs.
    """
    torch.manual_seed(depth)
    reference = Stack(depth, half, coupling).double()
    reference.set_memory("none")
    x = torch.randn(4, 2 * half, 8, 8, dtype=torch.float64)
    target = torch.randint(0, 10, (4,))
    exact = _gradients(reference, x, target)
    errors = {}
    autocast = dtype == torch.bfloat16
    weights = torch.float32 if autocast else dtype
    for strategy in ("none", "reversible"):
        model = Stack(depth, half, coupling).to(weights)
        model.load_state_dict(reference.state_dict())
        kept = f"(keep_input_every={keep_input_every})" if keep_input_every else ""
        model.set_memory(strategy + kept if strategy == "reversible" else strategy)
        if strategy == "none" and dtype == torch.float64:
            continue  # it is the reference
        with revnets.check_reconstruction() as drift, torch.autocast("cpu", enabled=autocast):
            errors[strategy] = _relative_errors(_gradients(model, x.to(weights), target), exact)
    reversible = errors["reversible"]
    return {
        "coupling": coupling,
        "dtype": "bfloat16 autocast" if autocast else str(dtype).replace("torch.", ""),
        "depth": depth,
        "keep_input_every": keep_input_every or "",
        "reversible_max": max(reversible),
        "reversible_median": statistics.median(reversible),
        "ordinary_max": max(errors["none"]) if "none" in errors else 0.0,
        "ordinary_median": statistics.median(errors["none"]) if "none" in errors else 0.0,
        "input_reconstruction_drift": drift.max_rel_error,
    }


def write_results(memory_rows, speed_rows, error_rows, config) -> None:
    stem = results_stem("reversible_stack", config["device"])
    for name, rows in [("memory", memory_rows), ("speed", speed_rows), ("gradients", error_rows)]:
        write_csv(RESULTS / f"{stem}-{name}.csv", rows)
    lines = [
        "# Reversible stack against its ordinary-autograd twin",
        "",
        provenance("reversible_stack.py", config["device"]),
        "",
        f"Stack: N additive blocks, f = g = conv3x3({config['half']})-BatchNorm-ReLU, input "
        f"{config['batch']}x{2 * config['half']}x{config['size']}x{config['size']}, then global "
        "average pooling, a linear head and cross-entropy. One training step = forward, backward, "
        "SGD (momentum 0.9). The columns are memory plans (`revnets.parse_memory_plan`), "
        "followed by the stack as by the zoo's models: `none` is ordinary autograd on the same "
        "blocks; `checkpoint` cuts the blocks into about sqrt(n) segments and checkpoints all "
        "but the last (non-reentrant torch.utils.checkpoint); `reversible` is "
        "`ReversibleSequence` as is, `reversible(store_last_blocks=k)` keeps the last k blocks' "
        "graphs from the forward pass instead of recomputing them in backward (less "
        "recomputation for k - 1 more blocks' activations, still flat in depth).",
        "",
        "## Peak memory of a training step above parameters, gradients and optimizer state (MiB)",
        "",
        "Counted as live tensor storage (revnets.measure_memory).",
        "",
        "| depth | " + " | ".join(config["strategies"]) + " |",
        "|---|" + "---|" * len(config["strategies"]),
    ]
    for depth in config["depths"]:
        cells = [
            f"{r['peak_above_model_state_mib']:.1f}"
            for s in config["strategies"]
            for r in memory_rows
            if r["depth"] == depth and r["strategy"] == s
        ]
        lines.append(f"| {depth} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Reference, measured on this machine type by the project (../shared/references.md, "
        "same stack, depth 8/16/32): plain 472/920/1816, revlib 96/96/97, RevTorch 114/117/121, "
        "MemCNN 130/132/137 MiB.",
        "",
        f"## Step time at depth {config['speed_depth']}, ratio to `none`",
        "",
        f"{config['repeats']} interleaved repetitions in one process (order rotated each round, "
        "garbage collector paused, one warm-up round). `ratio` is the median step time over the "
        "median of `none`; min and max are over the ratios of steps timed in the same round. The "
        f"repetitions are also cut into {config['repeats'] // config['trial']} consecutive trials "
        f"of {config['trial']}, each a complete measurement by the acceptance rule (median of at "
        "least 9 interleaved repetitions): best and worst trial ratio. This VM's speed drifts by "
        "10-20 % from step to step, which is what the spread shows.",
        "",
        "The same measurement is made twice: `fresh`, first thing in the process, as in a "
        "training run, and `warm`, after the memory table's multi-GiB steps have changed what the "
        "C allocator (glibc) keeps. Ordinary autograd allocates its activations anew every step; "
        "whether that costs page faults depends on the allocator's state (median count per step "
        "in the column). Both are shown; neither is picked.",
        "",
        "`recompute floor` is what the strategy must cost at least if everything but the "
        "recomputation were free: 1 + (the share of blocks it recomputes) x (a forward of the "
        "blocks without a graph, timed in the same rounds) / (an ordinary step). With f and g "
        "recomputed once each per block, a ratio below the floor is only possible where ordinary "
        "autograd pays for something the others do not, such as page faults (or by noise).",
        "",
        "| condition | strategy | median step (s) | ratio | min | max | best trial | worst trial "
        "| page faults per step | recompute floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in speed_rows:
        lines.append(
            f"| {r['condition']} | {r['strategy']} | {r['median_step_s']:.3f} | {r['ratio']:.3f} | "
            f"{r['ratio_min']:.3f} | {r['ratio_max']:.3f} | {r['trial_ratio_best']:.3f} | "
            f"{r['trial_ratio_worst']:.3f} | {r['page_faults_per_step']} | "
            f"{r['recompute_floor']:.3f} |"
        )
    lines += [
        "",
        "Reference ratios measured on this machine type (../shared/references.md): RevTorch "
        "1.27x, revlib 1.33x, torch checkpoint per block 1.27x, MemCNN 1.71x "
        "(benchmarks/peers.py compares them in one run).",
        "",
        "## Gradient error",
        "",
        "Relative error (norm of the difference over the norm) of the input gradient and of "
        "every parameter gradient, against ordinary autograd on the same weights in float64; "
        "largest and median over the gradient tensors. `ordinary` is plain autograd in the same "
        "dtype: the round-off any backprop has. `drift` is the largest reconstruction error of a "
        "block input (`revnets.check_reconstruction`), relative to that input's largest "
        "magnitude. 8-channel halves, batch 4, 8x8, so BatchNorm normalises over only 256 values "
        "per channel; the seed is the depth. The affine stack (conv3x3 + tanh, no normalisation, "
        "scales up to e^0.92 per block) is ill-conditioned with depth: where ordinary autograd's "
        "error equals the reversible one, the float32 forward itself has left the float64 one, "
        "and the row measures the stack, not the reconstruction. `kept every k`: "
        "`ReversibleSequence(keep_input_every=k)`, which keeps the true input of every k-th block "
        "so that reconstruction restarts from it (depth / k inputs stored).",
        "",
        "| coupling | dtype | depth | kept every k | reversible max | reversible median "
        "| ordinary max | ordinary median | drift |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in error_rows:
        if r["dtype"] == "float64":
            ordinary = "(reference) | (reference)"
        else:
            ordinary = f"{r['ordinary_max']:.2e} | {r['ordinary_median']:.2e}"
        lines.append(
            f"| {r['coupling']} | {r['dtype']} | {r['depth']} | {r['keep_input_every'] or '-'} | "
            f"{r['reversible_max']:.2e} | {r['reversible_median']:.2e} | {ordinary} | "
            f"{r['input_reconstruction_drift']:.2e} |"
        )
    write_markdown(RESULTS / f"{stem}.md", lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small demo, prints only")
    parser.add_argument("--repeats", type=int, default=27)
    parser.add_argument("--trial", type=int, default=9, help="repetitions per trial")
    args = parser.parse_args(argv)

    strategies = PLANS
    if args.quick:
        config = dict(depths=[4, 16], half=16, batch=8, size=16, speed_depth=8, repeats=5,
                      trial=5)
    else:
        config = dict(depths=[8, 16, 32, 64], half=64, batch=32, size=32, speed_depth=8,
                      repeats=args.repeats, trial=args.trial)
    config.update(
        strategies=strategies,
        device="cpu",
    )
    shape = (config["half"], config["batch"], config["size"])
    print(f"reversible stack, half={shape[0]} channels, batch {shape[1]}, {shape[2]}x{shape[2]}")
    speed_args = (config["speed_depth"], *shape, strategies, config["repeats"], config["trial"])
    # Timed twice: first in a fresh process, as a training run would be, then after the memory
    # runs have had the C allocator grow and keep a large heap (see write_results).
    speed_rows = speed_table(*speed_args, condition="fresh")
    memory_rows = memory_table(config["depths"], *shape, strategies)
    if not args.quick:
        speed_rows += speed_table(*speed_args, condition="warm")
    error_rows = []
    cases = [(c, torch.float64, 8, None) for c in ("additive", "affine")]
    if not args.quick:
        cases += [("additive", torch.float32, d, None) for d in (1, 4, 16, 64, 256)]
        cases += [("additive", torch.float32, 256, k) for k in (64, 16)]
        cases += [("additive", torch.bfloat16, d, None) for d in (4, 16, 64, 256)]
        cases += [("additive", torch.bfloat16, 256, 16)]
        cases += [("affine", torch.float32, d, None) for d in (4, 16, 64)]
    for coupling, dtype, depth, every in cases:
        row = gradient_errors(depth, coupling, dtype, every)
        error_rows.append(row)
        kept = f", kept every {every}" if every else ""
        print(f"  grads   {coupling:<8} {row['dtype']:<7}  depth {depth:3d}{kept}  relative error "
              f"{row['reversible_max']:.2e} (ordinary {row['ordinary_max']:.2e}, drift "
              f"{row['input_reconstruction_drift']:.2e})")
    if not args.quick:
        write_results(memory_rows, speed_rows, error_rows, config)


if __name__ == "__main__":
    main(sys.argv[1:])
