"""State a module holds through plain objects and containers at any depth (NOTE [ What a module
holds ] in revnets/replay/held.py): one walk that the replay, the planner and the messages share.
Each case trains exactly as the same model without memory savings (``twin``), its state updated
once per step, or is refused by name."""

import dataclasses
import logging
import re
import types

import pytest
import torch
from test_held_state import Scale, Scaled, planned_at, planned_with_twin
from torch import nn

import revnets
from revnets import Reconstruct

from conftest import max_grad_error, rel_error, train_step, twin

# What a module holds through plain objects, at any depth, is state as a list's contents are
# (NOTE [ What a module holds ]): the replay, the planner and the messages follow one walk.


class Settings:
    """A plain object a module keeps its settings, a counter and a helper in."""

    def __init__(self, helper, inner=None):
        self.helper, self.inner, self.calls = helper, inner, 0


class HeldInSettings(nn.Module):
    """Calls a BatchNorm held in a plain object (without weights, which a reversible block
    would refuse, as not its own), and counts its calls in one 6 objects deep; the output
    follows the count through a saved tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.settings = Settings(nn.BatchNorm1d(4, affine=False))
        for _ in range(5):
            self.settings = Settings(self.settings.helper, inner=self.settings)

    def forward(self, x):
        deepest = self.settings
        while deepest.inner is not None:
            deepest = deepest.inner
        deepest.calls += 1
        scale = torch.tensor(1 + 0.1 * deepest.calls, dtype=x.dtype)
        return self.settings.helper(torch.tanh(self.lin(x))) * scale


def settings_state(model):
    found = []
    for m in model.modules():
        if isinstance(m, HeldInSettings):
            s, norm = m.settings, m.settings.helper
            while s.inner is not None:
                s = s.inner
            found += [s.calls, norm.num_batches_tracked.item(), *norm.running_mean.tolist(),
                      *norm.running_var.tolist()]
    return found


@pytest.mark.parametrize("reversible", [False, True], ids=["checkpointed", "reconstructed"])
def test_a_module_and_a_counter_held_through_plain_objects_are_updated_once_per_step(reversible):
    """The replay followed containers but not plain objects: the BatchNorm held in one ran its
    statistics twice per step, and the counter advanced twice, so the gradients were taken at
    the advanced count: silently other gradients."""
    torch.manual_seed(0)
    if reversible:
        model = revnets.ReversibleSequence(
            [revnets.ReversibleBlock(HeldInSettings(), HeldInSettings(), split_dim=-1)],
            Reconstruct(),
        ).double()
    else:
        model = nn.Sequential(revnets.Checkpointed(HeldInSettings()), nn.Linear(4, 2))
    model = model.double()
    for m in model.modules():
        if isinstance(m, HeldInSettings):
            m.settings.helper.double()
    reference = twin(model)
    x = torch.randn(5, 8 if reversible else 4, dtype=torch.float64)
    xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(3):
        for m, xi in zip((model, reference), xs):
            m(xi).square().sum().backward()
    assert rel_error(xs[0].grad, xs[1].grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10
    assert settings_state(model) == pytest.approx(settings_state(reference), rel=1e-10)


class CountsDeep(nn.Module):
    """Counts its calls in a plain object 6 objects deep; the output follows the count."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.settings = Settings(None)
        for _ in range(5):
            self.settings = Settings(None, inner=self.settings)

    def forward(self, x):
        deepest = self.settings
        while deepest.inner is not None:
            deepest = deepest.inner
        deepest.calls += 1
        return torch.tanh(self.lin(x)) * (1 + 0.1 * deepest.calls) + x


def deepest_calls(model):
    found = []
    for m in model.modules():
        if isinstance(m, CountsDeep):
            s = m.settings
            while s.inner is not None:
                s = s.inner
            found.append(s.calls)
    return found


def test_planning_finds_and_undoes_a_counter_held_deeper_than_four_objects():
    """The planner followed held state 4 objects deep: the trace's count went unseen, stayed
    advanced after planning, and was baked into the graph as a constant: the planned step's
    gradients were silently other than the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(*(CountsDeep() for _ in range(6)), nn.Linear(16, 1)).double()
    plain = twin(model)
    x = torch.randn(256, 16, dtype=torch.float64)
    assert deepest_calls(model) == [0] * 6
    planned = planned_at(model, x, 0.7)
    assert planned.memory_plan.parts  # a plan, not the model as it was
    assert deepest_calls(model) == [0] * 6
    for _ in range(2):
        for m in (planned, plain):
            m(x).square().sum().backward()
    assert max_grad_error(model, plain) <= 1e-10
    assert deepest_calls(model) == deepest_calls(plain) == [2] * 6


def test_a_refusal_names_a_module_held_through_a_plain_object_by_its_path():
    """Not followed, the held buffer written later was not refused: the recomputation read it
    as the later code left it, silently."""
    shared = Scale()
    first = Scaled(shared)
    first.shared, first.settings = [], Settings(shared)
    first.forward = lambda x: first.lin(x) * first.settings.helper.scale
    h = revnets.Checkpointed(first)(torch.randn(2, 4))
    shared.scale.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"settings\.helper\.scale was modified"):
        h.sum().backward()


class Reads(nn.Module):
    """Reads a tensor it holds in a list or in a plain object."""

    def __init__(self, holder):
        super().__init__()
        self.lin, self.holder = nn.Linear(4, 4), holder

    def forward(self, x):
        scale = self.holder[0] if isinstance(self.holder, list) else self.holder.cfg.scale
        return torch.tanh(self.lin(x)) * scale


@pytest.mark.parametrize("holder, name", [
    (lambda t: [t], r"holder\[0\]"),
    (lambda t: types.SimpleNamespace(cfg=types.SimpleNamespace(scale=t)), r"holder\.cfg\.scale"),
], ids=["list", "plain-object"])
def test_a_held_tensor_the_forward_read_and_later_code_wrote_is_refused_by_name(holder, name):
    """The recomputation read it as the later code left it: silently other gradients (0.28)."""
    scale = torch.full((4,), 1.5)
    h = revnets.Checkpointed(Reads(holder(scale)))(torch.randn(2, 4, requires_grad=True))
    scale.mul_(2.0)
    with pytest.raises(RuntimeError, match=name + " was modified in place between the forward"):
        h.sum().backward()


@dataclasses.dataclass(slots=True)
class SlottedCount:
    count: int = 0


class DictWithCount(dict):
    """A dict subclass that keeps a count as an attribute of its own."""

    def __init__(self):
        super().__init__()
        self.count = 0


class AttributeDict:
    """Slots only, attributes served by a ``__getattr__`` that raises KeyError (the walk must
    not call it)."""

    __slots__ = ("_d",)

    def __init__(self):
        object.__setattr__(self, "_d", {"count": 0})

    def __getattr__(self, key):
        return self._d[key]

    def __setattr__(self, key, value):
        self._d[key] = value

    def __deepcopy__(self, memo):
        copied = AttributeDict()
        object.__setattr__(copied, "_d", dict(self._d))
        return copied


class Counts(nn.Module):
    def __init__(self, counter):
        super().__init__()
        self.lin, self.counter = nn.Linear(4, 4), counter

    def forward(self, x):
        self.counter.count += 1
        return torch.tanh(self.lin(x)) * (1 + 0.1 * self.counter.count)


@pytest.mark.parametrize("counter", [SlottedCount, DictWithCount, AttributeDict],
                         ids=["dataclass-slots", "dict-subclass", "getattr-raises"])
def test_a_count_kept_in_slots_or_a_containers_own_attributes_advances_once_per_step(counter):
    """Slots and a dict subclass's own attributes were not followed: counted twice per step,
    the gradients taken at the advanced count; an object whose __getattr__ raises crashed."""
    torch.manual_seed(0)
    model = nn.Sequential(revnets.Checkpointed(Counts(counter())), nn.Linear(4, 2)).double()
    plain = twin(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):
        for m in (model, plain):
            m(x).square().sum().backward()
    assert max_grad_error(model, plain) <= 1e-10
    assert model[0].module.counter.count == plain[0].module.counter.count == 2


class Shares(nn.Module):
    """Holds a plain object every block shares, and a logger; the last block counts in it."""

    def __init__(self, shared, last):
        super().__init__()
        self.lin, self.shared, self.last = nn.Linear(16, 16), shared, last

    def forward(self, x):
        self.shared.log.debug("a block ran")  # fills the logger's cache on its first call
        if self.last:
            self.shared.ctx.calls += 1
        return torch.tanh(self.lin(x)) * (1 + 0.1 * self.shared.ctx.calls) + x


class SharesInALoop(nn.Module):
    def __init__(self):
        super().__init__()
        shared = types.SimpleNamespace(log=logging.getLogger("revnets.tests"),
                                       ctx=types.SimpleNamespace(calls=0))
        self.blocks = nn.ModuleList(Shares(shared, last=i == 5) for i in range(6))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_an_object_blocks_share_is_each_ones_and_a_count_the_graph_froze_is_refused_changed():
    """The shared object was credited to the first block alone: the last block's count was
    blamed on the model's own forward, which could then not be traced; and a logger reached
    every logger of the process, whose caches torch fills while tracing. Now the last block is
    kept whole; the others' graphs froze the count they read, so the step after it changed is
    refused by name, where they would have read the old count silently."""
    model, plain, x, planned = planned_with_twin(SharesInALoop, keep=0.8)
    assert model.blocks[0].shared.ctx.calls == 0  # as planning found it
    for m in (planned, plain):
        m(x).square().sum().backward()
    assert max_grad_error(model, plain) <= 1e-10
    assert model.blocks[0].shared.ctx.calls == plain.blocks[0].shared.ctx.calls == 1
    with pytest.raises(RuntimeError, match=r"blocks\.0\.shared\.ctx\.calls \(SimpleNamespace\) "
                                           r"is 1, 0 when planned"):
        planned(x)


# What a call is given is state too (NOTE [ Replay ], rule 2): a key-value cache an attention
# layer is handed and fills (transformers' DynamicCache), a list the forward appends to. The
# recomputation finds them as the forward did, and leaves them as the forward left them.


class KeyCache:
    """A plain object the forward fills, as transformers' DynamicCache: ``update`` appends the
    new keys and returns every key so far."""

    def __init__(self):
        self.keys = []

    def update(self, k):
        self.keys.append(k)
        return torch.cat(self.keys, dim=1)


class CachedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.key, self.value = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, cache, seen=None):
        keys = cache.update(self.key(x))
        if seen is not None:
            seen.append(keys.shape[1])
        weights = torch.softmax(x @ keys.transpose(1, 2), dim=-1)
        return weights @ torch.cat([self.value(x)] * (keys.shape[1] // x.shape[1]), dim=1)


@pytest.mark.parametrize("given_as", ["keyword", "positional"])
def test_a_cache_the_forward_fills_is_found_by_the_recomputation_as_the_forward_found_it(given_as):
    layer = CachedAttention().double()
    plain = twin(layer)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    caches, seen = (KeyCache(), KeyCache()), ([], [])
    for module, cache, lengths in zip((revnets.Checkpointed(layer), plain), caches, seen):
        if given_as == "keyword":
            out = module(x, cache=cache, seen=lengths)
        else:
            out = module(x, cache, lengths)
        out.square().sum().backward()
    # The recomputation ran on the cache as found (3 keys, not 6) and dropped what it added.
    assert len(caches[0].keys) == len(caches[1].keys) == 1
    assert seen[0] == seen[1] == [3]
    assert max_grad_error(layer, plain) < 1e-12


def test_a_planned_model_whose_layers_fill_a_cache_trains_as_the_model():
    """Plans of whole modules (a model torch.fx cannot trace): each layer is handed a cache
    among other arguments, as a Hugging Face decoder hands its layers ``past_key_values``."""

    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(CachedAttention() for _ in range(3))

        def forward(self, x):
            if x.shape[0] > 1:  # control flow on a shape: torch.fx cannot trace it
                for layer in self.layers:
                    x = x + layer(x, cache=KeyCache())
            return x

    model = Untraceable().double()
    plain = twin(model)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="checkpoints of whole modules"):
        with pytest.raises(revnets.PlanningError) as refused:
            revnets.auto_checkpoint(model, x, 1, measure_time=False)
        least = int(re.search(r"\((\d+) bytes", str(refused.value))[1])
        planned = revnets.auto_checkpoint(model, x, least, measure_time=False)
    checkpointed = {part.name for part in planned.memory_plan.parts
                    if isinstance(part.decision, revnets.Checkpoint)}
    assert {"layers.0", "layers.1", "layers.2"} <= checkpointed
    train_step(planned, x)
    train_step(plain, x)
    assert max_grad_error(model, plain) < 1e-12
