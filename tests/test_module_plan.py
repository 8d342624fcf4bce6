"""A model torch.fx cannot trace is planned as checkpoints of whole modules its own forward
calls (NOTE [ Plans of whole modules ]): measured == predicted within the budget, training
exactly as the model itself does, and left as it was."""

import inspect
import random
import threading

import pytest
import torch
from torch import nn

import revnets
from revnets.facts.operators import SELECTIVE_OPS
from revnets.memory import measure_memory
from revnets.planning import CheckpointedModules

from conftest import activation_budget, train_step


def mlp(width: int, activation: nn.Module | None = None) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 4 * width), activation or nn.Tanh(),
                         nn.Linear(4 * width, width))


class Exchange(nn.Module):
    """Two streams that feed each other, taking and returning a list (as CrossViT's blocks),
    skipped at random in training (stochastic depth drawn with Python's ``random``)."""

    def __init__(self, width: int, skip: float):
        super().__init__()
        self.skip = skip
        self.a, self.b = (nn.Sequential(nn.Linear(width, 4 * width), nn.BatchNorm1d(4 * width),
                                        nn.GELU(), nn.Dropout(0.2), nn.Linear(4 * width, width))
                          for _ in range(2))
        self.gain = 1.5  # read by the model's own forward, through whatever stands here

    def forward(self, xs):
        a, b = xs
        if self.training and random.random() < self.skip:
            return [a, b]
        return [a + self.a(b), b + self.b(a)]


class TwoStreams(nn.Module):
    """Its forward picks a path by a shape: torch.fx cannot trace it."""

    def __init__(self, width: int = 32, depth: int = 4, skip: float = 0.0):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Exchange(width, skip) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.stem(x)
        xs = [h, h.flip(0)] if h.shape[0] > 1 else [h, h]
        for block in self.blocks:
            xs = block(xs)
        return self.head(xs[0] + xs[1]) * self.blocks[0].gain


def untraceable(dtype=torch.float32, skip=0.0):
    """A skip drawn makes every step's peak a draw: planned at 0, peaks are exact."""
    torch.manual_seed(0)
    return TwoStreams(skip=skip).to(dtype), torch.randn(256, 8, dtype=dtype)


def plan(model, x, budget):
    with pytest.warns(UserWarning, match="TwoStreams cannot be traced.*whole modules"):
        return revnets.auto_checkpoint(model, x, budget)


def unplanned_peak(model, x):
    return measure_memory(train_step, model, x).peak_bytes


def test_a_model_fx_cannot_trace_is_planned_as_checkpoints_of_the_modules_it_calls():
    model, x = untraceable()
    unplanned = unplanned_peak(model, x)
    budget = activation_budget(model, x, 0.5)
    planned = plan(model, x, budget)
    assert isinstance(planned, CheckpointedModules) and planned.model is model
    assert planned.memory_plan.parts and all(
        isinstance(part.decision, revnets.Checkpoint) for part in planned.memory_plan.parts)
    measured = measure_memory(train_step, planned, x).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= budget < unplanned


def test_its_training_steps_are_the_model_s_own_gradients_buffers_draws_and_hooks():
    model, x = untraceable(torch.float64, skip=0.3)
    for block in model.blocks:  # planned with every block run: a budget drawn is no budget
        block.skip = 0.0
    planned = plan(model, x, activation_budget(model, x, 0.5))
    for block in model.blocks:
        block.skip = 0.3
    calls = []
    model.blocks[1].register_forward_hook(lambda *args: calls.append(1))

    def steps(trained):
        torch.manual_seed(1)
        random.seed(1)
        grads = []
        for _ in range(3):
            train_step(trained, x)
            grads.append([p.grad for p in model.parameters()])  # None in a block skipped
        return grads, [b.clone() for b in model.buffers()], random.random(), len(calls)

    buffers = [b.clone() for b in model.buffers()]
    own = steps(model)
    for b, saved in zip(model.buffers(), buffers):
        b.copy_(saved)
    calls.clear()
    theirs = steps(planned)
    for own_step, their_step in zip(own[0], theirs[0]):
        assert [a is None for a in own_step] == [b is None for b in their_step]
        assert max((a - b).abs().max().item() for a, b in zip(own_step, their_step)
                   if a is not None) < 1e-10
    assert all(torch.equal(a, b) for a, b in zip(own[1], theirs[1]))  # BatchNorm, once a step
    assert own[2:] == theirs[2:]  # Python's generator drawn as often; the hook ran once a step


def test_outside_training_steps_the_model_itself_runs_and_no_module_stays_swapped():
    model, x = untraceable()
    modules = dict(model.named_modules())
    planned = plan(model, x, activation_budget(model, x, 0.5))
    train_step(planned, x)
    with torch.no_grad():
        torch.manual_seed(1)
        no_grad = planned(x)
        torch.manual_seed(1)
        assert torch.equal(no_grad, model(x))
    planned.eval()
    assert not model.training and torch.equal(planned(x), model(x))
    planned.train()
    model.blocks[2].b[0].weight.data = torch.randn(1, 1)  # the step fails in the model's code
    with pytest.raises(RuntimeError):
        train_step(planned, x)
    assert dict(model.named_modules()) == modules
    assert list(planned.state_dict()) == list(model.state_dict())


def test_a_refusal_names_a_budget_that_then_plans_the_same_way_every_time():
    model, x = untraceable()
    with pytest.raises(revnets.PlanningError) as refused:
        plan(model, x, 10**5)
    smallest = refused.value.smallest_budget
    first, again = plan(model, x, smallest), plan(model, x, smallest)
    assert first.names == again.names
    assert measure_memory(train_step, first, x).peak_bytes == first.memory_plan.peak_bytes
    assert first.memory_plan.peak_bytes <= smallest


def test_a_smaller_budget_never_gets_a_higher_peak():
    model, x = untraceable()
    unplanned = unplanned_peak(model, x)
    with pytest.raises(revnets.PlanningError) as refused:
        plan(model, x, 10**5)
    low = refused.value.smallest_budget
    peaks = [measure_memory(train_step, plan(model, x, int(low + share * (unplanned - low))),
                            x).peak_bytes for share in (0.0, 0.2, 0.4, 0.6, 0.8)]
    assert peaks == sorted(peaks) and len(set(peaks)) > 1


def test_a_model_that_fits_as_it_is_comes_back_as_itself():
    model, x = untraceable()
    unplanned = unplanned_peak(model, x)
    planned = plan(model, x, unplanned)
    assert planned is model and model.memory_plan.peak_bytes == unplanned


def test_forward_times_of_an_untraceable_model_are_empty_and_plan_as_no_times_do():
    model, x = untraceable()
    times = revnets.forward_times(model, x)
    assert times.steps == ()
    budget = activation_budget(model, x, 0.5)
    with pytest.warns(UserWarning):
        timed = revnets.auto_checkpoint(model, x, budget, measure_time=times)
    assert timed.names == plan(model, x, budget).names


class Gated(nn.Module):
    """A block whose attributes its model's code reads and writes; two of its names are also
    ``Checkpointed``'s (a buffer ``memory``, a submodule ``module``)."""

    def __init__(self, width: int):
        super().__init__()
        self.body = mlp(width, nn.GELU())
        self.module = nn.Linear(width, width)
        self.register_buffer("memory", torch.full((), 0.5, dtype=torch.float64))
        self.scale = 1.0

    def forward(self, x, gate=1.0):
        y = self.body(x) * self.scale * gate
        self.aux = y.pow(2).mean()  # an auxiliary loss, summed by the model
        return self.module(x) + y * self.memory


class Peeking(nn.Module):
    """Its forward looks at its blocks: their type, mode and attributes, and every module's
    auxiliary loss (``self.modules()``); and it cannot be traced."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Gated(width) for _ in range(4))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h
        for block in self.blocks:
            block.scale = block.scale * 0.5
            h = block(h, gate=2.0) if isinstance(block, Gated) and "gate" in inspect.signature(
                block.forward).parameters else block(h)
            h = h if block.training else 2 * h
            h = h * block.memory
        aux = sum(m.aux for m in self.modules() if hasattr(m, "aux"))
        return self.head(h) + aux


def test_the_model_s_code_sees_its_own_modules_in_a_planned_step():
    """Checkpointed blocks stay what they are to the model's code: their type, mode, attributes
    (also those named as a Checkpointed's), what it writes to them, their forward's signature,
    and ``self.modules()`` (a
    stand-in swapped in at their parent had the model's code take other branches, count each
    auxiliary loss twice and write to the stand-in: other gradients, silently)."""
    torch.manual_seed(0)
    model, x = Peeking().double(), torch.randn(256, 8, dtype=torch.float64)
    model.blocks[1].eval()
    with pytest.warns(UserWarning, match="Peeking cannot be traced"):
        planned = revnets.auto_checkpoint(model, x, activation_budget(model, x, 0.5))
    assert any(name.startswith("blocks.") for name in planned.names)
    runs = {}
    for name, trained in (("model", model), ("planned", planned)):
        for block in model.blocks:
            block.scale = 1.0
        model.zero_grad(set_to_none=True)
        out = trained(x)
        out.sum().backward()
        runs[name] = (out.detach(), [p.grad for p in model.parameters()],
                      [block.scale for block in model.blocks])
    (out, grads, scales), (planned_out, planned_grads, planned_scales) = runs.values()
    assert torch.equal(out, planned_out) and scales == planned_scales == [0.5] * 4
    assert max((a - b).abs().max().item() for a, b in zip(grads, planned_grads)) < 1e-10


class KeepsItsOutput(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        self.out = x + self.b(torch.tanh(self.a(x)))  # read by the caller; nothing returned


class OutputsKept(TwoStreams):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(KeepsItsOutput(32) for _ in range(4))

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h
        for block in self.blocks:
            block(h)
            h = block.out
        return self.head(h)


@pytest.mark.parametrize("refused_first", [False, True])
def test_a_module_keeping_its_output_on_itself_is_predicted_to_the_byte(refused_first):
    """Each block holds its last output from one step to the next. The real run frees the old
    one once the block's checkpoint no longer needs it; the prediction held its fake for the
    whole step (a block's output per block above the measure). After a refusal, the
    refusal's traceback held the old outputs until Python's cycle collector ran, and the next
    step measured them (a block's output per block above the prediction)."""
    torch.manual_seed(0)
    model, x = OutputsKept(), torch.randn(256, 8)
    train_step(model, x)  # every block now holds an output
    budget = activation_budget(model, x, 0.5 if refused_first else 0.8)
    with pytest.warns(UserWarning, match="OutputsKept cannot be traced"):
        if refused_first:
            with pytest.raises(revnets.PlanningError) as refusal:
                revnets.auto_checkpoint(model, x, budget)
            budget = refusal.value.smallest_budget
            del refusal
        planned = revnets.auto_checkpoint(model, x, budget)
    assert any(name.startswith("blocks.") for name in planned.names)
    assert measure_memory(train_step, planned, x).peak_bytes == planned.memory_plan.peak_bytes


class WritesItsInput(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = mlp(width)

    def forward(self, x):
        x += 1.0  # in place: a checkpoint would recompute from the written input
        return x + self.body(x)


class InPlaceBlocks(TwoStreams):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(WritesItsInput(32) for _ in range(4))

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h
        for block in self.blocks:
            h = block(h.clone())
        return self.head(h)


def test_a_module_that_writes_its_input_in_place_is_never_checkpointed():
    """Checkpointed, its recomputation read the written input (torch raised from inside the
    backward, naming no module)."""
    torch.manual_seed(0)
    model, x = InPlaceBlocks(), torch.randn(256, 8)
    with pytest.warns(UserWarning):
        planned = revnets.auto_checkpoint(model, x, activation_budget(model, x, 0.7))
    assert planned.names and not any(name.count(".") == 1 for name in planned.names)
    assert measure_memory(train_step, planned, x).peak_bytes == planned.memory_plan.peak_bytes


class SharedInside(nn.Module):
    """One Sequential registered in two places, first named inside another module."""

    def __init__(self, width: int = 32):
        super().__init__()
        shared = mlp(width)
        self.outer = nn.Sequential(nn.Linear(width, width), shared)
        self.first = shared
        self.stem, self.head = nn.Linear(8, width), nn.Linear(width, 3)

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h
        return self.head(self.outer(self.first(h)))


def test_no_module_is_checkpointed_inside_another_one():
    """``outer.1`` is first called by the model itself, at the depth of ``outer``: planning
    both crashed swapping one inside the other (KeyError)."""
    torch.manual_seed(0)
    model, x = SharedInside(), torch.randn(512, 8)
    unplanned = unplanned_peak(model, x)
    for share in (0.95, 0.8, 0.6):
        try:
            with pytest.warns(UserWarning):
                planned = revnets.auto_checkpoint(model, x, int(share * unplanned))
        except revnets.PlanningError:
            continue
        chosen = [model.get_submodule(name) for name in planned.names]
        assert not any(a is not b and any(b is m for m in a.modules())
                       for a in chosen for b in chosen)
        assert measure_memory(train_step, planned, x).peak_bytes == planned.memory_plan.peak_bytes


class ReversibleInside(TwoStreams):
    def __init__(self, memory):
        super().__init__()
        self.middle = revnets.ReversibleSequence([revnets.ReversibleBlock(
            nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)),
            nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)))
            for _ in range(3)], memory=memory)

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h
        return self.head(self.middle(h))


@pytest.mark.parametrize("memory", [revnets.Reconstruct(), revnets.Store()])
def test_an_untraceable_model_holding_a_reversible_sequence_is_planned_or_refused_by_budget(
        memory):
    """The engine calls its blocks' pre-hooks itself, without keywords: profiling crashed.
    Storing, a refusal named twice the budget a plan met at a larger one (the floor the model
    ranked lowest was not)."""
    torch.manual_seed(0)
    model, x = ReversibleInside(memory), torch.randn(512, 8)
    unplanned = unplanned_peak(model, x)
    peaks, named = [], []
    for share in (0.9, 0.7, 0.6, 0.5, 0.4):
        try:
            with pytest.warns(UserWarning):
                planned = revnets.auto_checkpoint(model, x, int(share * unplanned))
        except revnets.PlanningError as refused:
            named.append(refused.smallest_budget)
            with pytest.warns(UserWarning):
                planned = revnets.auto_checkpoint(model, x, refused.smallest_budget)
        peaks.append(measure_memory(train_step, planned, x).peak_bytes)
        assert peaks[-1] == planned.memory_plan.peak_bytes
    assert named and max(named) <= min(peaks)


def test_a_checkpointed_module_s_own_hooks_run_once_around_it():
    model, x = untraceable()
    calls = []
    planned = plan(model, x, activation_budget(model, x, 0.5))
    module = model.get_submodule(planned.names[0])
    module.register_forward_pre_hook(lambda *args: calls.append("pre"))
    module.register_forward_hook(lambda *args: calls.append("forward"))
    train_step(planned, x)
    assert calls == ["pre", "forward"]


class Shifted(nn.Module):
    """Its first step saves nothing of its input."""

    def __init__(self, width: int):
        super().__init__()
        self.body = mlp(width)

    def forward(self, input):
        return self.body(input + 1.0)


class Configured(nn.Module):
    """Blocks reading a setting their model changes after calling them (a config dict), and
    blocks taking their input by keyword, which the loss then writes in place."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.stem, self.head = nn.Linear(8, width), nn.Linear(width, 3)
        self.blocks = nn.ModuleList([mlp(width), mlp(width), Shifted(width), Shifted(width)])
        self.config = {"scale": 1.0}
        self.blocks[0].config = self.blocks[1].config = self.config

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h
        for block in self.blocks[:2]:
            h = h + torch.tanh(block(h) * block.config["scale"])
            self.config["scale"] += 1.0
        kept = h
        for block in self.blocks[2:]:
            h = h + block(input=kept)
        return self.head(h), kept


def test_modules_whose_input_or_state_is_written_before_the_backward_train_as_themselves():
    """A block whose input the loss writes is never checkpointed (torch checks positional
    inputs only: other gradients, silently); blocks reading a setting changed after their call
    are, their recomputation reading it as their call found it (NOTE [ Replay ], rule 2)."""
    torch.manual_seed(0)
    model, x = Configured().double(), torch.randn(256, 8, dtype=torch.float64)

    def loss(out):
        logits, kept = out
        kept.mul_(2.0)
        return logits.sum()

    def step(trained):
        model.config["scale"] = 1.0
        model.zero_grad(set_to_none=True)
        loss(trained(x)).backward()
        return [p.grad.clone() for p in model.parameters()]

    peak = measure_memory(lambda: step(model)).peak_bytes
    with pytest.warns(UserWarning):
        planned = revnets.auto_checkpoint(model, x, int(0.9 * peak), loss_fn=loss)
    assert not {"blocks.2", "blocks.3"} & set(planned.names)
    assert {"blocks.0", "blocks.1"} <= set(planned.names)
    assert all(torch.equal(a, b) for a, b in zip(step(model), step(planned)))


class Scaled(nn.Module):
    """An MLP whose output is scaled by a tensor it holds, which its model replaces after the
    call."""

    def __init__(self, width: int):
        super().__init__()
        self.body = mlp(width)
        self.scale = torch.ones(width)

    def forward(self, h):
        return torch.tanh(self.body(h) * self.scale)


class Rescaling(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.stem, self.head = nn.Linear(8, width), nn.Linear(width, 3)
        self.blocks = nn.ModuleList([Scaled(width) for _ in range(4)])

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h
        for block in self.blocks:
            h = h + block(h)
            block.scale = block.scale * 2.0
        return self.head(h)


def test_a_module_whose_held_tensor_is_replaced_after_its_call_is_never_checkpointed():
    """Blocks whose tensor attribute the model replaces after calling them are not
    checkpointed (their replay would refuse the tensor swapped; a number or a config changed
    after the call is put back instead, as above); the MLPs inside them are: the least budget's
    plan trains to the model's gradients."""
    torch.manual_seed(0)
    model, x = Rescaling().double(), torch.randn(256, 8, dtype=torch.float64)

    def step(trained):
        for block in model.blocks:
            block.scale = torch.ones(32, dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        trained(x).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    with pytest.warns(UserWarning), pytest.raises(revnets.PlanningError) as refused:
        revnets.auto_checkpoint(model, x, 1, loss_fn=lambda o: o.sum(), measure_time=False)
    with pytest.warns(UserWarning):
        planned = revnets.auto_checkpoint(model, x, refused.value.smallest_budget,
                                          loss_fn=lambda o: o.sum(), measure_time=False)
    assert planned.names and set(planned.names) <= {f"blocks.{k}.body" for k in range(4)}
    assert all(torch.equal(a, b) for a, b in zip(step(model), step(planned)))


def test_another_thread_sharing_a_module_runs_its_own_forward():
    """Two planned models sharing blocks, both steps under way in two threads, the first ending
    first: it put back the forward it had found, and the second then put back the first's,
    which stayed on the module."""
    model, x = untraceable()
    other = TwoStreams()
    other.blocks = model.blocks
    first, second = (plan(net, x, activation_budget(net, x, 0.5)) for net in (model, other))
    inside, first_done = threading.Barrier(2, timeout=120), threading.Event()
    errors = []

    def wait(*args):
        inside.wait()
        if threading.current_thread().name == "second":
            assert first_done.wait(timeout=120)

    model.blocks[0].register_forward_pre_hook(wait)

    def step(planned):  # no zero_grad: the threads would set the same gradients at once
        try:
            planned(x).sum().backward()
        except Exception as error:  # noqa: BLE001  reported below, not lost in the thread
            errors.append(error)

    def run_first():
        step(first)
        first_done.set()

    threads = [threading.Thread(target=run_first),
               threading.Thread(target=step, args=(second,), name="second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(thread.is_alive() for thread in threads)
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_forward_set_as_a_callable_object_runs_as_set():
    """A forward the user set on a module, an object keeping the forward it wraps as its own
    ``forward``, is what the checkpoint runs (its attributes are not the plan's wrapper's)."""

    class Scaled:
        def __init__(self, forward, scale):
            self.forward, self.scale = forward, scale

        def __call__(self, x):
            return self.forward(x) * self.scale

    torch.manual_seed(0)
    model, reference = (nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
                        for _ in range(2))
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        m[0].forward = Scaled(m[0].forward, 10.0)
    x = torch.randn(3, 4, dtype=torch.float64)
    planned, unplanned = CheckpointedModules(model, ["0"])(x), reference(x)
    assert torch.equal(planned, unplanned)
    planned.sum().backward()
    unplanned.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                          reference.parameters()))


def threads_running(*steps) -> None:
    errors = []

    def run(step):
        try:
            step()
        except Exception as error:  # noqa: BLE001  reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(step,)) for step in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(thread.is_alive() for thread in threads)


def test_two_threads_training_one_plan_leave_the_modules_as_they_were():
    """Two threads stepping one plan at once: each recomputation's replay leaves the plan's
    forwards alone (they are the plan's to set and remove, not module state), so none stays on
    a module after the steps, and a later change of the class's forward is seen."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 1))
    planned = CheckpointedModules(model, ["0", "2"])
    x = torch.randn(16, 8)

    def steps():
        for _ in range(30):
            planned(x).sum().backward()

    threads_running(steps, steps)
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)]


def test_steps_in_two_threads_leave_dynamos_setting_as_they_found_it():
    """A step traces its checkpoints with dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint
    (NOTE [ Plans of modules compiled ]): the first of two threads' steps starts and ends while
    the second's is under way, and the setting is on in both and as the first found it after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    planned = CheckpointedModules(model, ["0"])
    x = torch.randn(16, 8)
    second_inside, first_done = threading.Event(), threading.Event()
    seen = []

    def hold(module, args):
        seen.append(torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint)
        if threading.current_thread().name == "first":
            assert second_inside.wait(timeout=120)
        else:
            second_inside.set()
            assert first_done.wait(timeout=120)

    model[2].register_forward_pre_hook(hold)

    def step_of(name):
        def step():
            threading.current_thread().name = name
            try:
                planned(x).sum().backward()
            finally:
                if name == "first":
                    first_done.set()
        return step

    threads_running(step_of("first"), step_of("second"))
    assert seen == [True, True]
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False


def test_two_plans_sharing_modules_step_at_once_each_with_its_own_decisions():
    """A plan running three modules as one run and another checkpointing the last of them
    alone, stepping at once in two threads: each thread runs its own plan's checkpoints (the
    second's is no member of the first's run), and both leave the model as it was."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 1)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    run = CheckpointedModules(model, {("0", "1", "2"): revnets.Checkpoint()})
    alone = CheckpointedModules(model, {"2": revnets.Checkpoint(selective=True)})
    inside, done = threading.Event(), threading.Event()

    def hold(module, args):  # the run's step stays under way while the other one steps
        if threading.current_thread().name == "run":
            inside.set()
            assert done.wait(timeout=120)

    model[4].register_forward_pre_hook(hold)
    outputs = {}

    def step_of(name, planned):
        def step():
            threading.current_thread().name = name
            if name == "alone":
                assert inside.wait(timeout=120)
            try:
                out = planned(x)
                outputs[name] = out.detach()
                out.sum().backward()
            finally:
                done.set()
        return step

    threads_running(step_of("run", run), step_of("alone", alone))
    with torch.no_grad():
        assert torch.equal(outputs["run"], model(x)) and torch.equal(outputs["alone"], model(x))
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)]


class _Products(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products a step runs, forward and backward."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in SELECTIVE_OPS
        return func(*args, **(kwargs or {}))


def products_of_a_step(model, x) -> int:
    with _Products() as products:
        train_step(model, x)
    return products.count


def test_a_module_checkpointed_selectively_trains_as_the_model_and_runs_no_product_again():
    """Checkpoint(selective=True) keeps a module's products and recomputes the rest (its
    BatchNorm, GELU, dropout): the model's gradients and buffers, as many products as the model
    runs itself; Checkpoint() runs each block's forward products again."""
    model, x = untraceable(torch.float64)
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    selective = CheckpointedModules(
        model, dict.fromkeys(blocks, revnets.Checkpoint(selective=True)))
    whole = CheckpointedModules(model, blocks)
    assert selective.names == whole.names == tuple(blocks)

    def step(trained):
        torch.manual_seed(1)  # the same dropout masks
        train_step(trained, x)
        return [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]

    buffers = [b.clone() for b in model.buffers()]
    results = []
    for trained in (model, selective):
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
        results.append(step(trained))
    (own_grads, own_buffers), (grads, after) = results
    assert max((a - b).abs().max().item() for a, b in zip(own_grads, grads)) < 1e-10
    assert all(torch.equal(a, b) for a, b in zip(own_buffers, after))
    runs = products_of_a_step(model, x)
    assert products_of_a_step(selective, x) == runs
    # Whole: each block's four Linears but the last, whose output no backward reads (torch's
    # recomputation stops once it has what the backward needs).
    assert products_of_a_step(whole, x) == runs + 3 * len(blocks)


def test_the_planner_keeps_products_where_the_budget_leaves_room_for_them():
    """Just below the unplanned peak, a plan that recomputes only what is cheap to recompute:
    some module checkpointed selectively, measured == predicted, within the budget."""
    model, x = untraceable()
    unplanned = unplanned_peak(model, x)
    planned = plan(model, x, int(0.97 * unplanned))
    decisions = planned.decisions
    assert any(d.selective for d in decisions.values())
    assert [part.decision for part in planned.memory_plan.parts] == list(decisions.values())
    measured = measure_memory(train_step, planned, x).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= int(0.97 * unplanned)


class ProductWrittenInPlace(nn.Module):
    """A Linear whose output the next ReLU overwrites: kept by a selective checkpoint, torch
    would refuse the backward (the kept output's version changed). Without that ReLU, keeping
    the products would save the Tanhs' outputs."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(inplace=True), nn.Tanh(),
                          nn.Tanh(), nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.stem(x)
        h = h.flip(0) if h.shape[0] > 1 else h  # untraceable
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_a_module_whose_product_is_written_in_place_is_never_checkpointed_selectively():
    model, x = ProductWrittenInPlace(), torch.randn(256, 8)
    unplanned = unplanned_peak(model, x)
    chosen = []
    for share in (0.98, 0.95, 0.9, 0.8, 0.7):
        with pytest.warns(UserWarning):
            try:
                planned = revnets.auto_checkpoint(model, x, int(share * unplanned))
            except revnets.PlanningError:
                continue
        train_step(planned, x)  # the backward runs
        chosen += [(name, d.selective) for name, d in planned.decisions.items()]
    assert chosen
    unsafe = {f"blocks.{i}" for i in range(4)} | {f"blocks.{i}.0" for i in range(4)}
    assert not [name for name, selective in chosen if selective and name in unsafe]


def test_a_module_plan_refuses_a_decision_that_is_no_checkpoint_of_a_module():
    model, _ = untraceable()
    for decision in (revnets.Store(), revnets.Checkpoint(segments=2)):
        with pytest.raises(TypeError, match=r"blocks.0.*Checkpoint\(\) or "
                                            r"Checkpoint\(selective=True\)"):
            CheckpointedModules(model, {"blocks.0": decision})
