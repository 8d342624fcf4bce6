"""Modules the planner's trace goes through run as their traced graph in a planned training step
(NOTE [ Traced modules run as their graph ] in revnets/graph/trace_state.py): what their forward
does besides computing (hooks, state they hold, grad mode) keeps them whole, the trace leaves
the model as it was, and what the graph froze is refused by name once it changes. Each case is
compared with the same model trained without planning."""

import collections
import copy
import functools
import threading

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

import revnets
from revnets.graph.reads import AttributesRead
from revnets.planning import as_graph_chain

from conftest import activation_budget, train_step


class Residual(nn.Module):
    """A block with submodules, which the planner's trace goes through unless it must not."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Counting(Residual):
    """Assigns attributes in its forward: a counter and the features it last saw."""

    def __init__(self):
        super().__init__()
        self.calls, self.seen = 0, []

    def forward(self, x):
        self.calls += 1
        self.last = x.detach()
        self.seen.append(x.shape)
        return super().forward(x)


class Stack(nn.Module):
    def __init__(self, block=Residual, n: int = 6):
        super().__init__()
        self.blocks = nn.Sequential(*(block() for _ in range(n)))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


def planned_stack(model, x, keep=0.9):
    planned = revnets.auto_checkpoint(model, x, activation_budget(model, x, keep),
                                      measure_time=False)
    assert isinstance(planned, revnets.planning.PlannedModel)
    return planned


def test_hooks_on_a_module_the_trace_would_go_through_fire_in_planned_steps():
    # Traced through, the block's hooks ran once, on proxies, while planning, and never again.
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(1024, 32)
    plain = copy.deepcopy(model)
    calls = {"planned": [], "plain": []}
    for name, net in (("planned", model), ("plain", plain)):
        net.blocks[2].register_forward_hook(lambda m, a, out, c=calls[name]: c.append(1))
        net.blocks[3].register_forward_hook(lambda m, a, out: 2 * out)  # changes the output
    planned = planned_stack(model, x)
    called = {s.label for s in as_graph_chain(model) if s.op == "call_module"}
    assert {"blocks_2", "blocks_3"} <= called and "blocks_1" not in called  # kept whole
    calls["planned"].clear()
    train_step(planned, x)
    train_step(plain, x)
    assert len(calls["planned"]) == len(calls["plain"]) == 1
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_module_assigning_attributes_is_kept_whole_and_left_as_it_was():
    # Traced through, the block kept a torch.fx Proxy as ``last`` and never counted again.
    torch.manual_seed(0)
    model, x = Stack(Counting), torch.randn(1024, 32)
    plain = copy.deepcopy(model)
    planned = planned_stack(model, x, keep=0.95)
    for block in model.blocks:  # planning runs the model: what it assigned are real values
        assert type(block.last) is torch.Tensor and block.last.device.type == "cpu"
        assert all(type(shape) is torch.Size for shape in block.seen)
    counted = [b.calls for b in model.blocks]
    train_step(planned, x)
    train_step(plain, x)
    assert [b.calls - c for b, c in zip(model.blocks, counted)] == [1] * 6  # once, as a step does
    for b, c in zip(model.blocks, plain.blocks):
        assert torch.equal(b.last, c.last)


def test_a_cache_filled_by_a_forward_in_the_other_mode_is_left_empty():
    # levit's attention fills a dict of biases in eval mode; the trace in the other mode (which
    # finds code depending on it) left a Proxy there, read by every later evaluation.
    model = timm.create_model("levit_128s", num_classes=10)
    as_graph_chain(model)
    caches = [m.attention_bias_cache for m in model.modules() if hasattr(m, "attention_bias_cache")]
    assert caches and all(cache == {} for cache in caches)
    model.eval()
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 10)


def test_a_model_assigning_attributes_in_its_own_forward_is_refused_by_name():
    class KeepsItsFeatures(Stack):
        def forward(self, x):
            self.features = self.blocks(x)
            return self.head(self.features)

    model = KeepsItsFeatures()
    with pytest.raises(revnets.planning.NotAChainError, match=r"KeepsItsFeatures\.features"):
        as_graph_chain(model)
    assert "features" not in vars(model)


@pytest.mark.parametrize("where", ["traced block", "model itself", "global"])
def test_a_hook_a_planned_step_would_not_run_is_refused_by_name(where):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(1024, 32)
    planned = planned_stack(model, x)
    hook = lambda *args: None  # noqa: E731
    handle, match = {
        "traced block": lambda: (model.blocks[1].register_forward_hook(hook), r"blocks\.1"),
        "model itself": lambda: (model.register_forward_pre_hook(hook), "the model itself"),
        "global": lambda: (nn.modules.module.register_module_forward_hook(hook), "global"),
    }[where]()
    try:
        with pytest.raises(RuntimeError, match=match):
            train_step(planned, x)
        planned.eval()
        with torch.no_grad():
            planned(x)  # evaluation runs the model itself, hooks and all
    finally:
        handle.remove()
    planned.train()
    train_step(planned, x)


class HoldsState(Residual):
    """Changes state it holds in ways other than assigning its own attributes: a buffer counted
    up and a moving average (updated in place), a plain object's field, a list in a dict."""

    class Stats:
        count = 0

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("average", torch.zeros(32, dtype=torch.float64))
        self.stats, self.store = self.Stats(), {"features": []}

    def forward(self, x):
        self.steps += 1
        self.average.mul_(0.9).add_(0.1 * x.detach().mean(0))
        self.stats.count += 1
        self.store["features"].append(x.shape)
        return super().forward(x + self.average)


def test_state_a_module_holds_is_left_as_it_was_by_the_trace_and_updated_once_per_step():
    # Traced through, the buffers were updated by the trace itself and never again (the moving
    # average's update half frozen into the graph: other gradients), and the plain object and
    # the list kept Proxies.
    torch.manual_seed(0)
    model, x = Stack(HoldsState).double(), torch.randn(1024, 32, dtype=torch.float64)
    as_graph_chain(model)
    block = model.blocks[0]
    assert block.steps.item() == 0 and block.stats.count == 0 and block.store["features"] == []
    assert torch.equal(block.average, torch.zeros(32, dtype=torch.float64))
    plain = copy.deepcopy(model)
    planned = planned_stack(model, x, keep=0.95)
    for net in (model, plain):  # the step measuring the budget ran on the model alone
        for b in net.blocks:
            b.steps.zero_(), b.average.zero_(), b.store["features"].clear()
            b.stats.count = 0
    for _ in range(3):
        train_step(planned, x)
        train_step(plain, x)
    for b, c in zip(model.blocks, plain.blocks):
        assert b.steps.item() == c.steps.item() == 3  # module state: replayed, updated once
        assert torch.equal(b.average, c.average)
        # Python state outside module slots runs again where a checkpoint recomputes the block,
        # as under torch.utils.checkpoint; it runs, where a traced graph would never run it.
        assert b.stats.count >= 3 and len(b.store["features"]) >= 3
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


class NoisyInTraining(Residual):
    def forward(self, x):
        if self.training:  # a step more in training mode, inside a block
            x = x + 0.01 * torch.randn_like(x)
        return super().forward(x)


def test_a_step_only_one_mode_runs_keeps_that_block_whole_not_the_model_refused():
    chain = as_graph_chain(Stack(NoisyInTraining))
    called = {s.label for s in chain if s.op == "call_module"}
    assert {f"blocks_{i}" for i in range(6)} <= called


class Reversing(Residual):
    """Builds a constant in its forward: the permutation reversing its features."""

    def forward(self, x):
        return super().forward(x[:, torch.arange(x.shape[1] - 1, -1, -1)])


class ReversingStack(Stack):
    def forward(self, x):
        return self.head(self.blocks(x)[:, torch.arange(31, -1, -1)])


def test_a_constant_built_in_a_forward_is_traced_through_not_refused_as_mode_dependent():
    # Each trace stores a new tensor for the constant, which looked like code unlike in
    # training and in eval mode: the model was refused as depending on self.training.
    torch.manual_seed(0)
    model, x = ReversingStack(Reversing), torch.randn(64, 32)
    steps = {s.label for s in as_graph_chain(model) if s.op == "call_module"}
    assert not steps & {f"blocks_{i}" for i in range(6)}  # no block kept whole
    reference = copy.deepcopy(model)
    planned = planned_stack(model, x, keep=0.8)
    train_step(planned, x)
    train_step(reference, x)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


class SizedCache(Residual):
    """Fills a table per input size on first use (position tables, rotary embeddings)."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x):
        n = x.shape[-1]
        if n not in self.cache:
            self.cache[n] = torch.linspace(0.5, 1.5, n, dtype=x.dtype, device=x.device)
        return super().forward(x * self.cache[n])


def test_planning_leaves_no_meta_tensor_in_a_cache_filled_lazily():
    # Planning's runs on the meta device filled the cache with a meta tensor: planning failed,
    # and so did the model afterwards.
    torch.manual_seed(0)
    model, x = Stack(SizedCache), torch.randn(1024, 32)
    budget = activation_budget(Stack(SizedCache), x, 0.95)
    planned = revnets.auto_checkpoint(model, x, budget, measure_time=False)
    assert all(t.device.type == "cpu" for b in model.blocks for t in b.cache.values())
    train_step(planned, x)
    model(x)


def test_hooks_on_a_sequential_keep_it_whole_and_on_a_sequential_model_are_refused():
    torch.manual_seed(0)
    model = Stack()
    model.blocks.register_forward_hook(lambda m, a, out: None)
    chain = as_graph_chain(model)
    assert "blocks" in {s.label for s in chain if s.op == "call_module"}
    sequential = nn.Sequential(*(Residual() for _ in range(4)))
    sequential.register_forward_hook(lambda m, a, out: 2 * out)
    with pytest.raises(RuntimeError, match="register it on the model auto_checkpoint returned"):
        revnets.auto_checkpoint(sequential, torch.randn(1024, 32), 10**9, measure_time=False)


class SkipsInEval(nn.Module):
    """A layer dropped outside training: no step at all in eval mode."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(32, 32)

    def forward(self, x):
        return self.scale(x) if self.training else x


class WithDroppedLayers(Residual):
    def __init__(self):
        super().__init__()
        self.skip = SkipsInEval()
        self.drop_path = timm.layers.DropPath(0.1)  # returns its input as it is in eval mode

    def forward(self, x):
        return x + self.drop_path(self.b(torch.relu(self.a(self.skip(x)))))


def test_layers_dropped_in_one_mode_are_kept_whole_and_the_block_around_them_traced():
    # The block calling them looks as if it depended on its mode too (its values come from
    # elsewhere in eval mode), and was kept whole with them.
    chain = as_graph_chain(Stack(WithDroppedLayers))
    called = {s.label for s in chain if s.op == "call_module"}
    assert {f"blocks_{i}_{name}" for i in range(6) for name in ("skip", "drop_path")} <= called
    assert not {f"blocks_{i}" for i in range(6)} & called


class MaxNorm(nn.Module):
    """A user activation taking its statistic without grad: a graph records no grad mode."""

    def forward(self, x):
        with torch.no_grad():
            scale = x.abs().amax(-1, keepdim=True)
        return x / scale


class NormedResidual(Residual):
    def __init__(self):
        super().__init__()
        self.act = MaxNorm()

    def forward(self, x):
        return x + self.act(self.b(torch.relu(self.a(x))))


def test_code_changing_the_grad_mode_keeps_its_module_whole():
    # Traced into, the division's gradient flowed through ``scale`` as well: other gradients.
    torch.manual_seed(0)
    model, x = Stack(NormedResidual).double(), torch.randn(1024, 32, dtype=torch.float64)
    called = {s.label for s in as_graph_chain(model) if s.op == "call_module"}
    assert {f"blocks_{i}_act" for i in range(6)} <= called
    plain = copy.deepcopy(model)
    planned = planned_stack(model, x, keep=0.8)
    train_step(planned, x)
    train_step(plain, x)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)

    class NoGradInItsOwnForward(Stack):
        def forward(self, x):
            with torch.no_grad():
                x = x * 2
            return super().forward(x)

    with pytest.raises(revnets.planning.NotAChainError, match="grad mode"):
        as_graph_chain(NoGradInItsOwnForward())


class Scaled(Residual):
    def __init__(self):
        super().__init__()
        self.norm = timm.layers.LayerNorm(32)  # its weight: read by a traced graph directly
        self.scale = 1.0  # read by a traced graph as a constant

    def forward(self, x):
        return x + self.scale * self.b(torch.relu(self.a(self.norm(x))))


def test_what_a_traced_graph_froze_is_refused_by_name_when_changed_after_planning():
    # A parameter or buffer read directly and replaced is followed (tests/test_planned_model.py).
    torch.manual_seed(0)
    model, x = Stack(Scaled), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.8)
    model.blocks[2].scale = 0.5  # a schedule changing it: the graph would keep 1.0
    with pytest.raises(RuntimeError, match=r"blocks\.2\.scale \(Scaled\) is 0\.5, 1\.0 when"):
        train_step(planned, x)
    model.blocks[2].scale = 1.0
    state = {k: v * 2 for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # in place: what the graph reads
    train_step(planned, x)
    model.blocks[0].norm = timm.layers.LayerNorm(32)  # a new module: the graph runs the old
    with pytest.raises(RuntimeError, match=r"blocks\.0\.norm \(Scaled\) is another module"):
        train_step(planned, x)


def test_a_block_added_to_a_traced_container_after_planning_is_refused_by_name():
    """The graph runs the blocks the trace went through: one appended since (a model grown
    stage by stage) would be left out of every planned step without a word."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.8)
    model.blocks.append(Residual())
    with pytest.raises(RuntimeError, match=r"blocks \(Sequential\) has submodules \['6'\] "
                                           r"added since planning"):
        train_step(planned, x)
    del model.blocks[6]
    train_step(planned, x)


class ListScaled(Residual):
    def __init__(self):
        super().__init__()
        self.scales = [1.0, 2.0]  # read by a traced graph as constants
        self.act = torch.relu  # called by a traced graph as the function it was

    def forward(self, x):
        return x + self.scales[0] * self.b(self.act(self.a(x)))


def test_what_a_traced_graph_froze_of_lists_and_functions_is_refused_by_name_when_changed():
    """Numbers in a list, and a function held as an attribute, are frozen into the graph as
    they were when planned: changed since, the plan would run the old ones."""
    torch.manual_seed(0)
    model, x = Stack(ListScaled), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.8)
    model.blocks[2].scales[0] = 3.0
    with pytest.raises(RuntimeError, match=r"blocks\.2\.scales \(list\) was changed in place"):
        train_step(planned, x)
    model.blocks[2].scales[0] = 1.0  # an equal number: as planned
    train_step(planned, x)
    model.blocks[1].act = torch.tanh
    with pytest.raises(RuntimeError, match=r"blocks\.1\.act \(ListScaled\) is tanh, relu when"):
        train_step(planned, x)


class ClassScaled(Residual):
    scale = 1.0  # a constant of the class, which a schedule may change on the class

    def forward(self, x):
        return x + self.scale * self.b(torch.relu(self.a(x)))


class ArrayScaled(Residual):
    def __init__(self):
        super().__init__()
        self.w = np.ones(2)

    def forward(self, x):
        return x + float(self.w[0]) * self.b(torch.relu(self.a(x)))


class PartialAct(Residual):
    def __init__(self):
        super().__init__()
        self.act = functools.partial(F.leaky_relu, negative_slope=0.1)

    def forward(self, x):
        return x + self.b(self.act(self.a(x)))


class ReadByName(Residual):
    def forward(self, x):  # ``temperature`` is set from outside the class
        return x + getattr(self, "temperature") * self.b(torch.relu(self.a(x)))


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleDict({k: nn.Linear(32, 32) for k in "abc"})

    def forward(self, x):
        for key in self.branches:
            x = torch.tanh(self.branches[key](x))
        return x


def reorder(branches):
    branches["a"] = branches.pop("a")


class ReadsItsOwner(Residual):
    def forward(self, x):  # ``owner``: the model, in a plain list the model fills
        return x + self.owner[0].scale * self.b(torch.relu(self.a(x)))


def owned_stack():
    model = Stack(ReadsItsOwner)
    model.scale = 1.0
    for block in model.blocks:
        block.owner = [model]
    return model


def temperature_of(module):
    return module.temperature


class ReadByAFunction(Residual):
    def forward(self, x):  # ``temperature`` is set from outside the class
        return x + temperature_of(self) * self.b(torch.relu(self.a(x)))


class OptionalGain(Residual):
    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return x + (h * self.gain if hasattr(self, "gain") else h)


class Config:
    """A plain object whose number is read through a property."""

    def __init__(self):
        self._rate = 0.5

    @property
    def rate(self):
        return self._rate

    @rate.setter
    def rate(self, value):
        self._rate = value


class ConfigRate(Residual):
    def __init__(self):
        super().__init__()
        self.cfg = Config()

    def forward(self, x):
        return x + self.cfg.rate * self.b(torch.relu(self.a(x)))


class Scaler:
    def __init__(self, k):
        self.k = k

    def __call__(self, h):
        return h * self.k


class HelperScaled(Residual):
    def __init__(self):
        super().__init__()
        self.scale = Scaler(0.5)

    def forward(self, x):
        return x + self.scale(self.b(torch.relu(self.a(x))))


class ClosureScaled(Residual):
    def __init__(self):
        super().__init__()
        scales = self.scales = [1.0]  # the lambda reads the list, the forward does not
        self.act = lambda h: torch.relu(h) * scales[0]

    def forward(self, x):
        return x + self.b(self.act(self.a(x)))


class ClassListScaled(Residual):
    SCALES = [1.0]

    def forward(self, x):
        return x + type(self).SCALES[0] * self.b(torch.relu(self.a(x)))


class ItemScaled(Residual):
    def __init__(self):
        super().__init__()
        self.register_buffer("temp", torch.tensor(0.5))

    def forward(self, x):
        return x + self.temp.item() * self.b(torch.relu(self.a(x)))


def doubled(h):
    return 2 * h


class Rates:
    SCALES = [1.0]  # a list of the config's class, read through its instance


class RatesOfItsClass(Residual):
    def __init__(self):
        super().__init__()
        self.cfg = Rates()

    def forward(self, x):
        return x + self.cfg.SCALES[0] * self.b(torch.relu(self.a(x)))


class HydraConfigured(Residual):
    """A Hydra user's block: its rate read from the run's DictConfig."""

    def __init__(self):
        super().__init__()
        self.cfg = OmegaConf.create({"model": {"rate": 0.5}})

    def forward(self, x):
        return x + self.cfg.model.rate * self.b(torch.relu(self.a(x)))


class Settings:
    def __init__(self):
        self.rate, self.calls = 0.5, 0


def block_reading(settings):
    class Made(Residual):  # a class a factory makes, its forward closing over the settings
        def forward(self, x):
            return x + settings.rate * self.b(torch.relu(self.a(x)))

    return Made


CLOSED_OVER = Settings()
ClosesOverSettings = block_reading(CLOSED_OVER)


class ListedTensor(Residual):
    def __init__(self):
        super().__init__()
        self.gains = [torch.tensor(0.5)]  # a tensor held in a list, its value read

    def forward(self, x):
        return x + float(self.gains[0]) * self.b(torch.relu(self.a(x)))


FROZEN_ELSEWHERE = {
    "a constant of the class": (ClassScaled, lambda m: setattr(type(m.blocks[2]), "scale", 3.0),
                                r"blocks\.0\.scale \(ClassScaled\) is 3\.0, 1\.0 when"),
    "a numpy array written": (ArrayScaled, lambda m: m.blocks[2].w.__setitem__(0, 3.0),
                              r"blocks\.2\.w \(ArrayScaled\) is changed in place"),
    "a partial's keywords": (PartialAct,
                             lambda m: m.blocks[2].act.keywords.update(negative_slope=0.9),
                             r"blocks\.2\.act \(PartialAct\) is changed in place"),
    "an attribute read by getattr": (ReadByName, lambda m: setattr(m.blocks[2], "temperature", 3),
                                     r"blocks\.2\.temperature \(ReadByName\) is 3"),
    "submodules reordered": (Branches, lambda m: reorder(m.blocks[2].branches),
                             r"blocks\.2\.branches \(ModuleDict\) has its submodules in another"),
    "the model's number, read by its blocks through a plain list": (
        owned_stack, lambda m: setattr(m, "scale", 3.0), r"scale \(Stack\) is 3\.0, 1\.0 when"),
    "an attribute read by a function outside the class": (
        ReadByAFunction, lambda m: setattr(m.blocks[2], "temperature", 3.0),
        r"blocks\.2\.temperature \(ReadByAFunction\) is 3\.0, 1\.0 when"),
    "an attribute absent when planned": (
        OptionalGain, lambda m: setattr(m.blocks[2], "gain", 3.0),
        r"blocks\.2\.gain \(OptionalGain\) is 3\.0, absent when planned"),
    "a config's number read through its property": (
        ConfigRate, lambda m: setattr(m.blocks[2].cfg, "rate", 3.0),
        r"blocks\.2\.cfg\._rate \(Config\) is 3\.0, 0\.5 when planned"),
    "a number a callable helper reads": (
        HelperScaled, lambda m: setattr(m.blocks[2].scale, "k", 3.0),
        r"blocks\.2\.scale\.k \(Scaler\) is 3\.0, 0\.5 when planned"),
    "a list a lambda closes over": (
        ClosureScaled, lambda m: m.blocks[2].scales.__setitem__(0, 3.0),
        r"blocks\.2\.act \(ClosureScaled\) is changed in place"),
    "a class's list read through its class": (
        ClassListScaled, lambda m: type(m.blocks[2]).SCALES.__setitem__(0, 3.0),
        r"blocks\.0\.SCALES \(list\) was changed in place"),
    "a buffer whose value was read, replaced": (
        ItemScaled, lambda m: setattr(m.blocks[2], "temp", torch.tensor(3.0)),
        r"blocks\.2\.temp \(ItemScaled\) is a tensor whose value the trace read"),
    "the forward replaced": (
        Residual, lambda m: setattr(m.blocks[2], "forward", doubled),
        r"blocks\.2 \(Residual\) runs other code than when planned"),
    "a list of a config's class": (
        RatesOfItsClass, lambda m: Rates.SCALES.__setitem__(0, 3.0),
        r"blocks\.0\.cfg\.SCALES \(list\) was changed in place"),
    "a Hydra config's number": (
        HydraConfigured, lambda m: setattr(m.blocks[2].cfg.model, "rate", 3.0),
        r"blocks\.2\.cfg\._content\['model'\]\._content\['rate'\]\._val \(AnyNode\) is 3\.0"),
    "a number of settings the forward closes over": (
        ClosesOverSettings, lambda m: setattr(CLOSED_OVER, "rate", 3.0),
        r"<a Settings the model does not hold>\.rate \(Settings\) is 3\.0, 0\.5 when"),
    "a tensor held in a list, its value read": (
        ListedTensor, lambda m: m.blocks[2].gains[0].fill_(3.0),
        r"a tensor of shape \(\) \(Tensor\) is a tensor whose value the trace read"),
    "the class replaced": (
        Residual, lambda m: setattr(m.blocks[2], "__class__", ClassScaled),
        r"blocks\.2 \(ClassScaled\) runs other code than when planned"),
}


@pytest.mark.parametrize("change", FROZEN_ELSEWHERE)
def test_what_a_traced_graph_froze_outside_the_module_dict_is_refused_by_name(change):
    """A constant of the class, an array or a partial changed in place, a name read as a
    string, an order of submodules a loop followed, another module's number, a number read by
    a function, an attribute whose absence the code tested, a config's field read by its own
    code, what a lambda closes over, a buffer's value read and the buffer replaced, the code
    itself: each is frozen into the graph as it was when planned. Changed since, the plan is
    refused by name, never run with the old one."""
    build, modify, refusal = FROZEN_ELSEWHERE[change]
    torch.manual_seed(0)
    model, x = (build() if build is owned_stack else Stack(build)), torch.randn(1024, 32)
    for block in model.blocks:
        block.temperature = 1.0
    planned = planned_stack(model, x, keep=0.8)
    train_step(planned, x)
    modify(model)
    try:
        with pytest.raises(RuntimeError, match=refusal):
            train_step(planned, x)
    finally:
        ClassScaled.scale, ClassListScaled.SCALES[0], Rates.SCALES[0] = 1.0, 1.0, 1.0
        CLOSED_OVER.rate = 0.5


class ScaledByAListedTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.gains = nn.Linear(32, 32), [torch.tensor(0.5)]

    def forward(self, x):
        return x + self.a(x) * float(self.gains[0])


def test_a_number_held_in_a_list_as_a_tensor_keeps_its_value_in_predictions():
    """Predictions run the model on fake tensors, which have no values: a CPU scalar held in a
    list keeps its own, as a scalar buffer does, so the model plans (a prediction read its
    value and failed before) and trains with the model's gradients; written, it is refused."""
    torch.manual_seed(0)
    model, x = Stack(ScaledByAListedTensor), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.7)
    plain = copy.deepcopy(model)
    for net in (planned, plain):
        train_step(net, x)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    model.blocks[2].gains[0].fill_(3.0)
    with pytest.raises(RuntimeError, match=r"a tensor of shape \(\) \(Tensor\) is a tensor whose"):
        train_step(planned, x)


def test_lookups_by_another_thread_while_tracing_are_not_the_traces():
    """A monitor thread reading a module's counter during planning read nothing the graph
    froze: only the tracing thread's lookups are recorded."""
    module = nn.Linear(2, 2)
    module.seen, module.rate = 0, 0.5
    with AttributesRead() as recording:
        monitor = threading.Thread(target=lambda: module.seen)
        monitor.start()
        monitor.join()
        assert module.rate == 0.5
    read = {name for holder, names in recording.read.values() if holder is module
            for name in names}
    assert "rate" in read and "seen" not in read
    assert "__getattribute__" not in vars(nn.Module)


Rate = collections.namedtuple("Rate", "rate")


class RateTuple(Residual):
    def __init__(self):
        super().__init__()
        self.cfg = Rate(0.5)

    def forward(self, x):
        return x + self.cfg.rate * self.b(torch.relu(self.a(x)))


def test_a_tuple_made_again_with_the_same_values_is_no_change():
    """Settings kept as a namedtuple are compared by what they hold: made again with the same
    rate, the plan trains on; with another, it is refused."""
    torch.manual_seed(0)
    model, x = Stack(RateTuple), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.8)
    model.blocks[2].cfg = Rate(0.5)
    train_step(planned, x)
    model.blocks[2].cfg = Rate(3.0)
    with pytest.raises(RuntimeError, match=r"blocks\.2\.cfg \(RateTuple\) is another Rate"):
        train_step(planned, x)


class Labelled(Residual):
    """A label only ``describe`` reads: the forward the trace ran never did."""

    def __init__(self):
        super().__init__()
        self.label = "first"

    def describe(self):
        return f"{self.label}: {self.a}"


def test_an_attribute_the_traced_code_never_read_may_change():
    """What the trace did not run read nothing it froze: a label another method reads changes
    and the planned model keeps training, with the gradients of the model itself."""
    torch.manual_seed(0)
    model, x = Stack(Labelled), torch.randn(1024, 32)
    plain = copy.deepcopy(model)
    planned = planned_stack(model, x, keep=0.8)
    assert "blocks.2" in dict(planned._traced)  # traced into
    for net in (model, plain):
        net.blocks[2].label = "second"
    for net in (planned, plain):
        net.zero_grad()
        train_step(net, x)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_copy_or_a_cast_of_a_planned_model_checks_its_own_values_read():
    """The value the trace read is checked under its name in whichever model holds it: a
    cast that keeps it (float64) trains on; a copy of the planned model (an EMA) is refused
    when its own buffer is written, not when the original's is."""
    torch.manual_seed(0)
    model, x = Stack(ItemScaled), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.8)
    train_step(planned, x)
    copied = copy.deepcopy(planned)
    model.blocks[2].temp.fill_(3.0)
    train_step(copied, x)  # the original's write is not the copy's
    with pytest.raises(RuntimeError, match=r"blocks\.2\.temp \(ItemScaled\) is a tensor whose"):
        train_step(planned, x)
    copied.model.blocks[2].temp.fill_(3.0)
    with pytest.raises(RuntimeError, match=r"blocks\.2\.temp \(ItemScaled\) is a tensor whose"):
        train_step(copied, x)
    copied.model.blocks[2].temp.fill_(0.5)  # its value as planned again
    copied.double()
    train_step(copied, x.double())


class CountsCalls(nn.Module):
    def __init__(self, settings):
        super().__init__()
        self.settings = settings

    def forward(self, x):
        self.settings.calls += 1
        return x


class SharesSettings(Residual):
    """Reads a rate of the settings a kept-whole child counts its calls in."""

    def __init__(self):
        super().__init__()
        self.settings = Settings()
        self.count = CountsCalls(self.settings)

    def forward(self, x):
        return x + self.settings.rate * self.b(torch.relu(self.count(self.a(x))))

    def report(self):  # names the count, which the forward never reads
        return f"{self.settings.calls} calls"


def test_a_field_of_a_config_the_trace_never_read_may_change():
    """The traced code read the settings' rate; their call count, which a kept-whole child
    raises each step and only another method reads, was never read: step after step the
    planned model trains with the model's gradients and counts."""
    torch.manual_seed(0)
    model, x = Stack(SharesSettings), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.8)  # measuring the budget counted a call
    plain = copy.deepcopy(model)
    assert "blocks.2" in dict(planned._traced)
    for _ in range(3):
        for net in (planned, plain):
            net.zero_grad()
            train_step(net, x)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert model.blocks[2].settings.calls == plain.blocks[2].settings.calls
    model.blocks[2].settings.rate = 3.0
    with pytest.raises(RuntimeError, match=r"blocks\.2\.settings\.rate \(Settings\) is 3\.0"):
        train_step(planned, x)


class NumpyScaled(Residual):
    def __init__(self):
        super().__init__()
        self.scale = np.float64(1.0)  # a rate a schedule writes as numpy's scalar

    def forward(self, x):
        return x + float(self.scale) * self.b(torch.relu(self.a(x)))


def test_a_number_reassigned_its_own_value_is_no_change():
    """numpy's scalars compare by value, as Python's do: a schedule writing the same rate
    again is no change; another rate is refused."""
    torch.manual_seed(0)
    model, x = Stack(NumpyScaled), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.8)
    assert "blocks.2" in dict(planned._traced)  # traced into: its rate is frozen
    model.blocks[2].scale = np.float64(1.0)
    model.blocks[3].scale = 1.0
    train_step(planned, x)
    model.blocks[2].scale = np.float64(3.0)
    with pytest.raises(RuntimeError, match=r"blocks\.2\.scale \(NumpyScaled\) is "
                                           r"(np\.float64\()?3\.0"):
        train_step(planned, x)


class ReadsItsFlag(Residual):
    """A buffer read for its value: a number and a branch the trace takes once."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.tensor(1.0))
        self.register_buffer("on", torch.tensor(True))

    def forward(self, x):
        h = self.a(x)
        if self.on:
            h = torch.relu(h)
        return x + float(self.gain) * self.b(h)


@pytest.mark.parametrize("written", ["gain", "on"])
def test_a_tensor_whose_value_the_trace_read_is_refused_by_name_once_written(written):
    """torch.fx hands a traced forward its buffers as real tensors: ``float(self.gain)`` and
    ``if self.on:`` read their values once, and the graph keeps a number and a branch. Written
    since, the plan would run with the old ones."""
    torch.manual_seed(0)
    model, x = Stack(ReadsItsFlag), torch.randn(1024, 32)
    planned = planned_stack(model, x, keep=0.8)
    train_step(planned, x)
    getattr(model.blocks[2], written).fill_(False if written == "on" else 3.0)
    with pytest.raises(RuntimeError, match=rf"blocks\.2\.{written} \(ReadsItsFlag\) is a "
                                           r"tensor whose value the trace read"):
        train_step(planned, x)


class SlicesItsTable(Residual):
    """A buffer sliced while tracing: the graph keeps the view, which sees writes into it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.ones(64))

    def forward(self, x):
        return x + self.table[:32] * self.b(torch.relu(self.a(x)))


def test_a_buffer_the_graph_keeps_a_view_of_follows_its_writes():
    """A view of a buffer is a constant that reads the buffer's memory: written in place, the
    planned step computes what the model does, not refused."""
    torch.manual_seed(0)
    model, x = Stack(SlicesItsTable), torch.randn(1024, 32)
    plain = copy.deepcopy(model)
    planned = planned_stack(model, x, keep=0.8)
    for m in (model, plain):
        m.blocks[2].table.mul_(3.0)
    train_step(planned, x)
    train_step(plain, x)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


class SharedAndDirect(nn.Module):
    """Parameters and a buffer read directly in the model's code, one parameter under two
    names (a tied head), another reassigned by hand before tracing."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.gate = nn.Parameter(torch.ones(8))

    def forward(self, x):
        h = torch.tanh(self.embed(x)) * self.scale
        h = torch.nn.functional.linear(h, self.head.weight) * self.gate
        return self.head(h + self.scale)


def test_the_trace_names_parameters_and_buffers_as_torch_fx_does(monkeypatch):
    """The planner's tracer finds a tensor's name by its identity, where torch.fx walks every
    parameter and buffer of the model at each access: both give the same graphs."""
    from revnets.graph import trace

    def graphs():
        seen = []
        original = trace._Tracer.trace
        with monkeypatch.context() as patch:
            patch.setattr(trace._Tracer, "trace", lambda self, root, concrete_args=None: (
                seen.append(str(graph := original(self, root, concrete_args))), graph)[1])
            chain = as_graph_chain(model)
        return seen, chain

    model = SharedAndDirect()
    model.gate = nn.Parameter(torch.full((8,), 3.0))  # a new object under an old name
    fast, chain = graphs()
    monkeypatch.setattr(trace._Tracer, "_name_of", lambda self, value: None)
    walked, _ = graphs()
    assert fast == walked and "embed_weight" in fast[0] and "scale" in fast[0]
    x = torch.randn(2, 8)
    assert torch.equal(chain(x), model(x))


class Renaming(nn.Module):
    """Moves a submodule to another name in its forward, after reading a buffer."""

    def __init__(self):
        super().__init__()
        self.old = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        x = x * self.scale
        if "old" in self._modules:
            self.new = self._modules.pop("old")
        return x @ self.new.weight


def test_a_forward_moving_its_submodules_is_refused_by_name_as_assigning_attributes():
    """The names the trace looked up before the move no longer lead anywhere: torch.fx's own
    walk decides, and the model is refused for what its forward assigns."""
    with pytest.raises(revnets.planning.NotAChainError, match="assign"):
        as_graph_chain(Renaming())


class CallCounter:
    """A callable object with state, which torch.fx keeps a leaf call (``torch.fx.wrap``)."""

    def __init__(self):
        self.__name__ = "counted_double"
        self.calls, self.seen = 0, []

    def __call__(self, x):
        self.calls += 1
        self.seen.append(tuple(x.shape))
        return 2 * x


counted_double = CallCounter()
torch.fx.wrap("counted_double")


class CallingCounted(Residual):
    def forward(self, x):
        return x + self.b(counted_double(torch.relu(self.a(x))))


def test_timing_the_forward_leaves_a_wrapped_callable_object_as_it_was():
    """A traced step's target may be the user's callable object with state: timing runs put it
    back as they put back what modules hold (found by a review)."""
    torch.manual_seed(0)
    model, x = Stack(CallingCounted), torch.randn(64, 32)
    assert any(s.target is counted_double for s in as_graph_chain(model))
    counted_double.calls, counted_double.seen = 0, []
    revnets.forward_times(model, x)
    assert counted_double.calls == 0 and counted_double.seen == []


class CountingStructured(Counting):
    """Names its own attributes as the planner's graph steps name what no run changes."""

    structure = frozenset({"calls", "seen", "last"})


@pytest.mark.parametrize("kind", [Counting, CountingStructured])
def test_timing_the_forward_leaves_what_kept_whole_modules_hold_as_it_was(kind):
    """Forward times are measured by running the chain for real: a kept-whole block's counter,
    cached features and list moved on with every timing run (found by a review). What the
    snapshot leaves out of a graph step is the step's alone, whatever a user's class calls its
    attributes."""
    torch.manual_seed(0)
    model, x = Stack(kind), torch.randn(1024, 32)
    budget = activation_budget(model, x, 0.95)  # a step of the model itself
    for block in model.blocks:
        block.calls, block.seen = 0, []
        del block.last
    revnets.forward_times(model, x)
    revnets.auto_checkpoint(model, x, budget)  # times measured too
    for block in model.blocks:
        assert block.calls == 0 and block.seen == [] and not hasattr(block, "last")
