"""The values a step of a traced chain (``GraphStep``) reads: a value of the graph, looked up
by name in the state the chain passes on, a parameter or buffer the step holds, or a constant put
in a value's place (an optional argument's default)."""

from __future__ import annotations

from typing import Any

from torch import nn

from revnets.memory.call_arguments import rebuilt

__all__ = ["Attr", "Ref", "resolve", "substitute"]


class Ref:
    """A value of the graph, looked up by name in the live state."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Attr(Ref):
    """A parameter or buffer registered on the step under ``name``."""


def resolve(value: Any, env: dict[str, Any], step: nn.Module) -> Any:
    if isinstance(value, Attr):
        return getattr(step, value.name)
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, list):  # a plain list, not fx's immutable_list: dynamo traces lists
        return [resolve(v, env, step) for v in value]
    if isinstance(value, tuple):
        return rebuilt(value, (resolve(v, env, step) for v in value))
    if isinstance(value, dict):
        return {k: resolve(v, env, step) for k, v in value.items()}
    if isinstance(value, slice):  # x[:, :h] with h computed by the graph
        return slice(*(resolve(v, env, step) for v in (value.start, value.stop, value.step)))
    return value


def substitute(value: Any, constants: dict[str, Any]) -> Any:
    if isinstance(value, Ref) and value.name in constants:
        return constants[value.name]
    if isinstance(value, (tuple, list)):
        return rebuilt(value, (substitute(v, constants) for v in value))
    if isinstance(value, dict):
        return {k: substitute(v, constants) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(substitute(v, constants) for v in (value.start, value.stop, value.step)))
    return value
