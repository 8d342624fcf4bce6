"""Multi-process training under torchrun: DistributedDataParallel or FSDP2 (``fully_shard``),
NCCL on GPU, gloo on CPU.

FSDP2 shards each :class:`~revnets.ReversibleSequence` as one unit, then the model's root (the
stem, strided transitions and head). A sequence is the smallest unit that works: its engine hands
autograd all of the sequence's parameters at once and reverses it block by block in one backward
call, so every block's parameters must be gathered for the whole of that call. The sequences keep
their parameters gathered from forward to backward (``reshard_after_forward=False``): the engine
checks that nothing rewrote a parameter in between, and a re-gather is such a write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from revnets.reversible import ReversibleSequence

__all__ = ["MODES", "Distributed", "all_finite", "parse_mode", "setup_distributed", "shard_model"]

MODES = ("none", "ddp", "fsdp")


def parse_mode(value: bool | str | None) -> str:
    """``trainer.distributed`` as one of :data:`MODES`; the old booleans keep their meaning
    (``true`` is DDP)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "ddp"
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    raise ValueError(
        f"trainer.distributed={value!r} is not one of {', '.join(MODES)} (none: one process; "
        "ddp: DistributedDataParallel; fsdp: FSDP2 fully_shard, both under torchrun)"
    )


@dataclass(frozen=True)
class Distributed:
    mode: str = "none"
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def shutdown(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def setup_distributed(mode: bool | str | None) -> Distributed:
    mode = parse_mode(mode)
    if mode == "none":
        return Distributed()
    if "RANK" not in os.environ:
        raise RuntimeError(
            f"trainer.distributed={mode} expects to be started by torchrun, e.g. "
            f"torchrun --nproc_per_node=2 train.py trainer.distributed={mode}"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend)
    return Distributed(mode, dist.get_world_size(), dist.get_rank(), local_rank)


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2 over ``model`` in place: each reversible sequence, then the root (module
    docstring). Build the optimizer afterwards: sharding replaces the parameters."""
    from torch.distributed.fsdp import fully_shard

    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    for sequence in sequences:
        fully_shard(sequence, reshard_after_forward=False)
    fully_shard(model)
    return model


def all_finite(value: torch.Tensor, state: Distributed) -> bool:
    """Whether ``value`` is finite on every process (all must stop together, or none)."""
    finite = torch.isfinite(value).all().to(torch.int32).reshape(1)
    if state.enabled:
        finite = finite.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())
