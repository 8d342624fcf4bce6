"""The gradients of a chain's values in flight during its backward, whatever the plan: which a
step's backward makes as new tensors and which it passes on (an addition hands its output's
gradient to both operands, a view a view of it), and what exists of them while each step is
backpropagated (NOTE [ Gradients in flight ] in planning/search/chain_model.py)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from revnets.facts.tensors import storage_key
from revnets.planning.costs.layer_profile import LayerProfile

__all__ = ["GradientFlow", "gradient_flow", "gradient_parts"]

NO_MOMENT = -(2**62)  # a moment that does not happen: below any other


def gradient_parts(
    inputs: Any, output: Any, input_names: Sequence[str], output_names: Sequence[str],
    reads: Collection[str] | None = None,
) -> dict[str, int | str] | None:
    """What the backward of a step that took ``inputs`` (leaves) and returned ``output`` makes
    of the gradients of the values it reads (``reads``; None: all it was given), by name: the
    bytes of a new tensor, or the name of the output whose gradient it passes on; a value it
    makes none of is left out. Run on the meta device by the profile: one backward of the step,
    from gradients of the outputs it made (a value it passes on as it is keeps its gradient).
    None where that cannot tell (a value holding several tensors, a backward that fails
    there)."""
    given = _one_tensor_each(inputs, input_names)
    made = _one_tensor_each(output, output_names)
    if given is None or made is None:
        return None
    passed_on = {id(t) for _, t in given}
    given = [(name, t) for name, t in given
             if t.requires_grad and (reads is None or name in reads)]
    made = [(name, t) for name, t in made if t.requires_grad and id(t) not in passed_on]
    if not given or not made:
        return {}
    arriving = [torch.empty_like(t) for _, t in made]
    try:
        grads = torch.autograd.grad([t for _, t in made], [t for _, t in given], arriving,
                                    allow_unused=True)
    except Exception:  # noqa: BLE001  a step that cannot run backward on meta: see the docstring
        return None
    passed = {}
    for (name, _), grad in reversed(list(zip(made, arriving))):
        passed[storage_key(grad)] = name  # an output named twice: the first name
    return {name: passed.get(storage_key(grad), grad.untyped_storage().nbytes())
            for (name, _), grad in zip(given, grads) if grad is not None}


def _one_tensor_each(value: Any, names: Sequence[str]) -> list[tuple[str, Tensor]] | None:
    """The named values that are tensors, leaving out those holding none (a shape, a flag:
    no gradient); None if a value holds tensors inside (a list of them)."""
    values = value if isinstance(value, tuple) else (value,)
    if len(values) != len(names):
        return None
    found = []
    for name, v in zip(names, values):
        if isinstance(v, Tensor):
            found.append((name, v))
        elif any(isinstance(t, Tensor) for t in tree_leaves(v)):
            return None
    return found


@dataclass(frozen=True)
class GradientFlow:
    """Per step j of a chain: the bytes of the value gradients that exist while it is
    backpropagated (of the values live after it and the parts it makes of those it reads),
    just after it where it added a part to a gradient a later step made (NO_MOMENT elsewhere),
    and the new tensors among its parts."""

    during: np.ndarray
    after: np.ndarray
    made: np.ndarray


def gradient_flow(states: Sequence[dict[str, int]], profiles: Sequence[LayerProfile]
                  ) -> GradientFlow:
    """Follow the gradients of the values of ``states`` (the live values at each cut) from the
    chain's end to its start, as autograd makes them: each step's parts (``gradient_parts`` in
    its profile; new tensors of the values' sizes where unknown), a part for a value that
    already has a gradient summed with it into a new tensor (the engine sums out of place under
    a dispatch mode, as measure_memory and predict_memory run a step), its outputs' gradients
    dropped once it is backpropagated. Each tensor counts once, however many values hold it."""
    n = len(profiles)
    size: dict[int, int] = {}  # by tensor, numbered as made

    def new(nbytes: int) -> int:
        size[len(size)] = nbytes
        return len(size) - 1

    holding = {name: new(nbytes) for name, nbytes in states[n].items()}  # value -> tensor
    during, after, made = (np.zeros(n, dtype=np.int64) for _ in range(3))
    for j in reversed(range(n)):
        parts = profiles[j].gradient_parts
        takes = profiles[j].takes
        reads = [v for v in states[j] if takes is None or v in takes]
        made_by_j: dict[str, int] = {}
        for v in reads:
            part = states[j][v] if parts is None else parts.get(v)
            if part is None:
                continue  # it makes no gradient of v
            made_by_j[v] = holding[part] if isinstance(part, str) and part in holding \
                else new(part if isinstance(part, int) else states[j][v])
        arrived = {holding[v] for v in states[j + 1] if v in holding}
        fresh = set(made_by_j.values()) - arrived
        during[j] = sum(size[t] for t in arrived | fresh)
        made[j] = sum(size[t] for t in fresh)
        for v in states[j + 1]:
            if v not in states[j]:
                holding.pop(v, None)
        summing = 0
        for v, part in made_by_j.items():
            old = holding.get(v)
            if old is None or old == part:  # its first part, or passed on as it is
                holding[v] = part
                continue
            holding[v] = new(states[j][v])
            # Just after the sum: the gradient so far and the part too, where nothing else holds
            # them; sums happen one by one, so the largest counts.
            summing = max(summing, sum(size[t] for t in {old, part} - set(holding.values())))
        if summing:
            after[j] = sum(size[t] for t in set(holding.values())) + summing
        else:
            after[j] = NO_MOMENT
    return GradientFlow(during, after, made)
