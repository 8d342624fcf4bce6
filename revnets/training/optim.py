"""Optimizer and learning-rate schedule from the ``optim`` config group."""

from __future__ import annotations

import math

import torch
from torch import nn

from revnets.training.settings import OptimSettings

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(optim: OptimSettings, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``optim.make`` makes (the group's partial ``_target_``: torch.optim.SGD,
    AdamW...) over the model's trainable parameters.

    Weight decay is not applied to BatchNorm parameters and biases, as in the papers' code.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim > 1 else no_decay).append(p)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return optim.make(groups)


def lr_factor(optim: OptimSettings, step: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based) of ``total_steps``."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    if optim.schedule == "step":
        # milestones are fractions of the run: the RevNet recipe decays at 40k and 60k of 80k.
        passed = sum(step >= round(m * total_steps) for m in optim.milestones)
        return optim.gamma**passed
    if optim.schedule == "cosine":
        span = max(total_steps - optim.warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * (step - optim.warmup_steps) / span))
    raise ValueError(
        f"unknown optim.schedule {optim.schedule!r}; valid: 'step', 'cosine', 'constant'"
    )


def build_scheduler(
    optim: OptimSettings, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(optim, step, total_steps)
    )
