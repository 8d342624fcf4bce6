"""Training state on disk: atomic checkpoints and exact resume; a sharded (FSDP2) run's weights
and optimizer state through torch.distributed.checkpoint, each rank writing its own shards."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CHECKPOINT_NAME",
    "capture_rng",
    "load_checkpoint",
    "load_sharded",
    "restore_rng",
    "save_checkpoint",
    "save_sharded",
]

CHECKPOINT_NAME = "checkpoint.pt"


def capture_rng() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` so that a crash at any moment leaves the previous checkpoint intact:
    write a temporary file, flush it to disk, then atomically rename it over the old one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    run_dir = Path(run_dir).expanduser()
    path = run_dir / CHECKPOINT_NAME if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise FileNotFoundError(
            f"trainer.resume={run_dir}: no checkpoint there (expected {run_dir / CHECKPOINT_NAME})"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def save_sharded(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 dist_state: Any) -> str:
    """Write the model's and optimizer's shards with torch.distributed.checkpoint (every rank
    calls this) into a folder of ``run_dir`` named after ``step``; returns the folder's name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = f"checkpoint-step{step}.dcp"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state},
             checkpoint_id=Path(run_dir) / name)
    dist_state.barrier()
    return name


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what :func:`save_sharded` wrote into an already sharded model and its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
