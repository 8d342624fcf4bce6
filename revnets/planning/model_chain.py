"""The chain a model is planned as, the forward times measured on it once (``forward_times``),
and the memory plans left to zoo models that cannot be traced."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from revnets.facts.tensors import device_of
from revnets.graph.guard import refuse_hooks
from revnets.graph.trace import as_graph_chain
from revnets.graph.trace_state import Draws
from revnets.memory import Predictor
from revnets.plan import PRESETS, MemoryPlan, Reconstruct
from revnets.plan.switchable import SwitchableMemory
from revnets.planning.budget import LossFn, check_request, training_step
from revnets.planning.costs.step_times import ForwardTimes, chain_times
from revnets.planning.search.budget import fits, no_fit
from revnets.planning.untouched import ModelState
from revnets.replay import forked_rng, generators_held

__all__ = ["Untraceable", "choose_preset", "forward_times", "plain_sequential", "planning_chain"]


class Untraceable(TypeError):
    """torch.fx cannot trace a model's own forward into a chain of steps."""


def planning_chain(model: nn.Module, caller: str = "auto_checkpoint") -> nn.Sequential | None:
    """The chain ``model`` is planned as: an ``nn.Sequential`` itself, any other model its graph
    (:func:`as_graph_chain`); a zoo model is traced on its plain code path (its reversible stages
    reconstructing where they can, else storing), which its memory plan is switched to. None for
    a zoo model torch.fx cannot trace (its memory plan as it was: :func:`choose_preset` plans
    it); any other such model raises :class:`Untraceable`, naming why and ``caller``."""
    if plain_sequential(model):
        refuse_hooks([("", model)])  # the chain returned is another Sequential
        return model
    zoo = isinstance(model, SwitchableMemory)
    original = model.memory if zoo else None
    if zoo:  # trace the model's plain code path; the planner decides the rest
        model.set_memory(_keeping(original, PRESETS["reversible" if _reconstructs(model)
                                                     else "none"]))
    try:
        return as_graph_chain(model)
    except Exception as error:  # torch.fx raises many kinds on code it cannot trace
        if zoo:
            model.set_memory(original)
            return None
        raise Untraceable(
            f"{caller}: {type(model).__name__} cannot be traced into a graph of "
            f"single-input steps ({error})"
        ) from error


def plain_sequential(model: nn.Module) -> bool:
    """An ``nn.Sequential`` that runs its layers in turn: planned as itself. A subclass with a
    forward of its own (scaling the output, a dropout) is traced as any model is: planned as
    its layers, it lost that forward."""
    return isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward


def _keeping(original: MemoryPlan, preset: MemoryPlan) -> MemoryPlan:
    """``preset``, reconstructing as ``original`` does where both reconstruct: the planner
    decides whether a stage reconstructs, never the options of its reconstruction."""
    if isinstance(preset.stages, Reconstruct) and isinstance(original.stages, Reconstruct):
        return replace(preset, stages=original.stages)
    return preset


def _reconstructs(model: SwitchableMemory) -> bool:
    return model.memory_problem(PRESETS["reversible"]) is None


def choose_preset(
    model: SwitchableMemory,
    example_input: Any,
    budget: int,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    predictor: Predictor,
) -> nn.Module:
    """For zoo models torch.fx cannot trace: the cheapest preset that fits, each predicted by
    ``predictor``."""
    original = model.memory
    peaks = {}
    for name in ("none", "reversible", "checkpoint", "reversible+checkpoint"):
        if name not in model.memory_strategies:
            continue
        plan = _keeping(original, PRESETS[name])
        model.set_memory(plan)
        peaks[name] = predictor.predict(
            training_step, (model, example_input, loss_fn, optimizer), {}
        ).peak_bytes
        if fits(peaks[name], budget):
            model.memory_plan = replace(plan, peak_bytes=peaks[name], budget=budget)
            return model
    model.set_memory(original)
    best = min(peaks, key=peaks.get)
    raise no_fit(budget, peaks[best], f"memory plan {best!r}")


def forward_times(model: nn.Module, example_input: Any) -> ForwardTimes:
    """Measure once the forward times ``auto_checkpoint(model, example_input, ...)`` would
    measure (each step of the chain it plans ``model`` as, its reversible sequences storing, on
    at most 8 samples of ``example_input``), to plan with at any number of budgets: plans at
    several budgets then follow one measurement, and a smaller budget gets no higher peak where
    the search ranks its candidates right (NOTE [ Times measured once ]). ``model`` is left as
    it was (its buffers, and the random number generators too). A model torch.fx cannot trace
    has no steps: its plans are ranked on sizes and counted costs alone (NOTE [ Plans of whole
    modules ] in ``planning/modules/plan.py``), and its times are empty."""
    check_request("forward_times", model, example_input)
    kept, draws = ModelState(model), Draws(model)
    try:
        with forked_rng(device_of(example_input, torch.device("cpu")), generators_held(model)):
            try:
                chain = planning_chain(model, caller="forward_times")
            except Untraceable:
                chain = None
            if chain is None:  # planned on sizes and counted costs alone: no times to measure
                return ForwardTimes((), ())
            return chain_times(chain, example_input)
    finally:
        kept.restore()
        draws.restore()  # numpy's generator too
