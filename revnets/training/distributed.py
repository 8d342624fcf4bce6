"""Multi-process training with torchrun and DistributedDataParallel (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Distributed", "all_finite", "setup_distributed"]


@dataclass(frozen=True)
class Distributed:
    enabled: bool = False
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def shutdown(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def setup_distributed(enabled: bool) -> Distributed:
    if not enabled:
        return Distributed()
    if "RANK" not in os.environ:
        raise RuntimeError(
            "trainer.distributed=true expects to be started by torchrun, e.g. "
            "torchrun --nproc_per_node=2 train.py trainer.distributed=true"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend)
    return Distributed(True, dist.get_world_size(), dist.get_rank(), local_rank)


def all_finite(value: torch.Tensor, state: Distributed) -> bool:
    """Whether ``value`` is finite on every process (all must stop together, or none)."""
    finite = torch.isfinite(value).all().to(torch.int32).reshape(1)
    if state.enabled:
        finite = finite.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())
