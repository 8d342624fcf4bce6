"""``auto_checkpoint``: hand over a model and a memory budget, get back a model that trains within it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from revnets.checkpoint import checkpoint_segments
from revnets.memory import measure_memory
from revnets.planning.chain import Plan, candidate_plans
from revnets.planning.chain_graph import NotAChainError, as_chain
from revnets.planning.profile import profile_chain

__all__ = ["PlanningError", "auto_checkpoint", "predict_training_peak"]

MiB = 2**20


class PlanningError(ValueError):
    """No plan fits the budget; the message gives the smallest budget that can be reached."""


def _default_loss(output: Tensor) -> Tensor:
    return output.float().sum()


def predict_training_peak(
    model: nn.Module, example_input: Tensor, loss_fn: Callable[[Tensor], Tensor] = _default_loss
) -> int:
    """Peak bytes of forward + backward (parameters, gradients and activations), predicted on the
    meta device: nothing is computed and ``model`` is left alone."""
    meta = copy.deepcopy(model).to("meta") if _has_data(model) else model
    x = _meta_like(example_input)

    def step(model: nn.Module, x: Tensor) -> None:
        loss_fn(model(x)).backward()

    return measure_memory(step, meta.train(), x).peak_bytes


def _meta_like(value: Any) -> Any:
    """Meta tensors shaped like ``value`` (a tensor or a tuple of tensors), keeping requires_grad."""
    return tree_map(
        lambda t: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        if isinstance(t, Tensor) else t,
        value,
    )


def _has_data(model: nn.Module) -> bool:
    return any(t.device.type != "meta" for t in (*model.parameters(), *model.buffers()))


def auto_checkpoint(
    model: nn.Module,
    example_input: Tensor,
    budget: int,
    loss_fn: Callable[[Tensor], Tensor] = _default_loss,
) -> nn.Module:
    """Return ``model`` set up to train within ``budget`` bytes, recomputing as little as possible.

    ``budget`` bounds the peak of one forward + backward at ``example_input``'s shape: parameters,
    gradients and activations (optimizer state is the optimizer's business). Supported models:

    - revnets zoo models (anything with ``set_memory``): the cheapest memory strategy that fits,
      trying ``none``, ``reversible``, ``checkpoint``, ``reversible+checkpoint`` in that order.
      Returned as the same object.
    - chains of layers: ``nn.Sequential``, or any model whose torch.fx graph is a chain of
      steps (torchvision's ResNets, VGG, DenseNet; see :func:`as_chain`). The plan with the
      fewest recomputed layers among Chen's sqrt(n) and budgeted plans. Returned as a new
      ``nn.Sequential`` sharing the layers (same weights, same outputs).

    Raises :class:`PlanningError` stating the smallest reachable budget when none fits.
    """
    if hasattr(model, "set_memory") and hasattr(model, "memory_strategies"):
        return _choose_strategy(model, example_input, budget, loss_fn)
    if not isinstance(model, nn.Sequential):
        try:
            model = as_chain(model)
        except (NotAChainError, torch.fx.proxy.TraceError) as error:
            raise TypeError(
                f"auto_checkpoint: {type(model).__name__} is neither a chain of layers nor a "
                f"revnets zoo model ({error}); express it as an nn.Sequential of its stages"
            ) from error
    return _choose_plan(model, example_input, budget, loss_fn)


def _choose_strategy(model, example_input, budget, loss_fn) -> nn.Module:
    order = [s for s in ("none", "reversible", "checkpoint", "reversible+checkpoint")
             if s in model.memory_strategies]
    original = model.memory
    peaks = {}
    for strategy in order:
        model.set_memory(strategy)
        peaks[strategy] = predict_training_peak(model, example_input, loss_fn)
        if peaks[strategy] <= budget:
            return model
    model.set_memory(original)
    best = min(peaks, key=peaks.get)
    raise PlanningError(_no_fit(budget, peaks[best], f"memory strategy {best!r}"))


def _choose_plan(model, example_input, budget, loss_fn) -> nn.Module:
    meta_model = copy.deepcopy(model).to("meta")
    profiles = profile_chain(list(meta_model), _meta_like(example_input))
    best: tuple[int, Plan] | None = None
    for plan in candidate_plans(profiles):
        peak = predict_training_peak(checkpoint_segments(meta_model, plan), example_input, loss_fn)
        if peak <= budget:
            return checkpoint_segments(model, plan) if len(plan) > 1 else model
        if best is None or peak < best[0]:
            best = (peak, plan)
    assert best is not None
    raise PlanningError(_no_fit(budget, best[0], f"segments {best[1]}"))


def _no_fit(budget: int, smallest: int, how: Any) -> str:
    return (
        f"auto_checkpoint: no plan trains within {budget / MiB:.2f} MiB; the smallest budget this "
        f"model can reach at this input size is {smallest / MiB:.2f} MiB ({smallest} bytes, "
        f"with {how}). Use a smaller batch or a reversible architecture."
    )
