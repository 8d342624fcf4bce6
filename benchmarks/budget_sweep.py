"""Does a smaller budget ever get a higher peak? auto_checkpoint over evenly spaced budgets.

For each model (random init, nothing downloaded), the budget a refusal of 1 byte names (the
least the planner reaches) and the unplanned step's measured peak bound a range; the planner is
asked for ``--steps + 1`` budgets evenly spaced over it, sizes only (``measure_time=False``: no
timings, so every run plans alike), and each plan's step is measured (``measure_memory``). A
pair of budgets where the smaller one's measured peak is the higher is a violation; so is a
measured peak above its budget, or one unlike the plan's predicted peak. With ``--measured``,
every budget of a model is planned on one measurement of its forward times
(``revnets.forward_times``: NOTE [ Times measured once ]), which also makes selective plans.

    python benchmarks/budget_sweep.py               # writes results/budget_sweep-*
    python benchmarks/budget_sweep.py --measured    # writes results/budget_sweep-*-measured*
    python benchmarks/budget_sweep.py --steps 8 --only chain    # coarser, two models
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import timm
import torch
import torchvision
from torch import nn

import revnets

from common import RESULTS, MiB, provenance, results_stem, write_csv, write_markdown


def conv_chain() -> tuple[nn.Module, torch.Tensor]:
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(12):
        layers += [nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(16 * 16 * 16, 10)), torch.randn(
        4, 3, 16, 16)


def tanh_chain() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(48))), \
        torch.randn(512, 64)


MODELS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "conv_chain_12": conv_chain,
    "tanh_chain_48": tanh_chain,
    "tv_resnet18": lambda: (torchvision.models.resnet18(num_classes=10),
                            torch.randn(16, 3, 96, 96)),
    "tv_mobilenet_v3_small": lambda: (torchvision.models.mobilenet_v3_small(num_classes=10),
                                      torch.randn(16, 3, 96, 96)),
    "timm_vit_tiny": lambda: (timm.create_model("vit_tiny_patch16_224", img_size=64,
                                                num_classes=10), torch.randn(8, 3, 64, 64)),
}


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def train_step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss(model(x)).backward()


def sweep(name: str, steps: int, measured: bool) -> list[dict]:
    torch.manual_seed(0)
    model, x = MODELS[name]()
    model.train()
    times = revnets.forward_times(model, x) if measured else False
    try:
        revnets.auto_checkpoint(model, x, 1, loss_fn=loss, measure_time=times)
    except revnets.PlanningError as refusal:
        floor = refusal.smallest_budget
    else:
        raise AssertionError(f"{name}: a budget of one byte planned")
    unplanned = revnets.measure_memory(train_step, model, x).peak_bytes
    rows = []
    for i in range(steps + 1):
        budget = floor + (unplanned - floor) * i // steps
        planned = revnets.auto_checkpoint(model, x, budget, loss_fn=loss, measure_time=times)
        measured = revnets.measure_memory(train_step, planned, x).peak_bytes
        rows.append({"model": name, "budget_b": budget, "measured_b": measured,
                     "predicted_b": planned.memory_plan.peak_bytes})
    for previous, row in zip([None, *rows], rows):
        row["ok"] = (row["measured_b"] == row["predicted_b"] <= row["budget_b"]
                     and (previous is None or previous["measured_b"] <= row["measured_b"]))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="budgets per model, less one")
    parser.add_argument("--only", default="", help="models whose name contains this")
    parser.add_argument("--measured", action="store_true",
                        help="plan each model's budgets on one measurement of its times")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where tables go")
    args = parser.parse_args(argv)
    command = " ".join(["budget_sweep.py", *(sys.argv[1:] if argv is None else argv)])
    rows: list[dict] = []
    summary = []
    for name in (name for name in MODELS if args.only in name):
        found = sweep(name, args.steps, args.measured)
        rows += found
        bad = [r for r in found if not r["ok"]]
        summary.append(f"| {name} | {found[0]['budget_b'] / MiB:.3f} | "
                       f"{found[-1]['budget_b'] / MiB:.3f} | {len(found)} | "
                       f"{len({r['measured_b'] for r in found})} | {len(bad)} |")
        print(summary[-1], flush=True)
    stem = (results_stem("budget_sweep") + ("-measured" if args.measured else "")
            + (f"-{args.only}" if args.only else ""))
    write_csv(args.results / f"{stem}.csv", rows)
    write_markdown(args.results / f"{stem}.md", [
        "# A smaller budget never gets a higher peak", "", provenance(command), "",
        "Per model: budgets evenly spaced from the one a refusal names (the least the planner "
        "reaches) to the unplanned step's measured peak, "
        + ("planned on one measurement of the model's forward times (`revnets.forward_times`, "
           "passed as `measure_time`)" if args.measured else
           "planned on sizes alone (`measure_time=False`)")
        + "; each plan's step measured with `measure_memory`. Violations: "
        "a budget whose measured peak is higher than the next larger budget's, a peak over its "
        "budget, or a measured peak unlike the predicted one. Full rows in the CSV file.", "",
        "| model | least budget (MiB) | unplanned peak (MiB) | budgets | distinct peaks | "
        "violations |", "|---|---|---|---|---|---|", *summary])


if __name__ == "__main__":
    main()
