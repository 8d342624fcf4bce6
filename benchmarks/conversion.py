"""Pretrained networks made reversible (revnets.make_reversible): do they fine-tune as well, and
what do they save? Nothing is downloaded.

    python benchmarks/conversion.py            # writes results/conversion-cpu-pt<ver>-fp32*
    python benchmarks/conversion.py --quick    # tiny sizes, one seed, prints only

Two tasks, each pretrained here once (seed 0), then fine-tuned on held-out data over 3 seeds:

- vit: a timm ViT (depth 6, width 64, 8x8 images in 2x2 patches) pretrained on scikit-learn's
  digits 0-4, fine-tuned with a new head on digits 5-9; test accuracy.
- gpt: a Hugging Face GPT-2 (4 layers, width 64, bytes as tokens, 64 of them) pretrained on the
  standard library's documentation topics (pydoc_data.topics) but every fifth, fine-tuned on
  those; loss per byte on the last tenth of them.

Methods: full fine-tuning; the library's own gradient checkpointing (timm's
``set_grad_checkpointing``, transformers' ``gradient_checkpointing_enable``), the same function;
and the converted network (NOTE [ Reversible conversion ]) by each construction: revnets'
Difference at scale 1 and 0.5, Momentum at gamma 0.1 (revlib's and the paper's value) and MEFT
at lam = beta = 0.1 (the paper's). Step 0: the pretrained task's metric of each construction
before any fine-tuning, at several parameters, beside the pretrained one's. Exactness: the
reconstruction's drift (check_reconstruction) and the gradients' distance from ordinary
autograd of the same converted network, one float32 step of the pretrained network. Step time:
one fine-tuning step of each method, interleaved in one run. Peak: measured for one step
(AdamW), above parameters, gradients and optimizer state, and predicted. Memory against depth:
the same measure for 4 to 32 layers, with its exact prediction.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings
from collections.abc import Callable

import timm
import torch
import torch.nn.functional as F
from torch import nn

import revnets
from revnets.conversion import MEFT, Construction, Difference, Momentum

from common import (
    RESULTS,
    MiB,
    interleaved_times,
    provenance,
    results_stem,
    write_csv,
    write_markdown,
)

SEEDS = (0, 1, 2)
# The converted methods, each a construction (revnets.conversion).
CONSTRUCTIONS: dict[str, Construction] = {
    "difference 1": Difference(1.0), "difference 0.5": Difference(0.5),
    "momentum 0.1": Momentum(0.1), "meft 0.1/0.1": MEFT(0.1, 0.1)}
METHODS = ("full", "checkpointing", *CONSTRUCTIONS)
# Step 0 of each construction at these parameters.
STEP0 = [Difference(s) for s in (1.0, 0.5, 0.25, 0.125)] + [
    Momentum(g) for g in (0.5, 0.25, 0.1)] + [MEFT(0.5, 0.5), MEFT(0.1, 0.1)]
DEPTHS = (4, 8, 16, 32)
DEPTH_METHODS = ("full", "checkpointing", "difference 1", "difference 0.5")
CONTEXT = 64


# -- tasks ---------------------------------------------------------------------------------------
def digits() -> dict[str, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - x.mean()) / x.std()
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    x, y = x[order], y[order]
    parts = {}
    for name, low in (("pre", 0), ("fine", 5)):
        keep = (y >= low) & (y < low + 5)
        xs, ys = x[keep], y[keep] - low
        cut = int(0.8 * len(ys))
        parts |= {f"{name}_x": xs[:cut], f"{name}_y": ys[:cut],
                  f"{name}_test_x": xs[cut:], f"{name}_test_y": ys[cut:]}
    return parts


def pydoc_text() -> dict[str, torch.Tensor]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    as_bytes = lambda keys: torch.tensor(list("\n".join(topics[k] for k in keys).encode()))  # noqa: E731
    pre = as_bytes([k for i, k in enumerate(names) if i % 5])
    fine = as_bytes([k for i, k in enumerate(names) if not i % 5])
    cut = int(0.9 * len(fine))
    return {"pre": pre[: int(0.9 * len(pre))], "pre_test": pre[int(0.9 * len(pre)):],
            "fine": fine[:cut], "fine_test": fine[cut:]}


def vit(depth: int = 6, classes: int = 5) -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, in_chans=1,
                             num_classes=classes, embed_dim=64, depth=depth, num_heads=4)


def gpt(depth: int = 4) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64,
                                     n_layer=depth, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its default token ids lie outside 256
        return transformers.GPT2LMHeadModel(config)


# -- steps ---------------------------------------------------------------------------------------
def image_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def text_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def text_batches(data: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - CONTEXT, (batch,), generator=generator)
    return torch.stack([data[s:s + CONTEXT] for s in starts.tolist()])


def train(model: nn.Module, task: str, data: dict, split: str, steps: int, seed: int,
          lr: float) -> nn.Module:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x, y = batch_of(task, data, split, generator)
        optimizer.zero_grad(set_to_none=True)
        (image_loss if task == "vit" else text_loss)(model, x, y).backward()
        optimizer.step()
    return model


def batch_of(task: str, data: dict, split: str, generator: torch.Generator):
    if task == "vit":
        pick = torch.randint(0, len(data[f"{split}_y"]), (64,), generator=generator)
        return data[f"{split}_x"][pick], data[f"{split}_y"][pick]
    x = text_batches(data[split], 16, generator)
    return x, x


@torch.no_grad()
def metric(model: nn.Module, task: str, data: dict, split: str) -> float:
    """Test accuracy (vit), or loss per byte on consecutive windows (gpt)."""
    model.eval()
    if task == "vit":
        x, y = data[f"{split}_test_x"], data[f"{split}_test_y"]
        return (model(x).argmax(1) == y).float().mean().item()
    text = data[f"{split}_test"]
    windows = text[: len(text) // CONTEXT * CONTEXT].view(-1, CONTEXT)
    return model(input_ids=windows, labels=windows).loss.item()


def prepared(task: str, method: str, pretrained: nn.Module) -> nn.Module:
    model = copy.deepcopy(pretrained)
    if task == "vit":
        model.reset_classifier(5)
    if method == "checkpointing":
        if task == "vit":
            model.set_grad_checkpointing(True)
        else:  # transformers' name for it since 5.x, gradient_checkpointing_enable before
            getattr(model, "activation_checkpointing_enable",
                    getattr(model, "gradient_checkpointing_enable", None))()
    elif method in CONSTRUCTIONS:
        revnets.make_reversible(model, construction=CONSTRUCTIONS[method])
    return model


def peak_above_state(model: nn.Module, task: str, batch) -> tuple[int, int]:
    """One AdamW step's peak above parameters, gradients and optimizer state: measured, and
    predicted."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = image_loss if task == "vit" else text_loss

    def step(m, o, x, y):
        o.zero_grad(set_to_none=True)
        loss(m, x, y).backward()
        o.step()

    model.train()
    step(model, optimizer, *batch)  # the optimizer's state exists
    measured = revnets.measure_memory(step, model, optimizer, *batch)
    predicted = revnets.predict_memory(step, model, optimizer, *batch)
    return measured.above_model_state_bytes, predicted.above_model_state_bytes


# -- the runs ------------------------------------------------------------------------------------
def fine_tuning(task: str, data: dict, seeds: tuple[int, ...],
                scale: dict) -> tuple[list, list, list]:
    builder: Callable[[], nn.Module] = vit if task == "vit" else gpt
    torch.manual_seed(0)
    pretrained = train(builder(), task, data, "pre", scale["pretrain"], 0, 1e-3)
    step0 = [{"task": task, "construction": "pretrained", "divides_by": "-",
              "pretrained_task_metric": round(metric(pretrained, task, data, "pre"), 4)}]
    for construction in STEP0:
        converted = revnets.make_reversible(copy.deepcopy(pretrained),
                                            construction=construction)
        step0.append({"task": task, "construction": str(construction),
                      "divides_by": round(abs(construction.stream), 6),
                      "pretrained_task_metric": round(metric(converted, task, data, "pre"), 4)})
    exact = exactness(task, data, pretrained)
    rows = []
    for method in METHODS:
        for seed in seeds:
            torch.manual_seed(seed)
            model = train(prepared(task, method, pretrained), task, data, "fine", scale["fine"],
                          seed, 5e-4)
            rows.append({"task": task, "method": method, "seed": seed,
                         "metric": round(metric(model, task, data, "fine"), 4)})
            print(rows[-1], flush=True)
    return step0, exact, rows


def exactness(task: str, data: dict, pretrained: nn.Module) -> list:
    """Per construction, one float32 fine-tuning step of the pretrained network: the largest
    drift of a reconstructed block input, and the largest relative distance of a parameter's
    gradient from ordinary autograd of the same converted network (memory=Store())."""
    batch = batch_of(task, data, "fine", torch.Generator().manual_seed(0))
    loss = image_loss if task == "vit" else text_loss
    rows = []
    for method, construction in CONSTRUCTIONS.items():
        models = {}
        for memory in (revnets.Reconstruct(), revnets.Store()):
            model = copy.deepcopy(pretrained).train()
            revnets.make_reversible(model, construction=construction, memory=memory)
            models[type(memory).__name__] = model
        with revnets.check_reconstruction() as report:
            loss(models["Reconstruct"], *batch).backward()
        loss(models["Store"], *batch).backward()
        error = max(
            ((p.grad - q.grad).norm() / q.grad.norm()).item()
            for p, q in zip(models["Reconstruct"].parameters(), models["Store"].parameters())
            if q.grad is not None and q.grad.norm() > 0)
        rows.append({"task": task, "construction": method,
                     "divides_by": round(abs(construction.stream), 6),
                     "reconstruction_drift": f"{report.max_rel_error:.2e}",
                     "gradient_error": f"{error:.2e}"})
        print(rows[-1], flush=True)
    return rows


def speed_and_memory(task: str, data: dict, pretrained_like: nn.Module, repeats: int) -> list:
    generator = torch.Generator().manual_seed(0)
    batch = batch_of(task, data, "fine", generator)
    models = {method: prepared(task, method, pretrained_like) for method in METHODS}
    optimizers = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-4) for m in METHODS}
    loss = image_loss if task == "vit" else text_loss

    def step(method: str) -> Callable[[], None]:
        def run() -> None:
            models[method].train()
            optimizers[method].zero_grad(set_to_none=True)
            loss(models[method], *batch).backward()
            optimizers[method].step()
        return run

    times = interleaved_times({m: step(m) for m in METHODS}, repeats).seconds
    full = statistics.median(times["full"])
    rows = []
    for method in METHODS:
        measured, predicted = peak_above_state(models[method], task, batch)
        rows.append({"task": task, "method": method,
                     "step_ms": round(1e3 * statistics.median(times[method]), 2),
                     "step_vs_full": round(statistics.median(times[method]) / full, 3),
                     "peak_above_state_mib": round(measured / MiB, 3),
                     "predicted_equal": measured == predicted})
    return rows


def memory_against_depth(task: str, data: dict, depths: tuple[int, ...]) -> list:
    generator = torch.Generator().manual_seed(0)
    batch = batch_of(task, data, "fine", generator)
    rows = []
    for depth in depths:
        torch.manual_seed(0)
        base = vit(depth) if task == "vit" else gpt(depth)
        for method in DEPTH_METHODS:
            measured, predicted = peak_above_state(prepared(task, method, base), task, batch)
            rows.append({"task": task, "depth": depth, "method": method,
                         "peak_above_state_mib": round(measured / MiB, 3),
                         "predicted_equal": measured == predicted})
            print(rows[-1], flush=True)
    return rows


def plot(rows: list, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        for method in DEPTH_METHODS:
            points = [(r["depth"], r["peak_above_state_mib"]) for r in rows
                      if r["task"] == task and r["method"] == method]
            axis.plot(*zip(*points), marker="o", label=method)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("layers")
        axis.set_ylabel("peak above model state (MiB)")
        axis.set_title({"vit": "timm ViT, batch 64", "gpt": "HF GPT-2, batch 16 x 64"}[task])
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(rows: list, keys: list[str]) -> list[str]:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return lines


def summary(rows: list) -> list[dict]:
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        for method in METHODS:
            values = [r["metric"] for r in rows if r["task"] == task and r["method"] == method]
            out.append({"task": task, "method": method, "seeds": len(values),
                        "mean": round(statistics.mean(values), 4),
                        "min": min(values), "max": max(values)})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny runs, one seed, prints only")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    scale = ({"pretrain": 20, "fine": 10} if args.quick else {"pretrain": 600, "fine": 300})
    seeds = SEEDS[:1] if args.quick else SEEDS
    data = {"vit": digits(), "gpt": pydoc_text()}
    step0, exact, tuned, speed, depth_rows = [], [], [], [], []
    for task in data:
        zero, drifts, rows = fine_tuning(task, data[task], seeds, scale)
        step0 += zero
        exact += drifts
        tuned += rows
        torch.manual_seed(0)
        speed += speed_and_memory(task, data[task], vit() if task == "vit" else gpt(),
                                  3 if args.quick else 20)
        depth_rows += memory_against_depth(task, data[task], DEPTHS[:2] if args.quick else DEPTHS)
    for row in (*step0, *exact, *summary(tuned), *speed):
        print(row)
    if args.quick:
        return
    stem = results_stem("conversion")
    write_csv(RESULTS / f"{stem}-step0.csv", step0)
    write_csv(RESULTS / f"{stem}-exactness.csv", exact)
    write_csv(RESULTS / f"{stem}-fine-tuning.csv", tuned)
    write_csv(RESULTS / f"{stem}-speed.csv", speed)
    write_csv(RESULTS / f"{stem}-depth.csv", depth_rows)
    plot(depth_rows, RESULTS / f"{stem}-depth.png")
    lines = [
        "# Pretrained networks made reversible: fine-tuning, step 0, speed, memory",
        "",
        provenance("conversion.py") + " Pretrained here (seed 0) and fine-tuned over seeds "
        f"{', '.join(map(str, seeds))}; AdamW, {scale['pretrain']} pretraining and "
        f"{scale['fine']} fine-tuning steps. vit: test accuracy on digits 5-9 (higher is "
        "better); gpt: loss per byte on held-out documentation topics (lower is better).",
        "",
        "## Fine-tuned",
        "",
        *table(summary(tuned), ["task", "method", "seeds", "mean", "min", "max"]),
        "",
        "## Step 0: the pretrained task's metric, before fine-tuning",
        "",
        *table(step0, ["task", "construction", "divides_by", "pretrained_task_metric"]),
        "",
        "## Exactness: one float32 step of the pretrained network",
        "",
        "reconstruction_drift: the largest relative error of a reconstructed block input "
        "(check_reconstruction); gradient_error: the largest relative distance of a "
        "parameter's gradient from ordinary autograd of the same converted network. Side "
        "information kept for reversal: none (0 bits per element per layer; the peaks below "
        "are measured and predicted).",
        "",
        *table(exact, ["task", "construction", "divides_by", "reconstruction_drift",
                       "gradient_error"]),
        "",
        "## One fine-tuning step: time (interleaved, one run) and peak above model state",
        "",
        *table(speed, ["task", "method", "step_ms", "step_vs_full", "peak_above_state_mib",
                       "predicted_equal"]),
        "",
        "## Peak above model state against depth",
        "",
        f"![memory against depth]({stem}-depth.png)",
        "",
        *table(depth_rows, ["task", "depth", "method", "peak_above_state_mib",
                            "predicted_equal"]),
    ]
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    sys.exit(main())
