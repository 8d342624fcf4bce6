"""The zoo model a training run names, with the memory plan it asks for."""

from __future__ import annotations

import timm
import torch
from torch import nn

import revnets  # noqa: F401  (registers the zoo with timm)
from revnets.plan import MemoryPlan
from revnets.training.memory_options import MemoryConfigError
from revnets.training.settings import ModelSettings

__all__ = ["create_model"]


def create_model(
    model: ModelSettings, num_classes: int, device: torch.device | str = "cpu",
    memory: MemoryPlan | None = None,
) -> nn.Module:
    """The zoo model ``model.name`` under ``memory`` (None: the model's own plan); ``exact``
    and every other key of the model group (``+model.units=[2,2,2]``) are keywords of its
    builder."""
    with torch.device(device):
        built = timm.create_model(
            model.name, num_classes=num_classes, drop_rate=model.drop_rate,
            **({"exact": True} if model.exact else {}), **model.keywords,
        )
        if memory is not None:
            try:  # on the weights as built; a refusal names the presets the model can follow
                built.set_memory(memory)
            except ValueError as error:
                raise MemoryConfigError(f"model={model.name}: {error}") from None
    return built
