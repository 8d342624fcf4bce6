"""Memory plans as Hydra keys: ``python train.py memory=reversible memory.store_last_blocks=2``.

A config of the ``memory`` group (configs/memory/) names a preset (``preset``, null for the model's
own default); its options are the fields of that preset's stages' decision
(:func:`revnets.plan.preset_options`). They are declared once here as a typed schema, made from
those fields and registered in Hydra's ConfigStore, so Hydra accepts them as keys and checks their
types; :func:`memory_plan_from_config` builds the plan from them, the one place a config becomes a
:class:`~revnets.plan.MemoryPlan`. A field added to a decision needs nothing here.

``memory=auto memory.budget=2GiB`` asks :func:`revnets.auto_checkpoint` for a plan of any model
(the zoo's, timm's, a Hugging Face one) within a byte budget: the config becomes an
:class:`AutoPlan`, its budget read here once (:func:`parse_size`), and the trainer plans the
model it built with it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields, make_dataclass
from typing import Optional, get_args, get_type_hints

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from revnets.plan import PRESETS, MemoryPlan, plan_from_options, preset_options

__all__ = [
    "AUTO",
    "SCHEMA_NAME",
    "AutoPlan",
    "MemoryConfigError",
    "MemoryOptions",
    "check_memory_overrides",
    "memory_plan_from_config",
    "parse_size",
]

SCHEMA_NAME = "memory_options"  # configs/memory/*.yaml extend it: `- /memory_options@_here_`
AUTO = "auto"  # the preset that plans under memory.budget
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


class MemoryConfigError(ValueError):
    """A memory config that names no plan the model can follow: an unknown preset or option, a
    value out of range, or a plan the model refuses."""


def _option_types() -> dict[str, type]:
    """Each option's type, without the None it may allow (every key is optional in a config)."""
    types: dict[str, type] = {}
    for plan in PRESETS.values():
        decision = type(plan.stages)
        hints = get_type_hints(decision)
        for field in fields(decision):
            kinds = [kind for kind in get_args(hints[field.name]) if kind is not type(None)]
            types[field.name] = kinds[0] if kinds else hints[field.name]
    return types


@dataclass(frozen=True)
class AutoPlan:
    """``memory=auto``: the model the run builds, planned by :func:`revnets.auto_checkpoint` to
    train within ``budget`` bytes (the peak of one step of one process, its optimizer's
    update included)."""

    budget: int


def parse_size(value: object) -> int:
    """Bytes from a whole number or a size such as ``2GiB``, ``512MiB``, ``1.5GB`` (binary
    units KiB..TiB, decimal KB..TB, case ignored)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        found = _SIZE.match(str(value))
        if found is None or found["unit"].lower() not in UNITS:
            raise MemoryConfigError(
                f"memory.budget={value!r} is not a size: give bytes (2147483648) or a number "
                "and a unit, e.g. memory.budget=2GiB, 512MiB or 1.5GB")
        number, unit = float(found["number"]), found["unit"].lower()
    size = int(number * UNITS[unit])
    if size <= 0:
        raise MemoryConfigError(f"memory.budget={value!r}: a budget is more than 0 bytes")
    return size


# null: not given, the decision's own default. Optional[...] because OmegaConf reads typing's form.
# ``budget`` is memory=auto's (a string, so that 2GiB and 2147483648 both pass Hydra's check).
MemoryOptions = make_dataclass(
    "MemoryOptions",
    [("preset", Optional[str], None), ("budget", Optional[str], None)]
    + [(key, Optional[kind], None) for key, kind in _option_types().items()],
)
ConfigStore.instance().store(name=SCHEMA_NAME, node=MemoryOptions)


def _options_help() -> str:
    takers: dict[str, list[str]] = {}
    for preset, options in preset_options().items():
        for option in options:
            takers.setdefault(option, []).append(preset.replace("+", "_"))
    takers["budget"] = [AUTO]
    return ", ".join(f"{option} (memory={'|'.join(presets)})" for option, presets in takers.items())


def memory_plan_from_config(memory: DictConfig) -> MemoryPlan | AutoPlan | None:
    """The plan a ``memory`` config asks for: its preset with the options it sets; an
    :class:`AutoPlan` for ``memory=auto memory.budget=...``; None for ``memory=default`` (the
    model's own plan), which takes no options."""
    options = {key: value for key, value in OmegaConf.to_container(memory).items()
               if key != "preset" and value is not None}
    budget = options.pop("budget", None)
    if memory.preset == AUTO:
        if options:
            raise MemoryConfigError(
                f"memory=auto plans the model within memory.budget and takes no other option "
                f"(got {', '.join(options)}); the plan it finds decides them")
        if budget is None:
            raise MemoryConfigError(
                "memory=auto needs a budget: memory.budget=2GiB (or bytes, 512MiB, 1.5GB), the "
                "peak of one training step it plans the model to fit")
        return AutoPlan(parse_size(budget))
    if budget is not None:
        raise MemoryConfigError(
            f"memory.budget is memory=auto's option (plan the model within it); "
            f"memory={memory.preset or 'default'} does not take it")
    if memory.preset is None:
        if options:
            raise MemoryConfigError(
                f"memory=default is the model's own plan and takes no options (got "
                f"{', '.join(options)}); name a plan with them, e.g. memory=reversible "
                "memory.store_last_blocks=2"
            )
        return None
    try:
        return plan_from_options(memory.preset, **options)
    except ValueError as error:
        raise MemoryConfigError(str(error)) from None


def check_memory_overrides(overrides: Sequence[str]) -> None:
    """Refuse a command-line ``memory.<key>=...`` whose key no preset takes, naming the keys that
    exist. Hydra would refuse it too, but naming only the key."""
    parser = OverridesParser.create()
    known = {"preset", "budget", *_option_types()}
    for argument in overrides:
        if argument.startswith("-"):
            continue
        try:
            key = parser.parse_override(argument).key_or_group
        except Exception:  # not an override (a flag's value): Hydra reports it
            continue
        group, _, option = key.partition(".")
        if group == "memory" and option == "exact":
            raise MemoryConfigError(
                "memory.exact: exact is the arithmetic of the model's reversible stages, not a "
                "memory option, and no memory plan changes it: set model.exact=true"
            )
        if group == "memory" and option and option not in known:
            close = difflib.get_close_matches(option, known, n=1)
            hint = f"; did you mean memory.{close[0]}?" if close else "."
            raise MemoryConfigError(
                f"unknown memory option {option!r}{hint} Memory options: {_options_help()}"
            )
