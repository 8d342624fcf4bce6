"""How a model spends memory on activations: a typed plan, one decision per part.

Three things can happen to the activations of a part of a model during a training step:

- :class:`Store`: kept for backward (ordinary autograd).
- :class:`Checkpoint`: only the part's input is kept; its forward runs again in backward.
  ``segments`` splits a run of blocks into that many checkpointed pieces (``None``: about
  sqrt(n), Chen et al.'s optimum).
- :class:`Reconstruct`: a reversible part recomputes its inputs from its outputs in backward;
  ``store_last_blocks`` and ``keep_input_every`` trade some memory back for time.

A :class:`MemoryPlan` gives the decision for the blocks of a model's stages and for the rest
(stems, strided transitions, heads); a plan made by :func:`revnets.auto_checkpoint` also lists
every part it decided on, with its predicted memory and recompute time (print it). The zoo's
memory strategies are named presets (:data:`PRESETS`). Strings are parsed into plans once, where
they come in by :func:`parse_memory_plan` (timm's ``memory=`` keyword); options given as keys
(Hydra's ``memory.store_last_blocks=2``) make a plan by :func:`plan_from_options`.
"""

from __future__ import annotations

import math
import re
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import get_type_hints

from revnets.facts import MiB

__all__ = [
    "EXACT_HOME",
    "PRESETS",
    "Checkpoint",
    "Decision",
    "MemoryPlan",
    "PartPlan",
    "Reconstruct",
    "Store",
    "parse_memory_plan",
    "plan_from_options",
    "preset_options",
]



@dataclass(frozen=True)
class Store:
    """Keep the part's activations for backward."""

    def __str__(self) -> str:
        return "store"


@dataclass(frozen=True)
class Checkpoint:
    """Keep only the part's input and run its forward again in backward; a run of blocks is
    cut into ``segments`` checkpointed pieces (None: about sqrt(n)). ``selective``: keep the
    outputs of matrix products, convolutions and attention too, and recompute only the rest
    (norms, activations, dropout, additions: NOTE [ Selective recomputation ] in
    revnets/facts/operators.py)."""

    segments: int | None = None
    selective: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.selective, bool):
            raise ValueError(f"Checkpoint: selective must be True or False, got {self.selective!r}")
        if self.segments is not None and (
            isinstance(self.segments, bool) or not isinstance(self.segments, int)
            or self.segments < 1
        ):
            raise ValueError(
                f"Checkpoint: segments must be a positive integer or None (about sqrt(n)), got "
                f"{self.segments!r}"
            )

    def segments_for(self, blocks: int) -> int | None:
        """How many segments a run of ``blocks`` blocks is cut into (None: about sqrt(n))."""
        return None if self.segments is None else min(self.segments, max(blocks, 1))

    def __str__(self) -> str:
        options = [f"segments={self.segments}"] if self.segments is not None else []
        options += ["selective=true"] if self.selective else []
        return f"checkpoint({', '.join(options)})" if options else "checkpoint"


# Where a plan meets the arithmetic: ``exact`` is how a reversible sequence computes (its grid), not
# what it keeps, so it is the sequence's alone and no decision carries it.
EXACT_HOME = (
    "exact is the arithmetic of a reversible sequence, not a memory decision, and a plan never "
    "changes it: set it on the sequence (revnets.ReversibleSequence(blocks, exact=True), or "
    "sequence.exact = True), on a zoo model when it is built (timm.create_model(name, "
    "exact=True)), or in the trainer as model.exact=true"
)


@dataclass(frozen=True)
class Reconstruct:
    """Recompute a reversible part's inputs from its outputs in backward (see
    :class:`~revnets.ReversibleSequence` for ``store_last_blocks`` and ``keep_input_every``).
    The sequence's arithmetic (``exact``) is the sequence's own: no decision changes it."""

    store_last_blocks: int = 0
    keep_input_every: int | None = None
    exact: InitVar[object] = None  # refused by name: EXACT_HOME

    def __post_init__(self, exact: object) -> None:
        if exact is not None:
            raise TypeError(f"Reconstruct(exact={exact!r}): {EXACT_HOME}")
        if isinstance(self.store_last_blocks, bool) or not isinstance(self.store_last_blocks, int) \
                or self.store_last_blocks < 0:
            raise ValueError(
                "Reconstruct: store_last_blocks must be a non-negative integer, got "
                f"{self.store_last_blocks!r}"
            )
        if self.keep_input_every is not None and (
            isinstance(self.keep_input_every, bool) or not isinstance(self.keep_input_every, int)
            or self.keep_input_every < 1
        ):
            raise ValueError(
                "Reconstruct: keep_input_every must be a positive integer or None, got "
                f"{self.keep_input_every!r}"
            )

    def __str__(self) -> str:
        options = [f"store_last_blocks={self.store_last_blocks}"] if self.store_last_blocks else []
        if self.keep_input_every is not None:
            options.append(f"keep_input_every={self.keep_input_every}")
        return "reconstruct" + (f"({', '.join(options)})" if options else "")


Decision = Store | Checkpoint | Reconstruct


@dataclass(frozen=True)
class PartPlan:
    """One part of a planned model: what happens to its activations, and what that costs.

    ``kept_bytes``: activations it keeps from its forward until its backward (a checkpointed
    segment: its input), as modelled by the planner. ``recompute_seconds``: forward time run
    again in backward (NaN where times were not measured, e.g. on the meta device).
    """

    name: str
    decision: Decision
    kept_bytes: int = 0
    recompute_seconds: float = math.nan


@dataclass(frozen=True)
class MemoryPlan:
    """What happens to activations: ``stages`` for the blocks of each stage (reversible blocks
    can be reconstructed), ``rest`` for everything else (stems, strided transitions, heads).

    Plans made by :func:`revnets.auto_checkpoint` list their ``parts`` and the training step's
    predicted ``peak_bytes`` (with the ``budget`` asked for); ``str(plan)`` is then a table.
    """

    stages: Decision = Store()
    rest: Store | Checkpoint = Store()
    parts: tuple[PartPlan, ...] = field(default=(), compare=False)
    peak_bytes: int | None = field(default=None, compare=False)
    budget: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name, value in (("stages", self.stages), ("rest", self.rest)):
            if not isinstance(value, (Store, Checkpoint, Reconstruct)):
                raise TypeError(
                    f"MemoryPlan: {name} must be revnets.Store(), Checkpoint() or Reconstruct(), "
                    f"got {value!r}; for a plan named by a string use "
                    f"revnets.parse_memory_plan({value!r})"
                )
        if isinstance(self.rest, Reconstruct):
            raise ValueError(
                "MemoryPlan: only reversible blocks can be reconstructed; rest (stems, strided "
                "transitions, heads) can be Store() or Checkpoint()"
            )

    @property
    def name(self) -> str:
        """The preset's name, or the decisions spelt out."""
        for name, preset in PRESETS.items():
            if preset == self:
                return name
        return f"stages={self.stages}, rest={self.rest}"

    @property
    def reconstructs(self) -> bool:
        return isinstance(self.stages, Reconstruct)

    def __str__(self) -> str:
        if not self.parts:
            return self.name
        rows = [("part", "decision", "kept MiB", "recompute ms")]
        for part in self.parts:
            seconds = part.recompute_seconds
            ms = "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"
            rows.append((part.name, str(part.decision), f"{part.kept_bytes / MiB:.2f}", ms))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(
                cell.ljust(width) if i < 2 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        if self.peak_bytes is not None:
            within = "" if self.budget is None else f" (budget {self.budget / MiB:.2f} MiB)"
            peak = self.peak_bytes / MiB
            lines.append(f"predicted peak of a training step: {peak:.2f} MiB{within}")
        return "\n".join(lines)


PRESETS: dict[str, MemoryPlan] = {
    "none": MemoryPlan(Store(), Store()),
    "checkpoint": MemoryPlan(Checkpoint(), Store()),
    "reversible": MemoryPlan(Reconstruct(), Store()),
    "reversible+checkpoint": MemoryPlan(Reconstruct(), Checkpoint()),
}
_OPTIONS = re.compile(r"^(?P<name>[a-z+_]+)(?:\((?P<options>[^()]*)\))?$")


def preset_options() -> dict[str, tuple[str, ...]]:
    """The options each preset takes: the fields of its stages' decision (``Checkpoint``'s
    ``segments``, ``Reconstruct``'s ``store_last_blocks`` and ``keep_input_every``). A field added
    to a decision is an option everywhere plans come in: keywords, strings, Hydra keys."""
    return {name: tuple(f.name for f in fields(plan.stages)) for name, plan in PRESETS.items()}


def _preset(name: str) -> MemoryPlan:
    preset = PRESETS.get(name.replace("reversible_checkpoint", "reversible+checkpoint"))
    if preset is None:
        raise ValueError(f"unknown memory plan {name!r}; presets: {', '.join(PRESETS)}")
    return preset


def plan_from_options(preset: str, **options: object) -> MemoryPlan:
    """The preset named ``preset`` with ``options`` for its stages' decision:
    ``plan_from_options("reversible", store_last_blocks=2)`` is
    ``MemoryPlan(Reconstruct(store_last_blocks=2), Store())``. ``reversible_checkpoint`` (Hydra's
    file name) means ``reversible+checkpoint``. An option the preset does not take is refused,
    naming the ones it takes; values are checked by the decision itself."""
    plan = _preset(preset)
    valid = tuple(f.name for f in fields(plan.stages))
    unknown = [key for key in options if key not in valid]
    if "exact" in unknown:
        raise ValueError(f"memory plan {plan.name!r} has no option 'exact': {EXACT_HOME}")
    if unknown:
        takes = f"its options: {', '.join(valid)}" if valid else "it takes no options"
        raise ValueError(f"memory plan {plan.name!r} has no option {unknown[0]!r}; {takes}")
    return replace(plan, stages=replace(plan.stages, **options)) if options else plan


def _option_value(decision: type, key: str, text: str) -> int | bool:
    """A string option's value in its field's type: a whole number, or true/false for a flag."""
    if get_type_hints(decision).get(key) is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"option '{key}={text}' needs true or false")
        return text.lower() == "true"
    if not text.isdigit():
        raise ValueError(f"option '{key}={text}' needs a whole number")
    return int(text)


def parse_memory_plan(value: str | MemoryPlan) -> MemoryPlan:
    """A plan from its preset name, with options for the stages' decision in brackets:
    ``"reversible(store_last_blocks=3)"``, ``"checkpoint(segments=4)"`` (the form timm's
    ``memory=`` keyword takes; Hydra takes options as keys, see :func:`plan_from_options`).
    A plan is returned as is."""
    if isinstance(value, MemoryPlan):
        return value
    if not isinstance(value, str):
        raise TypeError(f"a memory plan is a MemoryPlan or a preset name, got {value!r}")
    match = _OPTIONS.match(value.strip().replace(" ", ""))
    if not match or match["name"].replace("reversible_checkpoint", "reversible+checkpoint") \
            not in PRESETS:
        raise ValueError(
            f"unknown memory plan {value!r}; presets: {', '.join(PRESETS)}, options in brackets "
            "(e.g. 'reversible(store_last_blocks=2)', 'checkpoint(segments=4)')"
        )
    decision = type(_preset(match["name"]).stages)
    options: dict[str, object] = {}
    for item in filter(None, (match["options"] or "").split(",")):
        key, _, text = item.partition("=")
        if key in options:
            raise ValueError(f"memory plan {value!r}: option {key!r} given twice")
        if key not in {f.name for f in fields(decision)}:
            options[key] = text  # refused by plan_from_options, naming the options there are
            continue
        try:
            options[key] = _option_value(decision, key, text)
        except ValueError as error:
            raise ValueError(f"memory plan {value!r}: {error}") from None
    try:
        return plan_from_options(match["name"], **options)
    except ValueError as error:
        raise ValueError(f"memory plan {value!r}: {error}") from None
