"""torch.compile: a compiled model trains as the eager one, across training and evaluation, without
recompiling per block.

The reversible engine is one opaque region to dynamo (``torch.compiler.disable`` in
revnets/reversible/sequence.py): one graph break per reversible sequence in a training forward,
none in evaluation or under the other plans. Inside it, f and g run compiled where the replay
allows it (NOTE [ Compiled transforms ] in revnets/reversible/compiled.py). Most tests use the
``aot_eager`` backend, which runs what dynamo and AOTAutograd captured with eager kernels: graph
breaks and recompilations are dynamo's whatever the backend, and gradients then match eager's to
float32 round-off. The slow tests use inductor, the default backend, on every zoo model and plan.
"""

import copy
import warnings

import pytest
import timm
import torch
import torch._dynamo
import torch.nn.functional as F
import torchvision
from torch import nn
from torch._dynamo.utils import counters

import revnets
from revnets import ReversibleBlock, ReversibleSequence
from revnets.plan import PRESETS
from revnets.planning.planned import PlanChain
from revnets.reversible import compiled
from revnets.reversible.compiled import compiled_backward, compiled_call

PLANS = list(PRESETS)
# The default run covers the plain and the reconstructing plan; the checkpointing ones are slow.
QUICK_PLANS = [
    plan if plan in ("none", "reversible") else pytest.param(plan, marks=pytest.mark.slow)
    for plan in PLANS
]


def small_revnet(plan: str) -> nn.Module:
    """Three stages of two RevNet units, each stage with its own block shape (as the issue's
    recompilations were per block shape)."""
    torch.manual_seed(0)
    return timm.create_model(
        "revnet38", units=(2, 2, 2), channels=(8, 8, 16, 32), num_classes=10, memory=plan
    )


def alternate(net: nn.Module, x: torch.Tensor, target: torch.Tensor, rounds: int) -> None:
    """Training steps (gradients kept) and evaluation forwards, alternating, as a loop does."""
    for _ in range(rounds):
        net.train()
        net.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        F.cross_entropy(net(x), target).backward()
        net.eval()
        with torch.no_grad():
            net(x)


def gradient_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Each parameter's largest gradient difference from the reference, relative to the
    reference's largest entry for that parameter, or to 1e-4 of the largest gradient entry in
    the model where the parameter's own is smaller (a gradient that is zero in exact
    arithmetic, as an attention key's bias has, is round-off noise in both runs)."""
    grads = [q.grad for q in reference.parameters() if q.grad is not None]
    floor = 1e-4 * max(g.abs().max().item() for g in grads)
    errors = {}
    theirs = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        q = theirs[name]
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            scale = max(q.grad.abs().max().item(), floor)
            errors[name] = (p.grad.double() - q.grad.double()).abs().max().item() / scale
    return errors


def assert_same_gradients(model: nn.Module, reference: nn.Module, rtol: float) -> None:
    """Every gradient within ``rtol`` of the reference's (``gradient_errors``)."""
    for name, error in gradient_errors(model, reference).items():
        assert error <= rtol, f"{name}: relative gradient error {error:.2e}"


def set_compile_transforms(model: nn.Module, option: bool | str | None) -> None:
    for sequence in model.modules():
        if isinstance(sequence, ReversibleSequence):
            sequence.compile_transforms = option


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    compiled_call.clear()
    compiled_backward.clear()
    counters.clear()
    # A recompile-limit hit raises instead of silently running the frame eagerly from then on.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("plan", QUICK_PLANS)
def test_compiled_training_and_evaluation_alternate_without_reaching_the_recompile_limit(
    plan, fresh_dynamo, monkeypatch
):
    """Compiled (aot_eager) and eager copies of the same weights, two rounds of a training step
    then an evaluation forward: no recompile-limit hit (it raises), and eager's gradients. Under
    a reconstructing plan the engine runs f and g compiled (with aot_eager too, here), as
    ``compile_transforms=None`` asks."""
    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = small_revnet(plan)
    set_compile_transforms(model, None)
    reference = copy.deepcopy(model)
    x, target = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    alternate(torch.compile(model, backend="aot_eager"), x, target, rounds=2)
    alternate(reference, x, target, rounds=2)
    assert_same_gradients(model, reference, rtol=1e-5)
    assert (compiled_call.calls > 0) == PRESETS[plan].reconstructs
    # Training and evaluation each compile their own graphs once: nothing grows with the rounds
    # (f and g: one graph per block shape for the forward and one for the recomputation).
    assert counters["stats"]["unique_graphs"] <= 16 + 8


@pytest.mark.parametrize("plan", QUICK_PLANS)
def test_graph_breaks_are_the_reversible_sequences_in_training(plan, fresh_dynamo):
    """Reconstructing plans break the graph once per reversible sequence (the engine runs
    eagerly between the compiled graphs); nothing else breaks it, and evaluation not at all."""
    model = small_revnet(plan)
    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    x = torch.randn(2, 3, 32, 32)
    model.train()
    breaks = torch._dynamo.explain(model)(x).break_reasons
    # Dynamo lists a break each time a frame it traces reaches a sequence: once per sequence
    # here; a model whose enclosing frames are re-traced after a nested break lists more.
    expected = len(sequences) if PRESETS[plan].reconstructs else 0
    assert len(breaks) == expected, breaks
    for reason in breaks:
        assert "torch.compiler.disable" in reason.reason
        assert reason.user_stack[-1].filename.endswith("reversible/sequence.py")
    model.eval()
    with torch.no_grad():
        assert torch._dynamo.explain(model)(x).break_reasons == []


def test_by_default_a_compiled_cpu_model_compiles_its_blocks_and_an_eager_one_does_not(
    fresh_dynamo, monkeypatch
):
    """The default (``compile_transforms=None``): under a compiled model on the CPU, f and g run
    compiled in the forward and each block's backward step as one compiled function (measured
    faster than eager there: docs/compile.md); the same model run eagerly compiles nothing."""
    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = small_revnet("reversible")
    x, target = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    F.cross_entropy(model(x), target).backward()
    assert compiled_call.calls == compiled_backward.calls == 0
    F.cross_entropy(torch.compile(model, backend="aot_eager")(x), target).backward()
    blocks = sum(len(m.blocks) for m in model.modules() if isinstance(m, ReversibleSequence))
    assert compiled_call.calls == 2 * blocks
    assert compiled_backward.calls == blocks


def _frozen(model: nn.Module) -> nn.Module:
    """Some batch norms left in eval mode inside training blocks (running statistics read, never
    written) and some weights that do not require grad."""
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d) and name.endswith("f.1"):
            module.eval()
    for name, parameter in model.named_parameters():
        if name.endswith("g.3.weight"):
            parameter.requires_grad_(False)
    return model


@pytest.mark.parametrize("prepare", [lambda model: model, _frozen],
                         ids=["as built", "frozen norms and weights"])
def test_compiled_transforms_give_ordinary_autograd_gradients_and_update_statistics_once(
    prepare, fresh_dynamo
):
    """f and g compiled inside the engine, each block's backward step one compiled function
    (aot_eager, float64), two training steps: the gradients of ordinary autograd (the same
    weights with the plan "none") to 1e-10, none for a frozen weight, and batch norm's running
    statistics and counts as ordinary autograd leaves them: updated once a step, not again by
    the recomputation (read, not written, where a norm is in eval mode)."""
    model = small_revnet("reversible").double()
    reference = prepare(copy.deepcopy(model).set_memory("none"))
    prepare(model)
    set_compile_transforms(model, "aot_eager")
    x, target = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2])
    for net in (model, reference):
        for _ in range(2):
            net.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), target).backward()
    assert compiled_call.calls > 0
    assert compiled_backward.calls > 0  # the blocks' backward steps, each one function
    assert_same_gradients(model, reference, rtol=1e-10)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12, msg=name)


def test_a_memory_meter_leaves_the_compiled_block_backward_on(fresh_dynamo):
    """Under measure_memory's dispatch mode, which dynamo does not compile under, blocks run
    the ordinary way, without a warning; the next step outside it runs them compiled again."""
    model = small_revnet("reversible")
    set_compile_transforms(model, "aot_eager")
    compiled_model = torch.compile(model, backend="aot_eager")
    x, target = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])

    def step(net, x):
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), target).backward()

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="revnets")
        revnets.measure_memory(step, compiled_model, x)
        before = compiled_backward.calls
        step(compiled_model, x)
    assert compiled_backward.calls > before


@pytest.mark.slow  # about 45 s: four models compiled
def test_a_compiled_block_backward_adds_memory_that_does_not_grow_with_depth(fresh_dynamo):
    """The compiled block backward holds a block's step at once (its outputs fresh, not added
    into the gradients it was given): a higher transient peak than the ordinary step, by the same
    bytes at 4 and at 8 blocks a stage. The sequence's activation memory still does not grow
    with depth."""
    extra = []
    for units in ((4, 4, 4), (8, 8, 8)):
        peaks = []
        for option in (False, "aot_eager"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = timm.create_model("revnet38", units=units, channels=(8, 8, 16, 32),
                                      num_classes=10, memory="reversible")
            set_compile_transforms(model, option)
            compiled_model = torch.compile(model, backend="aot_eager")
            x, target = torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4])

            def step():
                compiled_model.zero_grad(set_to_none=True)
                F.cross_entropy(compiled_model(x), target).backward()

            step()
            compiled_model.zero_grad(set_to_none=True)
            peaks.append(revnets.allocator_peak(step))
        extra.append(peaks[1] - peaks[0])
    assert compiled_backward.calls > 0
    assert extra[0] == extra[1] > 0, extra


@pytest.mark.parametrize("drop_path_rate", [0.0, 0.5])
def test_a_rev_vit_compiles_its_blocks_with_and_without_drop_path(drop_path_rate, fresh_dynamo):
    """A Rev-ViT's attention and MLP are known composites (NOTE [ Known layers ]) and its
    blocks draw their drop-path masks outside them (NOTE [ Drop path outside the transforms ]):
    its blocks run compiled inside the engine, each block's backward one compiled function, and
    train like ordinary autograd under the same seed (aot_eager, float64, gradients to 1e-10)."""
    torch.manual_seed(0)
    model = timm.create_model(
        "revvit_small_patch16_224", img_size=32, patch_size=4, depth=3, num_classes=10,
        drop_path_rate=drop_path_rate, memory="reversible").double()
    reference = copy.deepcopy(model).set_memory("none")
    set_compile_transforms(model, "aot_eager")
    x, target = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.tensor([1, 2, 3, 4])
    for net in (model, reference):
        torch.manual_seed(1)
        F.cross_entropy(net(x), target).backward()
    assert compiled_call.calls == 6 and compiled_backward.calls == 3
    assert_same_gradients(model, reference, rtol=1e-10)


def test_a_compiled_block_backward_starts_from_the_input_kept_for_it(fresh_dynamo):
    """``keep_input_every=1`` with f and g compiled (aot_eager): every block's backward starts
    from its kept input, not from a reconstruction. With g's outputs near 1e6 in float32, a
    reconstruction by subtraction loses bits (gradients off by about 3e-2); started from the
    kept inputs the gradients are the stored run's exactly."""

    def sequence(memory):
        torch.manual_seed(0)
        blocks = [ReversibleBlock(_feed_forward(4, 0.0), _feed_forward(4, 0.0), split_dim=-1)
                  for _ in range(2)]
        with torch.no_grad():
            for block in blocks:
                block.g[0].weight.mul_(1e6)
        return ReversibleSequence(blocks, memory=memory, compile_transforms="aot_eager")

    kept = sequence(revnets.Reconstruct(keep_input_every=1))
    stored = sequence(revnets.Store())
    x = torch.randn(3, 8)
    for net in (kept, stored):
        net(x).square().sum().backward()
    assert compiled_call.calls > 0
    assert_same_gradients(kept, stored, rtol=0.0)


class _Scaled(nn.Module):
    """A transform of one's own (not a known layer): the replay watches it at the dispatcher."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 0.5


def _feed_forward(width: int, dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout))


@pytest.mark.parametrize(
    "case", ["known layers", "dropout", "own module", "exact", "autocast", "eager model"]
)
def test_transforms_compile_only_where_the_replay_allows_it(case, fresh_dynamo):
    """Which f and g the engine compiles (NOTE [ Compiled transforms ]): known layers drawing no
    random numbers, outside exact sequences and autocast, when asked or under a compiled model;
    everything else runs eagerly. Either way the gradients are the stored run's."""

    def model(memory):
        torch.manual_seed(0)
        p = 0.3 if case == "dropout" else 0.0
        blocks = [
            ReversibleBlock(
                _Scaled(8) if case == "own module" else _feed_forward(8, p),
                _feed_forward(8, p), split_dim=-1,
            )
            for _ in range(3)
        ]
        return ReversibleSequence(
            blocks, memory=memory, exact=case == "exact",
            compile_transforms=None if case == "eager model" else "aot_eager",
        )

    reversible, stored = model(revnets.Reconstruct()), model(revnets.Store())
    x = torch.randn(5, 16)
    for net in (reversible, stored):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
            net(x).float().square().sum().backward()
    # Each compiled transform runs compiled in the forward; in backward a block whose f and g
    # both did runs its whole step as one compiled function (NOTE [ Compiled block backward ]),
    # and one with only g compiled recomputes g compiled.
    assert compiled_call.calls == {"known layers": 6, "own module": 6}.get(case, 0)
    assert compiled_backward.calls == {"known layers": 3}.get(case, 0)
    assert_same_gradients(reversible, stored, rtol=1e-2 if case == "autocast" else 1e-5)


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("this backend compiles nothing")


def test_a_transform_that_fails_to_compile_runs_eagerly(fresh_dynamo):
    """A backend that raises while compiling f or g: a warning naming the transform, and the
    gradients of the stored run (the transform ran eagerly, forward and recomputation)."""
    if "revnets_failing" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_failing_backend, name="revnets_failing")

    def model(memory):
        torch.manual_seed(0)
        blocks = [ReversibleBlock(_feed_forward(8, 0.0), _feed_forward(8, 0.0), split_dim=-1)]
        return ReversibleSequence(blocks, memory=memory, compile_transforms="revnets_failing")

    reversible, stored = model(revnets.Reconstruct()), model(revnets.Store())
    x = torch.randn(5, 16)
    with pytest.warns(UserWarning, match="could not be compiled.*runs eagerly"):
        reversible(x).square().sum().backward()
    stored(x).square().sum().backward()
    assert compiled_call.calls == 0
    assert_same_gradients(reversible, stored, rtol=1e-6)


class _DropoutFeedForward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_compiled_model_replays_dropout_inside_its_reversible_sequence(fresh_dynamo):
    """Dropout in f and g under a compiled model: the engine (eager inside the compiled model)
    replays the masks in its recomputation, so the gradients are ordinary autograd's."""

    def model(memory):
        torch.manual_seed(0)
        blocks = [
            ReversibleBlock(_DropoutFeedForward(8), _DropoutFeedForward(8), split_dim=-1)
            for _ in range(3)
        ]
        return nn.Sequential(
            nn.Linear(4, 16), ReversibleSequence(blocks, memory=memory), nn.Linear(16, 3)
        )

    reversible, stored = model(revnets.Reconstruct()), model(revnets.Store())
    x = torch.randn(5, 4)
    for net in (torch.compile(reversible, backend="aot_eager"), stored):
        torch.manual_seed(3)
        net(x).square().sum().backward()
    assert_same_gradients(reversible, stored, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", ["resnet32", "revnet38", "irevnet163", "revvit_small_patch16_224"])
def test_inductor_compiled_zoo_model_trains_as_eager(name, plan, fresh_dynamo):
    """The default backend on one model of each zoo family (under the reconstructing plans with
    f and g compiled inside the engine where they are known layers): no recompile-limit hit,
    and gradients as accurate as eager's: against a float64 eager run of the same weights, the
    compiled run's worst error within 1e-3 or three times eager's. Not compiled against eager
    directly: some of these networks' float32 gradients are ill-conditioned (irevnet163's
    eager ones differ from float64 by about 1e-1 at batch 2 and 4, revnet38's at batch 2), and
    two float32 runs that round differently differ as much (docs/compile.md)."""
    kwargs = {"img_size": 32, "patch_size": 8, "depth": 4} if name.startswith("revvit") else {}
    torch.manual_seed(0)
    try:
        model = timm.create_model(name, num_classes=10, memory=plan, **kwargs)
    except ValueError as error:
        assert "does not fit" in str(error)
        pytest.skip(str(error))
    set_compile_transforms(model, None)  # f and g compiled inside the engine too
    reference, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    x, target = torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4])
    compiled_model = torch.compile(model)
    alternate(compiled_model, x, target, rounds=1)
    alternate(reference, x, target, rounds=1)
    alternate(exact, x.double(), target, rounds=1)
    eager_error = max(gradient_errors(reference, exact).values())
    compiled_error = max(gradient_errors(model, exact).values())
    assert compiled_error <= max(1e-3, 3 * eager_error), (compiled_error, eager_error)
    # A second round: training and evaluation alternate without a recompile-limit hit.
    alternate(compiled_model, x, target, rounds=1)
    if name.startswith(("revnet", "irevnet")) and PRESETS[plan].reconstructs:
        assert compiled_call.calls > 0  # their transforms are torch.nn layers


@pytest.mark.slow
def test_trainer_compiles_once_for_training_and_evaluation(tmp_path, fresh_dynamo):
    """``trainer.compile=true`` with evaluations between the steps: no recompile-limit hit (it
    raises here) and a finite validation loss."""
    from revnets.training import train

    from test_training import SMALL, config

    result = train(config(*SMALL, "trainer.compile=true", "trainer.eval_every=2"), tmp_path)
    assert result["step"] == 4 and torch.isfinite(torch.tensor(result["val_loss"]))


PLANNED = {
    # name: (model, input): a ViT's ``torch.cat([cls_token, x])``, a window transformer, dense
    # concatenations, squeeze-excitation, a GPT-like stack
    # Four blocks in the default run (a nested plan too, planned and compiled in 40 % of the
    # time twelve take); vit_tiny's twelve, with which the limit was reached, run with the slow.
    "vit": (lambda: timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4,
                                      depth=4, num_classes=10), (2, 3, 32, 32)),
    "vit-12": (lambda: timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4,
                                         num_classes=10), (2, 3, 32, 32)),
    "swin": (lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=64,
                                       window_size=4, num_classes=10), (1, 3, 64, 64)),
    "densenet": (lambda: torchvision.models.densenet121(num_classes=10), (2, 3, 64, 64)),
    "efficientnet": (lambda: timm.create_model("efficientnet_b0", num_classes=10),
                     (2, 3, 64, 64)),
}


@pytest.mark.parametrize(
    "name", [n if n == "vit" else pytest.param(n, marks=pytest.mark.slow) for n in PLANNED]
)
def test_a_planned_model_compiles_into_one_graph(name, fresh_dynamo):
    """A planned model's traced steps are plain code to dynamo. A ViT's ``torch.cat([cls_token,
    x])`` read its list as torch.fx's immutable_list: dynamo broke the graph inside every
    checkpointed segment and recompiled ``Checkpointed.forward`` per segment, up to the
    recompile limit."""
    build, shape = PLANNED[name]
    torch.manual_seed(0)
    model = build()
    x, target = torch.randn(shape), torch.arange(shape[0]) % 10
    loss = lambda out: F.cross_entropy(out, target)  # noqa: E731
    try:
        planned = revnets.auto_checkpoint(model, x, 0, loss_fn=loss, measure_time=False,
                                          compiled=True)
    except revnets.planning.PlanningError as refusal:  # the smallest plan: most segments
        planned = revnets.auto_checkpoint(model, x, refusal.smallest_budget, loss_fn=loss,
                                          measure_time=False, compiled=True)
    assert str(planned.memory_plan).count("checkpoint") >= 1
    loss(torch.compile(planned, backend="aot_eager")(x)).backward()
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss(model(x)).backward()
    for compiled_grad, p in zip(compiled_grads, model.parameters()):
        torch.testing.assert_close(compiled_grad, p.grad, rtol=1e-4, atol=1e-5)


class _Printing(nn.Module):
    """Code that breaks dynamo's graph (a ``print``, ``.item()``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x


def _breaking_unit(selective: bool) -> nn.Module:
    """Batch norm, a graph break, dropout: state, a break and randomness in one region."""
    block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), _Printing(),
                          nn.Dropout(0.3), nn.ReLU())
    return revnets.Checkpointed(block, revnets.Checkpoint(selective=selective))


class _CheckpointsAMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _breaking_unit(False).module
        self.checkpointed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return revnets.checkpoint(self._stage, x) if self.checkpointed else self._stage(x)

    def _stage(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


BREAKING_REGIONS = {
    "checkpointed": lambda: _breaking_unit(False),
    "selective": lambda: _breaking_unit(True),
    "a method": _CheckpointsAMethod,
    # Selective units run as one region under compile (NOTE [ Selective segments under compile ]),
    # the middle one breaking it.
    "a plan's selective run": lambda: PlanChain(*(_breaking_unit(True) for _ in range(3))),
}


@pytest.mark.parametrize("region", BREAKING_REGIONS)
def test_a_graph_break_inside_a_compiled_checkpoint_replays_as_eager(region, fresh_dynamo):
    """Dynamo runs a region that breaks its graph with torch's checkpoint, eagerly: its
    recomputation reruns Python, which replays there (NOTE [ Compiled checkpoints ]). The
    batch statistics were updated twice in a step before. Compared with the module unwrapped,
    eagerly: gradients, every buffer, and the dropout masks drawn."""
    torch.manual_seed(0)
    model = BREAKING_REGIONS[region]().double()
    reference = copy.deepcopy(model)
    for unit in reference.modules():
        if isinstance(unit, revnets.Checkpointed):
            unit.memory = revnets.Store()
        if isinstance(unit, _CheckpointsAMethod):
            unit.checkpointed = False
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    torch.manual_seed(1)
    torch.compile(model, backend="aot_eager")(x).square().sum().backward()
    torch.manual_seed(1)
    reference(x).square().sum().backward()
    assert counters["graph_break"]
    assert_same_gradients(model, reference, rtol=1e-12)
    for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buffer, expected, rtol=1e-12, atol=0, msg=name)


def test_a_breaking_compiled_checkpoint_backpropagates_twice_and_runs_without_grad(
        fresh_dynamo):
    """Where dynamo runs the region eagerly: a second backward (retain_graph) recomputes it
    again, as the plain graph backpropagates twice (it crashed: a context manager used twice);
    without grad torch's checkpoint enters no context and the region runs as it is (it raised
    that the region ran outside its checkpoint)."""
    torch.manual_seed(0)
    model = _CheckpointsAMethod().double()
    reference = copy.deepcopy(model)
    reference.checkpointed = False
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    compiled = torch.compile(model, backend="aot_eager")
    for run in (compiled, reference):
        torch.manual_seed(1)
        loss = run(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert_same_gradients(model, reference, rtol=1e-12)
    for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buffer, expected, rtol=1e-12, atol=0, msg=name)
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x), rtol=1e-12, atol=0)


def test_a_checkpoint_compiled_with_the_eager_backend_is_refused_in_backward(fresh_dynamo):
    """backend="eager" runs dynamo's graph untraced: torch's checkpoint then recomputes it
    without its random state (other dropout masks: the gradients were silently wrong). Its
    forward is right, and torch._dynamo.explain, which runs one that way, still works."""
    model = revnets.Checkpointed(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))
    x = torch.randn(3, 4)
    assert torch._dynamo.explain(model)(x).graph_count == 1
    out = torch.compile(model, backend="eager")(x)
    with pytest.raises(RuntimeError, match=r"backend='eager'.*backend='aot_eager' or 'inductor'"):
        out.sum().backward()


def test_a_lazy_reversible_sequence_compiles_at_its_first_call(fresh_dynamo):
    """Lazy modules make their parameters in their first call, which the sequence runs as
    ordinary modules. Told by their parameters (``UninitializedParameter``), dynamo restarted its
    trace and failed (SpeculationLogDivergence); told by their class, the compiled model trains
    from its first call, as the eager one does, and reconstructs from its second."""
    def lazy_sequence():
        torch.manual_seed(0)
        return ReversibleSequence([ReversibleBlock(nn.LazyLinear(2), nn.LazyLinear(2))
                                   for _ in range(2)])

    model, eager = lazy_sequence(), lazy_sequence()
    compiled_model = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        x = torch.randn(3, 4)
        compiled_model(x).square().sum().backward()
        eager(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_a_lazy_module_in_a_breaking_compiled_checkpoint_is_refused_before_its_first_call(
        fresh_dynamo):
    """Dynamo runs the region eagerly inside torch's checkpoint, too late to store its first
    call instead: the recomputation would not draw the initial values again (another dropout
    mask). Refused by name, with what to do; after one forward it trains."""
    # The break comes first: dynamo makes a lazy module's parameters where it traces its call.
    model = revnets.Checkpointed(nn.Sequential(nn.Linear(4, 4), _Printing(), nn.LazyLinear(4),
                                               nn.Dropout(0.5)))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"lazy module that has not made its parameters.*"
                                           r"Run one forward of the model first"):
        compiled(x)
    with torch.no_grad():
        model(x)
    compiled(x).sum().backward()
