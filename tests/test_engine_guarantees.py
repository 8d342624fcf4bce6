"""The engine's guarantees, one class of silent error each (issue 23): every case trains exactly
like ordinary autograd (float64 gradients and buffers to 1e-10) or is refused by name. The
references are the same modules with memory=Store()."""

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import revnets
from revnets import Reconstruct, Store

from conftest import conv_unit, make_stack, max_grad_error, rel_error, twin

PLANS = [Reconstruct(), Reconstruct(store_last_blocks=1), Reconstruct(keep_input_every=2)]
PLAN_IDS = ["recompute_all", "store_last_block", "keep_input_every_2"]


def released_step(model, x, *context, seed=0):
    """A training step in which nothing but autograd holds the output during backward."""
    torch.manual_seed(seed)
    loss = model(x, *context).square().sum()
    loss.backward()


def assert_trains_like(model, reference, x, x_reference, steps=3, context=()):
    for seed in range(steps):
        released_step(model, x, *context, seed=seed)
        released_step(reference, x_reference, *context, seed=seed)
    assert rel_error(x.grad, x_reference.grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.allclose(a.double(), b.double(), rtol=0, atol=1e-12), name


def leaf(x):
    return x.detach().clone().requires_grad_()


# -- 1. memory layout ------------------------------------------------------------------------------


LAYOUTS = {
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "permuted": lambda x: x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
    "strided": lambda x: torch.cat([x, x], dim=3)[..., ::2],
}


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropout_draws_the_forward_masks_whatever_the_input_layout(layout, plan):
    model = make_stack(4, dropout=0.3, memory=plan).double()
    reference = twin(model)
    x = LAYOUTS[layout](torch.randn(3, 8, 5, 5, dtype=torch.float64))
    assert not x.is_contiguous()
    assert_trains_like(model, reference, leaf(x), leaf(x))


def test_a_channels_last_model_with_dropout_trains_like_ordinary_autograd():
    model = make_stack(4, dropout=0.3).double().to(memory_format=torch.channels_last)
    reference = twin(model)
    x = torch.randn(3, 8, 5, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    assert_trains_like(model, reference, leaf(x), leaf(x))


# -- 2. buffers reassigned in the forward ----------------------------------------------------------


class MovingAverage(nn.Module):
    """A moving average of the batch mean written the common way, by reassigning the buffer, and
    read by the output."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.register_buffer("avg", torch.zeros(1, channels, 1, 1))

    def forward(self, x):
        h = self.conv(x)
        if self.training:
            self.avg = 0.9 * self.avg + 0.1 * h.detach().mean((0, 2, 3), keepdim=True)
        return torch.tanh(h - self.avg)


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_a_buffer_reassigned_in_the_forward_is_replayed_and_updated_once(plan):
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(MovingAverage(4), MovingAverage(4)) for _ in range(3)], plan
    ).double()
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    assert_trains_like(model, twin(model), leaf(x), leaf(x))


def test_a_checkpointed_buffer_reassigned_in_the_forward_is_replayed_and_updated_once():
    model = nn.Sequential(revnets.Checkpointed(MovingAverage(8)), MovingAverage(8)).double()
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    assert_trains_like(model, twin(model), leaf(x), leaf(x))


# -- 3. forward hooks that change an output --------------------------------------------------------


HOOKS = {
    "clamp_": lambda module, args, out: out.clamp_(-0.3, 0.3),
    "mul_mask": lambda module, args, out: out.mul_((torch.arange(out.shape[1]) % 2).view(
        1, -1, 1, 1).to(out)),
    "replaced": lambda module, args, out: out * 2,
}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_a_hook_changing_an_output_inside_f_is_replayed(hook):
    model = make_stack(3, dropout=0.2).double()
    for block in model:
        block.f[0].register_forward_hook(HOOKS[hook])  # the convolution's output
    reference = twin(model)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    assert_trains_like(model, reference, leaf(x), leaf(x))


@pytest.mark.parametrize("hook", list(HOOKS))
def test_a_hook_changing_a_checkpointed_output_is_replayed(hook):
    model = nn.Sequential(revnets.Checkpointed(conv_unit(8)), conv_unit(8)).double()
    model[0].module[0].register_forward_hook(HOOKS[hook])
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    assert_trains_like(model, twin(model), leaf(x), leaf(x))


@pytest.mark.parametrize("hook", ["clamp_", "replaced"])
def test_a_hook_changing_a_blocks_own_output_is_refused(hook):
    model = make_stack(3).double()
    model[1].register_forward_hook(HOOKS[hook])
    with pytest.raises(RuntimeError, match="block 1 of a ReversibleSequence: a forward hook on "
                                           "the block replaced or changed its output"):
        model(torch.randn(2, 8, 5, 5, dtype=torch.float64, requires_grad=True))


def test_a_hook_changing_an_invertible_modules_output_is_refused():
    model = revnets.ReversibleSequence([make_stack(1)[0], revnets.SpaceToDepth(2)])
    model[1].register_forward_hook(HOOKS["clamp_"])
    with pytest.raises(RuntimeError, match="forward hook on SpaceToDepth changed in place its "
                                           "output"):
        model(torch.randn(2, 8, 4, 4, requires_grad=True))


# -- 4. an inverse that reads what its forward set -------------------------------------------------


class BatchCentering(revnets.Invertible):
    """Subtracts the batch mean and scales, keeping the mean for its inverse and a running mean,
    as invertible normalisations (RealNVP's batch norm, ActNorm) do."""

    def __init__(self, channels):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(1, channels, 1, 1) + 0.5)
        self.register_buffer("shift", torch.zeros(1, channels, 1, 1))
        self.register_buffer("running", torch.zeros(1, channels, 1, 1))

    def forward(self, x):
        mean = x.mean((0, 2, 3), keepdim=True)
        self.shift = mean.detach()
        self.running.mul_(0.9).add_(0.1 * mean.detach())
        return (x - mean) * self.scale

    def inverse(self, y):
        return y / self.scale + self.shift


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_an_inverse_runs_with_the_state_its_forward_left(plan):
    model = revnets.ReversibleSequence(
        [make_stack(1, dropout=0.2)[0], BatchCentering(8), make_stack(1)[0]], plan
    ).double()
    x = torch.randn(3, 8, 4, 4, dtype=torch.float64)
    assert_trains_like(model, twin(model), leaf(x), leaf(x))


# -- 5. cached parametrizations --------------------------------------------------------------------


def spectral_unit():
    return nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Conv2d(4, 4, 3, padding=1)), nn.Tanh()
    )


def cached_step(model, x, seed):
    torch.manual_seed(seed)
    with parametrize.cached():
        model(x).square().sum().backward()


@pytest.mark.parametrize("wrapper", ["sequence", "Checkpointed"])
def test_spectral_norm_under_a_parametrization_cache_gets_its_gradient(wrapper):
    if wrapper == "sequence":
        model = revnets.ReversibleSequence(
            [revnets.ReversibleBlock(spectral_unit(), spectral_unit()) for _ in range(2)]
        ).double()
    else:
        model = nn.Sequential(revnets.Checkpointed(spectral_unit()), spectral_unit()).double()
    reference = twin(model)
    x = torch.randn(2, 8 if wrapper == "sequence" else 4, 5, 5, dtype=torch.float64)
    x, x_reference = leaf(x), leaf(x)
    for seed in range(2):
        cached_step(model, x, seed), cached_step(reference, x_reference, seed)
    originals = [p for n, p in model.named_parameters() if n.endswith("original")]
    assert originals and all(p.grad is not None for p in originals)
    assert max_grad_error(model, reference) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name


# -- 6. generators wherever user code keeps them ---------------------------------------------------

GLOBAL_GENERATOR = torch.Generator()


class Noisy(nn.Module):
    """Adds noise drawn from a generator it reaches some way (``where``)."""

    def __init__(self, where, generator):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.where = where
        if where == "list":
            self.generators = [generator]
        elif where == "dict":
            self.generators = {"noise": generator}
        elif where == "closure":
            self.draw = lambda shape: torch.rand(shape, generator=generator, dtype=torch.float64)

    def generator(self, context):
        if self.where == "list":
            return self.generators[0]
        if self.where == "dict":
            return self.generators["noise"]
        if self.where == "context":
            return context
        return GLOBAL_GENERATOR

    def forward(self, x, context=None):
        h = self.linear(x)
        if self.where == "closure":
            return torch.tanh(h) * self.draw(h.shape)
        noise = torch.rand(h.shape, generator=self.generator(context), dtype=h.dtype)
        return torch.tanh(h) * noise


@pytest.mark.parametrize("where", ["list", "dict", "context", "global", "closure"])
def test_every_generator_a_transform_draws_from_is_replayed(where):
    def build(memory):
        generator = GLOBAL_GENERATOR if where == "global" else torch.Generator()
        blocks = [revnets.ReversibleBlock(Noisy(where, generator), Noisy(where, generator),
                                          split_dim=-1) for _ in range(3)]
        return revnets.ReversibleSequence(blocks, memory).double(), generator

    (model, generator), (reference, reference_generator) = build(Reconstruct()), build(Store())
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 8, dtype=torch.float64)
    x, x_reference = leaf(x), leaf(x)
    for seed in range(2):
        generator.manual_seed(seed)
        context = (generator,) if where == "context" else ()
        released_step(model, x, *context)
        reference_generator.manual_seed(seed)
        context = (reference_generator,) if where == "context" else ()
        released_step(reference, x_reference, *context)
    assert rel_error(x.grad, x_reference.grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10


# -- 7. memory others hold by its storage object ---------------------------------------------------


def test_an_output_whose_storage_the_caller_keeps_is_never_written():
    model = make_stack(3).double()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    out = model(x)
    storage, values = out.untyped_storage(), out.detach().clone()
    loss = out.square().sum()
    del out
    loss.backward()
    kept = torch.empty(0, dtype=torch.float64).set_(storage, 0, values.shape, values.stride())
    assert torch.equal(kept, values)


def test_a_gradient_whose_storage_a_hook_keeps_is_never_written():
    model = make_stack(3).double()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    seen = []

    def keep_storage(grad):
        seen.append((grad.untyped_storage(), grad.clone(), grad.shape, grad.stride()))

    out = model(x)
    out.register_hook(keep_storage)
    loss = out.square().sum()
    del out
    loss.backward()
    storage, values, shape, stride = seen[0]
    kept = torch.empty(0, dtype=torch.float64).set_(storage, 0, shape, stride)
    assert torch.equal(kept, values)


def gradient_handed_on(model):
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    incoming, returned = [], []
    x.register_hook(lambda grad: returned.append(grad.data_ptr()))
    out = model(x)
    out.register_hook(lambda grad: incoming.append(grad.data_ptr()))
    loss = out.square().sum()
    del out
    loss.backward()
    return returned == incoming


def test_gradient_memory_reuse_has_an_off_switch():
    assert gradient_handed_on(make_stack(3))
    model = make_stack(3)
    model.reuse_memory = False
    assert not gradient_handed_on(model)


# -- 8. what used to fail loudly but internally ----------------------------------------------------


def test_more_stored_blocks_than_blocks_beside_an_invertible_module():
    blocks = [make_stack(1)[0], revnets.SpaceToDepth(2), *make_stack(2, half=16)]
    model = revnets.ReversibleSequence(blocks, Reconstruct(store_last_blocks=10)).double()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64)
    assert_trains_like(model, twin(model), leaf(x), leaf(x), steps=1)


def test_irevnet_with_more_stored_blocks_than_it_has_trains():
    import timm

    model = timm.create_model("irevnet163", units=(2, 2, 2), num_classes=3,
                              memory="reversible(store_last_blocks=40)")
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("mode", ["torch.no_grad()", "torch.inference_mode()"])
def test_revnets_imports_under_no_grad_and_inference_mode(mode):
    code = (
        "import torch\n"
        f"with {mode}:\n"
        "    import revnets\n"
        "model = revnets.ReversibleSequence([revnets.ReversibleBlock(torch.nn.Linear(2, 2), "
        "torch.nn.Linear(2, 2), split_dim=-1)])\n"
        "model(torch.randn(3, 4, requires_grad=True)).sum().backward()\n"
        "print('trained')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "trained" in result.stdout


def test_old_keywords_are_refused_with_the_new_spelling():
    with pytest.raises(TypeError, match=r"memory_efficient.*memory=revnets.Store\(\)"):
        revnets.ReversibleSequence(make_stack(1).blocks, memory_efficient=False)
    with pytest.raises(TypeError, match=r"memory=revnets.Reconstruct\(store_last_blocks=k\)"):
        revnets.ReversibleSequence(make_stack(1).blocks, store_last_blocks=1)
    with pytest.raises(TypeError, match=r"enabled.*memory=revnets.Store\(\)"):
        revnets.Checkpointed(nn.Linear(2, 2), enabled=False)
    with pytest.raises(TypeError, match="a Checkpoint is carried out around the sequence"):
        revnets.ReversibleSequence(make_stack(1).blocks, revnets.Checkpoint())


@pytest.mark.parametrize("name, spelling", [
    ("memory_efficient", r"sequence.memory = revnets.Store\(\)"),
    ("store_last_blocks", r"sequence.memory = revnets.Reconstruct\(store_last_blocks=k\)"),
    ("keep_input_every", r"sequence.memory = revnets.Reconstruct\(keep_input_every=k\)"),
])
def test_old_options_assigned_as_attributes_are_refused_with_the_new_spelling(name, spelling):
    sequence = make_stack(2)
    with pytest.raises(AttributeError, match=f"no option '{name}': set {spelling}"):
        setattr(sequence, name, False)
    assert sequence.memory == revnets.Reconstruct() and name not in vars(sequence)
    checkpointed = revnets.Checkpointed(nn.Linear(2, 2))
    with pytest.raises(AttributeError, match=r"no option 'enabled': set checkpointed.memory = "
                                             r"revnets.Store\(\)"):
        checkpointed.enabled = False
    assert checkpointed.memory == revnets.Checkpoint()


# -- neighbouring cases (found by review): each exact, or refused by name -----------------------


class Linear4(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)


class StoresAuxiliaryLoss(Linear4):
    def forward(self, h):
        z = self.linear(h)
        self.aux = z.square().mean()  # a router's load-balancing term, read by the loop
        return torch.tanh(z)


def linear_sequence(unit, memory=Reconstruct(), depth=3):
    blocks = [revnets.ReversibleBlock(unit(), unit(), split_dim=-1) for _ in range(depth)]
    return revnets.ReversibleSequence(blocks, memory).double()


def test_a_loss_on_a_tensor_f_stored_as_an_attribute_is_refused_by_name():
    model = linear_sequence(StoresAuxiliaryLoss)
    out = model(torch.randn(5, 8, dtype=torch.float64, requires_grad=True))
    loss = out.square().sum() + sum(m.aux for m in model.modules() if hasattr(m, "aux"))
    with pytest.raises(RuntimeError, match=r"inside block \d of a ReversibleSequence \(captured "
                                           "by a forward hook or stored as a module attribute"):
        loss.backward()
    assert isinstance(model[0].f.aux.item(), float)  # logging it still works


def test_a_checkpointed_auxiliary_loss_attribute_gets_its_gradient():
    model = nn.Sequential(revnets.Checkpointed(StoresAuxiliaryLoss()), nn.Linear(4, 4)).double()
    reference = twin(model)
    for m in (model, reference):
        x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        (m(x).square().sum() + 10 * m[0].module.aux).backward()
    assert max_grad_error(model, reference) <= 1e-10


class DataSwap(Linear4):
    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, h):
        z = self.linear(h)
        self.avg.data = 0.9 * self.avg + 0.1 * z.detach().mean(0)
        return torch.tanh(z - self.avg)


def test_a_buffer_whose_data_is_swapped_in_the_forward_is_refused_by_name():
    model = linear_sequence(DataSwap)
    with pytest.raises(RuntimeError, match=r"blocks\.0\.f\.avg's \.data was replaced"):
        model(torch.randn(5, 8, dtype=torch.float64, requires_grad=True))


class StateInAList(Linear4):
    def __init__(self):
        super().__init__()
        self.state = [torch.zeros(4, dtype=torch.float64)]

    def forward(self, h):
        z = self.linear(h)
        self.state[0].mul_(0.5).add_(z.detach().mean(0))
        return torch.tanh(z - self.state[0])


@pytest.mark.parametrize("wrapper", ["sequence", "Checkpointed"])
def test_state_kept_outside_any_slot_and_written_in_place_is_replayed(wrapper):
    def build(memory):
        if wrapper == "sequence":
            return linear_sequence(StateInAList, memory)
        checkpointed = revnets.Checkpointed(StateInAList(), memory=(
            revnets.Checkpoint() if isinstance(memory, Reconstruct) else Store()))
        return nn.Sequential(checkpointed, nn.Linear(4, 8)).double()

    torch.manual_seed(0)
    model = build(Reconstruct())
    torch.manual_seed(0)
    reference = build(Store())
    width = 8 if wrapper == "sequence" else 4
    x = torch.randn(5, width, dtype=torch.float64)
    assert_trains_like(model, reference, leaf(x), leaf(x))


class ReadsRunningVariance(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=0.9)

    def forward(self, h):
        out = self.bn(self.linear(h))
        return torch.tanh(out * self.bn.running_var.clone())


def test_code_reading_a_training_batch_norms_running_statistics_is_refused_by_name():
    model = linear_sequence(ReadsRunningVariance)
    with pytest.raises(RuntimeError, match=r"bn\.running_var of a BatchNorm in training mode is "
                                           "read by other code"):
        model(torch.randn(5, 8, dtype=torch.float64, requires_grad=True))


def test_switching_to_eval_between_forward_and_backward_changes_nothing():
    model = make_stack(3, dropout=0.3).double()
    reference = twin(model)
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64)
    x, x_reference = leaf(x), leaf(x)
    for m, xi in ((model, x), (reference, x_reference)):
        torch.manual_seed(0)
        loss = m(xi).square().sum()
        m.eval()  # ordinary autograd's graph is fixed at the forward
        loss.backward()
        m.train()
    assert rel_error(x.grad, x_reference.grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10


class NumpyDepth(Linear4):
    def forward(self, h):
        import numpy as np

        keep = float(np.random.rand() < 0.5)
        return torch.tanh(self.linear(h)) * keep


class RandomInAList(Linear4):
    def __init__(self):
        super().__init__()
        import random

        self.rngs = [random.Random(0)]

    def forward(self, h):
        return torch.tanh(self.linear(h)) * self.rngs[0].random()


class Counter(Linear4):
    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, h):
        self.n += 1
        return torch.tanh(self.linear(h)) * (1 + 0.1 * self.n)


@pytest.mark.parametrize("unit", [NumpyDepth, RandomInAList, Counter],
                         ids=["numpy_global", "random_in_a_list", "python_counter"])
def test_python_side_randomness_and_numbers_are_replayed(unit):
    import numpy as np

    torch.manual_seed(0)
    model = linear_sequence(unit)
    torch.manual_seed(0)
    reference = linear_sequence(unit, Store())
    x = torch.randn(5, 8, dtype=torch.float64)
    x, x_reference = leaf(x), leaf(x)
    for seed in range(3):
        for m, xi in ((model, x), (reference, x_reference)):
            np.random.seed(seed)
            released_step(m, xi, seed=seed)
    assert rel_error(x.grad, x_reference.grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10


@pytest.mark.parametrize("wrapper", ["sequence", "Checkpointed"])
def test_a_with_kwargs_hook_changing_an_output_is_replayed(wrapper):
    def clamp(module, args, kwargs, out):
        return out.clamp_(-0.3, 0.3)

    if wrapper == "sequence":
        model = make_stack(3).double()
        for block in model:
            block.f[0].register_forward_hook(clamp, with_kwargs=True)
    else:
        model = nn.Sequential(revnets.Checkpointed(conv_unit(8)), conv_unit(8)).double()
        model[0].module[0].register_forward_hook(clamp, with_kwargs=True)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    assert_trains_like(model, twin(model), leaf(x), leaf(x))


def test_a_full_backward_hook_on_a_block_fires_when_stored_and_is_refused_when_reconstructed():
    calls = []
    model = make_stack(2, memory=Store())
    model[0].register_full_backward_hook(lambda *args: calls.append(1))
    model(torch.randn(2, 8, 4, 4, requires_grad=True)).sum().backward()
    assert calls == [1]
    model.memory = Reconstruct()
    with pytest.raises(RuntimeError, match="block 0 has a backward hook"):
        model(torch.randn(2, 8, 4, 4, requires_grad=True))


def block_hook_calls(memory, register) -> list:
    """The hooks ``register(block, calls)`` puts on (or around) each block of a two-block
    sequence, as called by one training step."""
    calls: list = []
    model = make_stack(2, memory=memory)
    handles = [handle for block in model for handle in register(block, calls)]
    try:
        model(torch.randn(2, 8, 4, 4, requires_grad=True)).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return calls


@pytest.mark.parametrize("register", [
    lambda block, calls: [
        block.register_forward_pre_hook(lambda m, a, k: calls.append("pre"), with_kwargs=True),
        block.register_forward_hook(lambda m, a, k, o: calls.append("hook"), with_kwargs=True)],
    lambda block, calls: [
        nn.modules.module.register_module_forward_pre_hook(
            lambda m, a: calls.append("pre") if m is block else None),
        nn.modules.module.register_module_forward_hook(
            lambda m, a, o: calls.append("hook") if m is block else None)],
], ids=["with_kwargs", "global"])
def test_forward_hooks_of_a_block_fire_when_reconstructed_as_when_stored(register):
    assert block_hook_calls(Reconstruct(), register) == block_hook_calls(Store(), register) \
        == ["pre", "hook"] * 2


def test_a_global_backward_hook_is_refused_when_reconstructed():
    hook = lambda *args: None  # noqa: E731
    handle = nn.modules.module.register_module_full_backward_hook(hook)
    try:
        with pytest.raises(RuntimeError, match="global module backward hook"):
            block_hook_calls(Reconstruct(), lambda block, calls: [])
    finally:
        handle.remove()


class ReentrantlyCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(3, 3), nn.Tanh())

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=True)


def test_a_reentrant_checkpoint_inside_f_is_named_in_backward():
    sequence = revnets.ReversibleSequence([
        revnets.ReversibleBlock(ReentrantlyCheckpointed(), ReentrantlyCheckpointed())])
    out = sequence(torch.randn(4, 6, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="use_reentrant=True.*use use_reentrant=False"):
        out.backward()


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def forward(self, x, context):
        shift = context["shift"] if isinstance(context, dict) else context[0]
        return torch.tanh(self.layer(x) + shift)


@pytest.mark.parametrize("wrap", [lambda t: [t], lambda t: {"shift": t}], ids=["list", "dict"])
def test_a_context_container_holding_a_tensor_that_requires_grad_is_refused_by_name(wrap):
    sequence = revnets.ReversibleSequence([revnets.ReversibleBlock(Shifted(), Shifted())])
    shift = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="context argument 0 is a .* pass each one"):
        sequence(torch.randn(4, 6), wrap(shift))


@pytest.mark.parametrize("sharded", ["block", "f"])
def test_a_block_or_transform_sharded_with_fsdp2_is_refused_by_name(sharded, tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        sequence = make_stack(2)
        fully_shard(sequence[0] if sharded == "block" else sequence[0].f)
        with pytest.raises(RuntimeError, match="sharded with FSDP2's fully_shard.*"
                                               "apply fully_shard to the ReversibleSequence"):
            sequence(torch.randn(2, 8, 4, 4, requires_grad=True))
    finally:
        dist.destroy_process_group()
