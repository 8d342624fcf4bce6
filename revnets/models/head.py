"""The zoo CNNs' classifier head, as timm's CNNs have it: average pooling (or none), dropout, a
linear layer."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["PooledClassifier", "check_pool", "new_classifier"]


def new_classifier(model: nn.Module, num_features: int, num_classes: int) -> nn.Module:
    """A linear classifier for ``num_classes`` (0: none), on the device, in the dtype and in the
    training mode of ``model``, as timm's ``reset_classifier`` builds its heads."""
    if not num_classes:
        return nn.Identity().train(model.training)
    like = next(model.parameters(), None)
    placement = dict(device=like.device, dtype=like.dtype) if like is not None else {}
    return nn.Linear(num_features, num_classes, **placement).train(model.training)


def check_pool(owner: str, global_pool: str) -> None:
    if global_pool not in ("avg", ""):
        raise ValueError(
            f"{owner}: global_pool must be 'avg' (average pooling) or '' (none: feature "
            f"maps), got {global_pool!r}"
        )


class PooledClassifier:
    """Mixin for models with ``global_pool``, ``num_classes``, ``num_features``, ``head_drop`` and
    ``fc``: timm's classifier interface over them."""

    global_pool: str
    num_classes: int
    num_features: int
    head_drop: nn.Module
    fc: nn.Module

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new classifier for ``num_classes`` (0: none); ``global_pool=''`` makes the model
        return unpooled feature maps, as timm's CNNs do."""
        if global_pool is not None:
            check_pool(type(self).__name__, global_pool)
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.fc = new_classifier(self, self.num_features, num_classes)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x.mean((2, 3))
        elif self.num_classes and not pre_logits:
            raise ValueError(
                f"{type(self).__name__}: global_pool='' returns feature maps, which a linear "
                "classifier cannot take; use num_classes=0 (timm.create_model(name, "
                "num_classes=0, global_pool='')) or global_pool='avg'"
            )
        x = self.head_drop(x)
        return x if pre_logits else self.fc(x)
