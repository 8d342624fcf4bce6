"""The model auto_checkpoint returns is the user's model to everything but its training forward
(NOTE [ A planned model is the model ]): the same state_dict keys and parameter names whatever
the plan, moves and casts that reach every tensor both paths read, and the model's own
attributes."""

import copy

import pytest
import torch
from torch import nn

import revnets
from revnets.planning import CheckpointedModules, PlannedModel

from conftest import activation_budget, max_grad_error, train_step


class Gated(nn.Module):
    """Layers, a BatchNorm, and a parameter and a buffer the model's own forward reads
    directly (a traced graph's get_attr)."""

    def __init__(self, width: int = 32, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.BatchNorm1d(width)
        self.gain = nn.Parameter(torch.ones(width))
        self.register_buffer("shift", torch.linspace(-1, 1, width))
        self.label = "gated"  # an attribute of the model's own

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.gain + self.shift
        return x


def plan_at(model, x, keep):
    return revnets.auto_checkpoint(model, x, activation_budget(model, x, keep),
                                   measure_time=False)


def sequential():
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)))


@pytest.mark.parametrize("build", [Gated, sequential], ids=["traced", "sequential"])
def test_state_dict_keys_and_parameter_names_are_the_models_whatever_the_plan(build):
    torch.manual_seed(0)
    model, x = build().double(), torch.randn(1024, 32, dtype=torch.float64)
    names = [name for name, _ in model.named_parameters()]
    keys = list(model.state_dict())
    plans = [plan_at(model, x, keep) for keep in (0.8, 0.6)]
    for plan in plans:
        assert isinstance(plan, PlannedModel)
        assert any(isinstance(m, revnets.Checkpointed) for m in plan.plan.modules())
        assert list(plan.state_dict()) == keys
        assert [name for name, _ in plan.named_parameters()] == names
    # A checkpoint saved under one plan resumes under another, and in the model itself.
    saved = {k: v * 2 for k, v in plans[0].state_dict().items()}
    plans[1].load_state_dict(saved)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(sequential() for _ in range(2))

    def forward(self, x):
        x = x if x.shape[0] > 1 else x.repeat(2, 1)  # a branch on a shape: fx cannot trace it
        for block in self.blocks:
            x = block(x)
        return x


def test_the_whole_module_fallback_has_the_models_keys_too():
    torch.manual_seed(0)
    model, x = Untraceable(), torch.randn(1024, 32)
    with pytest.warns(UserWarning, match="cannot be traced"):
        plan = plan_at(model, x, 0.8)
    assert isinstance(plan, CheckpointedModules)
    assert list(plan.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("move", ["planned.double()", "planned.model.double()"])
def test_a_cast_after_planning_reaches_the_tensors_the_plan_reads_directly(move):
    """Cast after planning, training and evaluation read the same (cast) buffer, and the
    planned step's gradients equal the model's own, cast alike."""
    torch.manual_seed(0)
    model, x = Gated(), torch.randn(512, 32)
    planned = plan_at(model, x, 0.5)  # noqa: F841  the name the moves use
    reference = copy.deepcopy(model).double()
    eval(move)
    assert model.shift.dtype == torch.float64
    x = x.double()
    train_step(planned, x)
    train_step(reference, x)
    assert max_grad_error(model, reference) < 1e-12
    assert torch.equal(model.norm.running_mean, reference.norm.running_mean)
    planned.eval()
    assert torch.equal(planned(x), reference.eval()(x))


def test_tensors_loaded_with_assign_are_the_ones_the_plan_reads():
    torch.manual_seed(0)
    model, x = Gated().double(), torch.randn(512, 32, dtype=torch.float64)
    plan = plan_at(model, x, 0.5)
    reference = copy.deepcopy(model)
    state = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    for net in (model, reference):
        net.load_state_dict(state, assign=True)  # new tensors under the same names
    train_step(plan, x)
    train_step(reference, x)
    assert max_grad_error(model, reference) < 1e-12


def test_a_copy_trains_apart_and_the_models_attributes_are_the_views():
    torch.manual_seed(0)
    model, x = Gated().double(), torch.randn(512, 32, dtype=torch.float64)
    plan = plan_at(model, x, 0.5)
    model.zero_grad(set_to_none=True)
    ema = copy.deepcopy(plan)  # an EMA copy: its own tensors, the same plan
    assert not {id(t) for t in ema.parameters()} & {id(t) for t in plan.parameters()}
    train_step(ema, x)
    assert all(p.grad is None for p in model.parameters())
    train_step(plan, x)
    assert max_grad_error(model, ema.model) < 1e-12
    assert plan.label == "gated" and plan.layers is model.layers


def test_the_plan_is_predicted_with_every_tensor_the_model_holds():
    """A buffer the traced forward never reads (one a trace folded into constants) is alive in
    training all the same: the plan's predicted peak counts it, as the measurement of the model
    returned does."""
    torch.manual_seed(0)
    model, x = Gated(), torch.randn(512, 32)
    model.register_buffer("table", torch.zeros(64, 1024))  # 256 KiB, never read
    plan = plan_at(model, x, 0.5)
    assert isinstance(plan, PlannedModel)
    report = revnets.measure_memory(train_step, plan, x)
    state = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert report.parameters == state
    assert report.peak_bytes == plan.memory_plan.peak_bytes


class Tempered(Gated):
    """Gated, its output scaled by a plain tensor attribute (a constant of the traced graph)
    and divided by a plain number."""

    def __init__(self):
        super().__init__()
        self.factor = torch.tensor(0.5)
        self.temperature = 1.0

    def forward(self, x):
        return super().forward(x) * self.factor / self.temperature


def test_a_plain_tensor_attribute_is_read_as_the_model_reads_it():
    torch.manual_seed(0)
    model, x = Tempered().double(), torch.randn(512, 32, dtype=torch.float64)
    plan = plan_at(model, x, 0.5)
    reference = copy.deepcopy(model)
    plan.factor = reference.factor = torch.tensor(2.0)  # set through the planned model
    assert model.factor is plan.factor
    train_step(plan, x)
    train_step(reference, x)
    assert max_grad_error(model, reference) < 1e-12
    # Emptied and loaded (meta initialisation, resuming): what both read comes back.
    state = copy.deepcopy(plan.state_dict())
    for net in (plan, reference):
        net.to_empty(device="cpu").load_state_dict(state)
    train_step(plan, x)
    train_step(reference, x)
    assert max_grad_error(model, reference) < 1e-12
    plan.temperature = 2.0  # the graph froze 1.0: refused by name, never trained on the old
    with pytest.raises(RuntimeError, match=r"temperature \(Tempered\) is 2\.0, 1\.0 when"):
        train_step(plan, x)


def test_apply_reaches_the_model_itself():
    torch.manual_seed(0)
    model, x = Gated(), torch.randn(512, 32)
    plan = plan_at(model, x, 0.5)

    def init(module):
        if isinstance(module, Gated):
            nn.init.constant_(module.gain, 3.0)

    plan.apply(init)
    assert torch.equal(model.gain, torch.full((32,), 3.0))


class Wrapper(nn.Module):
    """A model with attributes named as the view's own: a LightningModule's ``self.model``, a
    ``plan`` and a ``memory`` of its own."""

    def __init__(self):
        super().__init__()
        self.model = Gated()
        self.plan, self.memory = "warmup then cosine", 3

    def forward(self, x):
        return self.model(x)


def test_the_models_attributes_named_as_the_views_own_are_the_models():
    """Code written for the model reads what it reads there (``planned.model.layers``), and the
    view's own are reached by name whatever the model holds."""
    torch.manual_seed(0)
    model, x = Wrapper().double(), torch.randn(512, 32, dtype=torch.float64)
    plain = copy.deepcopy(model)
    planned = plan_at(model, x, 0.5)
    assert isinstance(planned, PlannedModel)
    assert planned.model is model.model and planned.model.layers is model.model.layers
    assert (planned.plan, planned.memory) == ("warmup then cosine", 3)
    assert PlannedModel.model_of(planned) is model
    assert any(isinstance(m, revnets.Checkpointed)
               for m in PlannedModel.plan_of(planned).modules())
    assert planned.memory_plan.parts
    train_step(planned, x)
    train_step(plain, x)
    assert max_grad_error(model, plain) < 1e-12


def test_a_whole_module_plan_keeps_the_models_attributes_named_as_its_own():
    torch.manual_seed(0)
    model, x = Untraceable().double(), torch.randn(256, 32, dtype=torch.float64)
    model.names, model.memory = ["the model's"], "its own"
    with pytest.warns(UserWarning, match="cannot be traced"):
        planned = plan_at(model, x, 0.8)
    assert isinstance(planned, CheckpointedModules)
    assert (planned.names, planned.memory) == (["the model's"], "its own")
    assert model.names == ["the model's"]
