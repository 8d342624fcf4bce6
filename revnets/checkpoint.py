"""Checkpointing for what is not invertible: recompute in backward instead of storing.

Built on non-reentrant :func:`torch.utils.checkpoint.checkpoint`, which already replays RNG and
autocast state. What it does not do is keep BatchNorm from updating its running statistics a
second time during the recomputation; :class:`Checkpointed` adds that, so a checkpointed model
trains exactly like the plain one.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch.utils.checkpoint
from torch import nn

from revnets.replay import frozen_running_stats

__all__ = ["Checkpointed", "checkpoint_segments"]


class Checkpointed(nn.Module):
    """Wrap any module so that, in training with grad enabled, its forward stores only its inputs
    and its internals are recomputed in backward.

    Args:
        module: the module to wrap (its state_dict keys gain a ``module.`` prefix).
        enabled: the off switch; ``False`` runs ``module`` as is.
        preserve_rng_state: replay RNG (dropout masks) in the recomputation.

    Gradients, outputs and BatchNorm running statistics equal those of the unwrapped module.
    """

    def __init__(self, module: nn.Module, enabled: bool = True, preserve_rng_state: bool = True):
        super().__init__()
        self.module = module
        self.enabled = enabled
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.enabled and self.training and torch.is_grad_enabled()):
            return self.module(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(
            self.module,
            *args,
            use_reentrant=False,
            preserve_rng_state=self.preserve_rng_state,
            context_fn=self._contexts,
            **kwargs,
        )

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, ...]:
        # The first context wraps the original forward, the second the recomputation.
        return contextlib.nullcontext(), frozen_running_stats(self.module)

    def extra_repr(self) -> str:
        return f"enabled={self.enabled}"


def checkpoint_segments(sequential: nn.Sequential, segments: int | None = None) -> nn.Sequential:
    """Split a sequential model into segments and checkpoint each, Chen et al.'s sqrt(n) plan.

    With ``n`` layers and ``segments`` about ``sqrt(n)`` (the default), training stores one
    activation per segment boundary plus one segment's internals at a time: O(sqrt n) memory for
    one extra forward pass. The last segment is not checkpointed: backward would recompute it
    immediately, saving nothing.

    Returns a new ``nn.Sequential`` of ``Checkpointed(nn.Sequential(...))`` segments sharing the
    original layers (so parameters are the same objects).
    """
    layers = list(sequential)
    n = len(layers)
    if n == 0:
        return nn.Sequential()
    if segments is None:
        segments = max(1, round(math.sqrt(n)))
    if not 1 <= segments <= n:
        raise ValueError(f"checkpoint_segments: segments must be between 1 and {n}, got {segments}")
    bounds = [round(i * n / segments) for i in range(segments + 1)]
    parts = [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    wrapped = [Checkpointed(part) for part in parts[:-1]] + [parts[-1]]
    return nn.Sequential(*wrapped)
