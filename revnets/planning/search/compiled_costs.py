"""What recomputing a chain's steps costs under torch.compile (NOTE [ Compiled costs ]), and the
segments that are selective checkpoints there because they cost nothing more so."""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import replace

from revnets.planning.costs.layer_profile import LayerProfile
from revnets.planning.search.chain import segment_cost
from revnets.planning.search.chain_model import Action, Segment

__all__ = ["compiled_costs", "selective_stored_runs", "selective_when_free"]


# NOTE [ Compiled costs ]
# Under torch.compile a checkpoint's cheap steps (norms, activations, additions) are recomputed
# inside the backward's fused kernels at next to no cost, and what recomputing a step costs is
# its matrix products, convolutions and attention: their floating-point operations, as
# torch.compile's own activation memory budget weighs them
# (torch._functorch.config.activation_memory_budget_runtime_estimator, "flops"). Counted on
# the meta device, they are the same in every run: forward times measured once on a busy CPU
# varied enough between runs that ResNet-50 at one budget was given four different plans in six
# calls. Measured times only set the scale, so that a reversible sequence, which runs eagerly
# also compiled and keeps its measured time, is weighed against them: the power of two nearest
# the seconds per operation over all such steps, by which operations add up exactly (plans
# recomputing the same operations tie exactly, whatever the times measured). Without measured
# times every costed step, reversible sequences included, costs its operations: the plans
# are those measured times give wherever the operations set the order.
def compiled_costs(profiles: Sequence[LayerProfile],
                   eager_steps: Container[int]) -> list[LayerProfile]:
    """``profiles`` costed for a compiled model (NOTE [ Compiled costs ]): steps with products
    cost their operations at the measured seconds per operation, ``eager_steps`` their
    measured time, and the others nothing. Unmeasured (NaN) times cost every step its
    operations (at least one)."""
    if any(math.isnan(p.forward_seconds) for p in profiles):
        return [replace(p, forward_seconds=float(max(p.product_flops, 1))
                        if p.index in eager_steps or p.selective_bytes else 0.0)
                for p in profiles]
    products = [p for p in profiles if p.selective_bytes and p.index not in eager_steps]
    flops = sum(p.product_flops for p in products)
    seconds = sum(p.forward_seconds for p in products)
    rate = 2.0 ** round(math.log2(seconds / flops)) if flops and seconds > 0 else None

    def cost(p: LayerProfile) -> float:
        if p.index not in eager_steps and not p.selective_bytes:
            return 0.0
        if p.index in eager_steps or rate is None or not p.product_flops:
            return p.forward_seconds
        return p.product_flops * rate

    return [replace(p, forward_seconds=cost(p)) for p in profiles]


def selective_when_free(plan: Sequence[Segment],
                        profiles: Sequence[LayerProfile]) -> tuple[Segment, ...]:
    """``plan`` with each checkpoint of steps that keep no product made selective: it keeps and
    recomputes what it did, and under torch.compile it runs as one with the selective
    checkpoints beside it (NOTE [ Selective segments under compile ] in planning/planned.py)."""
    return tuple((a, b, Action.SELECTIVE if recompute == Action.CHECKPOINT
                  and not any(profiles[i].selective_bytes for i in range(a, b)) else recompute)
                 for a, b, recompute in plan)


# NOTE [ Stored runs under compile ]
# A stored run of a plan for a compiled model is left to the partitioner at torch.compile's
# default budget, which keeps what its min-cut finds cheapest to keep (compile at budget 1.0
# peaks above the eager step on ViT-S: frontier.py), and the values at the run's ends break
# the selective checkpoints beside it, which otherwise run as one
# (NOTE [ Selective segments under compile ] in planning/planned.py). A selective checkpoint of the
# same run keeps its products, which the min-cut keeps anyway (it recomputes no matrix
# product), and recomputes its norms, activations and additions inside fused kernels, which
# costs nothing by NOTE [ Compiled costs ]. The eager step's peak, which the budget means, can
# rise though (an eager backward recomputes a selective segment's steps together), so the
# planner predicts the plan with its free stored runs selective, once, and takes it where it
# fits. ViT-S at a 70 % keep stored two runs (block 10's attention and the head) and peaked
# above compile's own 0.7 budget at about its speed (316.0 against 313.9 MiB); now 313.7 MiB
# (benchmarks/frontier.py, docs/results.md).
def selective_stored_runs(plan: Sequence[Segment], profiles: Sequence[LayerProfile],
                          reconstructed: Container[int]) -> tuple[Segment, ...]:
    """``plan`` with each stored run that a selective checkpoint recomputes at no cost (all it
    recomputes costs nothing under ``profiles``, costed by :func:`compiled_costs`) made one
    (NOTE [ Stored runs under compile ]); as the search's selective segments, never one whose
    kept outputs a step overwrites in place (``selective_safe``: torch refuses the backward)
    nor a ``reconstructed`` sequence, which runs as it is."""
    def free(a: int, b: int) -> bool:
        return (segment_cost(profiles, a, b, Action.SELECTIVE) == 0
                and all(profiles[i].selective_safe and i not in reconstructed
                        for i in range(a, b)))

    return tuple((a, b, Action.SELECTIVE if recompute == Action.STORE and free(a, b) else recompute)
                 for a, b, recompute in plan)
