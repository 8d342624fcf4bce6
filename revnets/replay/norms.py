"""Training-mode BatchNorm in a replay: batch statistics as usual, running statistics left as the
recorded run left them (NOTE [ Replay ], rule 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from revnets.replay.state import tracked_norms

__all__ = ["frozen_running_stats"]


class frozen_running_stats:  # noqa: N801 (a context manager, named like contextlib's)
    """Within this context, BatchNorm layers in training mode normalise with batch statistics as
    usual but leave ``running_mean``, ``running_var`` and ``num_batches_tracked`` as they were
    (NOTE [ Replay ], rule 2). ``tracked``: ``modules`` are those BatchNorms already.

    ``uncounted``: only torch.nn's own norms run inside (NOTE [ Known layers ]), which read
    ``num_batches_tracked`` for nothing but its update when momentum is set: it is taken out for
    the time of the context and put back as it was, instead of copied and restored.

    A class rather than a generator: it is entered for every replay of every transform."""

    __slots__ = ("norms", "frozen", "uncounted")

    def __init__(
        self, modules: nn.Module | Sequence[nn.Module], tracked: bool = False,
        uncounted: bool = False,
    ) -> None:
        if isinstance(modules, nn.Module):
            modules = [modules]
        self.norms = modules if tracked else tracked_norms(modules)
        self.frozen: list[tuple[Any, Tensor | None]] = []
        self.uncounted = uncounted

    def __enter__(self) -> None:
        for m in self.norms:
            count = m._buffers.get("num_batches_tracked")
            if count is not None and self.uncounted:
                m._buffers["num_batches_tracked"] = None
                self.frozen.append((m.momentum, count))
            else:
                self.frozen.append((m.momentum, None if count is None else count.clone()))
            # Momentum 0 blends in nothing of the batch: running = running * 1 + batch * 0,
            # exactly. Everything else stays as in the original forward, down to which tensors
            # autograd saves (torch.utils.checkpoint checks that the recomputation saves the same
            # ones). object.__setattr__: a plain attribute (or a subclass's property), without
            # nn.Module.__setattr__'s checks for parameters and submodules.
            object.__setattr__(m, "momentum", 0.0)

    def __exit__(self, *exc: Any) -> None:
        frozen, self.frozen = self.frozen, []
        for (momentum, count), m in zip(frozen, self.norms):
            object.__setattr__(m, "momentum", momentum)
            if count is not None and self.uncounted:
                m._buffers["num_batches_tracked"] = count  # the very tensor, untouched
            elif count is not None:  # a layer may drop its count (num_batches_tracked = None)
                now = m._buffers.get("num_batches_tracked")
                if now is not None:  # an integer count: copy_ records no graph
                    now.copy_(count)
