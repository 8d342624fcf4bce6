"""State a recomputed module holds outside its registered submodules (NOTE [ Replay ], rule 2):
helpers in a plain list, Python lists and dicts changed in place, a reference to the parent.
Each trains exactly as the same model without memory savings (``twin``), its state updated once
per step, or is refused by name."""

import pytest
import torch
from torch import nn

import revnets
from revnets import Reconstruct

from conftest import max_grad_error, rel_error, twin


def planned_at(model, x, keep):
    """``model`` as auto_checkpoint plans it within ``keep`` of its predicted peak."""
    peak = revnets.predict_memory(lambda m, x: m(x).sum().backward(), model, x).peak_bytes
    return revnets.auto_checkpoint(model, x, budget=int(keep * peak), measure_time=False,
                                   loss_fn=lambda out: out.sum())


class Helper(nn.Module):
    """A module its users keep unregistered (in a plain list): a Python counter, a tensor
    attribute reassigned, a frozen layer; its output depends on the counter through a tensor
    that autograd saves, so a recomputation that counts again computes other gradients."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.last = torch.zeros(())
        self.lin = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x):
        self.calls += 1
        self.last = self.last + x.detach().mean()
        return self.lin(x) * torch.tensor(1 + 0.1 * self.calls, dtype=x.dtype)


class Unit(nn.Module):
    """Keeps a history (a list appended to), counters in a dict and a nested list, and calls a
    helper held in a plain list; all of it scales the output through a saved tensor."""

    def __init__(self, helper):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.helpers = [helper]
        self.history = []
        self.stats = {"calls": 0, "seen": []}

    def forward(self, x):
        self.history.append(len(self.history))
        self.stats["calls"] += 1
        self.stats["seen"].append(x.shape[0])
        scale = len(self.history) + self.stats["calls"] + len(self.stats["seen"])
        return self.helpers[0](torch.tanh(self.lin(x))) * torch.tensor(scale, dtype=x.dtype)


def held_state(model):
    units = [m for m in model.modules() if isinstance(m, Unit)]
    helper = units[0].helpers[0]
    return (helper.calls, helper.last.item(), [len(u.history) for u in units],
            [u.stats["calls"] for u in units], [len(u.stats["seen"]) for u in units])


def reversible_model():
    helper = Helper()
    blocks = [revnets.ReversibleBlock(Unit(helper), Unit(helper), split_dim=-1) for _ in range(3)]
    return revnets.ReversibleSequence(blocks, Reconstruct())


def checkpointed_model():
    helper = Helper()
    return nn.Sequential(
        revnets.Checkpointed(nn.Sequential(Unit(helper), nn.Tanh())), revnets.Checkpointed(
            Unit(helper)
        ), nn.Linear(4, 8),
    )


@pytest.mark.parametrize("build", [reversible_model, checkpointed_model],
                         ids=["reconstructed", "checkpointed"])
def test_state_held_outside_registered_submodules_is_updated_once_per_step(build):
    """Recomputed, the counters and histories advanced twice per step and the gradients were
    taken at the advanced values: other gradients, silently."""
    torch.manual_seed(0)
    model = build().double()
    for m in model.modules():
        if isinstance(m, Unit):
            m.helpers[0].double()
    reference = twin(model)
    x = torch.randn(5, 8 if build is reversible_model else 4, dtype=torch.float64)
    xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(3):
        for m, xi in zip((model, reference), xs):
            m(xi).square().sum().backward()
    assert rel_error(xs[0].grad, xs[1].grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10
    assert held_state(model) == held_state(reference)


def test_a_forward_hook_on_a_helper_held_unregistered_fires_once_per_step():
    helper = Helper().double()
    fired = []
    helper.register_forward_hook(lambda m, args, out: fired.append(m.calls))
    model = revnets.Checkpointed(Unit(helper)).double()
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert fired == [1]


class Parent(nn.Module):
    """Checkpoints a child that holds the parent back (a plain reference, as callbacks do) and its
    neighbour, which runs after it. The parent and the neighbour change their own state after the
    child ran: that is the rest of the forward, no reason to refuse the child's recomputation,
    which reads the parent's numbers and lists as the child's forward read them."""

    def __init__(self):
        super().__init__()
        self.child = revnets.Checkpointed(Child(self))
        self.neighbour = Counted()
        self.child.module.neighbour = [self.neighbour]
        self.register_buffer("seen", torch.zeros(()))
        self.steps = 0
        self.log = []

    def forward(self, x):
        h = self.neighbour(self.child(x))
        self.steps += 1
        self.log.append(self.steps)
        self.summary = h.detach().mean()  # reassigned after the child ran
        self.seen += 1  # written in place after the child ran
        return h


class Child(Unit):
    """Reads the parent's step count and log, which the parent advances after calling it."""

    def __init__(self, parent):
        super().__init__(Helper())
        self.owner = [parent]

    def forward(self, x):
        parent = self.owner[0]
        scale = torch.tensor(1.0 + parent.steps + len(parent.log), dtype=x.dtype)
        return super().forward(x) * scale


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.lin(x)


def test_a_parent_and_a_neighbour_held_by_a_checkpointed_child_keep_their_own_updates():
    model = Parent().double()
    model.child.module.helpers[0].double()
    reference = twin(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    for m in (model, reference):
        for _ in range(2):
            out = m(x)
            handle = m.register_forward_pre_hook(lambda *args: None)  # the parent never reruns
            out.sum().backward()
            handle.remove()
    assert max_grad_error(model, reference) <= 1e-10
    for m in (model, reference):
        assert (m.steps, m.seen.item(), m.neighbour.count.item()) == (2, 2, 2)
    assert held_state(model) == held_state(reference)


class Scaled(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.shared = [shared]

    def forward(self, x):
        return self.lin(x) * self.shared[0].scale


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))


def test_a_held_buffer_read_by_the_run_and_written_later_is_refused_by_name():
    """The recomputation would read the buffer as the later code left it: silently other
    gradients. A held buffer the run does not read may change freely (the parent above). The
    refusal names the buffer by the path it is held through; it named its class alone."""
    shared = Scale()
    first = revnets.Checkpointed(Scaled(shared))
    h = first(torch.randn(2, 4))
    shared.scale.mul_(2.0)  # a later part of the forward
    with pytest.raises(RuntimeError, match=r"shared\[0\]\.scale was modified in place between "
                                           r"the forward pass and backward"):
        h.sum().backward()


class Configured(nn.Module):
    """Reads a list and a dict it does not change; an LRU-style dict whose order it changes; and a
    neighbour's tensor attribute, which the neighbour reassigns later in the forward."""

    def __init__(self, neighbour):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scales, self.cfg = [1.0], {"s": 1.0}
        self.cache = {"a": 1.0, "b": 3.0}
        self.neighbour = [neighbour]

    def forward(self, x):
        oldest = next(iter(self.cache))
        self.cache[oldest] = self.cache.pop(oldest)  # now the newest: same keys, other order
        scale = self.scales[0] * self.cfg["s"] * self.cache[oldest]
        last = self.neighbour[0].last
        return torch.tanh(self.lin(x) + last) * torch.tensor(scale, dtype=x.dtype)


class Averaging(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last = torch.zeros(4, dtype=torch.float64)

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        self.last = y.detach().mean(0)
        return y


def gradients_when_read_state_changes_after_the_forward(checkpointed):
    torch.manual_seed(0)
    neighbour = Averaging().double()
    first = Configured(neighbour).double()
    model = nn.Sequential(revnets.Checkpointed(first) if checkpointed else first, neighbour)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    grads = []
    for _ in range(2):
        y = model(x)
        first.scales[0] += 1.0  # a schedule, between forward and backward
        first.cfg["s"] *= 2.0
        hook = neighbour.register_forward_pre_hook(lambda *args: None)  # a profiler, say
        y.square().sum().backward()
        hook.remove()
        grads.append(torch.cat([x.grad.flatten(), first.lin.weight.grad.flatten()]))
        x.grad = None
        model.zero_grad()
    return grads


def test_what_the_forward_read_is_replayed_as_it_read_it_whatever_changes_it_later():
    """The recomputation read the list and dict as changed after the forward, the dict in its new
    order, and the neighbour's reassigned attribute (refused as a swapped weight), and a hook on
    the neighbour, which the checkpointed module never calls, was refused: other gradients or a
    refusal, where ordinary autograd uses what the forward read."""
    checkpointed = gradients_when_read_state_changes_after_the_forward(checkpointed=True)
    plain = gradients_when_read_state_changes_after_the_forward(checkpointed=False)
    for a, b in zip(checkpointed, plain):
        assert rel_error(a, b) <= 1e-10


class Shared(nn.Module):
    """One helper every unit calls, held unregistered; its output follows its call count."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16).requires_grad_(False)
        self.calls, self.seen = 0, []

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.shape[0])
        return torch.tanh(self.lin(x)) * torch.tensor(1 + 0.1 * self.calls, dtype=x.dtype)


class CallsShared(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.lin, self.shared = nn.Linear(16, 16), [shared]

    def forward(self, x):
        return self.shared[0](torch.tanh(self.lin(x))) + x


def test_planning_leaves_a_helper_held_unregistered_as_it_found_it():
    """Planning ran the model several times and put back the state of its registered modules
    only: the helper's count stood at 6 calls after auto_checkpoint."""
    torch.manual_seed(0)
    shared = Shared().double()
    model = nn.Sequential(*(CallsShared(shared) for _ in range(6)), nn.Linear(16, 1)).double()
    x = torch.randn(64, 16, dtype=torch.float64)
    assert (shared.calls, shared.seen) == (0, [])
    planned = planned_at(model, x, 0.85)
    assert planned is not model  # a plan, run through the helper's calls
    assert (shared.calls, shared.seen) == (0, [])


class LogsAndCallsShared(CallsShared):
    """Keeps a log, so the planner keeps it whole."""

    def __init__(self, shared):
        super().__init__(shared)
        self.log = []

    def forward(self, x):
        self.log.append(x.shape[0])
        return super().forward(x)


class SharedOnRoot(nn.Module):
    """The helper registered on the model too (for its state_dict), called by whole blocks
    that hold it in a plain list."""

    def __init__(self):
        super().__init__()
        self.shared = Shared()
        self.blocks = nn.Sequential(*(LogsAndCallsShared(self.shared) for _ in range(6)))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def planned_with_twin(kind, keep=0.7):
    """A model of ``kind`` in float64, its unplanned twin, an input, and the model planned
    within ``keep`` of its predicted peak (a plan, not the model as it was)."""
    torch.manual_seed(0)
    model = kind().double()
    plain = twin(model)
    x = torch.randn(512, 16, dtype=torch.float64)
    planned = planned_at(model, x, keep)
    assert planned.memory_plan.parts
    return model, plain, x, planned


def test_a_helper_registered_on_the_model_and_called_by_whole_blocks_keeps_counting():
    """The trace never read the helper's counter (only kept-whole blocks call the helper,
    through a plain list), so nothing it froze changes as the helper counts: step after step,
    the planned model runs with the gradients and the count of the model itself."""
    model, plain, x, planned = planned_with_twin(SharedOnRoot)
    for _ in range(3):
        for m in (planned, plain):
            m.zero_grad()
            m(x).square().sum().backward()
        assert max_grad_error(model, plain) <= 1e-10
    assert model.shared.calls == plain.shared.calls == 18


class Logger(nn.Module):
    """A helper keeping a log of its inputs' sizes, its output independent of the log."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16).requires_grad_(False)
        self.seen = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return torch.tanh(self.lin(x))


class LoggerOnRoot(SharedOnRoot):
    def __init__(self):
        super().__init__()
        self.shared = Logger()
        self.blocks = nn.Sequential(*(LogsAndCallsShared(self.shared) for _ in range(6)))


def test_a_helper_registered_on_the_model_keeps_its_log_in_planned_steps():
    """A list the helper of kept-whole blocks appends to each call is its own state, not
    something the model's trace froze (the trace never entered it): planned steps run, step
    after step, with the gradients and the log of the model itself."""
    model, plain, x, planned = planned_with_twin(LoggerOnRoot)
    for _ in range(2):
        for m in (planned, plain):
            m.zero_grad()
            m(x).square().sum().backward()
        assert max_grad_error(model, plain) <= 1e-10
    assert model.shared.seen == plain.shared.seen


class Scaling(nn.Module):
    """Code that reads a number, which a trace through it freezes."""

    def __init__(self):
        super().__init__()
        self.lin, self.k = nn.Linear(16, 16), 0.1

    def forward(self, x):
        return torch.tanh(self.lin(x)) * (1 + self.k)


class CallsScaling(LogsAndCallsShared):
    """Kept whole (it keeps a log), calling the model's Scaling through a plain list."""


class TracedAndCalledWhole(nn.Module):
    """``scaling`` is traced through by the model's own forward and called whole by blocks."""

    def __init__(self):
        super().__init__()
        self.scaling = Scaling()
        self.blocks = nn.Sequential(*(CallsScaling(self.scaling) for _ in range(6)))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.blocks(self.scaling(x) + x))


@pytest.mark.parametrize("after_planning", ["number", "hook"])
def test_a_module_traced_through_and_also_called_whole_is_still_refused_once_changed(
        after_planning):
    """Whatever else calls it, a module the trace went into runs as its graph there: a number
    its code reads changed after planning, or a hook added, would be silently wrong there."""
    torch.manual_seed(0)
    model = TracedAndCalledWhole().double()
    x = torch.randn(512, 16, dtype=torch.float64)
    planned = planned_at(model, x, 0.7)
    assert planned.memory_plan.parts
    planned(x).sum().backward()
    if after_planning == "number":
        model.scaling.k = 0.5
        match = r"scaling\.k \(Scaling\) is 0\.5, 0\.1 when planned"
    else:
        model.scaling.register_forward_hook(lambda m, args, out: None)
        match = r"a hook is registered on scaling \(Scaling\), which the plan runs as its traced"
    with pytest.raises(RuntimeError, match=match):
        planned(x)


class Unprintable:
    def __repr__(self):
        raise ValueError("no repr")


def test_a_refusal_names_a_module_held_under_a_key_it_cannot_print():
    """Naming the held buffer called the key's repr, whose error replaced the refusal."""
    shared = Scale()
    first = Scaled(shared)
    first.shared = {Unprintable(): shared, "n": 1}
    first.forward = lambda x: first.lin(x) * next(iter(first.shared.values())).scale
    h = revnets.Checkpointed(first)(torch.randn(2, 4))
    shared.scale.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"shared\[<Unprintable>\]\.scale was modified"):
        h.sum().backward()


class Encoder(nn.Module):
    """U-Net style: pushes its output onto a list shared with its decoder, which pops it; a
    history list reassigned, a mode string, and a counter created on the first call."""

    def __init__(self, skips):
        super().__init__()
        self.lin, self.skips = nn.Linear(4, 4), skips
        self.history, self.mode = [], "a"

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        self.history.append(1)
        y = torch.tanh(self.lin(x))
        self.skips.append(y)
        scale = self.calls + len(self.history) + len(self.skips) + (self.mode == "a")
        return y * torch.tensor(float(scale), dtype=x.dtype)


class Decoder(nn.Module):
    def __init__(self, skips):
        super().__init__()
        self.lin, self.skips = nn.Linear(4, 4), skips

    def forward(self, x):
        return torch.tanh(self.lin(x)) + self.skips.pop()


def test_state_the_rest_of_the_step_changes_back_or_reassigns_is_read_as_the_forward_read_it():
    """The skip list the decoder emptied again kept the recomputation's push (a leak, and other
    gradients from the next step); a history list or mode string reassigned between forward and
    backward was read as reassigned; a counter the first call created counted twice."""
    grads = {}
    for checkpointed in (True, False):
        torch.manual_seed(0)
        skips = []
        encoder = Encoder(skips).double()
        model = nn.Sequential(revnets.Checkpointed(encoder) if checkpointed else encoder,
                              Decoder(skips)).double()
        x = torch.randn(3, 4, dtype=torch.float64)
        for step in range(3):
            out = model(x)
            encoder.history, encoder.mode = [], "b" if step % 2 else "a"
            out.square().sum().backward()
            assert skips == []
        grads[checkpointed] = [p.grad.clone() for p in model.parameters()]
        assert encoder.calls == 3
    for a, b in zip(grads[True], grads[False]):
        assert rel_error(a, b) <= 1e-10


class Backref(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x):
        return torch.tanh(self.norm(self.lin(x))) + x


class HeldBack(nn.Module):
    """Blocks that hold the model back (``block.root = [model]``, never read); a step counter
    keeps fx from tracing it, so it is planned as checkpoints of the modules it calls."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Backref() for _ in range(6))
        for block in self.blocks:
            block.root = [self]
        self.head, self.step = nn.Linear(16, 1), 0

    def forward(self, x):
        self.step += 1
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_block_holding_the_model_back_is_still_checkpointed():
    """Following held modules, the planner's snapshot of each block held the whole model, whose
    later BatchNorms made every block look written: nothing could be checkpointed."""
    torch.manual_seed(0)
    model, x = HeldBack(), torch.randn(2048, 16)
    peak = revnets.predict_memory(lambda m, x: m(x).sum().backward(), model, x).peak_bytes
    with pytest.warns(UserWarning):
        planned = revnets.auto_checkpoint(model, x, budget=int(0.7 * peak), measure_time=False,
                                          loss_fn=lambda out: out.sum())
    assert any(part.name.startswith("blocks.") for part in planned.memory_plan.parts)


class Owner(nn.Module):
    """Checkpoints a child that reads the owner's tensor attribute, which the owner reassigns
    after calling it (a running summary)."""

    def __init__(self):
        super().__init__()
        self.child = revnets.Checkpointed(Reader(self))
        self.summary = torch.ones(4, dtype=torch.float64)

    def forward(self, x):
        h = self.child(x)
        self.summary = 1 + h.detach().mean(0)
        return h


class Reader(nn.Module):
    def __init__(self, owner):
        super().__init__()
        self.lin, self.owner = nn.Linear(4, 4), [owner]

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.owner[0].summary)


def test_a_parent_s_tensor_the_child_read_is_replayed_as_read():
    """The recomputation read the summary as the owner reassigned it after the child ran."""
    torch.manual_seed(0)
    model = Owner().double()
    reference = twin(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    for m in (model, reference):
        for _ in range(2):
            m(x).square().sum().backward()
    assert max_grad_error(model, reference) <= 1e-10


class Rated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.rate = nn.Linear(16, 16), 0.1

    def run(self, x):
        return torch.tanh(self.lin(x)) * (1 + self.rate) + x

    forward = run


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 0.1


class Looped(nn.Module):
    """Runs blocks from a ModuleList (indexed, never called), the last through a method of its
    own (traced without a module call), and reads a number of a module it never calls."""

    def __init__(self):
        super().__init__()
        self.blocks, self.cfg = nn.ModuleList(Rated() for _ in range(6)), Holder()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks[:-1]:
            x = block(x)
        return self.head(self.blocks[-1].run(x) * (1 + self.cfg.scale))


@pytest.mark.parametrize("change, match", [
    (lambda m: m.blocks.__setitem__(2, Rated().double()), r"blocks\.2 \(ModuleList\) is another"),
    (lambda m: setattr(m.blocks[5], "rate", 0.5), r"blocks\.5\.rate \(Rated\) is 0\.5, 0\.1"),
    (lambda m: setattr(m.cfg, "scale", 0.5), r"cfg\.scale \(Holder\) is 0\.5, 0\.1"),
], ids=["list-entry-replaced", "number-of-a-block-run-by-a-method", "number-its-parent-reads"])
def test_what_the_trace_froze_of_modules_it_read_without_calling_is_refused_once_changed(
        change, match):
    """Taken as traced only where the trace went into a module, these were not watched after
    planning: the plan ran the old block or the old number, silently (gradients 0.6-4 off)."""
    torch.manual_seed(0)
    model = Looped().double()
    x = torch.randn(512, 16, dtype=torch.float64)
    planned = planned_at(model, x, 0.7)
    assert planned.memory_plan.parts
    planned(x).sum().backward()
    change(model)
    with pytest.raises(RuntimeError, match=match):
        planned(x)
