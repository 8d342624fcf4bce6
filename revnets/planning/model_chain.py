"""The chain a model is planned as, and the memory plans left to zoo models that cannot be
traced."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from revnets.memory import Predictor
from revnets.models.switchable import SwitchableMemory
from revnets.plan import PRESETS, MemoryPlan, Reconstruct
from revnets.planning.budget import LossFn, no_fit, training_step
from revnets.planning.frozen import refuse_hooks
from revnets.planning.graph_step import GraphStep
from revnets.planning.trace import as_graph_chain
from revnets.reversible import ReversibleSequence

__all__ = ["Untraceable", "choose_preset", "plain_sequential", "planning_chain", "sequence_of"]


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


def sequence_of(step: nn.Module) -> ReversibleSequence | None:
    """The reversible sequence a chain step runs, if it runs one."""
    if isinstance(step, ReversibleSequence):
        return step
    if isinstance(step, GraphStep) and isinstance(getattr(step, "module", None),
                                                    ReversibleSequence):
        return step.module
    return None


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
        if peaks[name] <= budget:
            model.memory_plan = replace(plan, peak_bytes=peaks[name], budget=budget)
            return model
    model.set_memory(original)
    best = min(peaks, key=peaks.get)
    raise no_fit(budget, peaks[best], f"memory plan {best!r}")
