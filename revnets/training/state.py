"""Training state on disk: atomic checkpoints and exact resume."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_NAME", "capture_rng", "load_checkpoint", "restore_rng", "save_checkpoint"]

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
