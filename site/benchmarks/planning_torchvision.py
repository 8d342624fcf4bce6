"""auto_checkpoint on torchvision models, at Feng & Huang's published memory cut.

For each model (untrained weights; nothing is downloaded) `revnets.auto_checkpoint` gets as budget
the parameters and gradients plus the share of activation memory that Feng & Huang's optimal
checkpoints keep (their published cut applied to our unplanned peak, both predicted on the meta
device at their input shapes); it plans on the chain of the model's graph nodes, so cuts may fall
inside blocks, and returns the plan recomputing the least that fits. Its activation memory is
predicted at those shapes, and its step-time overhead measured on this CPU at a small batch,
interleaved with the unplanned model.

    python benchmarks/planning_torchvision.py   # writes results/planning_torchvision-*.{md,csv}
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch
import torchvision
from torch import nn

import revnets
from revnets.planning import PlanningError

from common import (
    RESULTS,
    MiB,
    interleaved_times,
    provenance,
    results_stem,
    write_csv,
    write_markdown,
)

# model, batch, image size, then Feng & Huang (CVPR 2021), published: regular MB, optimal MB,
# cut %, time overhead %.
MODELS = [
    ("resnet50", 64, 224, 5323, 1973, 63, 31),
    ("resnet152", 16, 224, 2767, 526, 81, 37),
    ("densenet121", 32, 224, 4027, 898, 78, 34),
    ("densenet201", 16, 224, 3146, 474, 85, 53),
    ("inception_v3", 32, 300, 3074, 881, 71, 29),
]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "inception_v3":
        return torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False)
    return getattr(torchvision.models, name)(weights=None)


def step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).float().sum().backward()


def predicted(model: nn.Module, x: torch.Tensor) -> revnets.MemoryReport:
    return revnets.predict_memory(step, model.train(), x)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for name, batch, size, regular_mb, optimal_mb, cut, overhead in MODELS:
        row = {"model": name, "input": f"{batch}x3x{size}x{size}", "published_regular_mb":
               regular_mb, "published_optimal_mb": optimal_mb, "published_cut_pct": cut,
               "published_overhead_pct": overhead}
        model = build(name)
        x = torch.empty(batch, 3, size, size, device="meta")
        regular = predicted(model, x)
        # Parameters and all their gradients: late in backward every gradient is alive.
        state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
        budget = state + int((1 - cut / 100) * regular.above_model_state_bytes)
        try:
            planned = revnets.auto_checkpoint(model, x, budget, measure_time=False)
        except (PlanningError, TypeError) as error:
            print(f"  {name}: {error}")
            rows.append({**row, "note": f"not planned: {str(error)[:160]}"})
            continue
        ours = predicted(planned, x).above_model_state_bytes
        x = torch.randn(args.time_batch, 3, size, size)
        times = interleaved_times(
            {"plain": functools.partial(step, model, x),
             "planned": functools.partial(step, planned, x)},
            args.repeats,
        ).seconds
        times = {key: statistics.median(seconds) for key, seconds in times.items()}
        row.update({
            "steps": len(planned.plan),
            "checkpoints": sum(isinstance(m, revnets.Checkpointed) for m in planned.plan),
            "regular_mib": round(regular.above_model_state_bytes / MiB, 1),
            "planned_mib": round(ours / MiB, 1),
            "cut_pct": round(100 * (1 - ours / regular.above_model_state_bytes), 1),
            "overhead_pct": round(100 * (times["planned"] / times["plain"] - 1), 1),
            "note": "",
        })
        rows.append(row)
        print("  ", row, flush=True)

    stem = results_stem("planning_torchvision")
    fields = ["model", "input", "steps", "checkpoints", "regular_mib", "planned_mib", "cut_pct",
              "overhead_pct", "published_regular_mb", "published_optimal_mb", "published_cut_pct",
              "published_overhead_pct", "note"]
    write_csv(RESULTS / f"{stem}.csv", [{f: r.get(f, "") for f in fields} for r in rows])
    lines = [
        "# Automatic checkpoint plans on torchvision models",
        "",
        provenance("planning_torchvision.py"),
        "",
        "Activation memory = peak of one forward + backward above parameters and gradients, "
        "predicted on the meta device at Feng & Huang's input shapes (exact: the meter counts the "
        "same tensors as on a real device). The plan is `revnets.auto_checkpoint`'s at a budget of "
        "parameters and gradients plus the share of activations Feng & Huang's published optimal "
        "plan keeps: the least recomputation within their memory cut, on the chain of the "
        "model's graph nodes. "
        f"Overhead: median of {args.repeats} interleaved steps at batch {args.time_batch} on this "
        "CPU. Feng & Huang (CVPR 2021) figures are **published** (CUDA allocator peak, their "
        "optimal checkpoints on the full graph).",
        "",
        "| model | input | chain steps | checkpoints | regular (MiB) | planned (MiB) | cut | "
        "overhead | published regular / optimal (MB) | published cut | published overhead |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("note"):
            lines.append(f"| {r['model']} | {r['input']} | - | - | - | - | - | - | "
                         f"{r['published_regular_mb']} / {r['published_optimal_mb']} | "
                         f"{r['published_cut_pct']} % | {r['published_overhead_pct']} % |")
            continue
        lines.append(
            f"| {r['model']} | {r['input']} | {r['steps']} | {r['checkpoints']} | "
            f"{r['regular_mib']:.0f} | {r['planned_mib']:.0f} | {r['cut_pct']:.0f} % | "
            f"{r['overhead_pct']:.0f} % | {r['published_regular_mb']} / "
            f"{r['published_optimal_mb']} | {r['published_cut_pct']} % | "
            f"{r['published_overhead_pct']} % |"
        )
    notes = [r for r in rows if r.get("note")]
    if notes:
        lines += ["", *[f"- {r['model']}: {r['note']}" for r in notes]]
    lines += [
        "",
        "A chain step is one node of the torch.fx graph (convolution, BatchNorm, ReLU, "
        "concatenation...); a checkpoint keeps every value live at its cut, so cuts fall inside "
        "bottlenecks and dense blocks as in Feng & Huang; chain steps counts the steps the plan "
        "runs (checkpointed runs count one).",
    ]
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main(sys.argv[1:])
