"""What a budget bounds: the training step a plan's peak is predicted on, and the error that
says no plan fits, naming the smallest budget that does."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "LossFn", "PlanningError", "check_optimizer", "default_loss", "no_fit", "training_step",
]

MiB = 2**20
LossFn = Callable[[Any], Tensor]


class PlanningError(ValueError):
    """No plan fits the budget; ``smallest_budget`` (bytes, also in the message) is the
    smallest budget that can be reached, which asked for plans."""

    def __init__(self, message: str, smallest_budget: int | None = None) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


def default_loss(output: Tensor) -> Tensor:
    return output.float().sum()


def check_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse, naming it, an optimizer whose step the budget's training step cannot take."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"auto_checkpoint: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if isinstance(optimizer, torch.optim.LBFGS) or (
            closure is not None and closure.default is inspect.Parameter.empty):
        hint = (" (LBFGS: about 2 * history_size + 2 vectors the size of the parameters)"
                if isinstance(optimizer, torch.optim.LBFGS) else "")
        raise TypeError(
            f"auto_checkpoint: {type(optimizer).__name__}.step needs a closure that evaluates the "
            f"model again (and reads the loss's value), which a budget's step, predicted on fake "
            f"tensors, cannot run; plan without optimizer= and leave room in the budget for its "
            f"state{hint}")


def training_step(
    model: nn.Module, x: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None
) -> None:
    """What a budget bounds: a step from freed gradients, as training loops run it. An optimizer
    without state yet (momentum, Adam's moments) takes a first step to make it: the budget holds
    for every step, not only the first."""
    for _ in range(2 if optimizer is not None and not optimizer.state else 1):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x)).backward()
        if optimizer is not None:
            optimizer.step()


def no_fit(budget: int, smallest: float, how: Any) -> PlanningError:
    return PlanningError(
        f"auto_checkpoint: no plan trains within {budget / MiB:.2f} MiB; the smallest budget this "
        f"model can reach at this input size is {smallest / MiB:.2f} MiB ({int(smallest)} bytes, "
        f"with {how}). Use a smaller batch or a reversible architecture.",
        int(smallest),
    )
