"""Does a RevNet still learn as well with ``exact=True``? Final test accuracy of a ResNet twin, a
RevNet (default reversible arithmetic) and the same RevNet with ``exact=True``, each trained in
float32 and under bfloat16 autocast, over 3 seeds, on two tasks that run here without downloads:

- ``digits``: scikit-learn's ``load_digits`` (1,797 8x8 grey images of handwritten digits, 10
  classes), upsampled to 16x16, a fixed 80/20 train/test split;
- ``synthetic``: the trainer's synthetic task (revnets.training.data.synthetic, 16x16, 10 classes).

The models are small (CPU): a 3x3 conv stem to 16 channels, then 6 reversible blocks with
conv + GroupNorm + ReLU on 8 channels per half for f and g (6,912 block weights), or, for the
ResNet twin, 3 residual units ``x + relu(gn(conv(x)))`` on 16 channels (the same 6,912), then
average pooling to 4x4 and a linear head. SGD with momentum, 5 epochs.

    pip install scikit-learn   # the `bench` extra
    OMP_NUM_THREADS=1 python benchmarks/exact_accuracy.py   # ~15 min on a busy CPU; results/
    python benchmarks/exact_accuracy.py --quick     # 1 epoch, 1 seed, printed only
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from revnets import Reconstruct, ReversibleBlock, ReversibleSequence
from revnets.training.data import synthetic

from common import RESULTS, provenance, results_stem, train_step, write_csv, write_markdown

MODELS = ("resnet", "revnet", "revnet exact")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
SEEDS = (0, 1, 2)
IMAGE = 16


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=IMAGE, mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def synthetic_task() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    train, test = synthetic(1536, 10, IMAGE, seed=0, split=0), synthetic(512, 10, IMAGE, 0, 1)
    return (*train.tensors, *test.tensors)


def conv_gn_relu(channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.GroupNorm(2, channels),
        nn.ReLU(),
    )


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.branch = conv_gn_relu(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


def model(kind: str, in_channels: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    width = 16
    if kind == "resnet":
        body: nn.Module = nn.Sequential(*[Residual(width) for _ in range(3)])
    else:
        blocks = [ReversibleBlock(conv_gn_relu(width // 2), conv_gn_relu(width // 2))
                  for _ in range(6)]
        body = ReversibleSequence(blocks, Reconstruct(), exact=kind == "revnet exact")
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), body, nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(16 * width, 10),
    )


def train(kind: str, precision: str, seed: int, task, epochs: int) -> float:
    x_train, y_train, x_test, y_test = task
    net = model(kind, x_train.shape[1], seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    dtype = PRECISIONS[precision]
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
    order = torch.Generator().manual_seed(seed)
    net.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y_train), generator=order).split(64):
            with autocast():
                train_step(net, optimizer, x_train[batch], y_train[batch])
    net.eval()
    with torch.no_grad(), autocast():
        predicted = net(x_test).argmax(1)
    return (predicted == y_test).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=len(SEEDS))
    parser.add_argument("--quick", action="store_true", help="1 epoch, 1 seed, nothing written")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = 1, 1
    tasks = {"digits": digits(), "synthetic": synthetic_task()}
    rows = []
    for task_name, task in tasks.items():
        for kind in MODELS:
            for precision in PRECISIONS:
                for seed in SEEDS[: args.seeds]:
                    start = time.perf_counter()
                    accuracy = train(kind, precision, seed, task, args.epochs)
                    rows.append({"task": task_name, "model": kind, "precision": precision,
                                 "seed": seed, "test_accuracy": round(accuracy, 4)})
                    print(rows[-1], f"{time.perf_counter() - start:.1f} s", flush=True)
    if args.quick:
        return
    stem = results_stem("exact_accuracy", precision="fp32-bf16")
    write_csv(RESULTS / f"{stem}.csv", rows)
    lines = [
        "# Accuracy with exact=True: ResNet twin, RevNet, RevNet exact=True",
        "",
        provenance("exact_accuracy.py").replace(", float32.", ", float32 and bfloat16 autocast."),
        "",
        f"Final test accuracy, mean ± standard deviation over {args.seeds} seeds (per-seed values "
        f"in `{stem}.csv`), {args.epochs} epochs; digits: scikit-learn's load_digits "
        f"(1,437 train / 360 test, 8x8 upsampled to {IMAGE}x{IMAGE}); synthetic: the trainer's "
        "synthetic task (1,536 train / 512 test). Models and training: see the script's "
        "docstring.",
        "",
        "| task | model | float32 | bfloat16 autocast |",
        "|---|---|---|---|",
    ]
    for task_name in tasks:
        for kind in MODELS:
            cells = []
            for precision in PRECISIONS:
                values = [r["test_accuracy"] for r in rows if r["task"] == task_name
                          and r["model"] == kind and r["precision"] == precision]
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                cells.append(f"{100 * statistics.mean(values):.1f} ± {100 * spread:.1f} %")
            name = "RevNet exact=True" if kind == "revnet exact" else (
                "ResNet twin" if kind == "resnet" else "RevNet (default)")
            lines.append(f"| {task_name} | {name} | " + " | ".join(cells) + " |")
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main()
