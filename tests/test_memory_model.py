"""The chain model a search ranks plans by (revnets/planning/search/chain_model.py): on chains whose
steps save what they are known to save, it is the exact peak less one constant, the same for
every plan, so a search's first exact prediction calibrates it for all the others."""

import pytest
import torch
from test_planning_speed import Pooled, conv_chain
from torch import nn

import revnets.planning.auto as auto
import revnets.planning.chain_planner as chain_planner
from revnets.planning.search.chain import modelled_peaks
from revnets.planning.search.chain_model import NO_MOMENT, SELECTIVE, ChainModel
from revnets.planning.search.options import Option


def errors(model: nn.Sequential, x: torch.Tensor, plans: list[list[tuple[int, int]]],
           loss=lambda out: out.square().mean()) -> list:
    """Exact peak less modelled peak of one-level ``plans`` (checkpointed segments; the rest of
    the chain stored), as the planner predicts and models them."""
    segmentations = [tuple((a, b, True) for a, b in plan)
                     + ((plan[-1][1] if plan else 0, len(model), False),) for plan in plans]
    return segment_errors(model, x, segmentations, loss, whole_inputs=True)


def segment_errors(model: nn.Module, x: torch.Tensor, segmentations: list[tuple],
                   loss=lambda out: out.square().mean(), whole_inputs: bool = False,
                   traced: bool = False) -> list:
    """Exact peak less modelled peak of ``segmentations`` ((start, stop, recompute) covering
    the chain: ``model`` itself, or its traced graph's steps), modelled as a search ranks
    them."""
    chain = auto.planning_chain(model) if traced else model
    planner = chain_planner.ChainPlanner(model, chain, x, loss, None, measure_time=False)
    profiles = planner._profiles_of(frozenset())
    modelled = modelled_peaks(segmentations, profiles, planner.input_state, whole_inputs)
    return [planner._predict(Option(frozenset(), s, 0.0, m)) - m
            for s, m in zip(segmentations, modelled)]


def test_a_storage_two_steps_save_is_counted_once():
    """BatchNorm saves the convolution's output, ReLU its own output and the next convolution
    the same tensor as its input; a checkpoint keeps the value the step after it saves. Counted
    twice, the model's error grew with the longest segment's length (by 728 kB between these
    plans)."""
    plans = [[], [(0, 13)], [(0, 12), (12, 24)], [(0, 7), (7, 18), (18, 28)],
             [(0, 8), (8, 15), (15, 22), (22, 28), (28, 34)]]
    found = errors(conv_chain(), torch.randn(4, 3, 16, 16), plans)
    assert len(set(found)) == 1, found


def test_a_value_a_segment_holds_and_the_next_keeps_as_its_input_is_counted_once():
    """A checkpoint keeps its input, which the segment before it may hold already: a stored
    segment whose ReLU saves its own output, a selective one that keeps its convolution's
    output. Counted twice, such plans were modelled 64 kB (the value) above the others, and a
    search passed over them for dearer plans (test_step_times.py)."""
    segmentations = [
        ((0, 13, True), (13, 21, SELECTIVE), (21, 28, True), (28, 39, False)),  # ends on a ReLU
        ((0, 13, True), (13, 22, SELECTIVE), (22, 28, True), (28, 39, False)),  # on a convolution
        ((0, 13, True), (13, 19, SELECTIVE), (19, 28, False), (28, 34, True), (34, 39, False)),
        ((0, 2, False), (2, 13, True), (13, 39, False)),  # stored up to a BatchNorm
        ((0, 3, False), (3, 13, True), (13, 39, False)),  # up to a ReLU
    ]
    found = segment_errors(conv_chain(), torch.randn(4, 3, 16, 16), segmentations)
    assert len(set(found)) == 1, found


def test_parameter_gradients_are_counted_where_the_backward_makes_them():
    """A step starts from freed gradients: a segment late in the chain is backpropagated with
    few parameter gradients made, an early one with most. Counted as a constant, the error
    differed by 40 % of the parameters' bytes between the first two of these plans."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(48)))
    plans = [[(0, 8), (8, 17), (17, 25), (25, 32), (32, 38), (38, 43)], [(0, 24)],
             [(0, 46)], [(0, 47)]]
    found = errors(model, torch.randn(512, 64), plans)
    assert len(set(found)) == 1, found


def test_the_loss_backward_is_counted_with_what_the_chain_holds():
    """A wide head under cross-entropy: the loss's backward (its log-softmax and the gradients
    it makes, each the head's output in size) runs while the chain holds all it stored, and
    that is where these plans peak. Counted there, the model is the exact peak less the
    parameters and the labels alone, whatever the plan; left out, it missed the loss's 3.6 MB
    besides, and
    a GPT's lowest plan stored its last block whole (frontier.py: 9 MiB above checkpointing
    it)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(12)),
                          nn.Linear(64, 2048))
    x, labels = torch.randn(256, 64), torch.randint(0, 2048, (256,))
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    plans = [[(0, 4), (4, 8), (8, 12)], [(0, 6)], [], [(0, 12)]]
    loss = lambda out: nn.functional.cross_entropy(out, labels)  # noqa: E731
    assert errors(model, x, plans, loss) == [parameters + labels.nbytes] * len(plans)


class Narrowing(nn.Module):
    """A residual block whose shortcut reads its input after the main branch has (torchvision's
    downsampling BasicBlock): the input's gradient comes in two parts, summed."""

    def __init__(self, wide: int, narrow: int) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Conv2d(wide, narrow, 3, 2, 1), nn.Tanh(),
                                  nn.Conv2d(narrow, narrow, 3, 1, 1))
        self.shortcut = nn.Conv2d(wide, narrow, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.main(x) + self.shortcut(x))


class NarrowingNet(nn.Module):
    """Traced into 16 steps: the stem (0, 1), a wide block (2-7) and a narrow one (8-13)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.Sequential(Narrowing(32, 4), Narrowing(4, 4))
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.tanh(self.stem(x))).flatten(1))


def narrowing_errors(checkpoints: list[tuple[int, int]]) -> list:
    """Errors of plans checkpointing one segment of NarrowingNet, storing the rest."""
    torch.manual_seed(0)
    segmentations = [((0, a, False), (a, b, True), (b, 16, False)) for a, b in checkpoints]
    return segment_errors(NarrowingNet(), torch.randn(2, 3, 32, 32), segmentations,
                          traced=True)


def test_a_gradient_in_parts_is_counted_with_their_sum():
    """The wide block's input gets its shortcut's gradient first, then its first
    convolution's, and autograd (under the dispatch mode that measures and predicts) sums the
    two into a third tensor: the plans storing that block peak there, those checkpointing it
    while it is recomputed. Left out, with the stored input's gradient counted twice where the
    shortcut only passes it on, plans whose checkpoint starts inside the block (at 3) were
    modelled 8 kB apart from the others."""
    assert len(set(narrowing_errors([(1, 3), (3, 4), (3, 8), (1, 8), (4, 15)]))) == 1


def test_a_value_only_a_stored_segment_saves_is_held_until_its_first_saver_is_backpropagated():
    """A stored segment starting at the wide block's input, after a checkpoint: the input is
    held by what the block's convolutions save, and freed with them, before its two gradients
    are summed. Counted as held to the segment's end, such plans were modelled 254 kB (the
    value) above the others, and a search passed over them."""
    assert len(set(narrowing_errors([(1, 2), (0, 2), (1, 3), (2, 8)]))) == 1


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.Tanh(),
                               nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class ResidualNet(nn.Module):
    """Traced into 11 steps: the stem (0), two residual blocks (1-4, 5-8; their additions 4
    and 8), the pooling (9) and the head (10)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(Residual(16), Residual(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def residual_errors(checkpoints: list[tuple[int, int]]) -> list:
    """Errors of plans checkpointing one segment of ResidualNet, storing the rest."""
    torch.manual_seed(0)
    segmentations = [((0, a, False), (a, b, True), (b, 11, False)) for a, b in checkpoints]
    return segment_errors(ResidualNet(), torch.randn(2, 3, 16, 16), segmentations,
                          traced=True)


def test_a_gradient_an_addition_passes_on_to_both_operands_is_one_tensor():
    """An addition's backward hands its output's gradient to both operands (a view's to its
    input as a view): one tensor, until a part from elsewhere is summed into one of them
    (planning/costs/gradients.py finds which steps pass gradients on, by one backward of each on
    the meta device). Counted as a new tensor per operand, plans checkpointing the last addition
    alone were modelled 23 kB apart from the others."""
    assert len(set(residual_errors([(8, 9), (8, 10), (1, 5), (2, 7), (5, 10)]))) == 1


def test_a_checkpoint_whose_steps_save_nothing_keeps_nothing():
    """A checkpoint keeps its inputs through what its segment saves (torch's non-reentrant
    checkpoint: the saved tensors hold its frame); a segment of an addition alone saves
    nothing, and its inputs are freed as the forward goes on. Counted as kept, such a plan
    was modelled 33 kB (a value) above the others."""
    assert len(set(residual_errors([(4, 5), (1, 5), (2, 7)]))) == 1


class ShapeChecked(nn.Module):
    """Reads its input's shape before using it (timm's models assert the image size so): a
    traced step that takes the input and makes no gradient of it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.view(x.shape[0], -1))


def test_a_step_reading_only_a_values_shape_makes_no_gradient_of_it():
    """Taken for a step making a new gradient of the input, the shape's step summed it with
    the later reader's: a moment three inputs' gradients high, where the unplanned step
    peaked in the model, so that the nested search below the floors ran on four timm
    transformers that it could not help (planner_zoo: 2 to 6 s each)."""
    torch.manual_seed(0)
    model, x = ShapeChecked(), torch.randn(256, 64)
    planner = chain_planner.ChainPlanner(model, auto.planning_chain(model), x,
                            lambda out: out.square().mean(), None, measure_time=False)
    profiles = planner._profiles_of(frozenset())
    chain = ChainModel.of(profiles, planner.input_state)
    assert profiles[0].takes == {"x"} and profiles[0].gradient_parts == {}
    assert (chain.summing == NO_MOMENT).all()


def test_a_checkpoint_of_a_frozen_layer_keeps_its_input():
    """A frozen Linear saves only its weight for its input's gradient, and that saved tensor
    holds the checkpoint's inputs as any other does. Taken for a step saving nothing, a
    checkpoint of it alone was modelled without its input, 524 kB (the value) below the
    plans around it."""
    torch.manual_seed(0)
    layers = [nn.Linear(256, 256), nn.Tanh()]
    for _ in range(2):
        layers += [nn.Linear(256, 256).requires_grad_(False), nn.Linear(256, 256), nn.Tanh()]
    segmentations = [((0, 2, True), (2, 3, True), (3, 8, False)),
                     ((0, 2, True), (2, 4, True), (4, 8, False)),
                     ((0, 2, False), (2, 8, False))]
    found = segment_errors(nn.Sequential(*layers), torch.randn(512, 256), segmentations)
    assert len(set(found)) == 1, found


def pooled_chain() -> tuple[nn.Sequential, torch.Tensor]:
    """A chain whose first step saves nothing of the input its caller holds."""
    torch.manual_seed(0)
    layers = [Pooled(), *(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(12))]
    return nn.Sequential(*layers), torch.randn(32, 64 * 32)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("make", [lambda: (conv_chain(), torch.randn(4, 3, 16, 16)),
                                  pooled_chain,
                                  lambda: (NarrowingNet(), torch.randn(2, 3, 32, 32))],
                         ids=["convolutions", "pooled input", "traced residuals"])
def test_no_plan_cutting_only_at_given_cuts_is_modelled_below_the_least_for_those_cuts(
        make, seed):
    """``ChainModel.least_bytes(cuts)``, by which the planner skips the nested search (its
    schedules keep groups of steps whole): every segmentation whose cuts are among ``cuts``,
    each segment stored, checkpointed or selective, is modelled at or above it, the input its
    caller holds included; and it never falls below the bound of single steps."""
    import random

    rng = random.Random(seed)
    model, x = make()
    chain = model if isinstance(model, nn.Sequential) else auto.planning_chain(model)
    planner = chain_planner.ChainPlanner(model, chain, x, lambda out: out.square().mean(), None,
                            measure_time=False)
    chain = ChainModel.of(planner._profiles_of(frozenset()), planner.input_state)
    n = chain.n
    cuts = [0, *sorted(rng.sample(range(1, n), rng.randrange(1, n // 2))), n]
    least = chain.least_bytes(cuts)
    assert least >= chain.least_bytes()
    for _ in range(40):
        kept = [0, *sorted(rng.sample(cuts[1:-1], rng.randrange(len(cuts) - 1))), n]
        segments = [(a, b, rng.choice([False, True, SELECTIVE])) for a, b in zip(kept, kept[1:])]
        assert chain.peak(segments, whole_inputs=False) >= least, segments
