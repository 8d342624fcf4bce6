"""auto_checkpoint on models with reversible stages: the plan it returns trains like ordinary
autograd and fits the budget, as measured."""

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import revnets
from revnets import Checkpoint, MemoryPlan, Reconstruct, Store
from revnets.memory import measure_memory

from conftest import max_grad_error

WIDTH = 8


def coupling_half() -> nn.Module:
    return nn.Sequential(nn.BatchNorm2d(WIDTH), nn.ReLU(), nn.Conv2d(WIDTH, WIDTH, 3, padding=1))


def reversible_stage(blocks: int) -> revnets.ReversibleSequence:
    return revnets.ReversibleSequence(
        revnets.ReversibleBlock(coupling_half(), coupling_half()) for _ in range(blocks)
    )


class HandBuilt(nn.Module):
    """Stem, reversible stage, strided transition, reversible stage, head: what users build."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 2 * WIDTH, 3, padding=1, bias=False), nn.BatchNorm2d(2 * WIDTH), nn.ReLU()
        )
        self.stage1 = reversible_stage(blocks)
        self.transition = nn.Sequential(
            nn.Conv2d(2 * WIDTH, 2 * WIDTH, 3, 2, 1, bias=False), nn.BatchNorm2d(2 * WIDTH),
            nn.ReLU(),
        )
        self.stage2 = reversible_stage(blocks)
        self.head = nn.Linear(2 * WIDTH, 10)

    def forward(self, x):
        x = self.stage2(self.transition(self.stage1(self.stem(x))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def loss_of(output):
    return output.square().mean()


def step(model, x):
    loss_of(model(x)).backward()


def peak(model, x):
    """A training step's measured peak, from no gradients (as after zero_grad(set_to_none=True)),
    as the planner predicts it."""
    model.zero_grad(set_to_none=True)
    return measure_memory(step, model, x).peak_bytes


def ordinary_autograd(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, revnets.ReversibleSequence):
            module.memory = revnets.Store()
    return twin


def assert_trains_like(planned, model, reference, x):
    """Two steps' gradients (float64, 1e-10) and every buffer equal ordinary autograd's (to
    round-off: the first block's statistics are reduced over a dense copy of its strided input
    half, NOTE [ Layout ])."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        step(planned, x)
        torch.manual_seed(1)
        step(reference, x)
        assert max_grad_error(model, reference) < 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.allclose(a, b, rtol=1e-12, atol=0), name


def budgets(model, x):
    """Everything stored; every reversible stage reconstructing, the rest stored."""
    stored = peak(ordinary_autograd(model), x)
    return stored, peak(model, x)


def test_hand_built_model_between_storing_and_reconstructing():
    torch.manual_seed(0)
    model = HandBuilt().double()
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    stored, reversible = budgets(model, x)
    assert reversible < stored
    budget = (stored + reversible) // 2
    reference = ordinary_autograd(model)
    planned = revnets.auto_checkpoint(model, x, budget, loss_of, measure_time=False)
    assert_trains_like(planned, model, reference, x)
    plan = planned.memory_plan
    assert peak(planned, x) == plan.peak_bytes <= budget
    decisions = {part.name: part.decision for part in plan.parts}
    assert Reconstruct() in decisions.values()


def test_hand_built_model_below_what_reconstruction_alone_reaches():
    planned, model, reference, x = planned_below_reconstruction()
    reversible = _planned_below_reconstruction(torch.float64)[4]  # measured before planning
    model_state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = model_state + int(0.8 * (reversible - model_state))
    assert_trains_like(planned, model, reference, x)
    plan = planned.memory_plan
    assert plan.budget == budget
    assert peak(planned, x) == plan.peak_bytes <= budget < reversible
    decisions = [part.decision for part in plan.parts]
    assert Reconstruct() in decisions and Checkpoint() in decisions
    assert any(isinstance(m, revnets.Checkpointed) for m in planned.plan.modules())
    table = str(plan)
    assert "stage1" in table and "reconstruct" in table and "checkpoint" in table
    assert "predicted peak of a training step" in table


def test_zoo_revnet_planned_part_by_part_below_reconstruction_alone():
    torch.manual_seed(0)
    model = timm.create_model("revnet38", units=(2, 2, 2)).double()
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    presets = {name: peak(copy.deepcopy(model).set_memory(name), x) for name in revnets.PRESETS}
    budget = (presets["reversible"] + presets["reversible+checkpoint"]) // 2
    reference = copy.deepcopy(model).set_memory("none")
    planned = revnets.auto_checkpoint(model, x, budget, loss_of, measure_time=False)
    assert isinstance(planned, revnets.planning.PlannedModel)
    assert_trains_like(planned, model, reference, x)
    planned.eval()
    with torch.no_grad():
        assert torch.allclose(planned(x), reference.eval()(x), rtol=1e-12, atol=0)
    assert peak(planned.train(), x) == planned.memory_plan.peak_bytes <= budget
    assert Checkpoint() in [part.decision for part in planned.memory_plan.parts]


_PLANNED_BELOW_RECONSTRUCTION = {}


def planned_below_reconstruction(dtype=torch.float64):
    """HandBuilt planned under a budget that needs checkpoints beside its reversible stages:
    planned once per dtype in a session, each test given its own deep copy (the planned model,
    the model it plans, the reference and the input copied together, so that the copy of the
    plan runs the copy of the model)."""
    return copy.deepcopy(_planned_below_reconstruction(dtype)[:4])


def _planned_below_reconstruction(dtype):
    """(planned, model, reference, x, the peak with every stage reconstructing)."""
    if dtype not in _PLANNED_BELOW_RECONSTRUCTION:
        _PLANNED_BELOW_RECONSTRUCTION[dtype] = _plan_below_reconstruction(dtype)
    return _PLANNED_BELOW_RECONSTRUCTION[dtype]


def _plan_below_reconstruction(dtype):
    torch.manual_seed(0)
    model = HandBuilt().to(dtype)
    x = torch.randn(8, 3, 16, 16, dtype=dtype)
    _, reversible = budgets(model, x)
    model_state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = model_state + int(0.8 * (reversible - model_state))
    reference = ordinary_autograd(model)
    planned = revnets.auto_checkpoint(model, x, budget, loss_of, measure_time=False)
    assert any(isinstance(m, revnets.Checkpointed) for m in planned.plan.modules())
    return planned, model, reference, x, reversible


def test_a_planned_model_fires_hooks_as_ordinary_autograd_does():
    """Forward hooks inside checkpointed parts and reversible stages fire once per forward (not
    again when backward recomputes), and a module's full backward hook sees the same gradients."""
    planned, model, reference, x = planned_below_reconstruction()
    seen = {}
    for name, net in (("planned", model), ("reference", reference)):
        calls, grads = [], []
        for module in (net.stem[0], net.stage1[0].f[2], net.transition[0], net.stage2[1].g[2]):
            module.register_forward_hook(lambda m, args, out, calls=calls: calls.append(m))
        net.head.register_full_backward_hook(lambda m, gi, go, grads=grads: grads.append(gi[0]))
        seen[name] = calls, grads
    assert_trains_like(planned, model, reference, x)
    (calls, grads), (reference_calls, reference_grads) = seen.values()
    assert len(calls) == len(reference_calls) == 2 * 4
    for a, b in zip(grads, reference_grads, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


def test_a_planned_model_trains_under_autocast_as_it_does_unplanned():
    """Under bfloat16 autocast the checkpoints the plan adds replay autocast: the planned model's
    gradients and statistics are those of the same model unplanned, whose reconstruction in turn
    differs from ordinary autograd by less than bfloat16 itself does from float32."""
    planned, model, reference, x = planned_below_reconstruction(torch.float32)
    unplanned = copy.deepcopy(model)

    def gradients(net, owner, autocast=True):
        owner.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(net(x))
        loss.backward()
        return [p.grad.clone() for p in owner.parameters()]

    def error(grads, exact):
        return max(((a - b).norm() / b.norm()).item() for a, b in zip(grads, exact))

    planned_grads = gradients(planned, model)
    unplanned_grads = gradients(unplanned, unplanned)
    assert error(planned_grads, unplanned_grads) == 0
    for (name, a), (_, b) in zip(model.named_buffers(), unplanned.named_buffers()):
        assert torch.equal(a, b), name
    exact = copy.deepcopy(reference)
    float32 = gradients(exact, exact, autocast=False)
    ordinary = gradients(reference, reference)
    assert error(unplanned_grads, ordinary) < error(ordinary, float32)


def test_a_compiled_planned_model_matches_ordinary_autograd():
    planned, model, reference, x = planned_below_reconstruction()
    compiled = torch.compile(planned, backend="aot_eager")
    assert_trains_like(compiled, model, reference, x)


def test_budget_counts_the_optimizer_when_one_is_given():
    torch.manual_seed(0)
    model = HandBuilt()
    x = torch.randn(8, 3, 16, 16)
    optimizer = torch.optim.Adam(model.parameters())

    def adam_step(model, optimizer, x):
        model.zero_grad(set_to_none=True)
        loss_of(model(x)).backward()
        optimizer.step()

    adam_step(model, optimizer, x)  # Adam's moments exist from here on, as in every later step
    sequences = [model.stage1, model.stage2]
    for sequence in sequences:
        sequence.memory = revnets.Store()
    stored = measure_memory(adam_step, model, optimizer, x).peak_bytes
    for sequence in sequences:
        sequence.memory = revnets.Reconstruct()
    planned = revnets.auto_checkpoint(model, x, stored - 1, loss_of, optimizer=optimizer)
    measured = measure_memory(adam_step, planned, optimizer, x)
    assert measured.peak_bytes == planned.memory_plan.peak_bytes <= stored - 1
    assert measured.optimizer_state >= 2 * sum(p.numel() * 4 for p in model.parameters())


def test_plans_print_as_their_preset_or_a_table():
    assert str(revnets.PRESETS["reversible"]) == "reversible"
    assert str(MemoryPlan(Reconstruct(store_last_blocks=2), Checkpoint())) == (
        "stages=reconstruct(store_last_blocks=2), rest=checkpoint"
    )
    plan = MemoryPlan(
        Reconstruct(), Store(),
        parts=(revnets.PartPlan("stem", Store(), 2**20, 0.0),
               revnets.PartPlan("stage1", Reconstruct(), 0, 0.0125)),
        peak_bytes=3 * 2**20, budget=4 * 2**20,
    )
    lines = str(plan).splitlines()
    assert lines[0].split() == ["part", "decision", "kept", "MiB", "recompute", "ms"]
    assert lines[2].split() == ["stem", "store", "1.00", "0.0"]
    assert lines[3].split() == ["stage1", "reconstruct", "0.00", "12.5"]
    assert lines[-1] == "predicted peak of a training step: 3.00 MiB (budget 4.00 MiB)"


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x):
        return {"logits": self.linear(x)}


MLP = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("request_, error, message", [
    (dict(budget="10MB"), TypeError, "budget is the training step's peak in bytes, a number"),
    (dict(budget=True), TypeError, "budget is the training step's peak in bytes, a number"),
    (dict(budget=float("nan")), ValueError, "a non-negative number"),
    (dict(budget=-1), ValueError, "a non-negative number"),
    (dict(example_input=None), TypeError, "example_input is None"),
    (dict(compiled="yes"), TypeError, "compiled is True or False, not 'yes'"),
    (dict(model=lambda x: x), TypeError, "model must be an nn.Module, got function"),
    (dict(loss_fn=lambda out: 3), TypeError, "loss_fn returned int, not a tensor"),
    (dict(loss_fn=lambda out: out), ValueError, r"loss_fn returned a tensor of shape \(4, 4\), "
                                                r"not a scalar"),
    (dict(loss_fn=lambda out: out.detach().sum()), ValueError, "does not require grad"),
    (dict(model=DictOutput()), TypeError, "the model returns a dict.*pass loss_fn="),
    (dict(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)), ValueError,
     "the optimizer updates 2 tensors that are not parameters of the model given"),
    (dict(example_input=torch.randn(4, 17)), ValueError, "Check that example_input is an input "
                                                         "the model takes"),
])
def test_bad_requests_are_refused_naming_the_argument(request_, error, message):
    """Each was an AttributeError, a bare StopIteration, an error of torch's that named no
    argument, or (a budget of True, an error of another function's wording) misleading."""
    arguments = dict(model=MLP, example_input=torch.randn(4, 16), budget=10**6,
                     measure_time=False) | request_
    with pytest.raises(error, match=message):
        revnets.auto_checkpoint(**arguments)


def test_plan_strings_are_parsed_once_with_named_errors():
    assert revnets.parse_memory_plan("checkpoint(segments=4)") == MemoryPlan(Checkpoint(4))
    assert revnets.parse_memory_plan("reversible_checkpoint").name == "reversible+checkpoint"
    with pytest.raises(ValueError, match="option 'segments=x' needs a whole number"):
        revnets.parse_memory_plan("checkpoint(segments=x)")
    with pytest.raises(ValueError, match="only reversible blocks can be reconstructed"):
        MemoryPlan(Store(), Reconstruct())
    with pytest.raises(ValueError, match="store_last_blocks must be a non-negative integer"):
        Reconstruct(store_last_blocks=-1)
    with pytest.raises(ValueError, match="option 'segments' given twice"):
        revnets.parse_memory_plan("checkpoint(segments=2,segments=3)")


@pytest.mark.parametrize("stages, rest", [("checkpoint", Store()), (Checkpoint(), "store"),
                                          (None, Store()), (Reconstruct(), None)])
def test_a_plan_of_anything_but_decisions_is_refused(stages, rest):
    """A string or None in a plan matches no decision, which the model took as storing
    everything: a plan printed as "checkpoint" that checkpointed nothing."""
    with pytest.raises(TypeError, match=r"must be revnets.Store\(\), Checkpoint\(\) or "
                                        r"Reconstruct\(\).*parse_memory_plan"):
        MemoryPlan(stages, rest)


def test_plans_from_keys_equal_plans_from_strings():
    # Hydra gives options as keys, timm's memory= keyword as a string: the same plan either way.
    by_keys = revnets.plan_from_options("reversible", store_last_blocks=2, keep_input_every=16)
    by_string = revnets.parse_memory_plan("reversible(store_last_blocks=2, keep_input_every=16)")
    assert by_keys == by_string
    assert by_keys == MemoryPlan(Reconstruct(store_last_blocks=2, keep_input_every=16), Store())
    assert revnets.plan_from_options("reversible_checkpoint") == revnets.PRESETS[
        "reversible+checkpoint"]
    with torch.device("meta"):
        model = timm.create_model("revnet38", memory="reversible(store_last_blocks=2)")
    assert model.memory == revnets.plan_from_options("reversible", store_last_blocks=2)
    refusal = "memory plan 'reversible' has no option 'store_last_block'; its options: " \
        "store_last_blocks, keep_input_every"
    with pytest.raises(ValueError, match=refusal):
        revnets.plan_from_options("reversible", store_last_block=2)
    with pytest.raises(ValueError, match=refusal):
        revnets.parse_memory_plan("reversible(store_last_block=2)")
    with pytest.raises(ValueError, match="plan 'none' has no option 'segments'; it takes no"):
        revnets.plan_from_options("none", segments=2)
