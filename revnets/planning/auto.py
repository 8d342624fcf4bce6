"""``auto_checkpoint``: hand over a model and a memory budget, get back a model that trains
within it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from revnets.checkpoint import checkpoint_segments
from revnets.memory import measure_memory
from revnets.planning.chain import candidate_plans
from revnets.planning.graph_chain import as_graph_chain
from revnets.planning.nested import group_chain, nested_schedule
from revnets.planning.profile import LayerProfile, _device_type, _nbytes, profile_chain

__all__ = ["PlannedModel", "PlanningError", "auto_checkpoint", "predict_training_peak"]

MiB = 2**20
LossFn = Callable[[Tensor], Tensor]
NESTED_GROUPS = 48  # nested schedules cost O(n^3): longer chains are grouped into this many runs


class PlanningError(ValueError):
    """No plan fits the budget; the message gives the smallest budget that can be reached."""


def _default_loss(output: Tensor) -> Tensor:
    return output.float().sum()


def predict_training_peak(
    model: nn.Module, example_input: Tensor, loss_fn: LossFn = _default_loss
) -> int:
    """Peak bytes of forward + backward (parameters, gradients and activations), predicted on the
    meta device: nothing is computed and ``model`` is left alone."""
    meta = copy.deepcopy(model).to("meta") if _has_data(model) else model
    x = _meta_like(example_input)

    def step(model: nn.Module, x: Tensor) -> None:
        loss_fn(model(x)).backward()

    return measure_memory(step, meta.train(), x).peak_bytes


def _meta_like(value: Any) -> Any:
    """Meta tensors shaped like ``value`` (a tensor or a tuple of tensors), keeping
    requires_grad."""
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
    loss_fn: LossFn = _default_loss,
    measure_time: bool = True,
) -> nn.Module:
    """Return ``model`` set up to train within ``budget`` bytes, recomputing as little as possible.

    ``budget`` bounds the peak of one forward + backward at ``example_input``'s shape: parameters,
    gradients and activations (optimizer state is the optimizer's business). Supported models:

    - revnets zoo models (anything with ``set_memory``): the cheapest memory strategy that fits,
      trying ``none``, ``reversible``, ``checkpoint``, ``reversible+checkpoint`` in that order.
      Returned as the same object.
    - ``nn.Sequential`` chains, and any other model torch.fx can trace, as the chain of its
      graph nodes (:func:`as_graph_chain`: branches and concatenations included, cuts anywhere).
      Candidates are the optimal plans of :func:`optimal_plan` over a range of budgets, Chen's
      sqrt(n) and budgeted plans, ordered by what they recompute (forward time measured layer
      by layer on ``example_input``'s device when ``measure_time``, else layers counted); the
      first whose exact peak, predicted on the meta device, fits (found by bisection: a few
      predictions). Below what one level of checkpoints reaches, nested checkpoints
      (:func:`nested_schedule`). An ``nn.Sequential`` comes back as a new ``nn.Sequential``
      over the same layers; any other model as a :class:`PlannedModel` that trains with the
      plan and evaluates with the model itself (same weights, same outputs).

    Raises :class:`PlanningError` stating the smallest reachable budget when none fits.
    """
    if hasattr(model, "set_memory") and hasattr(model, "memory_strategies"):
        return _choose_strategy(model, example_input, budget, loss_fn)
    if isinstance(model, nn.Sequential):
        return _choose_plan(model, example_input, budget, loss_fn, measure_time)
    try:
        chain = as_graph_chain(model)
    except Exception as error:  # torch.fx raises many kinds on code it cannot trace
        raise TypeError(
            f"auto_checkpoint: {type(model).__name__} cannot be traced into a graph of "
            f"single-input steps ({error}); express it as an nn.Sequential of its stages"
        ) from error
    planned = _choose_plan(chain, example_input, budget, loss_fn, measure_time)
    return model if planned is chain else PlannedModel(model, planned)


class PlannedModel(nn.Module):
    """A traced model and its checkpoint plan, sharing every parameter and buffer.

    Training steps (training mode, grad enabled) run the plan: the chain of graph nodes with
    checkpointed segments. Everything else (evaluation, inference) runs the model itself, since
    a trace may have frozen ``self.training`` checks of the mode it was traced in. Save and load
    weights through ``.model``, whose state_dict keys are the original ones.
    """

    def __init__(self, model: nn.Module, plan: nn.Sequential) -> None:
        super().__init__()
        self.plan = plan
        self._model = (model,)  # not registered again: its modules are the plan's

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    def train(self, mode: bool = True) -> PlannedModel:
        super().train(mode)
        self.model.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            return self.plan(*args, **kwargs)
        return self.model(*args, **kwargs)


def _choose_strategy(
    model: nn.Module, example_input: Tensor, budget: int, loss_fn: LossFn
) -> nn.Module:
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


def _choose_plan(
    model: nn.Sequential,
    example_input: Tensor,
    budget: int,
    loss_fn: LossFn,
    measure_time: bool,
) -> nn.Module:
    meta_model = copy.deepcopy(model).to("meta")
    meta_input = _meta_like(example_input)
    profiles = profile_chain(list(meta_model), meta_input)
    if measure_time and _device_type(example_input) != "meta":
        times = profile_chain(list(model), example_input, repeats=2)
        profiles = [replace(p, forward_seconds=t.forward_seconds) for p, t in zip(profiles, times)]
    input_state = profiles and _input_state(model, meta_input)
    plans = candidate_plans(profiles, input_state=input_state)
    peaks: dict[int, int] = {}

    def peak(i: int) -> int:
        if i not in peaks:
            planned = checkpoint_segments(meta_model, plans[i])
            peaks[i] = predict_training_peak(planned, example_input, loss_fn)
        return peaks[i]

    # Plans come in order of increasing recomputation, so memory mostly decreases along them:
    # bisect for the first that fits (each exact prediction runs the model on the meta device).
    if peak(0) <= budget:
        return model
    low, high = 0, len(plans) - 1
    if peak(high) > budget:
        smallest = min(range(len(plans)), key=peak)
        if peak(smallest) > budget:
            # Below what one level of checkpoints reaches: checkpoints within recomputations.
            return _nested_within(
                model, meta_model, profiles, example_input, budget, loss_fn,
                (peak(smallest), f"segments {plans[smallest]}"),
            )
        high = smallest
    while high - low > 1:
        middle = (low + high) // 2
        if peak(middle) <= budget:
            high = middle
        else:
            low = middle
    return checkpoint_segments(model, plans[high])


def _nested_within(
    model: nn.Sequential,
    meta_model: nn.Sequential,
    profiles: list[LayerProfile],
    example_input: Tensor,
    budget: int,
    loss_fn: LossFn,
    best_so_far: tuple[int, str],
) -> nn.Module:
    layers, grouped = group_chain(list(model), profiles, NESTED_GROUPS)
    meta_layers, _ = group_chain(list(meta_model), profiles, NESTED_GROUPS)
    model_state = sum(
        t.numel() * t.element_size() * (2 if getattr(t, "requires_grad", False) else 1)
        for t in (*model.parameters(), *model.buffers())
    )
    smallest, how = best_so_far
    # The schedule's memory model leaves out transients: shrink its budget until the exact
    # prediction fits.
    for share in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5):
        schedule = nested_schedule(grouped, int(share * (budget - model_state)))
        if schedule is None:
            break
        peak = predict_training_peak(schedule.apply(meta_layers), example_input, loss_fn)
        if peak <= budget:
            return schedule.apply(layers)
        if peak < smallest:
            smallest, how = peak, f"nested checkpoints {schedule.tree}"
    # Nothing fits: name the smallest budget, that of the most frugal schedule there is.
    low, high = 0, max(smallest - model_state, 1)
    frugal = None
    while high - low > max(high // 64, 1):
        middle = (low + high) // 2
        schedule = nested_schedule(grouped, middle)
        if schedule is None:
            low = middle
        else:
            high, frugal = middle, schedule
    if frugal is not None:
        peak = predict_training_peak(frugal.apply(meta_layers), example_input, loss_fn)
        if peak < smallest:
            smallest, how = peak, f"nested checkpoints {frugal.tree}"
    raise PlanningError(_no_fit(budget, smallest, how))


def _input_state(chain: nn.Sequential, example_input: Any) -> dict[str, int]:
    names = getattr(chain[0], "inputs", None) or ["input"]
    return {names[0]: _nbytes(example_input)}


def _no_fit(budget: int, smallest: int, how: Any) -> str:
    return (
        f"auto_checkpoint: no plan trains within {budget / MiB:.2f} MiB; the smallest budget this "
        f"model can reach at this input size is {smallest / MiB:.2f} MiB ({smallest} bytes, "
        f"with {how}). Use a smaller batch or a reversible architecture."
    )
