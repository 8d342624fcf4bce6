"""Which plan to predict next: a search over candidate plans that a chain model ranks and exact
predictions decide.

# NOTE [ Modelled search, exact acceptance ]
# An exact prediction (``revnets.predict_memory`` on fake tensors) runs the whole training step:
# tenths of a second for a small model, seconds for a thousand layers. A modelled peak is a sum
# over the chain's profiles (chain_model.py: what each step saves, each storage once, the
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
#   only the first kind can be a floor. Selective plans are made for the rooms of one fixed grid
#   (powers of ``ROOM_RATIO``, 2.9 % apart, in planning/auto.py) within 10 % of the budget's
#   room, never
#   for the budget's own room: a smaller budget's candidates are then the same plans, or plans
#   for smaller rooms of the same grid, each the cheapest within its room, so that the smaller
#   budget gets no higher peak where the ranking above does not err (``budget_sweep.py
#   --measured``: no pair of 120 budgets; one, 256 bytes, while the chain model counted twice
#   a value a segment holds and the next cut keeps: NOTE [ A storage saved twice is held
#   once ]). Made for rooms in
#   proportion to each budget, the candidates of two budgets were different plans, and a sweep
#   of budgets on one set of measured times got a higher measured peak at a smaller budget in 12
#   of 12 sweeps of a six-block MLP (tests/test_step_times.py); the budget's own room added to
#   the grid's, in 2 of 24 sweeps over four models. A grid 9 % apart left plans a room up to
#   9 % short of the budget (the budget's own room is the one whose plan was taken on 13 of 13
#   torchvision plans, by hand);
# - when nothing fitted that way, each choice's floors (the option of least modelled peak, ties
#   broken by the plan itself, and the cheapest option, which where activations are few peaks lower
#   than any checkpoint: sizes only, never timings) are predicted, in order of cost, and the first
#   that fits is kept; where none fits, the near floors (``near_floors``: those the floors' own
#   errors estimate below the lowest floor, found from sizes and the floors' peaks alone, one of
#   each modelled peak) are predicted alike. With the budget the one kept leaves spare, up to
#   ``MAX_GUESSES`` more predictions try options that recompute less, each choice's estimate
#   corrected by the largest error seen for it. A refusal names the smallest floor or near
#   floor predicted, so asked for that budget the search predicts the same floors and near
#   floors again and one fits;
# - planned for torch.compile, the plan found is retried once against the selective plan made for
#   the room its own error leaves (``auto_checkpoint``'s planner; selective candidates were made for
#   the room the parameters and buffers leave, before any error was known). Compiled, a selective
#   checkpoint recomputes no product, so the retry can save most of the recomputation; eager, the
#   one more prediction it costs on most plans was not repaid;
# - below every one-level floor, nested schedules (rotor's recursion over a grouped chain) are
#   chosen from a fixed set: the most frugal schedule (the least memory of rotor's model) and
#   rotor's schedules for rooms growing by a fixed ratio from that least memory, steps counted
#   (not timed). They are predicted from the cheapest, and the first that fits is taken; where
#   none fits, a refusal names the least of their peaks. The set depends on sizes alone, never on
#   the budget or on measured times, so at every budget the plan is the cheapest that fits among
#   the same schedules: a smaller budget gets the same plan or one that fitted where the larger
#   budget's did not, never a higher peak, and the budget a refusal names plans, in any run.
#   A nested schedule keeps each group of steps it schedules whole. Where the lowest floor,
#   both as predicted (less the model state) and as modelled, is within 0.1 % of its exact
#   peak (``NESTED_MIN_GAIN`` in planning/auto.py) of the least that any plan keeping those groups
#   whole holds at some moment in the chain model (``ChainModel.least_bytes``: the step's end,
#   or a group's backward with all it saves, the gradients made by then and the input its
#   caller holds), none is searched. Either alone misses plans: the prediction, where the
#   model errs high (Hiera-Tiny's floor, modelled 1.4 % above its prediction, skipped a nested
#   plan that met its budget); the model, where the floor peaks at what it leaves out
#   (Sequencer2D-S's floor peaks at an LSTM's backward workspace, 4 % above its model, and a
#   nested plan 2.3 % lower met its budget). Forced, by hand, on the 85 refusals of the
#   planner_zoo tables (2026-11-29), nesting went below the floor on 10; this searches 26
#   (single steps against the prediction searched 59) and skips one of the 10 (timm's
#   RepVGG-A0, 0.13 % lower); the searches it skips gained nothing, XCiT-nano's among them
#   (its first group holds the floor's peak: 3.6 s) and EfficientViT-M0's (the input its
#   caller holds made the whole gap: 2.7 s). Nesting gains little on most models but much on
#   some, with sizes alike, so no rule of sizes alone tells them apart: skipped where the gap
#   was under 5 % of what the floor holds above the model state (2026-11-29), the zoo's ten
#   refusals at a 70 % cut planned in 1 to 3 s less each and named budgets as low but one
#   (regnet_y_400mf, 1.2 % higher), and torchvision's VGGs at a 50 % cut, whose gaps are as
#   large a share as those of models nesting gained nothing on (26 to 29 %, ResNet-18 and
#   GoogLeNet as VGG-16), named budgets reaching a 7.6 % cut where nesting reaches 29 %. A
#   search that asked rotor for the budget's own room, and shrank it by each miss's overshoot,
#   found cheaper schedules in fewer predictions, but which ones depended on the budget: a
#   smaller budget could get a plan peaking above a larger one's (a tied Linear-Tanh chain,
#   tests/test_planner_robustness.py), and a refusal named a schedule that later searches did
#   not meet again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from revnets.planning.search.budget import fits
from revnets.planning.search.chain_model import Segment
from revnets.planning.search.nested import NestedSchedule

__all__ = [
    "LADDER", "LADDER_RATIO", "MAX_GUESSES", "Option", "Segments", "lowest_floor", "near_floors",
    "nested_candidates", "search", "search_nested",
]

Segments = tuple[Segment, ...]  # (start, stop, recompute) covering the chain
MAX_GUESSES = 6
LADDER, LADDER_RATIO = 6, 2**0.5  # the rooms rotor is asked for below the floors


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
    best = next((floor for floor in floors(options) if fits(exact(floor), budget)), None)
    if best is None:
        best = next((near for near in near_floors(options, peaks)
                     if fits(exact(near), budget)), None)
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
                      and fits(o.modelled + errors.get(o.reconstructed, offset), budget)), None)
        if guess is None:
            break
        peak = exact(guess)
        if fits(peak, budget):
            best = guess
        error = peak - guess.modelled
        held = errors.get(guess.reconstructed)
        errors[guess.reconstructed] = max(held, error) if worst and held is not None else error
    return best


def _comparable(segments: Segments) -> tuple[tuple[int, int, int], ...]:
    """``segments`` as a key that orders any two plans: how a segment recomputes (stored,
    checkpointed, selective) as a number. Plans of equal modelled peak, one with a selective
    segment where the other had a plain one, made the tuples themselves unorderable (a str
    against a bool)."""
    return tuple((a, b, int(recompute)) for a, b, recompute in segments)


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
        key = (option.modelled, _comparable(option.segments))
        held = best.get(option.reconstructed)
        if held is None or key < (held.modelled, _comparable(held.segments)):
            best[option.reconstructed] = option
        held = cheapest.get(option.reconstructed)
        if not any(recompute for _, _, recompute in option.segments) and (
                held is None or key < (held.modelled, _comparable(held.segments))):
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
                                  sorted(option.reconstructed), _comparable(option.segments)))
    # One of each modelled peak: plans alike to the model differ in a cut or two, and peaked
    # alike (timm's efficientvit_m0: four near floors modelled as a floor, each predicted at
    # its peak, half a second apiece).
    seen = {(floor.reconstructed, floor.modelled) for floor in lowest}
    distinct = []
    for option in near:
        if (option.reconstructed, option.modelled) not in seen:
            seen.add((option.reconstructed, option.modelled))
            distinct.append(option)
    return distinct[:MAX_GUESSES]


def lowest_floor(options: Sequence[Option], peaks: dict[Option, int]) -> Option:
    """The floor or near floor of least exact peak, after ``search`` found nothing (it
    predicted every floor and near floor then). A refusal names its peak: asked for that, the
    search predicts the floors and near floors again, in the same order, and this one fits. A
    guess that missed may have peaked lower, but asked for its peak the search can take
    another path and never predict it again."""
    return min([*floors(options), *near_floors(options, peaks)],
               key=lambda floor: (peaks[floor], floor.cost))


def nested_candidates(
    frugal: NestedSchedule, schedule_for: Callable[[int], NestedSchedule | None]
) -> list[NestedSchedule]:
    """The nested schedules a search below the floors chooses from: the most frugal schedule,
    and rotor's schedules for rooms ``LADDER_RATIO`` apart from the most frugal schedule's
    modelled bytes up, as long as they nest two deep or more (one level deep, a schedule is a
    one-level plan, which the floors bound already), at most ``LADDER`` of them; each once, the
    cheapest first. ``schedule_for`` must depend on sizes alone (NOTE above)."""
    found = {repr(frugal.tree): frugal}
    room = float(frugal.modelled_bytes or 0)
    for _ in range(LADDER):
        room *= LADDER_RATIO
        schedule = schedule_for(int(room))
        if schedule is None or schedule.depth() < 2:
            break
        found.setdefault(repr(schedule.tree), schedule)
    return sorted(found.values(), key=lambda s: (s.recompute_cost, repr(s.tree)))


def search_nested(
    candidates: Sequence[NestedSchedule], budget: int, predict: Callable[[NestedSchedule], int]
) -> tuple[NestedSchedule, int]:
    """The cheapest of ``candidates`` (ordered so) whose exact peak fits ``budget``, and that
    peak; where none fits, the one of least exact peak, and that peak, which, asked for, plans."""
    peaks = {}
    for schedule in candidates:
        peaks[schedule] = predict(schedule)
        if fits(peaks[schedule], budget):
            return schedule, peaks[schedule]
    least = min(peaks, key=peaks.get)
    return least, peaks[least]
