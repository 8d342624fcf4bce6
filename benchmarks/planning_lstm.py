"""A chain that is not a CNN, planned automatically: Chen et al.'s LSTM over a long sequence.

Four stacked LSTM cells, hidden size 1024, sequence length 1000, batch 64 (Chen et al. 2016)
unrolled into a chain of 1000 time steps that pass the recurrent state along. ``auto_checkpoint``
picks the plan with the least recomputation within a budget; memory is predicted at full size on
the meta device and measured on this CPU at a smaller size (where prediction and measurement are
compared).

    python benchmarks/planning_lstm.py   # writes results/planning_lstm-cpu-pt<ver>-fp32.{md,csv}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import Tensor, nn

import revnets

from common import (
    RESULTS,
    MiB,
    provenance,
    results_stem,
    write_csv,
    write_markdown,
)


class LSTMStep(nn.Module):
    """Time step ``t`` of a stack of LSTM cells; the state is (inputs, h_1..h_L, c_1..c_L)."""

    def __init__(self, cells: nn.ModuleList, t: int) -> None:
        super().__init__()
        self.cells = cells  # shared by every step
        self.t = t

    def forward(self, state: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        layers = len(self.cells)
        inputs, hs, cs = state[0], state[1 : 1 + layers], state[1 + layers :]
        x, new_h, new_c = inputs[self.t], [], []
        for cell, h, c in zip(self.cells, hs, cs):
            h, c = cell(x, (h, c))
            new_h.append(h)
            new_c.append(c)
            x = h
        return (inputs, *new_h, *new_c)


def unrolled(layers: int, hidden: int, steps: int, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    with torch.device(device):
        cells = nn.ModuleList(nn.LSTMCell(hidden, hidden) for _ in range(layers))
    return nn.Sequential(*(LSTMStep(cells, t) for t in range(steps)))


def initial_state(layers, hidden, steps, batch, device="cpu") -> tuple[Tensor, ...]:
    with torch.device(device):
        zeros = [torch.zeros(batch, hidden) for _ in range(2 * layers)]
        return (torch.randn(steps, batch, hidden), *zeros)


def loss_of(layers: int):
    return lambda state: state[layers].float().sum()  # the top layer's last hidden state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--small", type=int, nargs=3, default=[256, 100, 16],
                        metavar=("HIDDEN", "STEPS", "BATCH"))
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="budget: weights and gradients plus this fraction of the "
                        "unplanned activation memory")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    L, loss = args.layers, loss_of(args.layers)

    def step(model, state):
        loss(model(state)).backward()

    rows = []
    for label, (hidden, steps, batch), measure in [
        ("full size, predicted", (args.hidden, args.steps, args.batch), False),
        ("small, measured", tuple(args.small), True),
    ]:
        chain = unrolled(L, hidden, steps, "meta" if not measure else "cpu")
        state = initial_state(L, hidden, steps, batch, "meta" if not measure else "cpu")
        regular = revnets.predict_memory(step, chain, state).peak_bytes
        weights = 2 * sum(p.numel() * p.element_size() for p in chain.parameters())  # + grads
        budget = int(weights + args.fraction * (regular - weights))
        planned = revnets.auto_checkpoint(chain, state, budget, loss)
        predicted = planned.memory_plan.peak_bytes
        row = {"case": label, "layers": L, "hidden": hidden, "steps": steps, "batch": batch,
               "segments": sum(isinstance(m, revnets.Checkpointed) for m in planned.plan.modules()),
               "unplanned_mib": round(regular / MiB, 1),
               "planned_mib": round(predicted / MiB, 1)}
        if measure:
            measured = {}
            for name, m in (("unplanned", chain), ("planned", planned)):
                m.zero_grad(set_to_none=True)  # as predicted: no gradients before the step
                measured[name] = revnets.measure_memory(step, m, state).peak_bytes
            times = {"unplanned": [], "planned": []}
            for _ in range(args.repeats):
                for name, m in (("unplanned", chain), ("planned", planned)):
                    m.zero_grad(set_to_none=True)
                    start = time.perf_counter()
                    step(m, state)
                    times[name].append(time.perf_counter() - start)
            row.update({
                "measured_unplanned_mib": round(measured["unplanned"] / MiB, 1),
                "measured_planned_mib": round(measured["planned"] / MiB, 1),
                "overhead_pct": round(100 * (statistics.median(times["planned"])
                                             / statistics.median(times["unplanned"]) - 1), 1),
            })
        rows.append(row)
        print("  ", row, flush=True)

    stem = results_stem("planning_lstm")
    fields = list(rows[-1])  # the measured case has every column the predicted one has, and more
    write_csv(RESULTS / f"{stem}.csv", [{f: r.get(f, "") for f in fields} for r in rows])
    full, small = rows
    lines = [
        "# Automatic checkpointing of an unrolled LSTM (Chen et al.'s recurrent chain)",
        "",
        provenance("planning_lstm.py"),
        "",
        f"{L} stacked LSTM cells unrolled over the sequence as a chain of time steps; loss = sum "
        "of the top layer's last hidden state; one forward + backward (parameters, gradients and "
        f"activations). Budget: weights and gradients plus {args.fraction:.0%} of the unplanned "
        "activation memory; `auto_checkpoint` "
        "returns the plan with the fewest recomputed steps that fits.",
        "",
        "| case | hidden | steps | batch | checkpointed segments | unplanned (MiB) | "
        "planned (MiB) | measured unplanned / planned (MiB) | step-time overhead |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = (f"{r['measured_unplanned_mib']:.1f} / {r['measured_planned_mib']:.1f}"
                    if "measured_planned_mib" in r else "-")
        overhead = f"{r['overhead_pct']:.0f} %" if "overhead_pct" in r else "-"
        lines.append(
            f"| {r['case']} | {r['hidden']} | {r['steps']} | {r['batch']} | {r['segments']} | "
            f"{r['unplanned_mib']:.1f} | {r['planned_mib']:.1f} | {measured} | {overhead} |"
        )
    lines += [
        "",
        "The full-size case (Chen et al.: 4 layers, hidden 1024, sequence 1000, batch 64) is "
        "predicted on the meta device; the small case is also measured on this CPU, where "
        "prediction and measurement can be compared.",
    ]
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main(sys.argv[1:])
