"""The zoo model a training config names, with the memory plan it asks for."""

from __future__ import annotations

import timm
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

import revnets  # noqa: F401  (registers the zoo with timm)
from revnets.plan import MemoryPlan, parse_memory_plan

__all__ = ["create_model"]


def create_model(
    cfg: DictConfig, device: torch.device | str = "cpu", memory: MemoryPlan | None = None
) -> nn.Module:
    """The zoo model ``cfg.model.name`` under ``memory`` (default: ``cfg.memory.strategy``,
    parsed here, or the model's own default when that is null); any other key of ``cfg.model``
    (``+model.units=[2,2,2]``) is a keyword of its builder."""
    extra = OmegaConf.to_container(cfg.model, resolve=True)
    extra = {k: tuple(v) if isinstance(v, list) else v for k, v in extra.items()
             if k not in ("name", "drop_rate")}
    if memory is None and cfg.memory.strategy is not None:
        memory = parse_memory_plan(cfg.memory.strategy)
    with torch.device(device):
        return timm.create_model(
            cfg.model.name,
            num_classes=cfg.data.num_classes,
            memory=memory,
            drop_rate=cfg.model.drop_rate,
            **extra,
        )
