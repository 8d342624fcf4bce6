"""The zoo model a training config names, with the memory plan it asks for."""

from __future__ import annotations

import timm
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

import revnets  # noqa: F401  (registers the zoo with timm)
from revnets.plan import MemoryPlan
from revnets.training.memory_options import MemoryConfigError, memory_plan_from_config

__all__ = ["create_model"]


def create_model(
    cfg: DictConfig, device: torch.device | str = "cpu", memory: MemoryPlan | None = None
) -> nn.Module:
    """The zoo model ``cfg.model.name`` under ``memory`` (default: the plan ``cfg.memory`` asks
    for, or the model's own with ``memory=default``); any other key of ``cfg.model``
    (``+model.units=[2,2,2]``) is a keyword of its builder."""
    extra = OmegaConf.to_container(cfg.model, resolve=True)
    extra = {k: tuple(v) if isinstance(v, list) else v for k, v in extra.items()
             if k not in ("name", "drop_rate")}
    if memory is None:
        memory = memory_plan_from_config(cfg.memory)
    with torch.device(device):
        model = timm.create_model(
            cfg.model.name, num_classes=cfg.data.num_classes, drop_rate=cfg.model.drop_rate,
            **extra,
        )
        if memory is not None:
            try:  # on the weights as built; a refusal names the presets the model can follow
                model.set_memory(memory)
            except ValueError as error:
                raise MemoryConfigError(f"model={cfg.model.name}: {error}") from None
    return model
