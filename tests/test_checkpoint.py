import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import revnets
from revnets.memory import measure_memory

from conftest import conv_unit, max_grad_error, rel_error, twin


def unit_chain(n: int, channels: int = 4, dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(*(conv_unit(channels, dropout=dropout) for _ in range(n)))


def train(model, x, steps=3):
    for step in range(steps):
        torch.manual_seed(step)
        model(x).square().sum().backward()


def test_checkpointed_matches_plain_gradients_statistics_and_dropout():
    model = revnets.Checkpointed(unit_chain(3, dropout=0.3)).double()
    plain = twin(model)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    train(model, x), train(plain, x_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        if name.endswith("num_batches_tracked"):
            assert a.item() == 3
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name


def test_compiled_checkpointed_matches_plain():
    model = nn.Sequential(revnets.Checkpointed(conv_unit(4)), conv_unit(4)).double()
    plain = twin(model)
    compiled = torch.compile(model)
    for step in range(2):
        x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
        assert torch.allclose(compiled(x), plain(x), rtol=0, atol=1e-12)
        compiled(x).square().sum().backward()
        plain(x).square().sum().backward()
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name  # updated once per forward


def test_checkpointed_refuses_weights_swapped_for_the_forward_only():
    """torch.utils.checkpoint alone recomputes with the module's own weights here: wrong
    gradients, no error."""
    model = revnets.Checkpointed(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    weights = {name: p.detach() * 1.5 for name, p in model.named_parameters()}
    weights["module.2.weight"].requires_grad_()
    out = torch.func.functional_call(model, weights, (torch.randn(3, 4),))
    with pytest.raises(RuntimeError, match=r"checkpointed Sequential: 0.weight is not the tensor"):
        out.square().sum().backward()


class StagedByMethod(nn.Module):
    """Checkpoints a method of its own, as models written for torch.utils.checkpoint do
    (``checkpoint(self._stage, x)``), and a module bound by functools.partial."""

    def __init__(self, checkpointed: bool, dropout: float = 0.3) -> None:
        super().__init__()
        self.units = unit_chain(2, dropout=dropout)
        self.head = conv_unit(4)
        self.checkpointed = checkpointed

    def _stage(self, x, scale):
        return self.units(x) * scale

    def forward(self, x):
        if not self.checkpointed:
            return self.head(self._stage(x, 2.0))
        x = revnets.checkpoint(self._stage, x, scale=2.0)
        return revnets.checkpoint(functools.partial(self.head), x)


def test_checkpoint_of_a_method_replays_its_module():
    model = StagedByMethod(checkpointed=True).double()
    plain = copy.deepcopy(model)
    plain.checkpointed = False
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    train(model, x), train(plain, x)
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b), name  # statistics updated once per step, dropout replayed


def test_compiled_checkpoint_of_a_method_matches_plain():
    """Dynamo could not look into a bound method for its module: every compiled model that
    checkpointed a method failed to compile."""
    model = StagedByMethod(checkpointed=True, dropout=0.0).double()  # compiled draws differ
    plain = copy.deepcopy(model)
    plain.checkpointed = False
    compiled = torch.compile(model)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for step in range(2):
        torch.manual_seed(step)
        compiled(x).square().sum().backward()
        torch.manual_seed(step)
        plain(x).square().sum().backward()
    assert max_grad_error(model, plain) <= 1e-10


@pytest.mark.parametrize("selective", [False, True])
def test_a_second_backward_through_a_checkpoint_is_the_plain_one(selective):
    """backward(retain_graph=True) then backward again recomputes twice, as the plain graph
    backpropagates twice: gradients accumulate to twice one step's, statistics updated once.
    The second recomputation crashed (an AttributeError from a context manager used twice).
    Selective checkpointing keeps its products for one backward: torch refuses the second."""
    model = revnets.Checkpointed(unit_chain(2, dropout=0.3),
                                 revnets.Checkpoint(selective=selective)).double()
    plain = twin(model)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for m in (model, plain):
        torch.manual_seed(0)
        loss = m(x).square().sum()
        loss.backward(retain_graph=True)
        if selective and m is model:
            with pytest.raises(RuntimeError, match="backward an extra time"):
                loss.backward()
            return
        loss.backward()
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b), name


class _TakesCheckpointOptions(nn.Module):
    """A forward whose keywords torch.utils.checkpoint takes as its own options."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, module=1.0, debug=1.0, early_stop=1.0, determinism_check=1.0,
                preserve_rng_state=1.0, selective=1.0):
        return self.linear(x) * module * debug * early_stop * determinism_check * \
            preserve_rng_state * selective


@pytest.mark.parametrize("compiled", [False, True])
def test_keywords_named_like_checkpoint_options_reach_the_module(compiled):
    """torch's checkpoint took them as its options: the module got its defaults, silently (and
    ``module=`` was a TypeError). Checkpointed passes every keyword on; revnets.checkpoint all
    but its own two."""
    layer = _TakesCheckpointOptions()
    keywords = dict(module=2.0, debug=3.0, early_stop=5.0, determinism_check=7.0)
    x = torch.randn(3, 4)
    expected = layer(x, **keywords, preserve_rng_state=11.0, selective=13.0)
    wrapped = revnets.Checkpointed(layer)
    if compiled:
        wrapped = torch.compile(wrapped, backend="aot_eager")
    out = wrapped(x, **keywords, preserve_rng_state=11.0, selective=13.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(revnets.checkpoint(layer, x, **keywords),
                               layer(x, **keywords), rtol=0, atol=0)


def test_eager_checkpoints_stay_eager_while_another_thread_compiles(monkeypatch):
    """torch.compiler.is_compiling() is one flag for the whole process, true while any thread
    compiles: an eager checkpoint that read it took the compiled path, updating the batch
    statistics again in its recomputation with other dropout masks (NOTE [ Code dynamo
    traces ]). The flag set for the whole step, as another thread's compilation may hold it:
    gradients, statistics and draws are the plain model's."""
    model = revnets.Checkpointed(unit_chain(2, dropout=0.3)).double()
    plain = twin(model)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()
    train(model, x, steps=2)
    monkeypatch.undo()
    train(plain, x, steps=2)
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b), name


LAZY = {
    # name: (module, input): lazy layers drawing their initial values before a dropout in the
    # same region, a lazy batch norm, and a reversible sequence made of lazy layers
    "linear before dropout": (lambda: nn.Sequential(nn.LazyLinear(5), nn.Dropout(0.5)), (8, 6)),
    "norm and linear": (lambda: nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1, bias=False), nn.LazyBatchNorm2d(), nn.ReLU(),
        nn.Dropout(0.3), nn.LazyLinear(3)), (2, 2, 5, 5)),
    "reversible sequence": (lambda: revnets.ReversibleSequence([revnets.ReversibleBlock(
        nn.Sequential(nn.LazyConv2d(2, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.LazyConv2d(2, 3, padding=1), nn.Dropout(0.3))) for _ in range(2)]),
        (2, 4, 6, 6)),
}


@pytest.mark.parametrize("name", LAZY)
def test_a_checkpointed_lazy_module_initialises_in_its_first_step(name):
    """A lazy module makes its parameters in its first call, drawing their initial values: that
    call runs as it is, as a reversible sequence's does. Recording it failed on an uninitialised
    parameter (torch's ValueError); recomputing it would not draw them again, so a dropout after
    it would get another mask. Compared with the same module storing everything, seeded alike
    before it is built: gradients (the first step's too), buffers."""
    build, shape = LAZY[name]
    x = torch.randn(shape)
    models, first_grads = [], []
    for memory in (revnets.Checkpoint(), revnets.Store()):
        torch.manual_seed(0)
        model = revnets.Checkpointed(build(), memory)
        model(x).square().sum().backward()
        first_grads.append([p.grad.clone() for p in model.parameters()])
        train(model, x)
        models.append(model)
    lazy, plain = models
    for ours, theirs in zip(*first_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert max_grad_error(lazy, plain) <= 1e-6
    for (name, a), (_, b) in zip(lazy.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b), name


class _HoldsALazyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.helpers = [nn.LazyLinear(3)]  # unregistered: not among the module's submodules

    def forward(self, x):
        return self.helpers[0](self.conv(x).mean((2, 3)))


def test_a_lazy_layer_held_unregistered_is_refused_before_its_first_call():
    with pytest.raises(RuntimeError, match=r"helpers\[0\].weight is a lazy module's parameter"):
        revnets.Checkpointed(_HoldsALazyLayer())(torch.randn(2, 2, 5, 5))


def test_a_checkpoint_traced_by_make_fx_outside_torch_compile_is_refused_by_name():
    """make_fx (AOTAutograd's tracer) runs a checkpoint eagerly under a proxy tensor mode, where
    torch's checkpoint takes only dispatch-mode contexts and a replay of module state and
    random draws is not captured: it failed with torch's assertion about ``context_fn``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    model = revnets.Checkpointed(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    params = dict(model.named_parameters())

    def step(params, x):
        out = torch.func.functional_call(model, params, (x,))
        return torch.autograd.grad(out.sum(), list(params.values()))

    with pytest.raises(RuntimeError, match=r"checkpointed Sequential is traced by make_fx or "
                                           r"AOTAutograd outside torch.compile.*torch.compile"):
        make_fx(step)(params, torch.randn(3, 4))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_a_checkpoint_under_aot_module_outside_torch_compile_is_refused_by_name(dropout):
    """AOTAutograd first runs the module under a functional mode alone (no proxy mode yet),
    collecting its outputs' metadata: a replay of random draws there read a real generator
    state into fake tensors and failed with the fake mode's assertion."""
    from functorch.compile import aot_module, nop

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 16))
    model = nn.Sequential(nn.Linear(8, 16), revnets.Checkpointed(inner))
    with pytest.raises(RuntimeError, match=r"checkpointed Sequential is traced by make_fx or "
                                           r"AOTAutograd outside torch.compile"):
        aot_module(model, fw_compiler=nop)(torch.randn(4, 8)).sum().backward()


def test_a_checkpoint_under_torch_func_grad_is_refused_by_name_and_runs_stored():
    """torch.func's grad does not support the saved-tensor hooks a recomputation runs by: it
    failed with torch's words, naming no way out. The way named, a stored checkpoint, gives
    torch.func the plain module's gradients."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(3, 4)

    def gradients(module):
        def loss(params):
            return torch.func.functional_call(module, params, (x,)).sum()
        return list(torch.func.grad(loss)(dict(module.named_parameters())).values())

    with pytest.raises(RuntimeError, match=r"checkpointed Sequential runs under torch.func "
                                           r"\(grad\).*Checkpointed\(module, revnets.Store\(\)\)"):
        gradients(revnets.Checkpointed(inner))
    for stored, plain in zip(gradients(revnets.Checkpointed(inner, revnets.Store())),
                             gradients(inner), strict=True):
        assert torch.equal(stored, plain)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # torch's own
def test_a_checkpoint_under_forward_mode_jvp_gives_the_modules_tangent():
    """Forward mode saves nothing for a backward: jvp runs a training checkpoint as it is
    (refused, with grad, by a first version of the refusal above)."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x, tangent = torch.randn(3, 4), torch.randn(3, 4)
    _, checkpointed = torch.func.jvp(revnets.Checkpointed(inner), (x,), (tangent,))
    _, plain = torch.func.jvp(inner, (x,), (tangent,))
    assert torch.equal(checkpointed, plain)


def test_checkpoint_refuses_a_function_that_names_no_module():
    """A plain function names no module whose state its recomputation replays (it crashed
    with an AttributeError inside the replay): refused, naming what to pass instead."""
    units = unit_chain(1)
    x = torch.randn(2, 4, 6, 6)
    with pytest.raises(TypeError, match=r"is not an nn.Module or a method of one.*checkpoint the"):
        revnets.checkpoint(lambda t: units(t), x)
    with pytest.raises(TypeError, match=r"Checkpointed wraps an nn.Module, got function"):
        revnets.Checkpointed(lambda t: units(t))


@pytest.mark.parametrize("segments", [2.0, "2", [], [(0, 2)], True])
def test_checkpoint_segments_names_segments_it_cannot_take(segments):
    with pytest.raises(ValueError, match=r"segments is a number of segments or a list of \(start, "
                                         r"stop\) bounds covering 0..4 in order"):
        revnets.checkpoint_segments(unit_chain(4), segments)


def test_checkpoint_segments_takes_a_sequential_only():
    with pytest.raises(TypeError, match="takes an nn.Sequential, got Linear"):
        revnets.checkpoint_segments(nn.Linear(4, 4))


def test_checkpointed_momentum_none_statistics():
    chain = unit_chain(2)
    for m in chain.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # cumulative average: depends on num_batches_tracked
    model = revnets.Checkpointed(chain).double()
    plain = twin(model)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    train(model, x), train(plain, x)
    for a, b in zip(model.buffers(), plain.buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_checkpointed_saves_memory_and_switches_off():
    def step(model, x):
        model(x).square().mean().backward()

    x = torch.randn(4, 8, 16, 16, requires_grad=True)  # 32 KiB, like every activation here

    def peak(n, memory):
        model = nn.Sequential(*(revnets.Checkpointed(conv_unit(8), memory) for _ in range(n)))
        return measure_memory(step, model, x).above_model_state_bytes

    # Each unit more stores its conv and ReLU outputs (64 KiB) and BatchNorm's batch mean and
    # inverse std (2 x 8 floats) when plain; only its input (32 KiB) when checkpointed.
    assert peak(12, revnets.Store()) - peak(8, revnets.Store()) == 4 * (64 * 1024 + 2 * 8 * 4)
    assert peak(12, revnets.Checkpoint()) - peak(8, revnets.Checkpoint()) == 4 * 32 * 1024


def test_checkpoint_segments_sqrt_plan():
    chain = unit_chain(16).double()
    segmented = revnets.checkpoint_segments(chain)
    assert len(segmented) == 4
    assert [type(m).__name__ for m in segmented] == ["Checkpointed"] * 3 + ["Sequential"]
    assert sum(len(m.module) if isinstance(m, revnets.Checkpointed) else len(m)
               for m in segmented) == 16
    reference = twin(chain)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    train(segmented, x, steps=1), train(reference, x, steps=1)
    assert max_grad_error(chain, reference) <= 1e-10


def test_checkpoint_segments_memory_grows_like_sqrt():
    def step(model, x):
        model(x).square().mean().backward()

    x = torch.randn(2, 4, 16, 16, requires_grad=True)

    def peak(n, plan):
        chain = unit_chain(n)
        model = revnets.checkpoint_segments(chain) if plan else chain
        return measure_memory(step, model, x).above_model_state_bytes

    # 4x the layers: plain memory grows ~4x, sqrt(n) checkpointing ~2x.
    assert peak(64, False) / peak(16, False) > 3.5
    assert peak(64, True) / peak(16, True) < 2.5


class FunctionalRReLU(nn.Module):
    def forward(self, x):
        return F.rrelu(x, training=self.training)


@pytest.mark.parametrize("activation", [nn.RReLU, FunctionalRReLU])
def test_rrelu_in_training_is_refused_in_a_checkpoint_and_trains_in_a_reversible_block(
        activation):
    """torch's checkpoint recomputes RReLU's random slopes into a noise tensor its backward
    reads otherwise (wrong gradients; NOTE [ Recomputed wrong by torch ]): refused by name in
    training, run in eval mode; a reversible block's transform, recomputed by revnets' engine,
    gets ordinary autograd's gradients with it."""
    layer = nn.Sequential(nn.Linear(8, 8), activation()).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"RReLU \(F.rrelu\) in training mode runs in a "
                                           r"checkpoint.*eval mode"):
        revnets.checkpoint(layer, x)
    layer.eval()
    revnets.checkpoint(layer, x).sum().backward()

    torch.manual_seed(0)
    sequence = revnets.ReversibleSequence([revnets.ReversibleBlock(
        nn.Sequential(nn.Linear(4, 4), activation()), nn.Linear(4, 4)) for _ in range(2)]).double()
    stored = copy.deepcopy(sequence)
    stored.memory = revnets.Store()
    grads = []
    for model in (sequence, stored):
        torch.manual_seed(1)
        model(x).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert max((a - b).abs().max().item() for a, b in zip(*grads)) < 1e-10


class Defaulted(nn.Module):
    """Reads an attribute it may not have, with a default."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h):
        return torch.tanh(self.linear(h)) * getattr(self, "extra", 2.0)


def test_an_attribute_added_after_the_checkpointed_call_is_away_in_its_recomputation():
    """Code after the call sets an attribute the forward read as missing: the recomputation
    finds it missing too (NOTE [ Replay ], rule 2), and it is back after: the gradients of
    ordinary autograd."""
    torch.manual_seed(0)
    layer = Defaulted().double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    grads = []
    for run in (lambda: layer(x), lambda: revnets.checkpoint(layer, x)):
        layer.__dict__.pop("extra", None)
        layer.zero_grad(set_to_none=True)
        out = run()
        layer.extra = 3.0
        out.pow(2).sum().backward()
        grads.append(layer.linear.weight.grad)
    assert (grads[0] - grads[1]).abs().max() < 1e-10
    assert layer.extra == 3.0
