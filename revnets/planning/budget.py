"""What a budget bounds: the training step a plan's peak is predicted on, and the request a
planning call is given, checked before any work (where a peak meets the budget, and the
refusal naming the smallest budget that plans: search/budget.py)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from revnets.memory.call_arguments import refuse_uninitialised

__all__ = [
    "LossFn", "check_loss", "check_optimizer", "check_request", "default_loss", "forward_of",
    "training_step",
]
LossFn = Callable[[Any], Tensor]


# NOTE [ Example inputs ]
# What a plan is made for is one call of the model's own forward: ``model(example_input)``, or,
# where the example input is a mapping (a dict, a Hugging Face batch), ``model(**example_input)``
# (input_ids=, attention_mask=, labels=, ...). A model called with keywords is planned through
# its own forward (NOTE [ Plans of whole modules ] in planning/modules/plan.py), never as a
# traced graph: the chain of a graph takes one input.
def forward_of(model: nn.Module, example_input: Any) -> Any:
    """``model`` called on ``example_input`` (NOTE [ Example inputs ])."""
    if isinstance(example_input, Mapping):
        return model(**example_input)
    return model(example_input)


def default_loss(output: Tensor) -> Tensor:
    if not isinstance(output, Tensor):
        raise TypeError(
            f"auto_checkpoint: the model returns a {type(output).__name__}, and the default loss "
            f"sums a tensor; pass loss_fn=, which makes the step's loss from the output"
        )
    return output.float().sum()


def check_request(caller: str, model: Any, example_input: Any, budget: Any = 0) -> int:
    """The budget in bytes, once the model, input and budget are what planning takes; refused
    by name before any work is done."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be an nn.Module, got {type(model).__name__}")
    refuse_uninitialised(caller, [model])
    if not model.training:
        raise ValueError(
            f"{caller}: the {type(model).__name__} is in eval mode (model.training is False). "
            f"Plans are made for training steps, which keep activations for backward and run "
            f"dropout and batch norm as training does: call model.train() before planning (a "
            f"planned model evaluates as the model itself after model.eval())"
        )
    if example_input is None:
        raise TypeError(f"{caller}: example_input is None; pass an input the model's forward "
                        f"takes, at the batch size to plan for")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"{caller}: budget is the training step's peak in bytes, a number "
                        f"(2 * 2**30 for 2 GiB), got {budget!r}")
    if not (math.isfinite(budget) and budget >= 0):  # 0: refused, naming the least that plans
        raise ValueError(f"{caller}: budget is the training step's peak in bytes, a "
                         f"non-negative number (2 * 2**30 for 2 GiB), got {budget!r}")
    return int(budget)


def check_loss(loss: Any) -> None:
    """Refuse, naming ``loss_fn``, a loss no training step can take the backward of."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"auto_checkpoint: loss_fn returned {type(loss).__name__}, not a "
                        f"tensor; return the step's loss, computed from the model's output")
    if loss.numel() != 1:
        raise ValueError(f"auto_checkpoint: loss_fn returned a tensor of shape "
                         f"{tuple(loss.shape)}, not a scalar; reduce it (.mean() or .sum())")
    if not loss.requires_grad:
        raise ValueError("auto_checkpoint: loss_fn returned a loss that does not require grad; "
                         "compute it from the model's output, without .detach() or no_grad")


def check_optimizer(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> None:
    """Refuse, naming it, an optimizer whose step the budget's training step cannot take."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"auto_checkpoint: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    ours = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in ours]
    if foreign:
        raise ValueError(
            f"auto_checkpoint: the optimizer updates {len(foreign)} tensors that are not "
            f"parameters of the model given (the first of shape {tuple(foreign[0].shape)}); "
            f"pass the optimizer made over this model's parameters"
        )
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
        loss = loss_fn(forward_of(model, x))
        check_loss(loss)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
