import copy
import itertools
from dataclasses import replace

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.resnet import Bottleneck

import revnets
import revnets.planning.chain_planner as chain_planner
from revnets.memory import measure_memory
from revnets.planning import (
    LayerProfile,
    as_graph_chain,
    budget_plan,
    candidate_plans,
    forbidden_cuts,
    modelled_peak,
    nested_schedule,
    optimal_plan,
    optimal_segments,
    profile_chain,
    recompute_cost,
    segment_cost,
    sqrt_plan,
)
from revnets.planning.costs.meta_attention import may_attend
from revnets.planning.costs.profile import meta_like, on_meta
from revnets.planning.model_chain import planning_chain
from revnets.planning.search import chain as chain_module
from revnets.planning.search.chain_model import SELECTIVE
from revnets.planning.search.nested import most_frugal_schedule

from conftest import conv_unit, max_grad_error, train_step


def chain(units: int = 4, channels: int = 8) -> nn.Sequential:
    """A flat chain of 3 x ``units`` layers: conv, BatchNorm, ReLU, conv, ..."""
    return nn.Sequential(*(layer for _ in range(units) for layer in conv_unit(channels)))


def training_peak(model, x):
    """A training step's measured peak, from freed gradients as auto_checkpoint's budget."""

    def step(model, x):
        model.zero_grad(set_to_none=True)
        model(x).float().sum().backward()

    return measure_memory(step, model, x).peak_bytes


def test_profile_counts_what_autograd_saves():
    x = torch.randn(2, 8, 8, 8)  # 4 KiB
    profiles = profile_chain(list(conv_unit(8)), x)
    assert [p.name for p in profiles] == ["Conv2d", "BatchNorm2d", "ReLU"]
    assert all(p.output_bytes == 4096 for p in profiles)
    # conv saves its input; BatchNorm its input plus mean and inverse std; ReLU its output.
    assert [p.saved_bytes for p in profiles] == [4096, 4096 + 2 * 8 * 4, 4096]
    meta = profile_chain(list(conv_unit(8).to("meta")), x.to("meta"))
    assert [p.saved_bytes for p in meta] == [p.saved_bytes for p in profiles]


def test_chen_plans():
    assert sqrt_plan(16) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    profiles = profile_chain(list(chain(4)), torch.randn(1, 8, 4, 4))  # 12 layers of 512 B each
    per_layer = [p.saved_bytes for p in profiles]
    plan = budget_plan(profiles, segment_budget=3 * max(per_layer))
    assert plan[0][0] == 0 and plan[-1][1] == 12
    assert all(sum(per_layer[a:b]) <= 3 * max(per_layer) for a, b in plan)
    plans = candidate_plans(profiles)
    # The finest plan cuts everywhere but before the in-place ReLUs (layers 2, 5, 8, 11): a
    # checkpointed segment starting with one would overwrite the input its checkpoint keeps.
    starts = [0, 1, 3, 4, 6, 7, 9, 10]
    assert plans[0] == [(0, 12)] and plans[-1] == list(zip(starts, starts[1:] + [12]))
    assert all(profiles[a].inplace is False for plan in plans for a, _ in plan)


def test_checkpoint_segments_refuses_a_cut_before_an_in_place_layer():
    with pytest.raises(ValueError, match=r"starts with an in-place layer \(ReLU\)"):
        revnets.checkpoint_segments(chain(2), [(0, 2), (2, 4), (4, 6)])


def test_auto_checkpoint_meets_the_budget_with_identical_gradients():
    torch.manual_seed(0)
    model = chain(16).double()
    x = torch.randn(4, 8, 16, 16, dtype=torch.float64)
    full = training_peak(model, x)
    budget = int(0.5 * full)
    planned = revnets.auto_checkpoint(model, x, budget)
    # Which steps are checkpointed follows the forward times measured (on a busy machine the
    # first step was once stored); that some are is what the budget needs.
    assert any(isinstance(step, revnets.Checkpointed) for step in planned.plan)
    assert training_peak(planned, x) <= budget  # measured, on this CPU
    model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(model)
    planned(x).sum().backward()
    reference(x).sum().backward()
    assert max_grad_error(model, reference) <= 1e-6  # float32; recomputation repeats the same ops
    for a, b in zip(model.buffers(), reference.buffers()):
        assert torch.equal(a, b)


def test_auto_checkpoint_leaves_a_model_that_fits_alone():
    model = chain(4)
    x = torch.randn(2, 8, 8, 8)
    assert revnets.auto_checkpoint(model, x, budget=10 * training_peak(model, x)) is model


def test_auto_checkpoint_names_the_smallest_reachable_budget():
    model = chain(8)
    x = torch.randn(2, 8, 8, 8)
    with pytest.raises(revnets.PlanningError, match=r"smallest budget .* is [\d.]+ MiB"):
        revnets.auto_checkpoint(model, x, budget=1000)


@pytest.mark.parametrize("name", ["revnet38", "irevnet163"])
def test_auto_checkpoint_fits_zoo_models_to_the_byte(name):
    model = timm.create_model(name, memory="none", units=(2, 2, 2))
    x = torch.randn(8, 3, 32, 32)
    budget = training_peak(copy.deepcopy(model).set_memory("reversible"), x)
    assert budget < training_peak(model, x)
    planned = revnets.auto_checkpoint(model, x, budget)
    assert training_peak(planned, x) == planned.memory_plan.peak_bytes <= budget
    assert planned.memory_plan.reconstructs


class UntraceableRevViT(revnets.models.ReversibleVisionTransformer):
    """A zoo model branching on its input's shape in Python, which torch.fx cannot trace."""

    def forward(self, x):
        if x.shape[-1] > x.shape[-2]:
            x = x.transpose(-1, -2)
        return super().forward(x)


def rev_vit(cls=None):
    args = dict(img_size=32, patch_size=8, depth=4, embed_dim=32, num_heads=2, memory="none")
    return cls(**args) if cls else timm.create_model("revvit_small_patch16_224", **args)


def test_auto_checkpoint_plans_rev_vit_through_its_graph():
    # Rev-ViT traces (its input-size check is torch._assert, as in timm's ViT): planned as a
    # graph, its blocks reconstructing, the prediction an upper bound of the CPU's measurement.
    model, x = rev_vit(), torch.randn(8, 3, 32, 32)
    budget = int(1.01 * training_peak(copy.deepcopy(model).set_memory("reversible"), x))
    planned = revnets.auto_checkpoint(model, x, budget)
    assert planned.memory_plan.reconstructs
    assert training_peak(planned, x) <= planned.memory_plan.peak_bytes <= budget


def test_auto_checkpoint_picks_a_preset_for_zoo_models_it_cannot_trace():
    model, x = rev_vit(UntraceableRevViT), torch.randn(8, 3, 32, 32)
    # Slack: the prediction of Rev-ViT's reversible backward is about 5 KiB above the CPU's
    # measurement at this size (not yet explained; the other presets predict to the byte).
    budget = int(1.01 * training_peak(copy.deepcopy(model).set_memory("reversible"), x))
    planned = revnets.auto_checkpoint(model, x, budget)
    assert planned is model and model.memory_plan.name == "reversible"
    assert training_peak(planned, x) <= model.memory_plan.peak_bytes <= budget


class DataDependent(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_auto_checkpoint_refuses_what_it_can_neither_trace_nor_predict():
    with pytest.raises(TypeError, match="DataDependent cannot be traced.*cannot be predicted"), \
            pytest.warns(UserWarning, match="DataDependent cannot be traced"):
        revnets.auto_checkpoint(DataDependent(), torch.randn(1, 2), budget=10**6)


def test_an_in_place_layer_after_an_alias_forbids_the_cuts_back_to_the_storage_s_maker():
    """ReLU(inplace=True) after an Identity overwrites the convolution's output, which the
    Identity passes on: a checkpoint at the Identity would keep what the ReLU then changes,
    and planning crashed on it ("modified by an inplace operation", found by a review)."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, padding=1), nn.Identity(), nn.ReLU(inplace=True)]
    for _ in range(3):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.Identity(), nn.ReLU(inplace=True)]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    x = torch.randn(4, 3, 16, 16)
    profiles = profile_chain(list(model), x)
    assert [p.mutates_from for p in profiles if p.inplace] == [0, 3, 6, 9]
    assert {1, 2, 4, 5, 7, 8, 10, 11} <= forbidden_cuts(profiles)
    for budget in range(655_000, 690_000, 5_000):
        planned = revnets.auto_checkpoint(model, x, budget, measure_time=False)
        assert measure_memory(train_step, planned, x).peak_bytes == planned.memory_plan.peak_bytes


def synthetic_profiles(n, seed):
    """A chain of n steps, step i passing on value str(i); each step saves intermediates of its
    own and may save its input, its output or both (as ReLU its output and a convolution its
    input), which a neighbour may save too, and makes parameter gradients in its backward."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=generator))

    sizes = [draw(1, 50) for _ in range(n)]
    profiles = []
    for i in range(n):
        values = {}
        if i and draw(0, 2):
            values[(str(i - 1), 0)] = sizes[i - 1]
        if draw(0, 2):
            values[(str(i), 0)] = sizes[i]
        profiles.append(LayerProfile(
            i, "layer", 0, draw(1, 100) + sum(values.values()), float(draw(1, 10)),
            state={str(i): sizes[i]}, mutates_from=i - 1 if i % 4 == 3 else None,
            saved_values=values, grad_bytes=draw(0, 30)))
    return profiles


def held_for_backward(start, stop, profiles, kept):
    """What segment [start, stop) holds for its backward: what its steps save, a storage two of
    them save once, less the values ``kept`` at its cut already."""
    values, intermediates = {}, 0
    for p in profiles[start:stop]:
        values.update(p.saved_values)
        intermediates += p.saved_bytes - sum(p.saved_values.values())
    return intermediates + sum(nbytes for (name, _), nbytes in values.items() if name not in kept)


def all_plans(n):
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), n]
        yield list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_optimal_plan_is_the_best_of_all_plans(seed, negative):
    """Also where a step's time is below nothing (times a user gives, less a timer's overhead):
    the programme's early stop assumes no step costs less than nothing."""
    n = 10
    profiles = synthetic_profiles(n, seed)
    if negative:
        profiles[5] = replace(profiles[5], forward_seconds=-7.0)
    forbidden = forbidden_cuts(profiles)
    assert forbidden == {i for i in range(n) if i % 4 == 3}
    allowed = [p for p in all_plans(n) if not any(a in forbidden for a, _ in p[1:])]
    assert all(modelled_peak(p, profiles) == one_level_peak(p, profiles) for p in allowed)
    for budget in range(100, 700, 25):
        fitting = [p for p in allowed if one_level_peak(p, profiles) <= budget]
        plan = optimal_plan(profiles, budget)
        if not fitting:
            assert plan is None
            continue
        assert plan in fitting
        best = min(recompute_cost(p, profiles) for p in fitting)
        assert recompute_cost(plan, profiles) == best


def all_segmentations(n):
    """Every plan of optimal_segments' form: each segment but the last stored, checkpointed or
    checkpointed selectively."""
    for plan in all_plans(n):
        for kinds in itertools.product([False, True, SELECTIVE], repeat=len(plan) - 1):
            yield tuple((a, b, kind) for (a, b), kind in zip(plan, (*kinds, False)))


@pytest.mark.parametrize("seed", range(3))
def test_optimal_segments_are_the_best_of_all_segmentations(seed, monkeypatch):
    monkeypatch.setattr(chain_module, "FRONT_CAP", 10**9)  # exact: no front is thinned
    n = 6
    generator = torch.Generator().manual_seed(100 + seed)
    profiles = [replace(p, selective_bytes=int(torch.randint(0, 3, (1,), generator=generator)) * 8,
                        selective_safe=i != 2)
                for i, p in enumerate(synthetic_profiles(n, seed))]
    forbidden = forbidden_cuts(profiles)
    allowed = [p for p in all_segmentations(n) if not any(a in forbidden for a, _, _ in p[1:])
               and not any(kind == SELECTIVE and a <= 2 < b for a, b, kind in p)]
    cost = lambda plan: sum(segment_cost(profiles, *segment) for segment in plan)  # noqa: E731
    for budget in range(60, 500, 20):
        fitting = [p for p in allowed if segments_peak(p, profiles) <= budget]
        plan = optimal_segments(profiles, budget)
        if not fitting:
            assert plan is None
            continue
        assert segments_peak(plan, profiles) <= budget
        assert cost(plan) == pytest.approx(min(cost(p) for p in fitting))


def graph_profiles(n, seed):
    """A graph-like chain: value str(i), made by step i, stays live for up to three more cuts
    (a skip connection, a squeeze-excitation block's input), and a step may save any value
    live before it: a value a checkpoint keeps can be first saved several steps on."""
    generator = torch.Generator().manual_seed(1000 + seed)

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=generator))

    size = {str(i): draw(1, 50) for i in range(n)}
    until = {str(i): min(n, i + 1 + draw(0, 4)) for i in range(n)}
    states = [{}] + [{v: size[v] for v in size if int(v) + 1 <= cut <= until[v]}
                     for cut in range(1, n + 1)]
    profiles = []
    for i in range(n):
        values = {(v, 0): b for v, b in states[i].items() if draw(0, 5) < 2}
        if draw(0, 2):
            values[(str(i), 0)] = size[str(i)]
        profiles.append(LayerProfile(
            i, "step", 0, draw(0, 60) + sum(values.values()), float(draw(1, 10)),
            state=states[i + 1] or {str(i): size[str(i)]}, saved_values=values,
            grad_bytes=draw(0, 2) * draw(1, 40), selective_bytes=8 * draw(0, 3)))
    return profiles


@pytest.mark.parametrize("seed", range(12))
def test_optimal_segments_are_the_best_of_all_segmentations_of_a_graph(seed, monkeypatch):
    """As above, on chains whose cuts hold several values, some saved far from where they were
    made: the programme subtracts a value live at a segment's first cut only once a step of
    the segment has saved it, and keeps consecutive stored segments apart (joined, the value
    live between them would count twice)."""
    monkeypatch.setattr(chain_module, "FRONT_CAP", 10**9)
    n = 6
    profiles = graph_profiles(n, seed)
    cost = lambda plan: sum(segment_cost(profiles, *segment) for segment in plan)  # noqa: E731
    scored = [(segments_peak(p, profiles), cost(p), p) for p in all_segmentations(n)]
    for budget in sorted({peak for peak, _, _ in scored}):
        plan = optimal_segments(profiles, budget)
        fitting = [c for peak, c, _ in scored if peak <= budget]
        assert segments_peak(plan, profiles) <= budget
        assert cost(plan) == pytest.approx(min(fitting))


@pytest.mark.parametrize("seed", range(8))
def test_of_the_cheapest_segmentations_the_programme_returns_the_lowest(seed, monkeypatch):
    """Costed as for a compiled model (cheap steps recompute for free: a selective checkpoint of
    them costs what storing them does), many plans tie on time. Under every budget the
    programme's plan recomputes the least of all segmentations that fit, and of those it peaks
    the lowest (NOTE [ Of equal cost, the lowest ])."""
    monkeypatch.setattr(chain_module, "FRONT_CAP", 10**9)
    n = 6
    profiles = [replace(p, forward_seconds=p.forward_seconds if p.selective_bytes else 0.0)
                for p in graph_profiles(n, seed)]
    cost = lambda plan: sum(segment_cost(profiles, *segment) for segment in plan)  # noqa: E731
    scored = [(segments_peak(p, profiles), cost(p)) for p in all_segmentations(n)]
    for budget in sorted({peak for peak, _ in scored}):
        plan = optimal_segments(profiles, budget)
        cheapest = min(c for peak, c in scored if peak <= budget)
        assert cost(plan) == pytest.approx(cheapest)
        assert segments_peak(plan, profiles) == min(
            peak for peak, c in scored if peak <= budget and c == pytest.approx(cheapest))


@pytest.mark.parametrize("seed", range(3))
def test_mixed_plans_over_distinct_cuts_recompute_as_little_as_over_every_cut(seed, monkeypatch):
    """Traced chains are mostly free steps (views, reshapes, getattr: nothing saved, kept or
    recomputed; they pass on their input's storage). Of each run of cuts they join, the mixed
    programme visits only the cut with the fewest live bytes; with free steps costing no time,
    its best plan recomputes exactly as little as the best over every cut, under every budget,
    and fits where that one fits."""
    monkeypatch.setattr(chain_module, "FRONT_CAP", 10**9)  # exact: no front is thinned
    n, free = 9, {1, 2, 4, 5, 6}
    generator = torch.Generator().manual_seed(200 + seed)
    origin = {}
    for i in range(n):  # the value whose storage step i passes on
        origin[i] = origin[i - 1] if i in free else i
    synthetic = synthetic_profiles(n, seed)
    size = {i: sum(p.state.values()) for i, p in enumerate(synthetic)}
    profiles = [replace(p, mutates_from=None, saved_bytes=0 if i in free else p.saved_bytes,
                        state={str(i): size[origin[i]]},
                        grad_bytes=0 if i in free else p.grad_bytes,
                        saved_values={} if i in free else {
                            (str(origin[int(name)]), place): size[origin[int(name)]]
                            for (name, place) in p.saved_values},
                        forward_seconds=0.0 if i in free else p.forward_seconds,
                        selective_bytes=0 if i in free else 8 * int(
                            torch.randint(0, 3, (1,), generator=generator)))
                for i, p in enumerate(synthetic)]
    profiles = [replace(p, saved_bytes=p.saved_bytes - sum(synthetic[i].saved_values.values())
                        + sum(p.saved_values.values())) if i not in free else p
                for i, p in enumerate(profiles)]
    arrays = chain_module.ChainModel.of(profiles, None)
    live = lambda cut: sum(profiles[cut - 1].state.values())  # noqa: E731
    # Step k joins cuts k and k + 1: free steps 1-2 join cuts 1-3, free steps 4-6 cuts 4-7.
    assert arrays.distinct_cuts() == [min(run, key=live) for run in ([1, 2, 3], [4, 5, 6, 7], [8])]
    cost = lambda plan: sum(segment_cost(profiles, *segment) for segment in plan)  # noqa: E731
    for budget in range(20, 600, 10):
        everywhere = chain_module._optimal(arrays, budget, mixed=True)
        distinct = chain_module._optimal(arrays, budget, mixed=True, cuts=arrays.distinct_cuts())
        assert (distinct is None) == (everywhere is None)
        if distinct is not None:
            assert segments_peak(distinct, profiles) <= budget
            assert cost(distinct) == pytest.approx(cost(everywhere))


def segments_peak(plan, profiles):
    """The chain model: while a segment is backpropagated, memory holds the values live at
    every cut so far (a stored segment's input too: a slight over-count), what stored segments
    before it save and selective ones keep, and the most it holds while it is backpropagated:
    what the steps up to the one backpropagated saved (held_for_backward), the parameter
    gradients from that step on and the gradients of the values before and after it."""
    states = [{"input": 0}] + [p.state for p in profiles]
    gradients_from = lambda step: sum(p.grad_bytes for p in profiles[step:])  # noqa: E731
    kept, held, peak = {}, 0, 0
    for start, stop, kind in plan:
        kept.update(states[start])
        inside = held_for_backward(start, stop, profiles, states[start])
        # While step j is backpropagated: what steps start..j saved, the parameter gradients
        # from j on, the gradients of the values before and after step j.
        backward = max(held_for_backward(start, j + 1, profiles, states[start])
                       + gradients_from(j) + sum(states[j].values())
                       + sum(states[j + 1].values()) for j in range(start, stop))
        peak = max(peak, sum(kept.values()) + held + backward)
        # What it keeps (selective) or saves (stored) of the values live at a later cut is one
        # storage with what a checkpoint there keeps: counted with those.
        values = {}
        if kind == SELECTIVE:
            values = {name: nbytes for p in profiles[start:stop]
                      for name, nbytes in p.selective_values.items()}
            held += sum(p.selective_bytes for p in profiles[start:stop]) - sum(values.values())
        elif not kind:
            saved = {key: nbytes for p in profiles[start:stop]
                     for key, nbytes in p.saved_values.items()}
            for (name, _), nbytes in saved.items():
                if name in states[stop] and name not in states[start]:
                    values[name] = values.get(name, 0) + nbytes
            held += inside - sum(values.values())
        kept.update(values)
    return max(peak, gradients_from(0))  # after the backward: every gradient


def one_level_peak(plan, profiles):
    return segments_peak([(a, b, i < len(plan) - 1) for i, (a, b) in enumerate(plan)], profiles)


class Branches(nn.Module):
    """Two branches, a concatenation, a residual, an in-place ReLU and a parameter read directly."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.b = nn.Linear(8, 8)
        self.mix = nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        out = self.mix(torch.cat([a, b], dim=1)) + x
        return torch.tanh(F.relu(out, inplace=True)) * self.scale


def test_graph_chain_of_a_branching_model():
    torch.manual_seed(0)
    model = Branches().double()
    chain = as_graph_chain(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    assert torch.equal(chain(x), model(x))
    assert {p for p in chain.parameters()} == set(model.parameters())
    profiles = profile_chain(list(chain), x)
    # The in-place ReLU overwrites the sum before it: no checkpoint between the two.
    relu = next(i for i, step in enumerate(chain) if step.label == "relu")
    assert chain[relu].mutates_from == relu - 1 and relu in forbidden_cuts(profiles)
    for plan in all_plans(len(chain)):
        if any(a in forbidden_cuts(profiles) for a, _ in plan[1:]):
            continue
        planned = revnets.checkpoint_segments(chain, plan)
        grads = torch.autograd.grad(planned(x).sum(), list(model.parameters()))
        reference = torch.autograd.grad(model(x).sum(), list(model.parameters()))
        assert all(torch.allclose(g, r, rtol=0, atol=1e-12) for g, r in zip(grads, reference))


MODELS_NOBODY_HERE_WROTE = {
    # Small versions, so that activations outweigh weights at a test-sized input.
    # name: (builder, share of activation memory to keep)
    "torchvision.resnet": (
        lambda: torchvision.models.resnet.ResNet(Bottleneck, [1, 2, 1, 1], num_classes=10), 0.85
    ),
    # Cuts inside the dense blocks: only the per-layer BatchNorm/ReLU outputs are recomputed.
    "torchvision.densenet": (
        lambda: torchvision.models.DenseNet(8, (4, 4, 4), 16, bn_size=2, num_classes=10), 0.5
    ),
    "timm.convnext_atto": (lambda: timm.create_model("convnext_atto", num_classes=10), 0.65),
    "timm.vit": (
        lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64,
                                  patch_size=8, depth=4),
        0.65,
    ),
    "timm.mobilenetv3": (lambda: timm.create_model("mobilenetv3_small_050", num_classes=10), 0.6),
}


@pytest.mark.parametrize("name", list(MODELS_NOBODY_HERE_WROTE))
def test_models_nobody_here_wrote(name):
    build, keep = MODELS_NOBODY_HERE_WROTE[name]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(8, 3, 64, 64)
    reference = copy.deepcopy(model)
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights, grads
    budget = int(state + keep * (training_peak(model, x) - state))  # less activation memory
    model.zero_grad(set_to_none=True)
    before = copy.deepcopy(model.state_dict())
    planned = revnets.auto_checkpoint(model, x, budget)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    assert any(isinstance(m, revnets.Checkpointed) for m in planned.plan.modules())
    assert training_peak(planned, x) <= budget
    model.zero_grad(set_to_none=True)
    reference.load_state_dict(model.state_dict())
    planned(x).sum().backward()
    reference(x).sum().backward()
    assert max_grad_error(model, reference) <= 1e-6  # float32; recomputation repeats the same ops
    for a, b in zip(model.buffers(), reference.buffers()):
        assert torch.equal(a, b)
    planned.eval(), reference.eval()
    assert not model.training
    assert torch.equal(planned(x), reference(x))  # evaluation runs the model itself


class RNNStep(nn.Module):
    """Step t of an unrolled RNN whose state (inputs, hidden) passes along the chain."""

    def __init__(self, cell: nn.RNNCell, t: int):
        super().__init__()
        self.cell, self.t = cell, t

    def forward(self, state):
        inputs, h = state
        return inputs, self.cell(inputs[self.t], h)


def test_recurrent_chain_with_tuple_state():
    torch.manual_seed(0)
    cell = nn.RNNCell(16, 128).double()
    model = nn.Sequential(*(RNNStep(cell, t) for t in range(40)))
    state = (torch.randn(40, 32, 16, dtype=torch.float64),
             torch.zeros(32, 128, dtype=torch.float64))

    def loss(out):
        return out[1].sum()

    def peak(m):
        return measure_memory(lambda m, s: loss(m(s)).backward(), m, state).peak_bytes

    budget = int(0.7 * peak(model))
    cell.zero_grad(set_to_none=True)
    planned = revnets.auto_checkpoint(model, state, budget, loss)
    cell.zero_grad(set_to_none=True)
    assert peak(planned) == planned.memory_plan.peak_bytes <= budget
    cell.zero_grad(set_to_none=True)
    loss(planned(state)).backward()
    grads = [p.grad.clone() for p in cell.parameters()]
    cell.zero_grad(set_to_none=True)
    loss(model(state)).backward()
    for a, p in zip(grads, cell.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-12, atol=1e-12)


def tanh_chain(n, width=128):
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)))


def activation_peak(model, x):
    model.zero_grad(set_to_none=True)
    return measure_memory(lambda m, x: m(x).sum().backward(), model, x).above_model_state_bytes


def test_nested_schedules_go_below_one_level_plans():
    model = tanh_chain(32).double()
    x = torch.randn(64, 128, dtype=torch.float64)
    profiles = profile_chain(list(model), x)
    full = activation_peak(model, x)
    costs = []
    for share in (2.0, 0.5, 0.25, 0.2, 0.15):
        schedule = nested_schedule(profiles, int(share * full))
        one_level = optimal_plan(profiles, int(share * full))
        if share <= 0.25:
            assert one_level is None and schedule.depth() >= 2
        costs.append(schedule.recompute_cost)
        planned = schedule.apply(list(model))
        assert activation_peak(planned, x) <= 1.1 * share * full
        grads = torch.autograd.grad(planned(x).sum(), list(model.parameters()))
        reference = torch.autograd.grad(model(x).sum(), list(model.parameters()))
        assert all(torch.equal(g, r) for g, r in zip(grads, reference))
    assert costs[0] == 0 and costs == sorted(costs)  # less memory, more recomputation


def all_nested_trees(s, t, forbidden):
    """Every nested schedule of layers s..t: layer s kept whole, or a checkpointed run s..k-1
    (its own schedule inside), then the rest."""
    if s == t:
        yield [s]
        return
    for rest in all_nested_trees(s + 1, t, forbidden):
        yield [s, *rest]
    if s not in forbidden:
        for k in range(s + 1, t + 1):
            for run in all_nested_trees(s, k - 1, forbidden):
                for rest in all_nested_trees(k, t, forbidden):
                    yield [run, *rest]


def nested_memory(items, s, profiles):
    """rotor's model of a tree's memory, written out from its definition: a layer kept whole
    holds what it saves and its output while the rest runs; a checkpointed run holds only its
    output while the rest runs, then is run again under its own schedule; a last layer's
    backward holds its output's and its input's gradients."""
    out = [sum(p.state.values()) for p in profiles]
    first, rest = items[0], items[1:]
    if isinstance(first, int):
        whole = profiles[first].saved_intermediate_bytes + out[first]
        if not rest:
            return whole + out[first] + (out[first - 1] if first else 0)
        return whole + nested_memory(rest, first + 1, profiles)
    stop = s + sum(1 for _ in flatten(first))
    return max(out[stop - 1] + nested_memory(rest, stop, profiles),
               nested_memory(first, s, profiles))


def flatten(items):
    for item in items:
        yield from flatten(item) if isinstance(item, list) else (item,)


@pytest.mark.parametrize("seed", range(4))
def test_most_frugal_schedule_needs_the_least_memory_of_all_nested_schedules(seed):
    n = 7
    generator = torch.Generator().manual_seed(200 + seed)
    profiles = [replace(p, saved_intermediate_bytes=int(torch.randint(0, 60, (1,),
                                                                       generator=generator)))
                for p in synthetic_profiles(n, seed)]
    forbidden = forbidden_cuts(profiles)
    trees = list(all_nested_trees(0, n - 1, forbidden))
    least = min(nested_memory(tree, 0, profiles) for tree in trees)
    frugal = most_frugal_schedule(profiles)
    assert frugal.tree in trees
    assert nested_memory(frugal.tree, 0, profiles) == least == frugal.modelled_bytes
    assert frugal.recompute_cost == recomputed(frugal.tree)


def recomputed(items):
    """Layers run again in backward: every checkpointed run once more, nested ones again."""
    return sum(len(list(flatten(item))) + recomputed(item)
               for item in items if isinstance(item, list))


def test_auto_checkpoint_nests_checkpoints_when_one_level_is_not_enough():
    model = tanh_chain(32, width=64)
    x = torch.randn(512, 64)  # activations outweigh weights and gradients
    full = training_peak(model, x)
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(state + 0.25 * (full - state))
    model.zero_grad(set_to_none=True)
    planned = revnets.auto_checkpoint(model, x, budget)
    nested = [m for m in planned.plan.modules() if isinstance(m, revnets.Checkpointed)
              and any(isinstance(c, revnets.Checkpointed) for c in m.module.modules())]
    assert nested
    assert training_peak(planned, x) <= budget


def checkpoint_depth(module):
    """How deep checkpoints nest in ``module``."""
    inner = [checkpoint_depth(c) for c in module.children()]
    return int(isinstance(module, revnets.Checkpointed)) + max(inner, default=0)


@pytest.mark.slow  # about 10 s
def test_swin_v2_b_at_half_its_activations_plans_in_few_predictions(monkeypatch):
    """Swin-V2-B at batch 2, asked for a 50 % cut. Its lowest one-level plan once missed that
    budget by 0.8 MB and nested checkpoints were searched; the chain model now ranks a one-level
    plan that fits first: few predictions (each a step of a 88M-parameter model on fake
    tensors), checkpoints at most three deep, and the plan's predicted peak its measured one."""
    torch.manual_seed(0)
    model = torchvision.models.swin_v2_b(weights=None).train()
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2,))

    def loss(out):
        return F.cross_entropy(out, y)

    def step(m, x):
        m.zero_grad(set_to_none=True)
        loss(m(x)).backward()

    unplanned = revnets.predict_memory(step, model, x).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(state + 0.5 * (unplanned - state))
    depths = []
    predict = chain_planner.ChainPlanner.peak
    monkeypatch.setattr(chain_planner.ChainPlanner, "peak", lambda self, module: (
        depths.append(checkpoint_depth(module)), predict(self, module))[1])
    planned = revnets.auto_checkpoint(model, x, budget, loss_fn=loss, measure_time=False)
    assert 1 <= checkpoint_depth(planned.plan) <= 3
    assert 1 <= len(depths) <= 3 and max(depths) <= 3
    assert measure_memory(step, planned, x).peak_bytes == planned.memory_plan.peak_bytes <= budget


def test_inception_v3_plan_keeps_gradients_and_statistics():
    # Inception-v3 has no small variant: its smallest input, with every segment but the last
    # checkpointed, shows that branches and concatenations are recomputed exactly.
    torch.manual_seed(0)
    model = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False)
    x = torch.randn(2, 3, 75, 75)
    chain = as_graph_chain(model)
    profiles = profile_chain(list(copy.deepcopy(chain).to("meta")), x.to("meta"))
    plan = candidate_plans(profiles)[-1]  # the finest: a checkpoint wherever one may go
    assert len(plan) > 20
    planned = revnets.checkpoint_segments(chain, plan)
    reference = copy.deepcopy(model)
    for m in (planned, reference):
        torch.manual_seed(1)  # the same dropout mask for both; checkpoints replay it
        m(x).sum().backward()
    assert max_grad_error(model, reference) <= 1e-6
    for a, b in zip(model.buffers(), reference.buffers()):
        assert torch.equal(a, b)


class MaskedAttention(nn.Module):
    """Causal, with a boolean mask, or with a learnt position bias as its mask."""

    def __init__(self, mask: str, width: int = 64, heads: int = 4, length: int = 64) -> None:
        super().__init__()
        self.qkv, self.heads, self.mask = nn.Linear(width, 3 * width), heads, mask
        self.bias = nn.Parameter(torch.zeros(1, heads, length, length))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = {"causal": None, "bias": self.bias,
                "boolean": torch.ones(n, n, dtype=torch.bool, device=x.device).tril()}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[self.mask],
                                           is_causal=self.mask == "causal")
        return y.transpose(1, 2).reshape(b, n, d)


@pytest.mark.parametrize("mask", ["causal", "boolean", "bias"])
def test_attention_profiled_on_meta_saves_what_the_cpu_kernel_saves(mask):
    """On the meta device attention runs its math decomposition, which saves the L x L matrix;
    the CPU's fused kernel saves the query, key, value, output and log-sum-exp. Profiled for
    the CPU, each step's sizes on meta are the CPU's own: with a boolean mask (made a float
    one, as the kernel's caller does), and with a mask that needs a gradient, which the CPU
    sends down the math path (NOTE [ Attention on the meta device ]; CoAtNet's learnt bias
    crashed the fused kernel's meta run)."""
    chain = nn.Sequential(nn.Linear(64, 64), MaskedAttention(mask), nn.GELU(),
                          MaskedAttention(mask))
    x = torch.randn(2, 64, 64)
    on_cpu = profile_chain(list(chain), x)
    with on_meta(list(chain)):
        for_cpu = profile_chain(list(chain), meta_like(x), kernels_of=torch.device("cpu"))
        math = profile_chain(list(chain), meta_like(x))
    size = lambda profiles: [(p.saved_bytes, p.state) for p in profiles]  # noqa: E731
    assert size(for_cpu) == size(on_cpu)
    assert (size(math) == size(on_cpu)) == (mask == "bias")


class AttentionByFunction(nn.Module):
    """Attention traced into its graph as a function, after torch.nn's own attention."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(width, 4, batch_first=True)
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x):
        x = self.mha(x, x, x, need_weights=False)[0]
        q, k, v = self.qkv(x).view(x.size(0), x.size(1), 3, 4, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).flatten(1)


def test_attention_in_a_traced_chain_is_profiled_as_the_cpu_runs_it_and_only_there():
    """The mode that runs attention's CPU kernel on meta costs a few microseconds on every torch
    function a profile calls, so it is entered only for chains with a step that may attend:
    torch.nn's attention, F.scaled_dot_product_attention, or code not torch's own. A ResNet's
    steps, all torch.nn's and torch's, do not."""
    chain = planning_chain(AttentionByFunction())
    mha = [isinstance(getattr(step, "module", None), nn.MultiheadAttention) for step in chain]
    assert [may_attend(step) for step in chain] == [
        attends or getattr(step, "target", None) is F.scaled_dot_product_attention
        for step, attends in zip(chain, mha)]
    x = torch.randn(2, 64, 64)
    on_cpu = profile_chain(list(chain), x)
    with on_meta(list(chain)):
        for_cpu = profile_chain(list(chain), meta_like(x), kernels_of=torch.device("cpu"))
    # torch.nn's attention runs as before on meta (NOTE [ Attention on the meta device ]).
    sizes = lambda profiles: [p.saved_bytes for p, m in zip(profiles, mha) if not m]  # noqa: E731
    assert sizes(for_cpu) == sizes(on_cpu)
    assert not any(map(may_attend, planning_chain(torchvision.models.resnet18())))


def test_sizes_are_profiled_on_meta_copies_of_the_models_own_tensors():
    """The planner profiles sizes with the model's own modules (no copy of it) on meta copies of
    their parameters and buffers: one copy for a tensor two layers share, parameters still
    parameters, and everything put back, also when the profile fails."""
    from revnets.planning.costs.profile import on_meta

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    model[2].weight = model[0].weight  # tied
    before = [(id(t), t.device) for t in (*model.parameters(), *model.buffers())]
    with on_meta(list(model)):
        assert model[0].weight is model[2].weight and model[0].weight.is_meta
        assert isinstance(model[0].weight, nn.Parameter) and model[1].running_mean.is_meta
        assert profile_chain(list(model), torch.empty(2, 4, device="meta"))
    with pytest.raises(RuntimeError, match="profile failed"), on_meta(list(model)):
        raise RuntimeError("profile failed")
    assert [(id(t), t.device) for t in (*model.parameters(), *model.buffers())] == before


@pytest.mark.parametrize("seed", range(8))
def test_candidate_plans_reach_the_least_modelled_peak_of_all_plans(seed):
    # A search names and tries the lowest candidate as the floor of one-level plans: it must be
    # the lowest plan there is (to a thousandth), not the lowest of a coarse grid of budgets.
    n = 12
    profiles = synthetic_profiles(n, seed)
    forbidden = forbidden_cuts(profiles)
    allowed = [p for p in all_plans(n) if not any(a in forbidden for a, _ in p[1:])]
    floor = min(modelled_peak(p, profiles) for p in allowed)
    lowest = min(modelled_peak(p, profiles) for p in candidate_plans(profiles))
    assert floor <= lowest <= floor * (1 + 1 / 1000)


def test_the_pareto_front_is_every_point_no_other_beats_the_first_of_equals_first():
    """The dynamic programme's Pareto front, whichever sort finds it (unique keys of bytes and
    arrival, or a stable sort by bytes where those would not fit in 63 bits): each point that no
    other point beats, one beating another where it has no more bytes and no more time and is
    either better in one or arrived first, in order of bytes."""
    _pareto_front = chain_module._pareto_front
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 300):
        for offset in (0, 2**61):  # the second past the unique keys' 63 bits
            kept = rng.integers(0, 40, size) + offset
            spent = rng.integers(0, 6, size).astype(np.float64)
            beaten = {i for i in range(size) for j in range(size) if j != i
                      and kept[j] <= kept[i] and spent[j] <= spent[i]
                      and (kept[j] < kept[i] or spent[j] < spent[i] or j < i)}
            expected = sorted(set(range(size)) - beaten, key=lambda i: kept[i])
            assert _pareto_front(kept, spent).tolist() == expected
