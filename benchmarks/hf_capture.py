"""Two routes to a plan for a Hugging Face model, measured side by side: checkpoints of the
modules its own forward calls (what `auto_checkpoint` does with a model torch.fx cannot trace),
and the graph planner on the graph `torch.export.export(strict=False)` captures of it.

    python benchmarks/hf_capture.py            # Llama and GPT-2, 4 layers, width 256
    python benchmarks/hf_capture.py --quick    # small sizes, to check that it runs

Each model: vocabulary 4096, batch 4 x 256 tokens, random weights, ``use_cache=False``, trained
with cross-entropy on its logits from its token ids alone (a graph is planned for one
positional input). For each route: the least budget it reaches (the budget its refusal of one
byte names), the seconds that took (export included), and at transformers' own checkpointing's
measured peak the plan's measured peak, predicted peak and step time, interleaved with
transformers' step. The exported graph is the model's code for these shapes and options, a
copy sharing its parameters; export's input-checking hooks are removed from it (the planner
refuses a model with hooks of its own, which a planned step would not run).
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hf_checkpointing import VOCAB, build

import revnets

from common import (
    RESULTS,
    MiB,
    interleaved_times,
    provenance,
    results_stem,
    write_csv,
    write_markdown,
)


def logits_of(out: Any) -> torch.Tensor:
    """The logits of the model's output, or of the exported graph's planned chain's (a dict)."""
    return out["logits"] if isinstance(out, dict) else out.logits


def exported(model: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    """The graph torch.export captures of ``model`` called on ``x``, as a module sharing its
    parameters, without export's input-checking hooks."""
    graph = torch.export.export(model, (x,), strict=False).module()
    graph._forward_pre_hooks.clear()
    graph._forward_hooks.clear()
    return graph


def least_budget(model: torch.nn.Module, x: torch.Tensor, loss_fn: Any) -> int:
    """The least budget ``auto_checkpoint`` reaches: the one its refusal of a byte names."""
    try:
        revnets.auto_checkpoint(model, x, 1, loss_fn=loss_fn, measure_time=False)
    except revnets.PlanningError as refusal:
        return refusal.smallest_budget
    raise AssertionError("a budget of one byte was met")


def measure(kind: str, quick: bool, repeats: int) -> list[dict]:
    layers, width, length, batch = (2, 64, 32, 2) if quick else (4, 256, 256, 4)
    torch.manual_seed(0)
    model = build(kind, width, layers, length)
    x = torch.randint(0, VOCAB, (batch, length))
    y = torch.randint(0, VOCAB, (batch * length,))

    def loss_of(out: Any) -> torch.Tensor:
        return F.cross_entropy(logits_of(out).reshape(-1, VOCAB), y)

    def step(m: torch.nn.Module, x: torch.Tensor) -> None:  # x an argument: an input counted
        m.zero_grad(set_to_none=True)
        loss_of(m(x)).backward()

    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable()
    hf_peak = revnets.measure_memory(step, hf, x).peak_bytes
    steps = {"hf checkpointing": functools.partial(step, hf, x)}
    rows = {"hf checkpointing": {"least_mib": "", "least_vs_hf": "", "planning_s": "",
                                 "peak_mib": round(hf_peak / MiB, 2), "predicted_equal": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto_checkpoint's: planned as modules
        for route in ("modules", "export graph"):
            start = time.perf_counter()
            planned_from = model if route == "modules" else exported(model, x)
            least = least_budget(planned_from, x, loss_of)
            seconds = time.perf_counter() - start
            rows[route] = {"least_mib": round(least / MiB, 2),
                           "least_vs_hf": round(least / hf_peak, 4),
                           "planning_s": round(seconds, 2), "peak_mib": "refused",
                           "predicted_equal": ""}
            if least > hf_peak:
                continue
            planned = revnets.auto_checkpoint(planned_from, x, hf_peak, loss_fn=loss_of)
            steps[route] = functools.partial(step, planned, x)
            peak = revnets.measure_memory(step, planned, x).peak_bytes
            rows[route].update(peak_mib=round(peak / MiB, 2),
                               predicted_equal=peak == planned.memory_plan.peak_bytes)
    timings = interleaved_times(steps, repeats).seconds
    hf_time = statistics.median(timings["hf checkpointing"])
    return [{"model": kind, "route": key, **row,
             "time_vs_hf": round(statistics.median(timings[key]) / hf_time, 3)
             if key in timings else ""}
            for key, row in rows.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = []
    for kind in ("llama", "gpt2"):
        for row in measure(kind, args.quick, 2 if args.quick else args.repeats):
            print("  ", row, flush=True)
            rows.append(row)
    stem = results_stem("hf_capture") + ("-quick" if args.quick else "")
    write_csv(args.results / f"{stem}.csv", rows)
    write_markdown(args.results / f"{stem}.md", [
        "# Plans of modules against plans of an exported graph",
        "",
        provenance(" ".join(["hf_capture.py", *(argv or [])])),
        "",
        "Least budget: the smallest budget `auto_checkpoint` reaches on the route (the model "
        "itself, planned as checkpoints of its modules; or the graph "
        "`torch.export.export(model, (x,), strict=False)` captures, planned by the graph "
        "planner), over transformers' checkpointing's measured peak, and the seconds it took, "
        "export included. At transformers' peak: the plan's peak measured by "
        "`revnets.measure_memory` (equal to its prediction or not), and its step's time over "
        f"transformers' step, median of {args.repeats} interleaved steps.",
        "",
        "| model | route | least budget (MiB) | least / HF's peak | planning (s) | "
        "peak at HF's peak (MiB) | measured == predicted | time / HF's |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {r['model']} | {r['route']} | {r['least_mib']} | "
          f"{r['least_vs_hf']} | {r['planning_s']} | {r['peak_mib']} | "
          f"{r['predicted_equal']} | {r['time_vs_hf']} |" for r in rows],
    ])


if __name__ == "__main__":
    main(sys.argv[1:])
