"""Where a plan's peak meets the budget: the one acceptance (``fits``) every search, the module
planner and the zoo's presets decide by, and the refusal that names the smallest budget reached
(``no_fit``, a :class:`PlanningError`)."""

from __future__ import annotations

from typing import Any

from revnets.facts import MiB

__all__ = ["PlanningError", "fits", "no_fit"]


class PlanningError(ValueError):
    """No plan fits the budget; ``smallest_budget`` (bytes, also in the message) is the
    smallest budget that can be reached, which asked for plans."""

    def __init__(self, message: str, smallest_budget: int | None = None) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


def fits(peak: float, budget: int) -> bool:
    """Whether a plan peaking at ``peak`` bytes (predicted exactly; or modelled, where a search
    guesses which plan to predict) trains within ``budget`` bytes: the only place the two are
    compared."""
    return peak <= budget


def no_fit(budget: int, smallest: float, how: Any) -> PlanningError:
    """The refusal where no plan fits ``budget``: ``smallest``, the least peak reached (``how``),
    is the budget that plans."""
    return PlanningError(
        f"auto_checkpoint: no plan trains within {budget / MiB:.2f} MiB; the smallest budget this "
        f"model can reach at this input size is {smallest / MiB:.2f} MiB ({int(smallest)} bytes, "
        f"with {how}). Use a smaller batch or a reversible architecture.",
        int(smallest),
    )
