"""Step time against peak memory: revnets' plans beside torch.compile's activation memory budget
and torch.utils.checkpoint (per block, and selective: matmul outputs kept).

Every point is one way of running the same model's training step (forward and backward from
freed gradients). Memory: the peak of the step above what is alive when it starts (parameters),
read by ``revnets.allocator_peak`` from torch.profiler's allocator events (every allocation and
free of the CPU allocator, Inductor's generated code included, which a dispatch-level meter such
as ``revnets.measure_memory`` cannot see), summed in time order; every point is measured by that
one meter. Time: median of interleaved steps, over the eager step's.

    python benchmarks/frontier.py            # gpt, resnet50, vit, hf-llama, hf-gpt2
    python benchmarks/frontier.py --quick    # small sizes, to check that it runs
    python benchmarks/frontier.py --only gpt
    python benchmarks/frontier.py --only hf-llama   # a Hugging Face model (revnets[hf]); or hf-gpt2
    python benchmarks/frontier.py --device cuda   # on a GPU: the caching allocator's peak
    python benchmarks/frontier.py --only resnet --processes 3
        # each model in three fresh processes: a compiled step's speed moves by a few percent
        # from process to process (where its memory lands), which interleaving cannot remove

Each row says which torch.compile point of the same process, if any, reaches no more memory in
less time (``beaten_by``): a revnets point with none is at or below compile's curve there.

The Hugging Face models (transformers' Llama and GPT-2 from their configs, random weights) are
planned as checkpoints of modules (torch.fx cannot trace them): layers and their sublayers,
whole or selective, runs of layers, checkpoints nested inside others; planned with
``compiled=True`` (no runs of layers, which run eagerly under compile) for their "revnets +
compile" points; beside transformers' own gradient checkpointing, of every layer and of every
second one, and revnets' plan at the peak that transformers' checkpointing of every layer
measures (``revnets at hf's peak``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
import torchvision
from planner_zoo import GPT
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import revnets
from revnets.facts.operators import SELECTIVE_OPS  # the same operators kept, for a like comparison
from revnets.planning import PlanningError

from common import (
    RESULTS,
    MiB,
    interleaved_times,
    provenance,
    read_csv,
    results_stem,
    write_csv,
    write_markdown,
)

KEEPS = (0.7, 0.5, 0.3, 0.15)  # revnets: share of the activation part kept in the budget
FRACTIONS = (0.7, 0.5, 0.3, 0.1)  # torch.compile's activation_memory_budget


FAMILIES = ("revnets + compile", "revnets", "compile", "torch checkpoint", "hf checkpointing",
            "eager")


def family_of(method: str) -> str:
    return next(f for f in FAMILIES if method.startswith(f))


def loss_of(out: Any, y: Tensor) -> Tensor:
    """Cross-entropy of a model's logits (a Hugging Face output's ``logits``, flattened)."""
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def step_of(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(model(x), y).backward()

    return step


def with_hf_checkpointing(model: nn.Module, every: int) -> nn.Module | None:
    """A copy of a Hugging Face model under its own gradient checkpointing, of every
    ``every``-th layer."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        return None
    clone = copy.deepcopy(model)
    getattr(clone, "activation_checkpointing_enable", clone.gradient_checkpointing_enable)()
    layers = [m for m in clone.modules() if hasattr(m, "gradient_checkpointing")
              and type(m).__name__.endswith(("Layer", "Block"))]
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0
    return clone


class PerBlock(nn.Module):
    """Runs ``block`` under torch.utils.checkpoint, keeping matmul outputs when selective."""

    def __init__(self, block: nn.Module, selective: bool) -> None:
        super().__init__()
        self.block, self.selective = block, selective

    def forward(self, x: Tensor) -> Tensor:
        if not self.selective:
            return checkpoint(self.block, x, use_reentrant=False)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=_keep_matmuls)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_keep_matmuls = functools.partial(create_selective_checkpoint_contexts, _policy)


def blocks_of(model: nn.Module) -> tuple[nn.Module, str] | None:
    """The container of the repeated blocks torch.utils.checkpoint wraps, and its attribute."""
    for owner, name in ((model, "blocks"), (model, "layer3")):
        if isinstance(getattr(owner, name, None), nn.Sequential):
            return owner, name
    return None


def with_checkpointed_blocks(model: nn.Module, selective: bool) -> nn.Module | None:
    found = blocks_of(model)
    if found is None:
        return None
    owner, name = found
    wrapped = nn.Sequential(*(PerBlock(b, selective) for b in getattr(owner, name)))
    copy = _shallow(model)
    setattr(copy, name, wrapped)
    return copy


def _shallow(model: nn.Module) -> nn.Module:
    """A module object of its own over the same submodules and parameters."""
    clone = model.__new__(type(model))
    clone.__dict__ = dict(model.__dict__)
    clone._modules = dict(model._modules)
    return clone


def compiled(model: nn.Module, fraction: float, x: Tensor, y: Tensor) -> Callable[[], None]:
    """torch.compile's step under ``activation_memory_budget=fraction``, on a copy of the model
    of its own. The budget is applied by a backend of this fraction's own: dynamo keeps compiled
    code per backend (a copy of the same model class compiled for another fraction would
    otherwise reuse its graphs), and AOTAutograd's and Inductor's caches are off inside it (their
    keys would let one fraction's partition serve another)."""
    fn = torch.compile(copy.deepcopy(model), backend=functools.partial(_budgeted, fraction))
    step = step_of(fn, x, y)
    step()  # compiles forward and backward under this budget
    step.model = fn  # whose gradients to free before a measured step
    return step


def _budgeted(fraction: float, graph: torch.fx.GraphModule, inputs: list) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    with (
        torch._functorch.config.patch(activation_memory_budget=fraction,
                                      enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        return compile_fx(graph, inputs)


def cases(quick: bool, scale: int = 1) -> dict[str, Callable[[], tuple[nn.Module, Tensor, Tensor]]]:
    """The three models at CPU-sized batches, each times ``scale`` (a GPU needs larger ones to
    be busy rather than waiting on kernel launches)."""

    def gpt() -> tuple[nn.Module, Tensor, Tensor]:
        layers, width, length, batch = (2, 64, 32, 2) if quick else (6, 384, 256, 4)
        batch *= scale
        model = GPT(4096, width, layers, 6 if not quick else 4, length)
        tokens = torch.randint(0, 4096, (batch, length))
        return model, tokens, torch.randint(0, 4096, (batch * length,))

    def resnet() -> tuple[nn.Module, Tensor, Tensor]:
        # Sizes where activations, not the gradients of the weights, make the peak.
        model = torchvision.models.resnet18() if quick else torchvision.models.resnet50()
        size, batch = (32, 2) if quick else (128, 8)
        batch *= scale
        return model, torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))

    def vit() -> tuple[nn.Module, Tensor, Tensor]:
        name = "deit_tiny_patch16_224" if quick else "vit_small_patch16_224"
        size, batch = (32, 2) if quick else (224, 8)
        batch *= scale
        model = timm.create_model(name, img_size=size, num_classes=10)
        return model, torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))

    def hugging_face(kind: str) -> Callable[[], tuple[nn.Module, Tensor, Tensor]]:
        def build() -> tuple[nn.Module, Tensor, Tensor]:
            import transformers

            layers, width, length, batch = (2, 64, 32, 2) if quick else (4, 256, 256, 4)
            batch *= scale
            vocab = 4096
            if kind == "llama":
                config = transformers.LlamaConfig(
                    vocab_size=vocab, hidden_size=width, intermediate_size=int(2.75 * width),
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                    max_position_embeddings=length, use_cache=False)
                model = transformers.LlamaForCausalLM(config)
            else:
                config = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers,
                                                 n_head=4, n_positions=length, use_cache=False)
                model = transformers.GPT2LMHeadModel(config)
            tokens = torch.randint(0, vocab, (batch, length))
            return model, tokens, torch.randint(0, vocab, (batch * length,))

        return build

    return {"gpt": gpt, "resnet": resnet, "vit": vit, "hf-llama": hugging_face("llama"),
            "hf-gpt2": hugging_face("gpt2")}


def frontier(
    name: str,
    build: Callable,
    repeats: int,
    device: torch.device,
    keeps: tuple[float, ...] = KEEPS,
    fractions: tuple[float, ...] = FRACTIONS,
) -> list[dict]:
    torch.manual_seed(0)
    model, x, y = (part.to(device) for part in build())
    model.train()
    steps: dict[str, Callable[[], None]] = {"eager": step_of(model, x, y)}
    steps["eager"]()  # on a GPU, cuBLAS's and cuDNN's handles and workspaces are made once
    model.zero_grad(set_to_none=True)
    eager_peak = revnets.measure_memory(steps["eager"]).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budgets, smallest = {}, None
    times = revnets.forward_times(model, x)  # one measurement for every plan of the sweep
    for keep in keeps:
        budget = int(state + keep * (eager_peak - state))
        try:
            revnets.auto_checkpoint(model, x, budget, measure_time=times,
                                    loss_fn=lambda out: loss_of(out, y))
            budgets[f"keep {keep}"] = budget
        except PlanningError as refusal:
            smallest = refusal.smallest_budget
    if smallest is not None:  # the lowest revnets reaches: the budget a refusal names
        budgets["smallest"] = smallest
    hf_every = {every: with_hf_checkpointing(model, every) for every in (1, 2)}
    if hf_every[1] is not None:  # revnets at transformers' checkpointing's own peak
        budgets["at hf's peak"] = revnets.measure_memory(
            step_of(hf_every[1], x, y)).peak_bytes
        hf_every[1].zero_grad(set_to_none=True)
    for label, budget in budgets.items():
        for under_compile in (False, True):
            # A plan for a compiled model (``compiled=True``: its checkpoints' cheap steps are
            # recomputed inside fused kernels, so it keeps products and recomputes the rest),
            # compiled as users compile models.
            try:
                planned = revnets.auto_checkpoint(model, x, budget, compiled=under_compile,
                                                  measure_time=times,
                                                  loss_fn=lambda out: loss_of(out, y))
            except PlanningError:  # below what a plan for a compiled model reaches (no runs)
                assert under_compile
                continue
            steps[f"revnets + compile {label}" if under_compile else f"revnets {label}"] = (
                compiled(planned, 1.0, x, y) if under_compile else step_of(planned, x, y))
    for selective in (False, True):
        wrapped = with_checkpointed_blocks(model, selective)
        if wrapped is not None:
            steps["torch checkpoint " + ("SAC (matmuls kept)" if selective else "per block")] = \
                step_of(wrapped, x, y)
    for every, wrapped in hf_every.items():
        if wrapped is not None:
            step = step_of(wrapped, x, y)
            step.model = wrapped  # a copy: its own gradients to free before a measured step
            steps["hf checkpointing " + ("every layer" if every == 1 else f"every {every}nd "
                                         "layer")] = step
    for fraction in (1.0, *fractions):
        steps[f"compile budget {fraction}"] = compiled(model, fraction, x, y)
    peaks = {}
    for key, step in steps.items():
        step()  # warm: the first step allocates what later ones reuse
        getattr(step, "model", model).zero_grad(set_to_none=True)
        peaks[key] = revnets.allocator_peak(step, device)
    seconds = interleaved_times(steps, repeats).seconds
    eager = statistics.median(seconds["eager"])
    rows = [{"model": name, "method": key, "peak_mib": round(peaks[key] / MiB, 2),
             "time_ratio": round(statistics.median(seconds[key]) / eager, 3)} for key in steps]
    for row in rows:
        row["beaten_by"] = beaten_by(row, rows)
    return rows


def beaten_by(row: dict, rows: list[dict]) -> str:
    """The fastest torch.compile point of ``rows`` that reaches no more memory than ``row`` in
    less time, or "" (``row`` is at or below compile's curve, or lower than it reaches)."""
    better = [r for r in rows if family_of(r["method"]) == "compile" and r is not row
              and r["peak_mib"] <= row["peak_mib"] and r["time_ratio"] < row["time_ratio"]]
    return min(better, key=lambda r: r["time_ratio"])["method"] if better else ""


def in_processes(name: str, processes: int, argv: list[str]) -> list[dict]:
    """One model's rows measured in ``processes`` fresh processes of this script, each row
    with the process it came from."""
    rows = []
    for run in range(processes):
        with tempfile.TemporaryDirectory() as folder:
            subprocess.run([sys.executable, __file__, *argv, "--only", name, "--processes", "1",
                            "--results", folder], check=True)
            found = read_csv(next(Path(folder).glob("*.csv")))
        rows += [{"process": run, **row} for row in found]
    return rows


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(","))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == name]
        for color, family in enumerate(FAMILIES):
            for process in sorted({r.get("process", 0) for r in mine}):
                points = sorted((r["peak_mib"], r["time_ratio"]) for r in mine
                                if family_of(r["method"]) == family
                                and r.get("process", 0) == process)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], "o-",
                            color=f"C{color}", alpha=1.0 if process == 0 else 0.5,
                            label=family if process == 0 else None)
        ax.set_title(name)
        ax.set_xlabel("step peak above parameters (MiB)")
        ax.set_ylabel("step time / eager")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--keeps", type=_floats, default=None,
                        help="revnets' budgets, as shares of the activation part kept "
                             f"(default: {','.join(map(str, KEEPS))}; every other with --quick)")
    parser.add_argument("--fractions", type=_floats, default=None,
                        help="torch.compile's activation_memory_budget values besides 1.0 "
                             f"(default: {','.join(map(str, FRACTIONS))}; every other with "
                             "--quick)")
    parser.add_argument("--batch-scale", type=int, default=1,
                        help="each model's batch times this (default: %(default)s)")
    parser.add_argument("--processes", type=int, default=1,
                        help="fresh processes each model is measured in (default: %(default)s)")
    args = parser.parse_args(argv)
    keeps = args.keeps or (KEEPS[::2] if args.quick else KEEPS)
    fractions = args.fractions or (FRACTIONS[::2] if args.quick else FRACTIONS)
    device = torch.device(args.device)
    # Every plan and copy of a model compiled in one process: its modules' frames are compiled
    # once for each (guards on the module objects); past dynamo's default of 8 they would run
    # eagerly, unnoticed.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    rows = []
    argv = sys.argv[1:] if argv is None else argv
    only = set(args.only.split(",")) if args.only else None
    for name, build in cases(args.quick, args.batch_scale).items():
        if only is None or name in only:
            found = (in_processes(name, args.processes, argv) if args.processes > 1 else
                     frontier(name, build, args.repeats, device, keeps, fractions))
            for row in found:
                print("  ", row, flush=True)
                rows.append(row)
    stem = results_stem("frontier", device.type) + ("-quick" if args.quick else "") + (
        f"-batch{args.batch_scale}x" if args.batch_scale != 1 else "") + (
        f"-{args.only}" if args.only else "")
    write_csv(args.results / f"{stem}.csv", rows)
    plot(rows, args.results / f"{stem}.png")
    lines = [
        "# Step time against peak memory",
        "",
        provenance(" ".join(["frontier.py", *argv]), args.device),
        "",
        (
            "Peak: the CUDA caching allocator's peak during one training step above its count "
            "at the start (gradients freed; `max_memory_allocated`, the same meter for eager, "
            "planned and compiled steps). "
            if device.type == "cuda" else
            "Peak: the CPU allocator's live bytes at their highest during one training step "
            "above where they were at its start (gradients freed), from torch.profiler's memory "
            "events (the same meter for eager, planned and compiled steps). "
        ) + "Time: median of "
        f"{args.repeats} interleaved steps over the eager step's. revnets: `auto_checkpoint` "
        "at budgets keeping the given share of the activation part of the eager peak, and at "
        "the smallest budget a refusal names where one was refused, and for Hugging Face "
        "models at the peak `revnets.measure_memory` measures under transformers' "
        "checkpointing of every layer (at hf's peak), every plan of a model on "
        "one measurement of its forward times (`revnets.forward_times`); revnets + compile: "
        "plans at the same budgets made for a compiled model (`auto_checkpoint(..., "
        "compiled=True)`: "
        "products kept, cheap steps recomputed) under `torch.compile` (default budget); compile: "
        "`torch.compile` under `torch._functorch.config.activation_memory_budget`; torch "
        "checkpoint: `torch.utils.checkpoint` around each repeated block, all recomputed or "
        "selectively (matmul, convolution and attention outputs kept). Beaten by: the fastest "
        "torch.compile point of the same process that reaches no more memory in less time.",
        "",
        f"![frontier]({stem}.png)",
        "",
        "| model | process | method | peak (MiB) | time / eager | beaten by |",
        "|---|---|---|---|---|---|",
        *[f"| {r['model']} | {r.get('process', 0)} | {r['method']} | {r['peak_mib']} | "
          f"{r['time_ratio']} | {r['beaten_by']} |" for r in rows],
    ]
    write_markdown(args.results / f"{stem}.md", lines)


if __name__ == "__main__":
    main(sys.argv[1:])
