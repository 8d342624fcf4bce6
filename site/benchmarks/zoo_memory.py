"""Activation memory of the model zoo: the RevNet paper's CIFAR models and 1000-layer networks.

    python benchmarks/zoo_memory.py            # writes results/zoo_memory-cpu-pt<ver>-fp32.{md,csv}
    python benchmarks/zoo_memory.py --quick    # small batches, prints only
    python benchmarks/zoo_memory.py --only 1000_layers   # redo one table, keep the others' CSVs

CIFAR table: batch 100, 32x32, float32, training mode. "Kept after forward" is MemCNN's measure
(memory alive after the forward pass, i.e. what is stored for backward); "step peak" is the peak of
a whole training step above parameters, gradients and optimizer state.

Step time of each RevNet against its ResNet twin at batch 100; ImageNet models predicted on the meta
device at batch 32; 1000 layers: ResNet-1001 against RevNet-992 under each memory strategy,
measured at a small batch on this CPU and predicted at batch 128 on the meta device.
The fully invertible networks (i-RevNet) sit beside their RevNet and ResNet twins in each table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import timm
import torch
import torch.nn.functional as F

import revnets

from common import (
    RESULTS,
    MiB,
    interleaved_times,
    provenance,
    ratio_summary,
    read_csv,
    results_stem,
    train_step,
    write_csv,
    write_markdown,
)

# MemCNN (van de Leemput et al. 2019), batch 100 on a GTX 1080: activation memory in MB.
MEMCNN_PUBLISHED = {
    "resnet32": 238.6,
    "resnet110": 810.7,
    "resnet164": 2452.8,
    "revnet38": 85.6,
    "revnet110": 85.7,
    "revnet164": 432.7,
}
CIFAR_ROWS = [
    ("resnet32", "none"),
    ("resnet110", "none"),
    ("resnet164", "none"),
    ("revnet38", "reversible"),
    ("revnet110", "reversible"),
    ("revnet164", "reversible"),
    ("revnet38", "none"),
    ("revnet110", "none"),
    ("revnet164", "none"),
    ("irevnet163", "reversible"),
    ("irevnet163", "none"),
]
DEEP_ROWS = [
    ("resnet1001", "none"),
    ("resnet1001", "checkpoint"),
    ("revnet992", "reversible"),
    ("revnet992", "reversible+checkpoint"),
    ("irevnet1000", "reversible"),
]


def forward_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def setup(name: str, memory: str, batch: int, device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = timm.create_model(name, memory=memory)
        x = torch.randn(batch, 3, 32, 32)
        y = torch.randint(0, 10, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=2e-4)
    return model, optimizer, x, y


def cifar_table(batch: int) -> list[dict]:
    rows = []
    for name, memory in CIFAR_ROWS:
        model, optimizer, x, y = setup(name, memory, batch)
        kept = revnets.measure_memory(forward_loss, model, x, y).retained_bytes
        train_step(model, optimizer, x, y)  # momentum buffers exist from here on
        step = revnets.measure_memory(train_step, model, optimizer, x, y)
        rows.append(
            {
                "model": name,
                "memory": memory,
                "parameters": sum(p.numel() for p in model.parameters()),
                "kept_after_forward_mib": round(kept / MiB, 1),
                "step_peak_above_state_mib": round(step.above_model_state_bytes / MiB, 1),
                "memcnn_published_mb": MEMCNN_PUBLISHED.get(name, "")
                if memory != "none" or name.startswith("resnet") else "",
            }
        )
        print("  ", rows[-1])
        del model, optimizer
    return rows


TWINS = [("resnet32", "revnet38"), ("resnet110", "revnet110"), ("resnet164", "revnet164")]
IMAGENET_ROWS = [
    ("preact_resnet101", "none"),
    ("revnet104", "reversible"),
    ("revnet104", "none"),
    ("irevnet301", "reversible"),
    ("irevnet301", "none"),
]


def twin_speed(batch: int, repeats: int) -> list[dict]:
    """Step time of each RevNet (reversible, and none on the same weights) over its ResNet twin,
    interleaved so that drifts in machine speed hit all three alike."""
    rows = []
    for resnet, revnet in TWINS:
        setups = {
            (resnet, "none"): setup(resnet, "none", batch),
            (revnet, "reversible"): setup(revnet, "reversible", batch),
            (revnet, "none"): setup(revnet, "none", batch),
        }
        times = interleaved_times(
            {key: functools.partial(train_step, *args) for key, args in setups.items()}, repeats
        ).seconds
        to_resnet = ratio_summary(times[(revnet, "reversible")], times[(resnet, "none")])
        to_same_weights = ratio_summary(times[(revnet, "reversible")], times[(revnet, "none")])
        rows.append({
            "resnet": resnet,
            "revnet": revnet,
            "resnet_step_s": round(statistics.median(times[(resnet, "none")]), 3),
            "revnet_step_s": to_resnet["median_step_s"],
            "ratio_to_resnet": to_resnet["ratio"],
            "ratio_to_resnet_min": to_resnet["ratio_min"],
            "ratio_to_resnet_max": to_resnet["ratio_max"],
            "ratio_to_same_weights_none": to_same_weights["ratio"],
            "ratio_to_same_weights_none_min": to_same_weights["ratio_min"],
            "ratio_to_same_weights_none_max": to_same_weights["ratio_max"],
        })
        print("  ", rows[-1], flush=True)
    return rows


def imagenet_table(batch: int) -> list[dict]:
    """ImageNet models at 224x224, predicted on the meta device (too large for this CPU)."""
    rows = []
    for name, memory in IMAGENET_ROWS:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = timm.create_model(name, memory=memory)
            x = torch.empty(batch, 3, 224, 224)
            y = torch.zeros(batch, dtype=torch.long)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        kept = revnets.measure_memory(forward_loss, model, x, y).retained_bytes
        train_step(model, optimizer, x, y)
        step = revnets.measure_memory(train_step, model, optimizer, x, y)
        rows.append({
            "model": name,
            "memory": memory,
            "parameters": sum(p.numel() for p in model.parameters()),
            "kept_after_forward_mib": round(kept / MiB, 1),
            "step_peak_above_state_mib": round(step.above_model_state_bytes / MiB, 1),
        })
        print("  ", rows[-1], flush=True)
    return rows


def deep_table(batch: int, predict_batch: int, repeats: int) -> list[dict]:
    rows = []
    setups = {}
    for name, memory in DEEP_ROWS:
        model, optimizer, x, y = setup(name, memory, batch)
        train_step(model, optimizer, x, y)  # momentum buffers exist from here on
        measured = revnets.measure_memory(train_step, model, optimizer, x, y)
        check = revnets.predict_memory(train_step, model, optimizer, x, y)  # same step, on meta
        meta = setup(name, memory, predict_batch, device="meta")
        train_step(*meta)
        predicted = revnets.measure_memory(train_step, *meta)
        setups[(name, memory)] = (model, optimizer, x, y)
        rows.append(
            {
                "model": name,
                "memory": memory,
                "batch": batch,
                "measured_peak_mib": round(measured.peak_bytes / MiB, 1),
                "measured_above_state_mib": round(measured.above_model_state_bytes / MiB, 1),
                "predicted_minus_measured_bytes": check.peak_bytes - measured.peak_bytes,
                "predict_batch": predict_batch,
                "predicted_peak_mib": round(predicted.peak_bytes / MiB, 1),
                "predicted_above_state_mib": round(predicted.above_model_state_bytes / MiB, 1),
            }
        )
        print("  ", rows[-1])
    # i-RevNet-1000's 450 MiB of parameters, gradients and momentum disturb the timing of the
    # other steps when interleaved with them: it is timed in a round of its own against the base.
    base = DEEP_ROWS[0]
    groups = [[key for key in setups if key[0] != "irevnet1000"],
              [base, *(key for key in setups if key[0] == "irevnet1000")]]
    times: dict = {}
    for group in groups:
        seconds = interleaved_times(
            {key: functools.partial(train_step, *setups[key]) for key in group}, repeats
        ).seconds
        times.update({key: (seconds[key], seconds[base]) for key in group})
    base_peak = rows[0]["predicted_peak_mib"]
    for row, key in zip(rows, setups):
        summary = ratio_summary(*times[key])
        row["step_s"] = summary["median_step_s"]
        row["time_ratio"] = summary["ratio"]
        row["time_ratio_min"] = summary["ratio_min"]
        row["time_ratio_max"] = summary["ratio_max"]
        row["predicted_memory_ratio"] = round(base_peak / row["predicted_peak_mib"], 2)
    return rows


TABLES = ("cifar", "cifar_speed", "imagenet", "1000_layers")


def write(tables: dict[str, list[dict]], args) -> None:
    stem = results_stem("zoo_memory")
    for name, rows in tables.items():
        write_csv(RESULTS / f"{stem}-{name}.csv", rows)
    cifar_rows, twin_rows = tables["cifar"], tables["cifar_speed"]
    imagenet_rows, deep_rows = tables["imagenet"], tables["1000_layers"]
    kept = {(r["model"], r["memory"]): r["kept_after_forward_mib"] for r in cifar_rows}
    ratio = kept[("revnet110", "reversible")] / kept[("revnet38", "reversible")]
    invertible = kept[("irevnet163", "reversible")] / kept[("irevnet163", "none")]
    parameters = {r["model"]: r["parameters"] for r in cifar_rows}
    heavier = parameters["irevnet163"] / parameters["revnet164"]
    lines = [
        "# Activation memory of the model zoo",
        "",
        provenance("zoo_memory.py")
        + " Memory is live tensor storage counted by `revnets.measure_memory` (exact on CPU).",
        "",
        f"## CIFAR models, batch {args.batch}, 32x32",
        "",
        "*Kept after forward*: activations alive after the forward pass (stored for backward), "
        "MemCNN's measure. *Step peak*: peak of forward + backward + SGD above parameters, "
        "gradients and optimizer state. MemCNN's figures are **published** (GTX 1080, batch 100, "
        "its own ResNet/RevNet variants with more parameters, MB as reported).",
        "",
        "| model | memory | parameters | kept after forward (MiB) | step peak (MiB) | "
        "MemCNN published (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in cifar_rows:
        lines.append(
            f"| {r['model']} | {r['memory']} | {r['parameters']:,} | "
            f"{r['kept_after_forward_mib']:.1f} | {r['step_peak_above_state_mib']:.1f} | "
            f"{r['memcnn_published_mb']} |"
        )
    lines += [
        "",
        f"RevNet-110 keeps {ratio:.3f}x the activations of RevNet-38: reversible stages do not "
        "grow with depth, only the stored stem, downsampling units and head remain. "
        f"i-RevNet-163 is invertible from stem to head (its downsampling too): it keeps "
        f"{kept[('irevnet163', 'reversible')]:.1f} MiB, {invertible:.3f}x of what the same "
        f"weights keep under `none`, with {heavier:.1f}x RevNet-164's parameters.",
        "",
        f"## Step time against the ResNet twin, batch {args.batch}",
        "",
        f"Median of {args.repeats} interleaved training steps on this CPU (order rotated each "
        "round, garbage collector paused, one warm-up round); in brackets the smallest and "
        "largest ratio of steps timed in the same round. The paper reports "
        "each RevNet update 1.5-2x as expensive as the ResNet's (**published**, depending on the "
        "implementation); MemCNN's published CIFAR-10 training times (GTX 1080) give 1.16x, 1.30x "
        "and 1.47x for 38/110/164.",
        "",
        "| ResNet | RevNet | ResNet step (s) | RevNet step (s) | ratio to ResNet | "
        "ratio to same weights with `none` |",
        "|---|---|---|---|---|---|",
        *[f"| {r['resnet']} | {r['revnet']} | {r['resnet_step_s']:.2f} | {r['revnet_step_s']:.2f} "
          f"| {r['ratio_to_resnet']:.2f} ({r['ratio_to_resnet_min']:.2f}-"
          f"{r['ratio_to_resnet_max']:.2f}) | {r['ratio_to_same_weights_none']:.2f} "
          f"({r['ratio_to_same_weights_none_min']:.2f}-{r['ratio_to_same_weights_none_max']:.2f}) |"
          for r in twin_rows],
        "",
        f"## ImageNet models, batch {args.imagenet_batch}, 224x224 (predicted on the meta device)",
        "",
        "| model | memory | parameters | kept after forward (MiB) | step peak (MiB) |",
        "|---|---|---|---|---|",
        *[f"| {r['model']} | {r['memory']} | {r['parameters']:,} | "
          f"{r['kept_after_forward_mib']:.1f} | {r['step_peak_above_state_mib']:.1f} |"
          for r in imagenet_rows],
        "",
        "## 1000 layers: ResNet-1001 against RevNet-992 and i-RevNet-1000",
        "",
        f"Measured: a training step at batch {args.deep_batch}, 32x32, on this CPU (total peak, "
        f"and the part above model state); step time is the median of {args.repeats} "
        "interleaved steps, the time ratio with the smallest and largest ratio of steps timed in "
        "the same round in brackets; that step predicted on the meta device differs from the "
        "measurement by the bytes in *check*. Predicted: the same step at batch "
        f"{args.predict_batch} run on the meta device (total peak). Ratios are against "
        "ResNet-1001 with `none`. Chen et al. (2016, **published**, MXNet, ImageNet 1000-layer "
        "ResNet): 48 GB -> 7 GB (6.9x) for about 30 % more time.",
        "",
        "| model | memory | measured peak (MiB) | above state (MiB) | check (bytes) | step (s) | "
        f"time ratio | predicted peak at batch {args.predict_batch} (MiB) | above state (MiB) | "
        "memory cut |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in deep_rows:
        lines.append(
            f"| {r['model']} | {r['memory']} | {r['measured_peak_mib']:.1f} | "
            f"{r['measured_above_state_mib']:.1f} | {r['predicted_minus_measured_bytes']} | "
            f"{r['step_s']:.2f} | {r['time_ratio']:.2f} "
            f"({r['time_ratio_min']:.2f}-{r['time_ratio_max']:.2f}) | "
            f"{r['predicted_peak_mib']:.1f} | {r['predicted_above_state_mib']:.1f} | "
            f"{r['predicted_memory_ratio']:.2f}x |"
        )
    write_markdown(RESULTS / f"{stem}.md", lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, prints only")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--deep-batch", type=int, default=4)
    parser.add_argument("--predict-batch", type=int, default=128)
    parser.add_argument("--imagenet-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--only", default=",".join(TABLES),
        help=f"comma-separated tables to redo ({', '.join(TABLES)}); the others are read back "
        "from their CSV files in results/",
    )
    args = parser.parse_args(argv)
    only = args.only.split(",")
    if unknown := set(only) - set(TABLES):
        parser.error(f"--only: unknown tables {sorted(unknown)}; choose from {', '.join(TABLES)}")
    if args.quick:
        args.batch, args.deep_batch, args.predict_batch, args.repeats = 4, 1, 8, 1
        args.imagenet_batch = 2
    makers = {
        "cifar": lambda: cifar_table(args.batch),
        "cifar_speed": lambda: twin_speed(args.batch, args.repeats),
        "imagenet": lambda: imagenet_table(args.imagenet_batch),
        "1000_layers": lambda: deep_table(args.deep_batch, args.predict_batch, args.repeats),
    }
    tables = {}
    for name in TABLES:
        if name in only:
            print(f"== {name}", flush=True)
            tables[name] = makers[name]()
        else:
            tables[name] = read_csv(RESULTS / f"{results_stem('zoo_memory')}-{name}.csv")
    if not args.quick:
        write(tables, args)


if __name__ == "__main__":
    main(sys.argv[1:])
