"""revnets side by side with MemCNN, revlib and RevTorch on the same reversible stack.

Every library wraps copies of the very same f and g modules (conv3x3(64)-BatchNorm-ReLU, 128
channels, 32x32, batch 32) under the same head and loss as benchmarks/reversible_stack.py. For each:
peak memory of a training step above model state at several depths, step time against ordinary
autograd (interleaved), BatchNorm updates per step (num_batches_tracked after one step; correct is
1) and the gradient error against ordinary autograd after one step.

    pip install -e '.[bench]'        # memcnn, revlib, revtorch
    python benchmarks/peers.py       # writes results/peers-cpu-pt<ver>-fp32.{md,csv}
    python benchmarks/peers.py --device cuda   # on a GPU: the allocator's peak, synchronized times
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import warnings

import torch
import torch.utils.checkpoint
from torch import nn

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
from reversible_stack import unit

warnings.filterwarnings("ignore", category=FutureWarning)  # peers use deprecated torch.cuda.amp
HALF, BATCH, SIZE = 64, 32, 32


class TorchCheckpointPerBlock(nn.Module):
    """Plain torch.utils.checkpoint around each block: what most users reach for first."""

    def __init__(self, blocks: list[revnets.ReversibleBlock]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


REVNETS_STORED = "revnets, last block stored"
REVNETS_CHECKPOINT = "revnets checkpoint"
OURS = ("none", "revnets", REVNETS_STORED, "torch checkpoint", REVNETS_CHECKPOINT)


def wrap(library: str, pairs: list[tuple[nn.Module, nn.Module]]) -> nn.Module:
    """The stack of (f, g) pairs as ``library`` builds a reversible sequence."""
    if library in ("revnets", REVNETS_STORED, "none"):
        blocks = [revnets.ReversibleBlock(f, g) for f, g in pairs]
        if library == "none":
            return revnets.ReversibleSequence(blocks, revnets.Store())
        stored = int(library == REVNETS_STORED)
        return revnets.ReversibleSequence(blocks, revnets.Reconstruct(store_last_blocks=stored))
    if library == "torch checkpoint":
        return TorchCheckpointPerBlock([revnets.ReversibleBlock(f, g) for f, g in pairs])
    if library == REVNETS_CHECKPOINT:  # the same, with revnets' replaying checkpoint
        return nn.Sequential(*(revnets.Checkpointed(revnets.ReversibleBlock(f, g))
                               for f, g in pairs))
    if library == "memcnn":
        import memcnn

        return nn.Sequential(*(
            memcnn.InvertibleModuleWrapper(memcnn.AdditiveCoupling(Fm=f, Gm=g), keep_input=False,
                                           keep_input_inverse=False, preserve_rng_state=True)
            for f, g in pairs
        ))
    if library == "revlib":
        import revlib

        return revlib.ReversibleSequential(*(m for pair in pairs for m in pair), split_dim=1)
    if library == "revtorch":
        import revtorch

        return revtorch.ReversibleSequence(
            nn.ModuleList(revtorch.ReversibleBlock(f, g) for f, g in pairs)
        )
    raise ValueError(library)


class Model(nn.Module):
    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.body = body
        self.head = copy.deepcopy(head)

    def canonical_parameters(self) -> list[nn.Parameter]:
        """f's then g's parameters block by block, then the head's: libraries register them in
        different orders (MemCNN puts g first)."""
        modules = [m for pair in self.pairs for m in pair]
        return [p for m in modules for p in m.parameters()] + list(self.head.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def timed_step(model: nn.Module, optimizer: torch.optim.Optimizer, x, target) -> None:
    train_step(model, optimizer, fresh(x), target)


def available(libraries: list[str]) -> list[str]:
    found = []
    for library in libraries:
        try:
            if library not in OURS:
                __import__(library)
            found.append(library)
        except ImportError:
            print(f"  {library} is not installed (pip install -e '.[bench]'): skipped")
    return found


def build(library: str, depth: int, device: str = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    with torch.device(device):
        pairs = [(unit(HALF), unit(HALF)) for _ in range(depth)]
        head = nn.Linear(2 * HALF, 10)
    model = Model(wrap(library, pairs), head)
    model.pairs = tuple(pairs)  # a tuple: kept for reference, not registered a second time
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, optimizer


def data(device: str = "cpu", batch: int = BATCH, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2 * HALF, SIZE, SIZE, generator=generator)
    target = torch.randint(0, 10, (batch,), generator=generator)
    return x.to(device), target.to(device)


def fresh(x: torch.Tensor) -> torch.Tensor:
    # MemCNN frees its input's storage in place, so every step gets its own copy of the batch.
    # It requires grad, as the output of a stem would: revlib and RevTorch compute no parameter
    # gradients at all when the input of the reversible sequence does not.
    return x.clone().requires_grad_(True)


def correctness(library: str, device: str = "cpu") -> tuple[int, float]:
    """(BatchNorm updates in one train_step, largest relative gradient error against autograd)."""
    x, target = data(device)
    grads = {}
    for lib in ("none", library):
        model, optimizer = build(lib, 4, device)
        model.train()
        train_step(model, optimizer, fresh(x), target)
        grads[lib] = [p.grad for p in model.canonical_parameters()]
        bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
        updates = int(bn.num_batches_tracked)
    error = max(((a - b).norm() / b.norm()).item() for a, b in zip(grads[library], grads["none"]))
    return updates, error


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args(argv)
    libraries = available([*OURS, "memcnn", "revlib", "revtorch"])
    x, target = data(args.device, args.batch)

    rows = []
    for library in libraries:
        row: dict = {"library": library}
        for depth in args.depths:
            model, optimizer = build(library, depth, args.device)
            train_step(model, optimizer, fresh(x), target)
            report = revnets.measure_memory(train_step, model, optimizer, fresh(x), target)
            row[f"mib_depth{depth}"] = round(report.above_model_state_bytes / MiB, 1)
        row["bn_updates_per_step"], row["grad_rel_error"] = correctness(library, args.device)
        rows.append(row)
        print("  ", row, flush=True)

    depth = args.depths[0]
    models = {library: build(library, depth, args.device) for library in libraries}
    timings = interleaved_times(
        {library: functools.partial(timed_step, *models[library], x, target)
         for library in libraries},
        args.repeats,
    )
    for row in rows:
        summary = ratio_summary(timings.seconds[row["library"]], timings.seconds["none"])
        row["step_ratio"] = summary["ratio"]
        row["ratio_min"], row["ratio_max"] = summary["ratio_min"], summary["ratio_max"]
        print(f"  speed {row['library']:<17} {row['step_ratio']:.3f}x", flush=True)

    on_gpu = torch.device(args.device).type == "cuda"
    stem = results_stem("peers", torch.device(args.device).type)
    stem += f"-batch{args.batch}" if args.batch != BATCH else ""
    write_csv(RESULTS / f"{stem}.csv", rows)
    versions = []
    for library in libraries:
        if library in ("memcnn", "revlib", "revtorch"):
            from importlib.metadata import version

            versions.append(f"{library} {version(library)}")
    depth_cols = " | ".join(f"depth {d} (MiB)" for d in args.depths)
    lines = [
        "# revnets side by side with other reversible-network libraries",
        "",
        provenance(" ".join(["peers.py", *(sys.argv[1:] if argv is None else argv)]), args.device)
        + " Peers: " + (", ".join(versions) or "none installed") + ".",
        "",
        f"The same f and g (conv3x3({HALF})-BatchNorm-ReLU), input {args.batch}x{2 * HALF}x"
        f"{SIZE}x{SIZE}, average pooling, linear head, cross-entropy, SGD. Memory: peak of a "
        "training step above parameters, gradients and optimizer state ("
        + ("the CUDA caching allocator's peak" if on_gpu else "live tensor storage")
        + "). Time: median "
        f"of {args.repeats} interleaved steps at depth {depth} (order rotated each round, garbage "
        "collector paused, after the memory runs"
        + (", the GPU synchronized around each step" if on_gpu else "")
        + "), over `none` (ordinary autograd on "
        "the same blocks); min and max of the paired ratios. BN updates: `num_batches_tracked` "
        "after one training step (1 is correct). Gradient error: largest relative error against "
        "ordinary autograd after one step at depth 4. The input requires grad (as a stem's output "
        "would): revlib and RevTorch return no parameter gradients otherwise.",
        "",
        f"| library | {depth_cols} | time ratio | min | max | BN updates | gradient error |",
        "|---|" + "---|" * (len(args.depths) + 5),
    ]
    for r in rows:
        mem = " | ".join(f"{r[f'mib_depth{d}']:.1f}" for d in args.depths)
        lines.append(
            f"| {r['library']} | {mem} | {r['step_ratio']:.3f} | {r['ratio_min']:.3f} | "
            f"{r['ratio_max']:.3f} | {r['bn_updates_per_step']} | {r['grad_rel_error']:.1e} |"
        )
    write_markdown(RESULTS / f"{stem}.md", lines)


if __name__ == "__main__":
    main(sys.argv[1:])
