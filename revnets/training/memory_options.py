"""Memory plans as Hydra keys: ``python train.py memory=reversible memory.store_last_blocks=2``.

A config of the ``memory`` group (configs/memory/) names a preset (``preset``, null for the model's
own default); its options are the fields of that preset's stages' decision
(:func:`revnets.plan.preset_options`). They are declared once here as a typed schema, made from
those fields and registered in Hydra's ConfigStore, so Hydra accepts them as keys and checks their
types; :func:`memory_plan_from_config` builds the plan from them, the one place a config becomes a
:class:`~revnets.plan.MemoryPlan`. A field added to a decision needs nothing here.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import fields, make_dataclass
from typing import Optional, get_args, get_type_hints

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from revnets.plan import PRESETS, MemoryPlan, plan_from_options, preset_options

__all__ = [
    "SCHEMA_NAME",
    "MemoryConfigError",
    "MemoryOptions",
    "check_memory_overrides",
    "memory_plan_from_config",
]

SCHEMA_NAME = "memory_options"  # configs/memory/*.yaml extend it: `- /memory_options@_here_`


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


# null: not given, the decision's own default. Optional[...] because OmegaConf reads typing's form.
MemoryOptions = make_dataclass(
    "MemoryOptions",
    [("preset", Optional[str], None)]
    + [(key, Optional[kind], None) for key, kind in _option_types().items()],
)
ConfigStore.instance().store(name=SCHEMA_NAME, node=MemoryOptions)


def _options_help() -> str:
    takers: dict[str, list[str]] = {}
    for preset, options in preset_options().items():
        for option in options:
            takers.setdefault(option, []).append(preset.replace("+", "_"))
    return ", ".join(f"{option} (memory={'|'.join(presets)})" for option, presets in takers.items())


def memory_plan_from_config(memory: DictConfig) -> MemoryPlan | None:
    """The plan a ``memory`` config asks for: its preset with the options it sets; None for
    ``memory=default`` (the model's own plan), which takes no options."""
    options = {key: value for key, value in OmegaConf.to_container(memory).items()
               if key != "preset" and value is not None}
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
    known = {"preset", *_option_types()}
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
