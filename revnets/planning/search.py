"""Which plan to predict next: a search over candidate plans that a chain model ranks and exact
predictions decide.

# NOTE [ Modelled search, exact acceptance ]
# An exact prediction (``revnets.predict_memory`` on fake tensors) runs the whole training step:
# tenths of a second for a small model, seconds for a thousand layers. A modelled peak is a sum
# over the chain's profiles (memory_model.py: what each step saves, each storage once, the
# values live at each cut, the gradients in flight) and costs microseconds, but leaves out
# transients (workspaces, what the loss's backward makes, a recomputation's own). So:
#
# - every option (a choice of reconstructing sequences and a segmentation) gets a modelled peak; its
#   estimated peak is that plus an offset per choice: the parameters and buffers to begin with, then
#   the error of the last option of the choice predicted;
# - options are tried in order of what they recompute; the first whose estimate fits is predicted
#   exactly, and accepted only if the prediction fits: a plan is never accepted on a model's word.
#   Once one fits, cheaper options whose estimates now fit are tried, up to ``MAX_GUESSES``
#   predictions in all;
# - candidates come from sizes alone (Chen's and optimal plans counting steps) and, where times were
#   measured, from times too (selective plans: storing the slow steps, recomputing the cheap ones);
#   only the first kind can be a floor;
# - when nothing fitted that way, each choice's floors (the option of least modelled peak, ties
#   broken by the plan itself, and the cheapest option, which where activations are few peaks lower
#   than any checkpoint: sizes only, never timings) are predicted, in order of cost, and the first
#   that fits is kept; where none fits, the near floors (``near_floors``: those the floors' own
#   errors estimate below the lowest floor, found from sizes and the floors' peaks alone) are
#   predicted alike. With the budget the one kept leaves spare, up to ``MAX_GUESSES`` more
#   predictions try options that recompute less, each choice's estimate corrected by the largest
#   error seen for it. A refusal names the smallest floor or near floor predicted, so asked for
#   that budget the search predicts the same floors and near floors again and one fits;
# - planned for torch.compile, the plan found is retried once against the selective plan made for
#   the room its own error leaves (``auto_checkpoint``'s planner; selective candidates were made for
#   the room the parameters and buffers leave, before any error was known). Compiled, a selective
#   checkpoint recomputes no product, so the retry can save most of the recomputation; eager, the
#   one more prediction it costs on most plans was not repaid;
# - below every one-level floor, nested schedules (rotor's recursion over a grouped chain) are tried
#   alike: rotor is given the budget less the error the lowest floor's prediction showed (exact
#   minus modelled, at most the model state with its gradients, which rotor's model leaves out). The
#   schedule found there is predicted; where it fits, its prediction measured the slack it leaves,
#   and the room grows by that once more (a schedule needs at most its room in rotor's model, so its
#   error is at least its exact peak less the room). Only where the first guess misses, or where
#   even the most frugal schedule's estimate does not fit, is that schedule (the least memory of
#   rotor's model, found from sizes alone) predicted: a refusal names its peak, and the room is
#   corrected by its error; a schedule that misses shrinks the room by what its prediction overshot
#   (fixed shares of the room jumped from a schedule just over the budget to the frugal one, so a
#   larger budget could get the frugal schedule where a smaller one got a cheaper plan). Predicting
#   the frugal schedule first cost the most of all nested predictions (it recomputes the most) where
#   a fitting schedule did not need it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from revnets.planning.chain import Segment
from revnets.planning.nested import NestedSchedule

__all__ = [
    "MAX_GUESSES", "Option", "Segments", "lowest_floor", "near_floors", "search",
    "search_nested",
]

Segments = tuple[Segment, ...]  # (start, stop, recompute) covering the chain
MAX_GUESSES = 6


@dataclass(frozen=True)
class Option:
    """One plan of the search: which sequences reconstruct, and how the chain is segmented."""

    reconstructed: frozenset[int]
    segments: Segments
    cost: float  # forward seconds recomputed (steps counted where not measured)
    modelled: int  # the chain model's peak: activations and gradients (chain.modelled_peaks)
    sized: bool = True  # chosen on sizes alone, not on measured times: may be a floor


def search(
    options: Sequence[Option],
    budget: int,
    predict: Callable[[Option], int],
    offset: int,
) -> tuple[Option | None, dict[Option, int]]:
    """The option the NOTE above picks for ``budget``, or None, with every peak predicted.
    ``options`` come in order of cost; ``offset`` is the first guess of what an exact peak adds
    to a modelled one (the parameters and buffers)."""
    peaks: dict[Option, int] = {}

    def exact(option: Option) -> int:
        if option not in peaks:
            peaks[option] = predict(option)
        return peaks[option]

    best = _guesses(options, None, budget, exact, peaks, offset, {}, worst=False)
    if best is not None:
        return best, peaks
    best = next((floor for floor in floors(options) if exact(floor) <= budget), None)
    if best is None:
        best = next((near for near in near_floors(options, peaks) if exact(near) <= budget), None)
    if best is None:
        return None, peaks
    # The model guessed low everywhere it was asked: the floor fits, with budget to spare. Spend
    # the guesses again on options that recompute less, each choice's estimate now corrected by
    # the largest error seen for it.
    errors: dict[frozenset[int], int] = {}
    for option, peak in peaks.items():
        error = peak - option.modelled
        errors[option.reconstructed] = max(errors.get(option.reconstructed, error), error)
    return _guesses(options, best, budget, exact, peaks, offset, errors, worst=True), peaks


def _guesses(
    options: Sequence[Option],
    best: Option | None,
    budget: int,
    exact: Callable[[Option], int],
    peaks: dict[Option, int],
    offset: int,
    errors: dict[frozenset[int], int],
    worst: bool,
) -> Option | None:
    """Up to ``MAX_GUESSES`` exact predictions of options cheaper than ``best`` (none predicted
    before, in ``peaks``) whose estimate fits; the cheapest that fits. ``errors`` (exact minus
    modelled peak per choice) is updated with the last error seen, or the largest if ``worst``."""
    for _ in range(MAX_GUESSES):
        cheaper = options[: options.index(best)] if best is not None else options
        guess = next((o for o in cheaper if o not in peaks
                      and o.modelled + errors.get(o.reconstructed, offset) <= budget), None)
        if guess is None:
            break
        peak = exact(guess)
        if peak <= budget:
            best = guess
        error = peak - guess.modelled
        held = errors.get(guess.reconstructed)
        errors[guess.reconstructed] = max(held, error) if worst and held is not None else error
    return best


def floors(options: Sequence[Option]) -> list[Option]:
    """Each choice's option of least modelled peak among those chosen on sizes alone, and the
    one that recomputes nothing (where activations are few, checkpoints can cost more than
    they save, which the model does not see), in order of cost. Which they are depends on
    sizes alone, never on measured times."""
    best: dict[frozenset[int], Option] = {}
    cheapest: dict[frozenset[int], Option] = {}
    for option in options:
        if not option.sized:
            continue
        key = (option.modelled, option.segments)
        held = best.get(option.reconstructed)
        if held is None or key < (held.modelled, held.segments):
            best[option.reconstructed] = option
        held = cheapest.get(option.reconstructed)
        if not any(recompute for _, _, recompute in option.segments) and (
                held is None or key < (held.modelled, held.segments)):
            cheapest[option.reconstructed] = option
    both = dict.fromkeys([*best.values(), *cheapest.values()])  # in a fixed order
    return sorted(both, key=lambda o: (o.cost, o.modelled))


def near_floors(options: Sequence[Option], peaks: dict[Option, int]) -> list[Option]:
    """Options chosen on sizes alone that may peak below every floor, once every floor is
    predicted (in ``peaks``) and none fitted: those whose modelled peak, with the least error
    the floors of their choice showed, lies below the lowest floor's exact peak, from the least
    such estimate, at most ``MAX_GUESSES``. The model's error differs a little from plan to plan
    (a window attention's transients), so a plan modelled above a floor can peak below it. What
    they are depends on sizes alone, never on the budget: asked for any budget whose floors all
    miss, the search walks the same ones in the same order."""
    lowest = floors(options)
    least = min(peaks[floor] for floor in lowest)
    error: dict[frozenset[int], int] = {}
    for floor in lowest:
        held = error.get(floor.reconstructed)
        error[floor.reconstructed] = min(held, peaks[floor] - floor.modelled) if held is not None \
            else peaks[floor] - floor.modelled
    near = [option for option in options if option.sized and option not in lowest
            and option.modelled + error[option.reconstructed] < least]
    near.sort(key=lambda option: (option.modelled + error[option.reconstructed],
                                  sorted(option.reconstructed), option.segments))
    return near[:MAX_GUESSES]


def lowest_floor(options: Sequence[Option], peaks: dict[Option, int]) -> Option:
    """The floor or near floor of least exact peak, after ``search`` found nothing (it
    predicted every floor and near floor then). A refusal names its peak: asked for that, the
    search predicts the floors and near floors again, in the same order, and this one fits. A
    guess that missed may have peaked lower, but asked for its peak the search can take
    another path and never predict it again."""
    return min([*floors(options), *near_floors(options, peaks)],
               key=lambda floor: (peaks[floor], floor.cost))


def search_nested(
    frugal: NestedSchedule,
    schedule_for: Callable[[int], NestedSchedule | None],
    budget: int,
    predict: Callable[[NestedSchedule], int],
    error: int,
    most: int,
) -> tuple[NestedSchedule | None, int]:
    """The nested schedule the NOTE above picks for ``budget`` and its exact peak, or None and
    the exact peak of ``frugal`` (the schedule of least modelled memory) where even that does
    not fit. ``schedule_for(room)`` is rotor's schedule for a room; ``error`` the lowest
    one-level floor's exact peak less its modelled one; no error counts more than ``most``."""
    peaks: dict[str, int] = {}

    def exact(schedule: NestedSchedule) -> int:
        key = repr(schedule.tree)
        if key not in peaks:
            peaks[key] = predict(schedule)
        return peaks[key]

    if frugal.modelled_bytes is not None and frugal.modelled_bytes + min(error, most) <= budget:
        found, room = None, budget - min(error, most)
        for _ in range(2):  # the guess, then the room grown by the slack it measured
            schedule = schedule_for(room)
            # One level deep, it is a one-level plan, which the floors already bound from below.
            if schedule is None or schedule.depth() < 2 or exact(schedule) > budget:
                break
            found = schedule
            room = budget - min(exact(schedule) - room, most)
        if found is not None:
            return found, exact(found)
    if exact(frugal) > budget:
        return None, exact(frugal)
    room = budget - min(exact(frugal) - (frugal.modelled_bytes or 0), most)
    # Each miss shrinks the room by what its prediction overshot, until a schedule fits, rotor
    # finds none, or three more have missed (a room that gives a schedule already predicted
    # shrinks again at no cost).
    predicted = len(peaks)
    for _ in range(4 * MAX_GUESSES):  # rotor calls (each shrinks the room), not predictions
        schedule = schedule_for(room)
        if schedule is None or len(peaks) - predicted >= 3 and repr(schedule.tree) not in peaks:
            break
        if exact(schedule) <= budget:
            return schedule, exact(schedule)
        room -= exact(schedule) - budget
    return frugal, exact(frugal)
