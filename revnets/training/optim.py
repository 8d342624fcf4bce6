"""Optimizer and learning-rate schedule from the ``optim`` config group."""

from __future__ import annotations

import math
from typing import Any

import hydra
import torch
from torch import nn

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    """``cfg.optimizer`` is a partial ``_target_`` (torch.optim.SGD, AdamW...) given the params.

    Weight decay is not applied to BatchNorm parameters and biases, as in the papers' code.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim > 1 else no_decay).append(p)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return hydra.utils.instantiate(cfg.optimizer)(groups)


def lr_factor(cfg: Any, step: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based) of ``total_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "step":
        # milestones are fractions of the run: the RevNet recipe decays at 40k and 60k of 80k.
        passed = sum(step >= round(m * total_steps) for m in cfg.milestones)
        return cfg.gamma**passed
    if cfg.schedule == "cosine":
        span = max(total_steps - cfg.warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup_steps) / span))
    raise ValueError(
        f"unknown optim.schedule {cfg.schedule!r}; valid: 'step', 'cosine', 'constant'"
    )


def build_scheduler(
    cfg: Any, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg, step, total_steps)
    )
