"""What a trace through a module must leave as it was: the module's attributes and its hooks
(NOTE [ Traced modules run as their graph ])."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["Attributes", "hooked", "refuse_hooks"]

# NOTE [ Traced modules run as their graph ]
# A module the planner's trace goes through (any module with submodules that is not kept whole)
# is never called in a planned training step: its steps run the nodes its forward recorded once,
# on proxies. Whatever else that forward does would happen once, at planning time, with proxies,
# and never again. So a module stays whole (called as itself by its step, its code run each
# time) where its forward does more than compute values:
#   - it has hooks (forward, pre-forward, backward): they run where the module is called;
#   - it assigns attributes of any module (a counter, a cache, features kept for a loss): the
#     trace is checked against the attributes as they were before (``Attributes``), undone, and
#     traced again with the module whole;
#   - it draws from Python's random module, or its code depends on ``training`` (trace.py).
# A hook registered on a traced module after planning, on the model itself, or globally would
# not run either: a planned training step refuses them by name (``refuse_hooks``).

# Modes are flipped on purpose, to find code that depends on them (trace.py).
_MODE = "training"
_CONTAINERS = (list, dict, set)


class Attributes:
    """The attributes of ``modules`` (their ``__dict__``, and the contents of any list, dict or
    set in it: hooks, parameters and submodules are dicts there), to find and undo what a
    trace assigned. ``tracer_names``: the attributes torch.fx itself adds to the traced model
    (constants its graph reads), which are kept."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.saved = [(m, dict(vars(m)), _contents(vars(m))) for m in modules]
        self.tracer_names: set[str] = set()

    def changed(self) -> str | None:
        """``"module.attribute"`` of the first attribute assigned since, or None."""
        for module, saved, contents in self.saved:
            now = vars(module)
            for key in now.keys() | saved.keys():
                if key == _MODE or (key in self.tracer_names and key not in saved):
                    continue
                value = now.get(key, _MISSING)
                if value is not saved.get(key, _MISSING) or (
                    key in contents and not _same(value, contents[key])
                ):
                    return f"{type(module).__name__}.{key}"
        return None

    def restore(self) -> None:
        for module, saved, contents in self.saved:
            now = vars(module)
            for key in [k for k in now if k not in saved and k not in self.tracer_names]:
                del now[key]
            now.update(saved)
            for key, items in contents.items():
                value = saved[key]
                value.clear()
                if isinstance(value, list):
                    value.extend(items)
                else:
                    value.update(items)


_MISSING = object()


def _contents(attributes: dict[str, Any]) -> dict[str, Any]:
    return {
        key: (dict(value) if isinstance(value, dict) else
              list(value) if isinstance(value, list) else set(value))
        for key, value in attributes.items() if isinstance(value, _CONTAINERS)
    }


def _same(value: Any, items: Any) -> bool:
    if len(value) != len(items):
        return False
    if isinstance(value, dict):
        return all(k in items and value[k] is items[k] for k in value)
    if isinstance(value, list):
        return all(a is b for a, b in zip(value, items))
    return value == items


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own that run when it is called."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _global_hooks() -> bool:
    module = nn.modules.module
    return bool(module._global_forward_hooks or module._global_forward_pre_hooks
                or module._global_backward_hooks or module._global_backward_pre_hooks)


def refuse_hooks(traced: Iterable[tuple[str, nn.Module]]) -> None:
    """Raise, naming it, if a module a planned step runs as its traced graph (``traced``: names
    and modules, "" for the model itself) has a hook, or if a global module hook is registered
    (NOTE [ Traced modules run as their graph ])."""
    if _global_hooks():
        raise RuntimeError(
            "auto_checkpoint: a global module hook (torch.nn.modules.module.register_module_"
            "forward_hook and the like) is registered; a planned training step runs traced "
            "graphs in which most of the model's modules are never called, so it would not fire "
            "as in the model. Remove it around planned training steps, or register hooks on the "
            "modules themselves before planning (the planner then keeps them whole)"
        )
    for name, module in traced:
        if hooked(module):
            where = (f"the model itself ({type(module).__name__}): register it on the model "
                     "auto_checkpoint returned" if not name else
                     f"{name} ({type(module).__name__}), which the plan runs as its traced graph: "
                     "register hooks before auto_checkpoint, which then keeps the module whole")
            raise RuntimeError(
                f"auto_checkpoint: a hook is registered on {where}. Where it is now, it would "
                "not run in a planned training step"
            )
