"""auto-planned checkpoints on torchvision models, beside Feng & Huang's published cuts.

For each model (untrained weights; nothing is downloaded) the torch.fx graph is turned into a chain
of its nodes passing the live values (`revnets.planning.as_graph_chain`, so cuts may fall inside
blocks); the optimal plans of `optimal_plan` over a range of budgets and Chen's sqrt(n) and
budgeted plans are proposed and the one with the smallest activation peak (predicted on the meta
device at a small batch) is kept. Its cut
of activation memory (peak above parameters and gradients, one forward + backward) is predicted
at Feng & Huang's input shapes on the meta device, and its step-time overhead measured on this CPU
at a small batch, interleaved with the unplanned model.

    python benchmarks/planning_torchvision.py   # writes results/planning_torchvision-*.{md,csv}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torchvision
from torch import nn

import revnets
from revnets.checkpoint import checkpoint_segments
from revnets.planning import NotAChainError, as_graph_chain, candidate_plans, profile_chain

from common import RESULTS, provenance, results_stem, write_csv, write_markdown

MiB = 2**20
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
    model(x).float().sum().backward()


def activation_peak(model: nn.Module, batch: int, size: int) -> int:
    x = torch.empty(batch, 3, size, size, device="meta")
    return revnets.predict_memory(step, model.train(), x).above_model_state_bytes


def timed(models: dict[str, nn.Module], x: torch.Tensor, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in models}
    for model in models.values():
        step(model, x)
    for _ in range(repeats):
        for key, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(model, x)
            times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search-batch", type=int, default=2)
    parser.add_argument("--time-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for name, batch, size, regular_mb, optimal_mb, cut, overhead in MODELS:
        row = {"model": name, "input": f"{batch}x3x{size}x{size}", "published_regular_mb":
               regular_mb, "published_optimal_mb": optimal_mb, "published_cut_pct": cut,
               "published_overhead_pct": overhead}
        model = build(name)
        try:
            chain = as_graph_chain(model)
        except (NotAChainError, torch.fx.proxy.TraceError) as error:
            print(f"  {name}: {error}")
            rows.append({**row, "note": f"not planned: {str(error)[:120]}"})
            continue
        meta_chain = as_graph_chain(build(name).to("meta"))
        profiles = profile_chain(list(meta_chain), torch.empty(args.search_batch, 3, size, size,
                                                               device="meta"))
        plans = candidate_plans(profiles)
        peaks = [activation_peak(checkpoint_segments(meta_chain, p), args.search_batch, size)
                 for p in plans]
        best = plans[min(range(len(plans)), key=peaks.__getitem__)]
        regular = activation_peak(meta_chain, batch, size)
        ours = activation_peak(checkpoint_segments(meta_chain, best), batch, size)
        x = torch.randn(args.time_batch, 3, size, size)
        times = timed({"plain": chain, "planned": checkpoint_segments(chain, best)}, x,
                      args.repeats)
        row.update({
            "steps": len(chain),
            "segments": len(best),
            "regular_mib": round(regular / MiB, 1),
            "planned_mib": round(ours / MiB, 1),
            "cut_pct": round(100 * (1 - ours / regular), 1),
            "overhead_pct": round(100 * (times["planned"] / times["plain"] - 1), 1),
            "note": "",
        })
        rows.append(row)
        print("  ", row, flush=True)

    stem = results_stem("planning_torchvision")
    fields = ["model", "input", "steps", "segments", "regular_mib", "planned_mib", "cut_pct",
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
        "same tensors as on a real device). The plan is the lowest-memory one among the optimal "
        "one-level plans (dynamic programming over a range of budgets) and Chen's sqrt(n) and "
        "budgeted plans on the chain of the model's graph nodes (chosen at batch "
        f"{args.search_batch}). "
        f"Overhead: median of {args.repeats} interleaved steps at batch {args.time_batch} on this "
        "CPU. Feng & Huang (CVPR 2021) figures are **published** (CUDA allocator peak, their "
        "optimal checkpoints on the full graph).",
        "",
        "| model | input | chain steps | segments | regular (MiB) | planned (MiB) | cut | "
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
            f"| {r['model']} | {r['input']} | {r['steps']} | {r['segments']} | "
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
        "bottlenecks and dense blocks as in Feng & Huang. Plans are one-level (each node is "
        "recomputed at most once).",
    ]
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main(sys.argv[1:])
