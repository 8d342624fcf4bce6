"""Training memory per image of Rev-ViT against timm's own ViTs, and step time on this CPU.

    python benchmarks/vit_memory.py            # writes results/vit_memory-cpu-pt<ver>-fp32.{md,csv}
    python benchmarks/vit_memory.py --quick    # small sizes, prints only

Memory per image: the peak of a training step (forward, backward, AdamW step) above parameters,
gradients and optimizer state, divided by the batch; predicted on the meta device at 224x224 and
checked against a measurement on this CPU at a small batch. Rows: Rev-ViT-S/B reversible (their
default), the same weights under ordinary autograd (`none`), and timm's vit_small_patch16_224 /
vit_base_patch16_224 (a class token, pre-norm residual blocks: the model Rev-ViT is compared with
in the paper). Step time: interleaved steps at 224x224 and a small batch, over timm's ViT.
"""

from __future__ import annotations

import argparse
import functools
import sys

import timm
import torch

import revnets

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

MB = 10**6

# Mangalam et al. 2022, Table 1, training memory per image (MB). Quoted from a secondary source,
# not checked against the paper itself.
PUBLISHED_MB = {
    "vit_small_patch16_224": 66.5,
    "revvit_small_patch16_224": 8.8,
    "vit_base_patch16_224": 129.7,
    "revvit_base_patch16_224": 17.0,
}
ROWS = [
    ("vit_small_patch16_224", None),
    ("revvit_small_patch16_224", "none"),
    ("revvit_small_patch16_224", "reversible"),
    ("vit_base_patch16_224", None),
    ("revvit_base_patch16_224", "none"),
    ("revvit_base_patch16_224", "reversible"),
]


def build(name: str, memory: str | None, seed: int = 0):
    torch.manual_seed(seed)
    kwargs = {} if memory is None else {"memory": memory}
    model = timm.create_model(name, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    return model.train(), optimizer


def batch(size: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(size, 3, 224, 224, generator=generator).to(device)
    return x, torch.randint(0, 1000, (size,), generator=generator).to(device)


def memory_row(name: str, memory: str | None, predict_batch: int, measure_batch: int) -> dict:
    # Built on the CPU, so that the predictions take the CPU's kernels (fused attention), and
    # trained a step, so that gradients and AdamW's state exist in every figure.
    model, optimizer = build(name, memory)
    x, y = batch(measure_batch)
    train_step(model, optimizer, x, y)
    predicted = revnets.predict_memory(train_step, model, optimizer, *batch(predict_batch, "meta"))
    small = revnets.predict_memory(train_step, model, optimizer, x, y)
    measured = revnets.measure_memory(train_step, model, optimizer, x, y)
    return {
        "model": name,
        "memory": memory or "timm",
        "params": sum(p.numel() for p in model.parameters()),
        f"mb_per_image_b{predict_batch}": round(
            predicted.above_model_state_bytes / predict_batch / MB, 2
        ),
        "published_mb_per_image": PUBLISHED_MB[name] if memory != "none" else "",
        f"measured_mib_b{measure_batch}": round(measured.above_model_state_bytes / MiB, 2),
        f"predicted_mib_b{measure_batch}": round(small.above_model_state_bytes / MiB, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, prints only")
    parser.add_argument("--batch", type=int, default=64, help="predicted batch")
    parser.add_argument("--measure-batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows_spec = ROWS[:3] if args.quick else ROWS
    predict_batch = 4 if args.quick else args.batch

    rows = []
    for name, memory in rows_spec:
        row = memory_row(name, memory, predict_batch, args.measure_batch)
        rows.append(row)
        print("  ", row, flush=True)

    x, y = batch(args.measure_batch)
    steps = {}
    for name, memory in rows_spec:
        model, optimizer = build(name, memory)
        steps[name, memory] = functools.partial(train_step, model, optimizer, x, y)
    timings = interleaved_times(steps, 2 if args.quick else args.repeats)
    for row, (name, memory) in zip(rows, rows_spec):
        family = "vit_small_patch16_224" if "small" in name else "vit_base_patch16_224"
        summary = ratio_summary(timings.seconds[name, memory], timings.seconds[family, None])
        row["step_s"] = summary["median_step_s"]
        row["step_ratio"] = summary["ratio"]
        print(f"  speed {name} {row['memory']}: {row['step_ratio']:.3f}x", flush=True)
    if args.quick:
        return

    stem = results_stem("vit_memory")
    write_csv(RESULTS / f"{stem}.csv", rows)
    key_mb, key_measured = f"mb_per_image_b{predict_batch}", f"measured_mib_b{args.measure_batch}"
    key_predicted = f"predicted_mib_b{args.measure_batch}"
    lines = [
        "# Rev-ViT against timm's ViT: training memory per image and step time",
        "",
        provenance("vit_memory.py"),
        "",
        "Memory: peak of a training step (forward, backward, AdamW) above parameters, gradients "
        f"and optimizer state, per image, predicted on the meta device at batch {predict_batch}, "
        f"224x224, float32; checked against a measurement on this CPU at batch "
        f"{args.measure_batch} (live tensor storage; the two columns on the right). `none` is "
        "the same Rev-ViT weights under ordinary autograd. Published: Mangalam et al. 2022, "
        "Table 1, MB per image on GPU, quoted from a secondary source and not checked against the "
        "paper itself. Step time: median of "
        f"{args.repeats} interleaved steps at batch {args.measure_batch}, 224x224, on this CPU, "
        "over timm's ViT of the same size.",
        "",
        f"| model | memory | params | MB per image (predicted, batch {predict_batch}) | "
        f"published MB per image | measured MiB (batch {args.measure_batch}) | predicted MiB "
        f"(batch {args.measure_batch}) | step s | step ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['memory']} | {r['params']:,} | {r[key_mb]:.2f} | "
            f"{r['published_mb_per_image']} | {r[key_measured]:.2f} | {r[key_predicted]:.2f} | "
            f"{r['step_s']:.3f} | {r['step_ratio']:.3f} |"
        )
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main(sys.argv[1:])
