"""The trainer's settings, resolved once from the Hydra config into small typed records that the
trainer's helpers take (the model factory, the data, the optimiser, the report): nothing past
:meth:`Settings.of` reads the config.

Settings that would train nothing are refused before anything runs: a step count, a batch or an
interval that is zero or negative does not fail on its own, it trains nothing (``range(0)``
micro-batches, no steps) and exits as if it had, or fails much later inside torch. An image size
the model cannot take is refused by the model's own rule (``input_size_problem``) before the
first step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from revnets.plan import MemoryPlan
from revnets.training.distributed import parse_mode
from revnets.training.memory_options import AutoPlan, memory_plan_from_config

__all__ = [
    "DataSettings",
    "ModelSettings",
    "OptimSettings",
    "Settings",
    "SettingsError",
    "TrainerSettings",
    "check_image_size",
    "check_sequence_length",
    "check_settings",
]


class SettingsError(ValueError):
    """A trainer or data setting out of its range; the message names the key and the fix."""


@dataclass(frozen=True)
class ModelSettings:
    """The model: ``name`` for ``timm.create_model`` (or ``hf:<a transformers class>``),
    ``exact`` its reversible stages' arithmetic, ``keywords`` the other keys of its group
    (``+model.units=[2,2,2]``; a Hugging Face config's keys)."""

    name: str
    drop_rate: float = 0.0
    exact: bool = False
    keywords: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DataSettings:
    """The data group: which set, its size and batch (the global batch, split across
    processes), where it lies."""

    name: str
    num_classes: int
    batch_size: int
    num_workers: int = 0
    image_size: int | None = None
    train_size: int | None = None
    val_size: int | None = None
    root: str | None = None
    download: bool = False
    augment: bool = False
    sequence_length: int | None = None  # text: the tokens of a sample


@dataclass(frozen=True)
class OptimSettings:
    """The optimiser, made from its parameter groups, and the learning-rate schedule."""

    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
    schedule: str = "constant"
    milestones: tuple[float, ...] = ()
    gamma: float = 0.1
    warmup_steps: int = 0


@dataclass(frozen=True)
class TrainerSettings:
    device: str = "auto"
    precision: str = "fp32"
    max_steps: int = 40
    epochs: int | None = None
    accumulate: int = 1
    log_every: int = 5
    eval_every: int | None = None
    checkpoint_every: int | None = 20
    resume: str | None = None
    compile: bool = False
    distributed: str = "none"  # parse_mode's: none, ddp or fsdp
    memory_report: bool = True
    tensorboard: bool = False


@dataclass(frozen=True)
class Settings:
    """A run's settings: ``memory`` is the plan the ``memory`` group asks for (None: the model's
    own; an :class:`AutoPlan`: planned within a budget), ``config`` the resolved config, as a
    checkpoint keeps it."""

    seed: int
    model: ModelSettings
    data: DataSettings
    optim: OptimSettings
    trainer: TrainerSettings
    memory: MemoryPlan | AutoPlan | None
    config: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, cfg: DictConfig) -> Settings:
        """Resolve ``cfg`` once (interpolations, the memory plan, the optimiser's partial)."""
        tree = OmegaConf.to_container(cfg, resolve=True)
        model = dict(tree["model"])
        keywords = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items()
                    if k not in ("name", "drop_rate", "exact")}
        optim = dict(tree["optim"])
        trainer = dict(tree["trainer"])
        trainer["distributed"] = parse_mode(trainer.get("distributed"))
        return cls(
            seed=tree["seed"],
            model=ModelSettings(model["name"], model.get("drop_rate", 0.0),
                                bool(model.get("exact", False)), keywords),
            data=_record(DataSettings, "data", tree["data"]),
            optim=OptimSettings(
                hydra.utils.instantiate(cfg.optim.optimizer), optim.get("schedule", "constant"),
                tuple(optim.get("milestones") or ()), optim.get("gamma", 0.1),
                optim.get("warmup_steps", 0)),
            trainer=_record(TrainerSettings, "trainer", trainer),
            memory=memory_plan_from_config(cfg.memory),
            config=tree,
        )


def check_settings(settings: Settings, world_size: int = 1) -> None:
    """Refuse settings no run can use: counts below one, micro-batches with no sample."""
    trainer, data = settings.trainer, settings.data
    positive = [("trainer.accumulate", trainer.accumulate),
                ("trainer.log_every", trainer.log_every), ("data.batch_size", data.batch_size)]
    # Intervals: 0 or None mean never (the loop tests them for truth).
    intervals = [("trainer.eval_every", trainer.eval_every),
                 ("trainer.checkpoint_every", trainer.checkpoint_every)]
    if trainer.epochs is None:
        positive.append(("trainer.max_steps", trainer.max_steps))
    for key in ("num_classes", "image_size", "train_size", "val_size", "sequence_length"):
        if getattr(data, key) is not None:
            positive.append((f"data.{key}", getattr(data, key)))
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


def check_image_size(settings: Settings, model: nn.Module, size: int | None) -> None:
    """Refuse the data's ``size`` x ``size`` images where the model says it cannot take them:
    i-RevNet's space to depth needs multiples of its reduction, a Rev-ViT its position
    embedding's size. The model states its rule (``input_size_problem``) rather than this file
    keeping a number per model; a model without one (the ResNets and RevNets pool adaptively)
    takes any size."""
    rule = getattr(model, "input_size_problem", None)
    problem = None if rule is None or size is None else rule(size, size)
    if problem is None:
        return
    if settings.data.image_size is not None:
        fix = "set data.image_size to a size it takes"
        given = f"data.image_size={size}"
    else:  # CIFAR's images are what they are
        fix = "choose a model that takes them"
        given = f"data={settings.data.name} ({size}x{size} images)"
    raise SettingsError(
        f"{given} does not fit model={settings.model.name}: {problem}; {fix} (a model keyword "
        "is given as +model.<key>=...)"
    )


def check_sequence_length(settings: Settings, model: nn.Module) -> None:
    """Refuse samples of more tokens than a language model's config gives positions for
    (``n_positions``, ``max_position_embeddings``)."""
    config, length = getattr(model, "config", None), settings.data.sequence_length
    for key in ("n_positions", "max_position_embeddings"):
        positions = getattr(config, key, None)
        if isinstance(positions, int) and length is not None and length > positions:
            raise SettingsError(
                f"data.sequence_length={length} is more than model={settings.model.name}'s "
                f"{positions} positions ({key}); set data.sequence_length to at most "
                f"{positions}, or model.{key} to at least {length}")


def _record(kind: type, group: str, values: dict[str, Any]) -> Any:
    known = {f.name for f in fields(kind)}
    unknown = [key for key in values if key not in known]
    if unknown:
        raise SettingsError(
            f"{group}.{unknown[0]} is not a setting of the {group} group; its settings: "
            f"{', '.join(sorted(known))}"
        )
    return kind(**values)


def _check_count(key: str, value: Any, alternative: str = "", least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        also = f" {alternative}" if alternative else ""
        raise SettingsError(
            f"{key} must be a whole number of at least {least}{also}, got {value!r}")
