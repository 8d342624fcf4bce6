"""``auto_checkpoint``: hand over a model and a memory budget, get back a model that trains
within it, and the plan it follows."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from revnets.facts.tensors import device_of
from revnets.memory import Predictor
from revnets.memory.fake_copies import held_elsewhere
from revnets.planning.budget import (
    LossFn,
    check_optimizer,
    check_request,
    default_loss,
)
from revnets.planning.chain_planner import ChainPlanner
from revnets.planning.costs.step_times import ForwardTimes
from revnets.planning.model_chain import Untraceable, choose_preset, planning_chain
from revnets.planning.modules.plan import plan_modules
from revnets.planning.planned import PlannedModel
from revnets.planning.untouched import ModelState, collector_paused
from revnets.replay import forked_rng, generators_held

__all__ = ["PlannedModel", "auto_checkpoint"]


def auto_checkpoint(
    model: nn.Module,
    example_input: Any,
    budget: int,
    loss_fn: LossFn = default_loss,
    optimizer: torch.optim.Optimizer | None = None,
    measure_time: bool | ForwardTimes = True,
    compiled: bool = False,
) -> nn.Module:
    """Return ``model`` set up to train within ``budget`` bytes, recomputing as little as
    possible; the plan it follows is its ``memory_plan`` (print it for a table of parts).

    ``budget`` is the peak of one training step at ``example_input``'s shape, predicted exactly
    on fake tensors of its device: parameters, gradients, activations, and the optimizer's state
    and update when ``optimizer`` is given (the same meaning as ``revnets.predict_memory`` of
    that step). The step calls ``model(example_input)``, or ``model(**example_input)`` where
    it is a mapping (a Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels``),
    planned through the model's own forward (NOTE [ Example inputs ] in
    ``planning/budget.py``).

    Any model torch.fx can trace, with reversible stages or without, zoo or hand-built, is
    planned as the chain of its graph nodes (:func:`as_graph_chain`: branches and concatenations
    included). Reversible sequences, invertible modules and modules marked ``planning_unit`` stay
    whole. Each reversible sequence can reconstruct (one extra forward of it) or store; around
    them, any run of steps can be checkpointed (nested where one level is not enough). For each
    choice of reconstructing sequences (those saving the most first), the candidate checkpoint
    plans (Chen's budgeted and sqrt(n) plans, optimal plans over a range of budgets), over all
    choices, are ordered by what they recompute (forward time measured once on at most 8 samples
    of ``example_input`` on its device when ``measure_time``, else steps counted); a chain model
    of their peaks picks the few that are predicted exactly, and only an exact prediction
    accepts a plan (NOTE [ Modelled search, exact acceptance ] in ``planning/search/options.py``).
    ``measure_time`` may also be the times :func:`revnets.forward_times` measured once: plans at
    several budgets made on them follow one measurement, so that a smaller budget gets no
    higher peak where the search ranks its candidates right (NOTE [ Times measured once ] in
    ``planning/costs/step_times.py``).

    ``compiled``: the model will train under ``torch.compile``, whose backward recomputes a
    checkpoint's cheap steps (norms, activations, additions) inside its fused kernels at next to
    no cost; plans are then ordered by what they recompute of matrix products, convolutions and
    attention alone (their floating-point operations: NOTE [ Compiled costs ] in
    ``planning/search/compiled_costs.py``), so selective checkpoints come first. The budget
    keeps its
    meaning (the eager step's exact peak): a compiled step's memory is the partitioner's to
    decide, and consecutive selective checkpoints run as one there
    (NOTE [ Selective segments under compile ] in ``planning/planned.py``).

    The model comes back as a :class:`PlannedModel` that trains with the plan and evaluates
    with the model itself (same weights, same outputs), and is the model to everything else
    (state_dict keys, parameters' names, moves: NOTE [ A planned model is the model ]); or as
    itself when storing everything fits. Models that
    cannot be traced: a zoo model gets the cheapest preset that fits; any other, with a warning
    naming why, comes back as a :class:`CheckpointedModules` whose training steps run its own
    forward with whole modules it calls checkpointed (NOTE [ Plans of whole modules ] in
    ``planning/modules/plan.py``; ``measure_time`` is not used there, and ``compiled`` leaves
    out runs of modules checkpointed as one, which run eagerly under compile: NOTE [ Plans of
    modules compiled ]).
    Raises :class:`PlanningError` stating the smallest reachable budget when no plan fits.
    Python's cycle collector is paused while it plans, and resumed as it was.
    """
    budget = check_request("auto_checkpoint", model, example_input, budget)
    if not isinstance(compiled, bool):
        raise TypeError(f"auto_checkpoint: compiled is True or False, not {compiled!r}")
    if not isinstance(measure_time, (bool, ForwardTimes)):
        raise TypeError(f"auto_checkpoint: measure_time is True, False or the ForwardTimes "
                        f"revnets.forward_times measured, not {type(measure_time).__name__}")
    # Which of the model's tensors the user holds too, counted before planning holds any.
    predictor = Predictor(held_elsewhere([model], []))
    kept = ModelState(model)
    try:
        # Timing runs the model for real: its draws, from torch's generators, Python's and its
        # own (a layer holding a torch.Generator), never happened.
        with (forked_rng(device_of(example_input, torch.device("cpu")), generators_held(model)),
              collector_paused()):
            return _auto_checkpoint(model, example_input, budget, loss_fn, optimizer,
                                    measure_time, compiled, predictor)
    except BaseException:  # no plan, the user's loss function failing, an interrupt
        kept.restore()
        raise


def _auto_checkpoint(
    model: nn.Module,
    example_input: Any,
    budget: int,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    measure_time: bool | ForwardTimes,
    compiled: bool,
    predictor: Predictor,
) -> nn.Module:
    check_optimizer(optimizer, model)
    if isinstance(example_input, Mapping):  # NOTE [ Example inputs ] in budget.py
        return plan_modules(model, example_input, budget, loss_fn, optimizer, TypeError(
            f"auto_checkpoint: {type(model).__name__} is called with keyword arguments"),
            predictor, compiled)
    try:
        chain = planning_chain(model)
    except Untraceable as untraceable:
        warnings.warn(f"{untraceable}; it is planned as checkpoints of whole modules its forward "
                      f"calls (NOTE [ Plans of whole modules ]), coarser than a graph's plan: "
                      f"for a finer one, make its forward traceable or an nn.Sequential of its "
                      f"stages", stacklevel=3)
        return plan_modules(model, example_input, budget, loss_fn, optimizer, untraceable,
                            predictor, compiled)
    if chain is None:
        return choose_preset(model, example_input, budget, loss_fn, optimizer, predictor)
    planner = ChainPlanner(model, chain, example_input, loss_fn, optimizer, measure_time, compiled,
                       predictor)
    planned, plan = planner.fit(budget)
    # Nothing checkpointed: the model itself, as predicted, runs the plan.
    result = model if planned is chain else PlannedModel(
        model, planned, PlannedModel.traced_by(chain), PlannedModel.reads_of(chain))
    result.memory_plan = plan
    return result
