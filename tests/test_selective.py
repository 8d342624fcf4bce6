"""Selective checkpoints (NOTE [ Selective recomputation ]): the outputs of matrix products,
convolutions and attention are kept, the rest recomputed. They train exactly like the plain
module, keep exactly what the note says (measured and predicted to the byte), and the planner
uses them where measured times say recomputing everything costs more."""

import copy
import math
from dataclasses import replace

import pytest
import timm
import torch
import torch._inductor.lowering  # noqa: F401  (inductor's max-pool decomposition reads it)
import torch.nn.functional as F
import torchvision
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

import revnets
from revnets import Checkpoint
from revnets.memory import measure_memory
from revnets.plan import Store, parse_memory_plan, plan_from_options
from revnets.planning.chain_planner import ROOM_RATIO, ChainPlanner, grid_rooms
from revnets.planning.costs import step_times
from revnets.planning.costs.profile import profile_chain
from revnets.planning.planned import PlanChain, PlannedModel
from revnets.planning.search.chain import modelled_peaks, selective_plans
from revnets.planning.search.chain_model import SELECTIVE
from revnets.planning.search.compiled_costs import selective_stored_runs
from revnets.planning.search.options import Option, floors

from conftest import conv_unit, max_grad_error, rel_error, twin

WIDTH = 16


class Attention(nn.Module):
    def __init__(self, width: int = WIDTH, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


def mlp(width: int = WIDTH) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def block() -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH), mlp(),
                         nn.Dropout(0.2))


def budget_keeping(model: nn.Module, x: torch.Tensor, loss, keep: float) -> int:
    """The predicted peak of a training step with only ``keep`` of its activation part."""
    stored = revnets.predict_memory(lambda m: loss(m(x)).backward(), model).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    return int(state + keep * (stored - state))


@pytest.mark.parametrize("make, shape", [
    (block, (3, 5, WIDTH)),
    (lambda: nn.Sequential(conv_unit(4, dropout=0.3), conv_unit(4)), (2, 4, 6, 6)),
], ids=["attention_mlp_dropout", "conv_batch_norm_in_place_relu"])
def test_a_selective_checkpoint_trains_like_the_plain_module(make, shape):
    model = revnets.Checkpointed(make(), Checkpoint(selective=True)).double()
    plain = twin(model)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    for step in range(3):
        for m, xi in ((model, x), (plain, x_plain)):
            torch.manual_seed(step)
            m(xi).square().sum().backward()
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name


def test_a_selective_checkpoint_keeps_the_outputs_of_matrix_products():
    batch = 64
    x = torch.randn(batch, WIDTH, requires_grad=True)

    def peak(n, memory):
        model = nn.Sequential(*(revnets.Checkpointed(mlp(), memory) for _ in range(n)))
        step = lambda m, x: m(x).square().mean().backward()  # noqa: E731
        predicted = revnets.predict_memory(step, model, x).above_model_state_bytes
        assert measure_memory(step, model, x).above_model_state_bytes == predicted
        x.grad = None
        return predicted

    # Per unit more: a checkpoint keeps its input (the previous unit's output, WIDTH floats a
    # sample); a selective one also the first product's output (4 x WIDTH), and the second
    # product's output is the next unit's input, kept once.
    per_sample = 4 * batch  # bytes of one float across the batch
    assert peak(6, Checkpoint()) - peak(4, Checkpoint()) == 2 * WIDTH * per_sample
    assert peak(6, Checkpoint(selective=True)) - peak(4, Checkpoint(selective=True)) == (
        2 * 5 * WIDTH * per_sample
    )


def test_selective_is_an_option_wherever_plans_come_in():
    assert str(parse_memory_plan("checkpoint(selective=true)").stages) == (
        "checkpoint(selective=true)"
    )
    assert plan_from_options("checkpoint", selective=True).stages == Checkpoint(selective=True)
    with pytest.raises(ValueError, match="selective must be True or False"):
        Checkpoint(selective=1)


def test_a_zoo_model_checkpointed_selectively_trains_like_the_plain_model():
    torch.manual_seed(0)
    model = timm.create_model("revnet38", num_classes=10).double()
    plain = twin(model)
    model.set_memory(parse_memory_plan("checkpoint(segments=2,selective=true)"))
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    for m in (model, plain):
        torch.manual_seed(1)
        m(x).square().sum().backward()
    assert max_grad_error(model, plain) <= 1e-10


@pytest.mark.parametrize("between", [[], [nn.Identity()], [nn.Identity(), nn.Flatten(1)]],
                         ids=["next_layer", "through_an_identity", "through_a_view"])
def test_an_output_modified_in_place_later_is_never_kept_selectively(between):
    """torch refuses a kept output that was modified in place (in backward); the profile marks
    the layer that keeps it, also where the writer gets it through layers that alias it (timm's
    squeeze-excite: a 1x1 convolution, an Identity norm, SiLU(inplace=True))."""
    chain = nn.Sequential(nn.Linear(WIDTH, WIDTH), *between, nn.ReLU(inplace=True),
                          nn.Linear(WIDTH, WIDTH), nn.GELU()).to("meta")
    profiles = profile_chain(list(chain), torch.randn(4, WIDTH, device="meta"))
    passing = [False] * len(between)
    assert [p.selective_bytes > 0 for p in profiles] == [True, *passing, False, True, False]
    assert [p.selective_safe for p in profiles] == [False, *([True] * len(between)), True, True,
                                                    True]


def test_the_planner_keeps_products_where_recomputing_them_costs_more():
    torch.manual_seed(0)
    width = 128
    model = nn.Sequential(*(nn.Sequential(nn.LayerNorm(width), mlp(width)) for _ in range(6)))
    x = torch.randn(256, width)
    loss = lambda out: out.square().mean()  # noqa: E731
    planned = revnets.auto_checkpoint(model, x, budget_keeping(model, x, loss, 0.75),
                                      loss_fn=loss)
    decisions = {str(part.decision) for part in planned.memory_plan.parts}
    assert "checkpoint(selective=true)" in decisions, planned.memory_plan
    reference = twin(model)
    loss(planned(x)).backward()
    loss(reference(x)).backward()
    assert max_grad_error(model, reference) <= 1e-5


def test_a_plan_for_a_compiled_model_recomputes_no_product_where_keeping_them_fits():
    """Under torch.compile a checkpoint's norms and activations are recomputed inside fused
    kernels at next to no cost: ``compiled=True`` plans count what they recompute of products
    alone, so where selective checkpoints meet the budget every checkpoint is selective (steps
    counted, not timed: the same plan on every machine)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False),
                                          nn.BatchNorm2d(16), nn.ReLU()) for _ in range(8)))
    x = torch.randn(4, 16, 16, 16)
    stored = revnets.predict_memory(lambda m: m(x).sum().backward(), model).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(state + 0.8 * (stored - state))
    planned = revnets.auto_checkpoint(model, x, budget, measure_time=False, compiled=True)
    decisions = [str(part.decision) for part in planned.memory_plan.parts
                 if str(part.decision).startswith("checkpoint")]
    assert decisions and set(decisions) == {"checkpoint(selective=true)"}, planned.memory_plan
    eager = revnets.auto_checkpoint(model, x, budget, measure_time=False)  # layers count alike
    assert "checkpoint" in {str(part.decision) for part in eager.memory_plan.parts}
    assert revnets.measure_memory(lambda m: m(x).sum().backward(), planned).peak_bytes <= budget
    model.zero_grad(set_to_none=True)
    reference = twin(model)
    planned(x).sum().backward()
    reference(x).sum().backward()
    assert max_grad_error(model, reference) <= 1e-5
    model.zero_grad(set_to_none=True)
    torch.compile(planned, backend="aot_eager")(x).sum().backward()  # as it is meant to run
    assert max_grad_error(model, reference) <= 1e-5


def bottlenecks(depth: int = 6, width: int = 32) -> nn.Sequential:
    """Identical ResNet-like blocks (1x1, 3x3 and 1x1 convolutions) between two unlike ones."""
    def unit(inner: int, outer: int, kernel: int) -> list[nn.Module]:
        return [nn.Conv2d(inner, outer, kernel, padding=kernel // 2, bias=False),
                nn.BatchNorm2d(outer), nn.ReLU()]

    blocks = [nn.Sequential(*unit(width, width // 2, 1), *unit(width // 2, width // 2, 3),
                            *unit(width // 2, width, 1)) for _ in range(depth)]
    return nn.Sequential(nn.Sequential(*unit(3, width, 3)), *blocks,
                         nn.Sequential(*unit(width, 8, 3)))


def test_a_compiled_plan_is_the_same_whatever_the_forward_times_measured(monkeypatch):
    """Costed by what their products compute (NOTE [ Compiled costs ]), plans for a compiled
    model do not follow the noise of the forward times measured: ResNet-50 at one budget got
    four plans in six calls. Measured times here are scaled at random, step by step, from half
    to twice what they were."""
    timed = step_times._forward_seconds
    generator = torch.Generator().manual_seed(0)

    def noisy(chain, example_input):
        seconds = timed(chain, example_input)
        scales = 2 ** (2 * torch.rand(len(seconds), generator=generator, dtype=torch.float64) - 1)
        return [s * float(scale) for s, scale in zip(seconds, scales)]

    monkeypatch.setattr(step_times, "_forward_seconds", noisy)
    torch.manual_seed(0)
    model, x = bottlenecks(), torch.randn(4, 3, 16, 16)
    stored = revnets.predict_memory(lambda m: m(x).sum().backward(), model).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(state + 0.55 * (stored - state))
    plans = {tuple((part.name, str(part.decision)) for part in
                   revnets.auto_checkpoint(model, x, budget, compiled=True).memory_plan.parts)
             for _ in range(6)}
    assert len(plans) == 1, plans


def test_a_compiled_plan_without_measured_times_costs_steps_by_their_products():
    """Unmeasured (``measure_time=False``), a compiled model's steps cost their operations too
    (NOTE [ Compiled costs ]), not one each: bottleneck blocks of unlike convolutions get the
    plans that measured times give."""
    torch.manual_seed(0)
    model, x = bottlenecks(depth=4, width=48), torch.randn(4, 3, 16, 16)
    stored = revnets.predict_memory(lambda m: m(x).sum().backward(), model).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    plans = {}
    for budget_share in (0.45, 0.55, 0.7):
        budget = int(state + budget_share * (stored - state))
        plans[budget_share] = [
            tuple((part.name, str(part.decision)) for part in revnets.auto_checkpoint(
                model, x, budget, compiled=True, measure_time=measured).memory_plan.parts)
            for measured in (True, False)]
    assert all(timed == counted for timed, counted in plans.values()), plans


def test_a_steps_products_are_counted_as_torchs_flop_counter_counts_them():
    """What a compiled recomputation costs (NOTE [ Compiled costs ]): the operations of the
    convolutions, matrix products and attention each step runs, as torch's FLOP counter counts
    them on a real run; the CPU's attention kernel included."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3), nn.Flatten(2), nn.Linear(8 * 8, 16), nn.GELU(),
              nn.Sequential(Attention(16, heads=4), nn.LayerNorm(16))]
    x = torch.randn(2, 3, 10, 10)
    counted = []
    value = x
    for layer in layers:
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            value = layer(value)
        counted.append(counter.get_total_flops())
    assert all(counted[i] for i in (0, 2, 4)) and not any(counted[i] for i in (1, 3))
    meta = profile_chain(layers, x.to("meta"), kernels_of=torch.device("cpu"))
    assert [p.product_flops for p in meta] == counted


def _compiled_backward_ops(model: nn.Module, x: torch.Tensor) -> set[str]:
    """The operators of ``model``'s compiled backward, with the decompositions and partitioner
    inductor uses."""
    graphs = _compiled_graphs(model, x)
    return {str(node.target) for node in graphs["backward"].graph.nodes}


def _compiled_graphs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.fx.GraphModule]:
    """``model``'s compiled forward and backward graphs, with the decompositions and partitioner
    inductor uses."""
    graphs = {}

    def keep(kind):
        def compiler(graph, inputs):
            graphs[kind] = graph
            return make_boxed_func(graph.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x).square().sum().backward()
    return graphs


def _forward_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """What ``model``'s compiled forward returns besides its inputs and parameters: its output,
    the batch statistics it updates, and what it saves for the backward (the partitioner's
    cut)."""
    forward = _compiled_graphs(model, x)["forward"]
    output = next(node for node in forward.graph.nodes if node.op == "output")
    return sum(node.meta["val"].numel() * node.meta["val"].element_size()
               for node in output.args[0]
               if isinstance(node, torch.fx.Node) and node.op != "placeholder")


def test_compiled_consecutive_selective_segments_run_as_one_and_keep_no_input_between_them():
    # NOTE [ Selective segments under compile ]: three selective segments of residual blocks.
    # Compiled as one plan, what the forward saves is less by exactly the two inputs between
    # them, which the same segments in an nn.Sequential keep; gradients and statistics equal
    # the plain blocks' eagerly and compiled.
    def segment():
        blocks = [torchvision.models.resnet.Bottleneck(16, 4) for _ in range(2)]
        return revnets.Checkpointed(nn.Sequential(*blocks), Checkpoint(selective=True))

    torch.manual_seed(0)
    segments = [segment().double() for _ in range(3)]
    x = torch.randn(2, 16, 8, 8, dtype=torch.float64)
    as_one, apart = PlanChain(*segments), copy.deepcopy(nn.Sequential(*segments))
    between = 2 * x.numel() * x.element_size()
    assert _forward_bytes(apart, x) - _forward_bytes(as_one, x) == between

    plain = twin(nn.Sequential(*(step.module for step in segments)))
    for run in (as_one, torch.compile(as_one, backend="aot_eager", fullgraph=True)):
        for model in (run, plain):
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
        assert max_grad_error(as_one, plain) <= 1e-10
        for (name, a), (_, b) in zip(as_one.named_buffers(), plain.named_buffers()):
            assert torch.equal(a, b) if a.dtype == torch.long else torch.allclose(
                a, b, rtol=0, atol=1e-12), name


def test_a_compiled_plan_checkpoints_steps_keeping_no_product_selectively():
    """A checkpoint of steps that keep no product (a norm, an activation, a pooling) keeps and
    recomputes what a selective one does. Planned for compile it is a selective one, so that it
    runs as one with the selective checkpoints beside it (NOTE [ Selective segments under
    compile ]); a plain one between them keeps the values at its cuts: ResNet-50's plan at a 70 %
    keep peaked above torch.compile's own curve so (benchmarks/frontier.py)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet.ResNet(torchvision.models.resnet.Bottleneck, [1, 1, 1, 1],
                                             num_classes=10, width_per_group=16)
    x, y = torch.randn(2, 3, 64, 64), torch.arange(2)
    loss = lambda out: F.cross_entropy(out, y)  # noqa: E731
    planned = revnets.auto_checkpoint(model, x, budget_keeping(model, x, loss, 0.95),
                                      loss_fn=loss, measure_time=False, compiled=True)
    free = [part for part in planned.memory_plan.parts
            if isinstance(part.decision, Checkpoint) and not part.recompute_seconds]
    assert free and all(part.decision.selective for part in free), planned.memory_plan

    # Why: a norm and an activation between two selective checkpoints of convolutions.
    def unit(*layers, selective=True):
        return revnets.Checkpointed(nn.Sequential(*layers), Checkpoint(selective=selective))

    steps = [unit(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
             unit(nn.BatchNorm2d(8), nn.ReLU()),
             unit(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())]
    as_one, apart = PlanChain(*steps), copy.deepcopy(PlanChain(*steps))
    apart[1].memory = Checkpoint()
    x = torch.randn(2, 8, 8, 8)
    cut = x.numel() * x.element_size()  # the plain one's input, which nothing else keeps
    assert _forward_bytes(apart, x) - _forward_bytes(as_one, x) >= cut


def test_compiled_selective_checkpoint_keeps_batch_statistics_instead_of_recomputing_them():
    # NOTE [ Norms in a compiled selective checkpoint ]: a batch norm after a kept convolution
    # keeps its statistics (var_mean is not run again in the backward); one after a residual
    # sum the checkpoint recomputes is recomputed whole, its output never kept.
    after_conv = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                               nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 8), nn.GELU())
    model = revnets.Checkpointed(after_conv, revnets.Checkpoint(selective=True)).double()
    plain = twin(model)
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    recomputed = _compiled_backward_ops(model, x)
    plain(x).square().sum().backward()
    assert "aten.var_mean.correction" not in recomputed
    assert "aten.convolution.default" not in recomputed  # the product is kept, as eagerly
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name

    class PreActivation(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.conv = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            x = x + 1.0  # a sum the checkpoint recomputes
            return self.conv(torch.relu(self.norm(x)))

    model = revnets.Checkpointed(PreActivation(), revnets.Checkpoint(selective=True)).double()
    assert "aten.var_mean.correction" in _compiled_backward_ops(model, x)


def test_a_found_plan_is_retried_with_the_selective_plan_for_the_room_its_prediction_measured():
    """Selective candidates are made for the room the model state leaves; a plan's exact
    prediction then measures what the chain model leaves out. The planner makes the cheapest
    selective plan for the room that correction leaves (the largest of the fixed grid's rooms
    within it: NOTE [ Modelled search, exact acceptance ]) and predicts it, and takes it where it
    fits (GPT-like at a 70 % keep under torch.compile, frontier.py: the plan found first
    recomputed twice the product time of the one this finds)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(block() for _ in range(4)))
    x = torch.randn(8, 32, WIDTH)
    loss = lambda out: out.square().mean()  # noqa: E731
    planner = ChainPlanner(model, model, x, loss, None, measure_time=True, compiled=True)
    profiles = planner._profiles_of(frozenset())
    everything = ((0, len(model) - 1, True), (len(model) - 1, len(model), False))
    found = Option(frozenset(), everything, planner._recompute(everything, profiles),
                   modelled_peaks([everything], profiles, planner.input_state)[0])
    exact = planner._predict(found)
    stored = revnets.predict_memory(lambda m: loss(m(x)).backward(), model).peak_bytes
    taken = 0
    for budget in range(exact, stored, (stored - exact) // 8):
        room = budget - (exact - found.modelled)  # the correction the prediction measured
        grid_room = grid_rooms(room / ROOM_RATIO, room)[-1]  # the grid's, below it
        cheapest = min(((planner._recompute(p, profiles), p) for p in map(tuple, selective_plans(
            profiles, [grid_room], planner.input_state))), default=None)
        peaks = {found: exact}
        refined = planner._refined(found, peaks, budget)
        if cheapest is None or cheapest[0] >= found.cost:
            assert refined == found and len(peaks) == 1  # nothing cheaper: nothing predicted
            continue
        fits = planner._predict(replace(found, segments=cheapest[1])) <= budget
        assert refined.segments == (cheapest[1] if fits else found.segments)
        assert len(peaks) == 2 and peaks[refined] <= budget
        taken += fits
    assert taken  # the budgets above include some where the cheaper plan fits


def test_a_compiled_plans_stored_runs_are_selective_where_that_costs_nothing_and_fits():
    """NOTE [ Stored runs under compile ]: under torch.compile a selective checkpoint of a stored
    run recomputes only what costs nothing there, and its forward saves less than the stored
    run's (the partitioner's default keeps more, and the values at its ends split the selective
    run). Four attention blocks at half the activations: the plan stored the last block; its
    prediction with that block selective is taken where it fits, and only there."""
    torch.manual_seed(0)
    model = nn.Sequential(*(block() for _ in range(4)))
    x = torch.randn(8, 32, WIDTH)
    loss = lambda out: out.square().mean()  # noqa: E731
    budget = budget_keeping(model, x, loss, 0.5)
    planned = revnets.auto_checkpoint(model, x, budget, loss_fn=loss, measure_time=False,
                                      compiled=True)
    assert not [part for part in planned.memory_plan.parts if isinstance(part.decision, Store)]
    assert planned.memory_plan.peak_bytes <= budget, planned.memory_plan

    planner = ChainPlanner(model, model, x, loss, None, measure_time=False, compiled=True)
    profiles = planner._profiles_of(frozenset())
    last_stored = ((0, 3, SELECTIVE), (3, 4, False))
    found = Option(frozenset(), last_stored, planner._recompute(last_stored, profiles),
                   modelled_peaks([last_stored], profiles, planner.input_state)[0])
    selective = ((0, 3, SELECTIVE), (3, 4, SELECTIVE))
    assert planner._recompute(selective, profiles) == found.cost == 0
    exact = planner._predict(replace(found, segments=selective))
    for room, taken in ((exact, selective), (exact - 1, last_stored)):
        assert planner._selective_throughout(found, {}, room).segments == taken
    nothing_checkpointed = replace(found, segments=((0, 4, False),))
    assert planner._selective_throughout(nothing_checkpointed, {}, exact) == nothing_checkpointed
    for module in model.modules():  # no dropout masks: what the forwards save has sizes
        if isinstance(module, (nn.Dropout, Attention)):
            module.eval()
    assert _forward_bytes(planner._apply(selective), x) < _forward_bytes(
        planner._apply(last_stored), x)


def test_a_compiled_plan_keeps_stored_the_runs_a_selective_checkpoint_cannot_run():
    """NOTE [ Stored runs under compile ] follows the search's rule: no selective checkpoint over
    a product a later step overwrites in place (a convolution and its in-place ReLU: torch
    refuses the backward, and planning failed with its words), nor over a reconstructing
    sequence."""
    torch.manual_seed(0)
    layers, width = [], 3
    for out in (8, 8, 16, 16, 16, 16):
        layers += [nn.Conv2d(width, out, 3, padding=1), nn.ReLU(inplace=True)]
        width = out
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(16 * 16 * 16, 10)).double()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    loss = lambda out: out.square().mean()  # noqa: E731
    budget = budget_keeping(model, x, loss, 0.9)
    planned = revnets.auto_checkpoint(model, x, budget, loss_fn=loss, measure_time=False,
                                      compiled=True)
    assert measure_memory(lambda: loss(planned(x)).backward()).peak_bytes \
        == planned.memory_plan.peak_bytes <= budget
    reference = twin(model)
    model.zero_grad(set_to_none=True)
    loss(planned(x)).backward()
    loss(reference(x)).backward()
    assert max_grad_error(model, reference) <= 1e-10

    planner = ChainPlanner(model, model, x, loss, None, measure_time=False, compiled=True)
    profiles = planner._profiles_of(frozenset())
    everything = ((0, len(model), False),)
    assert not profiles[0].selective_safe  # the first convolution's output, overwritten
    assert selective_stored_runs(everything, profiles, frozenset()) == everything
    head = ((0, len(model) - 1, True), (len(model) - 1, len(model), False))
    assert profiles[-1].selective_safe and profiles[-1].selective_bytes
    assert selective_stored_runs(head, profiles, frozenset())[-1][2] == SELECTIVE
    assert selective_stored_runs(head, profiles, frozenset({len(model) - 1})) == head


class StemStageHead(nn.Module):
    """A convolution stem, a reversible stage, and a wide head of products."""

    def __init__(self, width: int = 8, wide: int = 128) -> None:
        super().__init__()
        def half():
            return nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(),
                                 nn.Conv2d(width, width, 3, padding=1))

        self.stem = nn.Sequential(nn.Conv2d(3, 2 * width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(2 * width), nn.ReLU())
        self.stage = revnets.ReversibleSequence(
            revnets.ReversibleBlock(half(), half()) for _ in range(3))
        self.head = nn.Sequential(nn.Conv2d(2 * width, wide, 1), nn.BatchNorm2d(wide), nn.ReLU(),
                                  nn.Conv2d(wide, wide, 1), nn.BatchNorm2d(wide), nn.ReLU())
        self.fc = nn.Linear(wide, 10)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.head(self.stage(self.stem(x))), 1).flatten(1))


def test_a_compiled_plan_runs_a_reconstructing_sequence_as_it_is():
    """A reconstructing sequence keeps neither its input nor its internals; a checkpoint around
    it would run it once more. Made selective as a stored run (NOTE [ Stored runs under
    compile ]), it was, and peaked higher than the plan found."""
    torch.manual_seed(0)
    model = StemStageHead().double()
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    loss = lambda out: out.square().mean()  # noqa: E731
    planned = revnets.auto_checkpoint(model, x, budget_keeping(model, x, loss, 0.92),
                                      loss_fn=loss, measure_time=False, compiled=True)
    assert isinstance(model.stage.memory, revnets.Reconstruct), planned.memory_plan
    around = [step for step in PlannedModel.plan_of(planned)
              if isinstance(step, revnets.Checkpointed)
              and any(m is model.stage for m in step.modules())]
    assert not around, planned.memory_plan


def test_where_storing_everything_fits_a_compiled_plan_is_the_model_itself():
    """Selective checkpoints cost nothing under compile (NOTE [ Compiled costs ]), as storing
    does; of equal cost, the plan that checkpoints nothing comes first, so a budget the model
    meets alone gets the model back, compiled or not (it got four selective checkpoints)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU(),
                          nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)).double()
    x = torch.randn(512, 32, dtype=torch.float64)
    loss = lambda out: out.square().mean()  # noqa: E731
    stored = revnets.predict_memory(lambda m: loss(m(x)).backward(), model).peak_bytes
    for budget in (stored, 2 * stored):
        for compiled in (False, True):
            planned = revnets.auto_checkpoint(model, x, budget, loss_fn=loss,
                                              measure_time=False, compiled=compiled)
            assert planned is model, planned.memory_plan


def test_the_search_orders_plans_that_differ_only_in_how_a_segment_recomputes():
    """Of plans modelled alike, the search's floors take one by its segments. A selective
    segment where another plan had a plain or stored one made the two unorderable (a str
    against a bool): planning i-RevNet-163 for compile failed with a TypeError instead of
    naming its smallest budget."""
    def option(first, second):
        return Option(frozenset(), ((0, 2, first), (2, 4, second)), cost=0.0, modelled=100)

    plain, selective, stored = option(True, False), option(SELECTIVE, False), option(False, True)
    for options in ([plain, selective, stored], [selective, stored, plain]):
        assert floors(options) == [stored]  # the first segment stored, then checkpointed


def test_a_compiled_plan_without_measured_times_shows_no_recompute_time():
    """Unmeasured, a compiled model's steps cost their operations (NOTE [ Compiled costs ]),
    which its plan showed as milliseconds (2,097,152,000 ms for an attention block); it shows
    none, as an eager plan unmeasured does. Measured, it shows seconds."""
    torch.manual_seed(0)
    model = nn.Sequential(*(block() for _ in range(4)))
    x = torch.randn(8, 32, WIDTH)
    loss = lambda out: out.square().mean()  # noqa: E731
    budget = budget_keeping(model, x, loss, 0.3)
    for measured in (False, True):
        plan = revnets.auto_checkpoint(model, x, budget, loss_fn=loss, measure_time=measured,
                                       compiled=True).memory_plan
        seconds = [part.recompute_seconds for part in plan.parts
                   if isinstance(part.decision, Checkpoint) and not part.decision.selective]
        assert seconds, plan
        assert all(s > 0 and s < 1 for s in seconds) if measured else \
            all(math.isnan(s) for s in seconds), plan
