"""What recomputing a chain's steps costs under torch.compile (NOTE [ Compiled costs ])."""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import replace

from revnets.planning.profile import LayerProfile

__all__ = ["compiled_costs"]


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
