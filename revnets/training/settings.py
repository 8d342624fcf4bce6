"""The trainer's numeric settings checked before anything runs: a step count, a batch or an interval
that is zero or negative does not fail on its own, it trains nothing (``range(0)`` micro-batches,
no steps) and exits as if it had, or fails much later inside torch. An image size the model cannot
take is refused by the model's own rule (``input_size_problem``) before the first step."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from torch import nn

__all__ = ["SettingsError", "check_image_size", "check_settings"]


class SettingsError(ValueError):
    """A trainer or data setting out of its range; the message names the key and the fix."""


def check_settings(cfg: DictConfig, world_size: int = 1) -> None:
    """Refuse settings no run can use: counts below one, micro-batches with no sample."""
    trainer, data = cfg.trainer, cfg.data
    positive = [("trainer.accumulate", trainer.accumulate),
                ("trainer.log_every", trainer.log_every), ("data.batch_size", data.batch_size)]
    # Intervals: 0 or null means never (the loop tests them for truth).
    intervals = [("trainer.eval_every", trainer.eval_every),
                 ("trainer.checkpoint_every", trainer.checkpoint_every)]
    if trainer.epochs is None:
        positive.append(("trainer.max_steps", trainer.max_steps))
    for key in ("num_classes", "image_size", "train_size", "val_size"):
        if data.get(key) is not None:
            positive.append((f"data.{key}", data[key]))
    for key, value in positive:
        _check_count(key, value)
    if trainer.epochs is not None:
        _check_count("trainer.epochs", trainer.epochs, "or null")
    for key, value in intervals:
        if value is not None:
            _check_count(key, value, "(0 or null: never)", least=0)
    per_rank = data.batch_size // world_size
    if trainer.accumulate > per_rank:
        raise SettingsError(
            f"trainer.accumulate={trainer.accumulate} splits a batch of {per_rank} samples per "
            f"process into more micro-batches than it has samples; set trainer.accumulate to at "
            f"most {per_rank}, or raise data.batch_size"
        )


def check_image_size(cfg: DictConfig, model: nn.Module, size: int) -> None:
    """Refuse the data's ``size`` x ``size`` images where the model says it cannot take them:
    i-RevNet's space to depth needs multiples of its reduction, a Rev-ViT its position
    embedding's size. The model states its rule (``input_size_problem``) rather than this file
    keeping a number per model; a model without one (the ResNets and RevNets pool adaptively)
    takes any size."""
    rule = getattr(model, "input_size_problem", None)
    problem = None if rule is None else rule(size, size)
    if problem is None:
        return
    if cfg.data.get("image_size") is not None:
        fix = "set data.image_size to a size it takes"
        given = f"data.image_size={size}"
    else:  # CIFAR's images are what they are
        fix = "choose a model that takes them"
        given = f"data={cfg.data.name} ({size}x{size} images)"
    raise SettingsError(
        f"{given} does not fit model={cfg.model.name}: {problem}; {fix} (a model keyword is "
        "given as +model.<key>=...)"
    )


def _check_count(key: str, value: Any, alternative: str = "", least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        also = f" {alternative}" if alternative else ""
        raise SettingsError(
            f"{key} must be a whole number of at least {least}{also}, got {value!r}")
