"""What a measured or predicted call is given: the modules and optimizers among its arguments,
the device they name, and lazy modules with nothing yet to count, refused by name; and its lists
and tuples rebuilt with other elements, their type kept, for the walks over arguments and outputs
that replace tensors in place (fakes, meta tensors, real ones, graph values)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils._pytree import tree_flatten

from revnets.facts.tensors import device_of as first_device

__all__ = ["device_of", "owners_in", "rebuilt", "refuse_uninitialised"]

S = TypeVar("S", list, tuple)


def owners_in(args: tuple, kwargs: dict) -> list[nn.Module | torch.optim.Optimizer]:
    """The modules and optimizers among a call's arguments, nested ones too."""
    leaves, _ = tree_flatten((args, kwargs))
    return [x for x in leaves if isinstance(x, (nn.Module, torch.optim.Optimizer))]


def device_of(owners: list, args: tuple, kwargs: dict) -> torch.device | None:
    """The device of the first module's first tensor, else of the first tensor argument."""
    for owner in owners:
        if isinstance(owner, nn.Module):
            for t in (*owner.parameters(), *owner.buffers()):
                return t.device
    return first_device((args, kwargs))


def refuse_uninitialised(caller: str, modules: Iterable[Any]) -> None:
    """Refuse, by name, a lazy module among ``modules`` that has not made its parameters yet
    (an ``UninitializedParameter``): they are made in its first call, so there is nothing to
    count or copy before it."""
    for module in modules:
        if not isinstance(module, nn.Module):
            continue
        for name, m in module.named_modules():
            if any(isinstance(t, UninitializedTensorMixin)
                   for t in (*m._parameters.values(), *m._buffers.values())):
                raise ValueError(
                    f"{caller}: {type(m).__name__} ({name or 'the model'}) is a lazy module "
                    f"that has not made its parameters yet (a lazy module makes them in its "
                    f"first call). Run one forward of the model first, with torch.no_grad()"
                )


def rebuilt(value: S, items: Iterable[Any]) -> S:
    """``items`` in a container of ``value``'s type. A namedtuple's constructor takes its fields
    one by one, as torch's pytree rebuilds it (``type(value)(items)`` raised a TypeError there);
    lists, tuples, their subclasses and torch's return types take one iterable."""
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return type(value)(*items)
    return type(value)(items)
