"""Reversible sequences inside and around what users already use: conditioning, other memory
savers, hooks, randomness, module state. Each test compares the reversible path with the same
modules under ordinary autograd (float64, 1e-10), or expects an error that names the problem."""

import itertools
import random
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import revnets
from revnets import Reconstruct

from conftest import max_grad_error, rel_error, twin

WIDTH, CONTEXT = 6, 5


class FiLM(nn.Module):
    """A transform conditioned on a context vector (FiLM): linear - BatchNorm - scale and shift
    from the context - tanh - dropout."""

    def __init__(self, out: int = WIDTH, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, out, bias=False)  # a bias before BatchNorm gets no gradient
        self.norm = nn.BatchNorm1d(out)
        self.film = nn.Linear(CONTEXT, 2 * out)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, context):
        scale, shift = self.film(context).chunk(2, dim=-1)
        return self.dropout(torch.tanh(self.norm(self.linear(x)) * (1 + scale) + shift))


def film_sequence(depth=3, coupling="additive", dropout=0.0, **kwargs):
    out = 2 * WIDTH if coupling == "affine" else WIDTH
    return revnets.ReversibleSequence(
        [
            revnets.ReversibleBlock(
                FiLM(out, dropout), FiLM(out, dropout), coupling=coupling, split_dim=-1
            )
            for _ in range(depth)
        ],
        **kwargs,
    ).double()


def leaves(*tensors):
    """Fresh float64 leaves requiring grad: one set per model compared."""
    return [t.detach().clone().requires_grad_() for t in tensors]


def inputs(batch=4):
    return torch.randn(batch, 2 * WIDTH, dtype=torch.float64), torch.randn(
        batch, CONTEXT, dtype=torch.float64
    )


def step(model, *args, seed=0, wrap=lambda fn, *a: fn(*a)):
    """One training step whose output nothing holds during backward, as in a training loop (the
    engine may then release the output early and add into the incoming gradient)."""
    torch.manual_seed(seed)
    random.seed(seed)
    wrap(model, *args).square().sum().backward()


def assert_same_training(model, plain, args, args_plain):
    for a, b in zip(args, args_plain):
        if a.requires_grad:
            assert rel_error(a.grad, b.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(a, b) if not a.is_floating_point() else (
            torch.allclose(a, b, rtol=0, atol=1e-12)
        ), name


# -- 1. conditioning -----------------------------------------------------------------------------


@pytest.mark.parametrize("store_last_blocks", [0, 1, 3])
@pytest.mark.parametrize("coupling", ["additive", "affine"])
def test_context_gets_exact_gradients(coupling, store_last_blocks):
    model = film_sequence(coupling=coupling, memory=Reconstruct(store_last_blocks))
    plain = twin(model)
    x, t = inputs()
    args, args_plain = leaves(x, t), leaves(x, t)
    step(model, *args), step(plain, *args_plain)
    assert args[1].grad is not None and args[1].grad.abs().sum() > 0
    assert_same_training(model, plain, args, args_plain)


def test_context_through_a_single_block_and_its_inverse():
    block = revnets.ReversibleBlock(FiLM(), FiLM(), split_dim=-1).double().eval()
    x, t = inputs()
    assert torch.allclose(block.inverse(block(x, t), t), x, rtol=0, atol=1e-12)


def test_context_may_be_a_sequence_of_other_shape_and_non_tensors():
    """Cross-attention style: the context is a memory of other tokens, plus a flag."""

    class CrossAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv = nn.Linear(WIDTH, WIDTH), nn.Linear(CONTEXT, 2 * WIDTH)

        def forward(self, x, memory, causal):
            k, v = self.kv(memory).chunk(2, dim=-1)
            return F.scaled_dot_product_attention(self.q(x), k, v, is_causal=causal)

    model = revnets.ReversibleSequence(
        revnets.ReversibleBlock(CrossAttention(), CrossAttention(), split_dim=-1)
        for _ in range(3)
    ).double()
    plain = twin(model)
    x = torch.randn(2, 7, 2 * WIDTH, dtype=torch.float64)
    memory = torch.randn(2, 7, CONTEXT, dtype=torch.float64)
    args, args_plain = leaves(x, memory), leaves(x, memory)
    step(model, *args, False), step(plain, *args_plain, False)
    assert_same_training(model, plain, args, args_plain)


class ReadsAnAttribute(nn.Module):
    """Reads a tensor held as an attribute (a time embedding set before the call)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.embedding = None

    def forward(self, x):
        return self.linear(x) * self.embedding


class ReadsAPlainList(nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = [nn.Parameter(torch.randn(WIDTH, WIDTH))]  # not registered

    def forward(self, x):
        return x @ self.weights[0]


def test_a_tensor_read_through_an_attribute_is_refused_by_name():
    f = ReadsAnAttribute()
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(f, nn.Linear(WIDTH, WIDTH), split_dim=-1)] * 2
    )
    f.embedding = torch.randn(WIDTH, requires_grad=True) * 2  # computed earlier in the model
    out = model(torch.randn(3, 2 * WIDTH))
    with pytest.raises(RuntimeError, match=r"ReversibleBlock.f \(ReadsAnAttribute\) reads the "
                                           r"attribute f.embedding.*Pass it as context"):
        out.sum().backward()


class ReadsAPlainObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.settings = types.SimpleNamespace(weights={"w": nn.Parameter(torch.randn(WIDTH))})

    def forward(self, x):
        return x * self.settings.weights["w"]


@pytest.mark.parametrize("g, where", [
    (ReadsAPlainList, r"g\.weights\[0\]"), (ReadsAPlainObject, r"g\.settings\.weights\['w'\]"),
], ids=["list", "plain-object"])
def test_a_parameter_held_unregistered_is_refused_by_the_path_it_is_held_through(g, where):
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(nn.Linear(WIDTH, WIDTH), g(), split_dim=-1)]
    )
    out = model(torch.randn(3, 2 * WIDTH, requires_grad=True))
    with pytest.raises(RuntimeError, match=rf"ReversibleBlock.g \({g.__name__}\) reads the "
                                           rf"attribute {where}, which requires grad"):
        out.sum().backward()


def test_a_tensor_from_a_closure_is_refused():
    scale = nn.Parameter(torch.ones(WIDTH))

    class Closure(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * (scale * 2)

    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(Closure(), nn.Linear(WIDTH, WIDTH), split_dim=-1)]
    )
    out = model(torch.randn(3, 2 * WIDTH, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"reads a tensor of shape \(6,\).*not one of its "
                                           r"parameters \(read by MulBackward0"):
        out.sum().backward()


# -- 2. inside other memory savers ---------------------------------------------------------------


def _checkpointed(model, *args):
    return revnets.checkpoint(model, *args)


def _torch_checkpoint(model, *args):
    return torch.utils.checkpoint.checkpoint(model, *args, use_reentrant=False)


def _save_on_cpu(model, *args):
    with torch.autograd.graph.save_on_cpu():
        return model(*args)


def _custom_hooks(model, *args):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        return model(*args)


WRAPPERS = {
    "plain": lambda model, *args: model(*args),
    "Checkpointed": _checkpointed,
    "torch_checkpoint": _torch_checkpoint,
    "save_on_cpu": _save_on_cpu,
    "saved_tensors_hooks": _custom_hooks,
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_inside_other_memory_savers(wrapper):
    """The twin runs inside the same wrapper: torch.utils.checkpoint updates BatchNorm
    statistics twice for ordinary modules too."""
    model = film_sequence(dropout=0.2)
    plain = twin(model)
    x, t = inputs()
    args, args_plain = leaves(x, t), leaves(x, t)
    for seed in range(2):
        step(model, *args, seed=seed, wrap=WRAPPERS[wrapper])
        step(plain, *args_plain, seed=seed, wrap=WRAPPERS[wrapper])
    assert_same_training(model, plain, args, args_plain)


def plain_unit(dropout=0.2):
    return nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                         nn.Dropout(dropout))


def test_inside_checkpoint_segments():
    def stage():
        return revnets.ReversibleSequence(
            revnets.ReversibleBlock(plain_unit(), plain_unit(), split_dim=-1) for _ in range(3)
        )

    model = nn.Sequential(nn.Linear(2 * WIDTH, 2 * WIDTH), stage(),
                          nn.Linear(2 * WIDTH, 2 * WIDTH), stage()).double()
    segmented = revnets.checkpoint_segments(model, 2)
    plain = twin(model)
    x = torch.randn(4, 2 * WIDTH, dtype=torch.float64)
    args, args_plain = leaves(x), leaves(x)
    for seed in range(2):
        step(segmented, *args, seed=seed), step(plain, *args_plain, seed=seed)
    assert_same_training(model, plain, args, args_plain)


def test_inside_auto_checkpoint_plans():
    """A chain with reversible stages, planned under a budget below what storing it all takes:
    the planner checkpoints segments that contain the reversible sequences."""

    def stage():
        return revnets.ReversibleSequence(
            revnets.ReversibleBlock(plain_unit(), plain_unit(), split_dim=-1) for _ in range(2)
        )

    layers = []
    for _ in range(4):
        layers += [nn.Linear(2 * WIDTH, 2 * WIDTH), nn.Tanh(), stage()]
    model = nn.Sequential(*layers).double()
    x = torch.randn(64, 2 * WIDTH, dtype=torch.float64)
    everything = revnets.predict_memory(lambda m, x: m(x).sum().backward(), model, x).peak_bytes
    planned = revnets.auto_checkpoint(model, x, budget=everything - 1, measure_time=False)
    assert any(isinstance(m, revnets.Checkpointed) for m in planned.plan.modules())
    plain = twin(model)
    args, args_plain = leaves(x), leaves(x)
    for seed in range(2):
        step(planned, *args, seed=seed), step(plain, *args_plain, seed=seed)
    assert_same_training(model, plain, args, args_plain)


# -- 3. hooks ------------------------------------------------------------------------------------


def test_parameter_tensor_hooks_fire_once_on_the_total_gradient():
    model = film_sequence(dropout=0.1)
    plain = twin(model)
    calls = {"reversible": 0, "plain": 0}
    for name, m in (("reversible", model), ("plain", plain)):
        for p in m.parameters():
            def halve(grad, name=name):
                calls[name] += 1
                return grad / 2
            p.register_hook(halve)
    x, t = inputs()
    args, args_plain = leaves(x, t), leaves(x, t)
    step(model, *args), step(plain, *args_plain)
    assert calls["reversible"] == calls["plain"] == len(list(model.parameters()))
    assert_same_training(model, plain, args, args_plain)


def test_post_accumulate_grad_hooks_fire_once():
    model = film_sequence()
    calls = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    x, t = inputs()
    step(model, *leaves(x, t))
    assert len(calls) == len(list(model.parameters()))


def test_forward_hooks_fire_once_and_see_intact_activations():
    model = film_sequence(depth=4)
    plain = twin(model)
    seen = {"reversible": [], "plain": []}
    for name, m in (("reversible", model), ("plain", plain)):
        for block in m:
            block.g.register_forward_hook(
                lambda mod, args, out, name=name: seen[name].append((args[0], out))
            )
            block.register_forward_hook(
                lambda mod, args, out, name=name: seen[name].append((args[0], out))
            )
    x, t = inputs()
    args, args_plain = leaves(x, t), leaves(x, t)
    step(model, *args), step(plain, *args_plain)
    assert len(seen["reversible"]) == len(seen["plain"]) == 8
    for (a_in, a_out), (b_in, b_out) in zip(seen["reversible"], seen["plain"]):
        # Still what the forward pass computed, although the engine works in place.
        assert torch.allclose(a_in, b_in, rtol=0, atol=1e-12)
        assert torch.allclose(a_out, b_out, rtol=0, atol=1e-12)
    assert_same_training(model, plain, args, args_plain)


def test_a_loss_on_a_hooked_activation_is_refused():
    """Ordinary autograd would backpropagate an auxiliary loss into the block; the reversible
    engine keeps no graph there, so it refuses rather than silently drop the term."""
    model = film_sequence()
    captured = []
    model[1].f.linear.register_forward_hook(lambda mod, args, out: captured.append(out))
    x, t = inputs()
    out = model(*leaves(x, t))
    loss = out.square().sum() + captured[0].square().sum()
    with pytest.raises(RuntimeError, match=r"a loss used an activation from inside block 1"):
        loss.backward()


def test_forward_pre_hooks_run_again_and_can_tell():
    model = film_sequence()
    passes = []
    model[0].f.register_forward_pre_hook(lambda *_: passes.append(revnets.is_recomputing()))
    x, t = inputs()
    step(model, *leaves(x, t))
    assert passes == [False, True]


def test_global_forward_hooks_fire_once_per_module_call():
    model, plain = film_sequence(), None
    plain = twin(model)
    counts = {}
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: counts.__setitem__(id(mod), counts.get(id(mod), 0) + 1)
    )
    try:
        x, t = inputs()
        step(model, *leaves(x, t))
        reversible = sorted(counts.get(id(m), 0) for m in model.modules())
        counts.clear()
        step(plain, *leaves(x, t))
        ordinary = sorted(counts.get(id(m), 0) for m in plain.modules())
    finally:
        handle.remove()
    # Blocks run as halves inside a sequence; everything in f and g fires as often as in plain.
    assert reversible == ordinary


# -- 4. randomness -------------------------------------------------------------------------------


class ForkedDropout(nn.Module):
    """Draws inside torch.random.fork_rng: the generators look untouched afterwards."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        with torch.random.fork_rng():
            return F.dropout(self.linear(x), 0.5)


class GeneratorNoise(nn.Module):
    """Draws from its own torch.Generator."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x):
        noise = torch.rand(x.shape, generator=self.generator, dtype=x.dtype)
        return self.linear(x) * noise


class StochasticDepth(nn.Module):
    """Skips its branch at random, decided by Python's random module."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        if random.random() < 0.5:
            return torch.zeros_like(x)
        return torch.tanh(self.linear(x))


def dropout_linear():
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5))


@pytest.mark.parametrize("store_last_blocks", [0, 1])
@pytest.mark.parametrize("f,g", [
    # g draws from the global generator as well, so every f forks another state.
    (ForkedDropout, dropout_linear),
    (GeneratorNoise, GeneratorNoise),
    (StochasticDepth, StochasticDepth),
], ids=["fork_rng", "generator", "python_random"])
def test_randomness_from_any_generator_is_replayed(f, g, store_last_blocks):
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(f(), g(), split_dim=-1) for _ in range(6)],
        Reconstruct(store_last_blocks),
    ).double()
    plain = twin(model)
    x = torch.randn(4, 2 * WIDTH, dtype=torch.float64)
    args, args_plain = leaves(x), leaves(x)
    for seed in range(3):
        step(model, *args, seed=seed), step(plain, *args_plain, seed=seed)
    assert_same_training(model, plain, args, args_plain)


# -- 5. module state -----------------------------------------------------------------------------


class EMANorm(nn.Module):
    """Normalises with an exponential moving average of the batch mean that it updates in its
    forward and uses in its output (a buffer read after being changed)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, x):
        h = self.linear(x)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(h.mean(0), alpha=0.5)
        return torch.tanh(h - self.ema)


class HandMadeBatchNorm(nn.Module):
    """Calls F.batch_norm with its own running statistics, not an nn.BatchNorm module."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH, bias=False)
        self.register_buffer("mean", torch.zeros(WIDTH))
        self.register_buffer("var", torch.ones(WIDTH))

    def forward(self, x):
        return F.batch_norm(self.linear(x), self.mean, self.var, training=self.training,
                            momentum=0.3)


def spectral():
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH)), nn.Tanh())


def spectral_parametrized():
    return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH)),
                         nn.Tanh())


STATEFUL = {
    "ema": EMANorm,
    "hand_made_batch_norm": HandMadeBatchNorm,
    "spectral_norm": spectral,
    "parametrized_spectral_norm": spectral_parametrized,
}


@pytest.mark.parametrize("store_last_blocks", [0, 1])
@pytest.mark.parametrize("kind", list(STATEFUL))
def test_buffers_the_forward_updates_are_replayed_and_updated_once(kind, store_last_blocks):
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(STATEFUL[kind](), STATEFUL[kind](), split_dim=-1)
         for _ in range(4)],
        Reconstruct(store_last_blocks),
    ).double()
    plain = twin(model)
    x = torch.randn(5, 2 * WIDTH, dtype=torch.float64)
    args, args_plain = leaves(x), leaves(x)
    for seed in range(3):
        step(model, *args, seed=seed), step(plain, *args_plain, seed=seed)
    assert_same_training(model, plain, args, args_plain)


@pytest.mark.parametrize("kind", list(STATEFUL))
def test_checkpointed_replays_buffers_the_forward_updates(kind):
    model = revnets.Checkpointed(nn.Sequential(STATEFUL[kind](), STATEFUL[kind]())).double()
    plain = twin(model)
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    args, args_plain = leaves(x), leaves(x)
    for seed in range(3):
        step(model, *args, seed=seed), step(plain, *args_plain, seed=seed)
    assert_same_training(model, plain, args, args_plain)


class RotaryCache(nn.Module):
    """Rebuilds a cache buffer in its forward when the input is longer than the cache."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("cache", torch.zeros(0, WIDTH), persistent=False)

    def forward(self, x):
        if self.cache.shape[0] < x.shape[0]:
            self.cache = torch.cos(torch.arange(x.shape[0] * WIDTH, dtype=x.dtype)).view(-1, WIDTH)
        return self.linear(x) * self.cache[: x.shape[0]]


def test_checkpointed_accepts_a_cache_rebuilt_in_the_forward():
    model = revnets.Checkpointed(RotaryCache()).double()
    plain = twin(model)
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    args, args_plain = leaves(x), leaves(x)
    step(model, *args), step(plain, *args_plain)
    assert_same_training(model, plain, args, args_plain)


# -- 6. changed between forward and backward -----------------------------------------------------


def test_a_frozen_weight_modified_after_the_forward_is_refused():
    model = film_sequence()
    model[0].f.linear.weight.requires_grad_(False)
    x, t = inputs()
    out = model(*leaves(x, t))
    with torch.no_grad():
        model[0].f.linear.weight.mul_(2)
    with pytest.raises(RuntimeError, match=r"blocks.0.f.linear.weight was modified in place"):
        out.sum().backward()


def test_an_eval_mode_statistic_modified_after_the_forward_is_refused():
    model = film_sequence()
    model[1].g.norm.eval()
    x, t = inputs()
    out = model(*leaves(x, t))
    with torch.no_grad():
        model[1].g.norm.running_var.mul_(2)
    with pytest.raises(RuntimeError, match=r"blocks.1.g.norm.running_var was modified in place"):
        out.sum().backward()


@pytest.mark.parametrize("wrap", ["reversible", "checkpointed"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["frozen", "unfrozen"])
def test_a_weight_frozen_or_unfrozen_after_the_forward_is_refused(wrap, requires_grad):
    model = film_sequence()
    weight = model[0].f.linear.weight
    weight.requires_grad_(not requires_grad)
    if wrap == "checkpointed":
        model = revnets.Checkpointed(model)
    x, t = inputs()
    out = model(*leaves(x, t))
    weight.requires_grad_(requires_grad)
    with pytest.raises(RuntimeError, match=r"f.linear.weight.requires_grad was"):
        out.sum().backward()


HOOKS = {
    "forward_pre_hook": lambda m, hook: m.register_forward_pre_hook(hook),
    "full_backward_hook": lambda m, hook: m.register_full_backward_hook(hook),
    "backward_pre_hook": lambda m, hook: m.register_full_backward_pre_hook(hook),
}


@pytest.mark.parametrize("wrap", ["reversible", "checkpointed"])
@pytest.mark.parametrize("register", HOOKS.values(), ids=HOOKS.keys())
def test_a_hook_registered_between_forward_and_backward_does_not_run_for_that_step(
    wrap, register
):
    """Under ordinary autograd it does not run for this step; the recomputation would have run
    it (it was refused by name): it is hidden from the recomputation, and the next step trains
    with it."""
    model = film_sequence().double()
    if wrap == "checkpointed":
        model = revnets.Checkpointed(model)
    reference = twin(model)
    calls, (x, t) = {}, inputs()
    for m, name in ((model, "revnets"), (reference, "plain")):
        linear = (m.module if wrap == "checkpointed" else m)[0].f.linear
        out = m(*leaves(x, t))
        calls[name] = []
        register(linear, lambda *args, name=name: calls[name].append(1))
        out.square().sum().backward()
        calls[name].append("step")
        m(*leaves(x, t)).square().sum().backward()
    first = {name: c[:c.index("step")] for name, c in calls.items()}
    assert first["revnets"] == first["plain"] == []  # later, pre-hooks rerun (rule 4)
    assert max_grad_error(model, reference) <= 1e-10


def test_two_forwards_before_backward_train_like_ordinary_autograd():
    """Siamese use: the second forward updates the statistics again before either backward."""
    model = film_sequence(dropout=0.2)
    plain = twin(model)
    x, t = inputs()
    for m in (model, plain):
        torch.manual_seed(0)
        a, b = m(x, t), m(2 * x, t)
        (a * b).sum().backward()
    assert max_grad_error(model, plain) <= 1e-10


# -- 7. memory -----------------------------------------------------------------------------------


def test_the_output_is_released_before_the_blocks_below_the_top_are_recomputed():
    """Nothing holds the output during backward: the top block takes its halves out of it (in
    the layout the forward gave them, NOTE [ Layout ]) and its memory is freed at once, the random
    draws replayed all the same."""
    model = film_sequence(depth=3, dropout=0.3)
    plain = twin(model)
    output, alive_below_top = [], []

    def remember(module, args, out):
        output.append(weakref.ref(out.untyped_storage()))

    def look(module, args):
        if revnets.is_recomputing():
            alive_below_top.append(output[0]() is not None)

    model.register_forward_hook(remember)
    model[-2].g.register_forward_pre_hook(look)
    x, t = inputs()
    args, args_plain = leaves(x, t), leaves(x, t)
    step(model, *args), step(plain, *args_plain)
    assert alive_below_top == [False]
    assert_same_training(model, plain, args, args_plain)


def test_an_output_the_caller_holds_is_left_intact():
    model = film_sequence(depth=3, dropout=0.3)
    plain = twin(model)
    x, t = inputs()
    args, args_plain = leaves(x, t), leaves(x, t)
    torch.manual_seed(0)
    out = model(*args)
    kept = out.detach().clone()
    out.square().sum().backward()
    step(plain, *args_plain)
    assert torch.equal(out.detach(), kept)
    assert_same_training(model, plain, args, args_plain)


def test_the_incoming_gradient_is_added_into_when_nothing_else_holds_it():
    """The backward runs in the memory of the gradient it is given and hands that on as its
    input's gradient, instead of allocating a gradient per block."""
    model = film_sequence(depth=3)
    x, t = leaves(*inputs())
    incoming, returned = [], []
    x.register_hook(lambda grad: returned.append(grad.data_ptr()))
    out = model(x, t)
    out.register_hook(lambda grad: incoming.append(grad.data_ptr()))
    loss = out.square().sum()
    del out
    loss.backward()
    assert returned == incoming


class FullShapeShift(nn.Module):
    """``x / 2 + p`` with ``p`` of the input's full shape: autograd hands ``p`` the very gradient
    tensor that flows into ``x``."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(shape, dtype=torch.float64))

    def forward(self, x, context):
        return x / 2 + self.p


@pytest.mark.parametrize("held", ["tensor hook", "other branch", "parameter"])
def test_gradients_others_hold_are_never_added_into(held):
    """The incoming gradient kept by a tensor hook or also flowing to another branch, and
    parameter gradients that are the very tensors the blocks pass down (within a block and to
    the blocks below), stay as autograd made them, over two accumulating steps."""
    x, t = inputs()
    shape = (x.shape[0], WIDTH)
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(FiLM(), FiLM(), split_dim=-1),
         revnets.ReversibleBlock(FullShapeShift(shape), FiLM(), split_dim=-1),
         revnets.ReversibleBlock(FiLM(), FullShapeShift(shape), split_dim=-1)]
    ).double()
    plain = twin(model)
    other = torch.randn_like(x, requires_grad=True)
    weight = torch.randn_like(x)
    results = []
    for m in (model, plain):
        kept = []
        args = leaves(x, t)
        branch = leaves(other)[0]
        for _ in range(2):  # accumulating: no .grad may share another's memory
            out = m(*args)
            if held == "tensor hook":
                out.register_hook(kept.append)
            elif held == "other branch":
                out = out + branch
            (out * weight).sum().backward()
            del out
        results.append((args, branch, kept))
    (args, branch, kept), (args_plain, branch_plain, kept_plain) = results
    assert_same_training(model, plain, args, args_plain)
    if held == "tensor hook":
        assert torch.equal(kept[0], kept_plain[0])
    if held == "other branch":
        assert torch.equal(branch.grad, branch_plain.grad)


# -- 8. smaller ----------------------------------------------------------------------------------


def test_lazy_modules_in_f_train_from_the_first_call():
    torch.manual_seed(0)
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(nn.LazyConv2d(2, 3, padding=1), nn.LazyConv2d(2, 3, padding=1))
         for _ in range(2)]
    ).double()
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()  # the first call creates the parameters
    plain = twin(model)
    for p in model.parameters():
        p.grad = None
    args, args_plain = leaves(x), leaves(x)
    step(model, *args), step(plain, *args_plain)
    assert_same_training(model, plain, args, args_plain)


@pytest.mark.parametrize("store_last_blocks", [0, 1])
def test_channels_last_output_keeps_its_layout(store_last_blocks):
    def unit():
        return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())

    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(unit(), unit()) for _ in range(2)],
        Reconstruct(store_last_blocks),
    ).to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 5, 5, requires_grad=True).to(memory_format=torch.channels_last)
    plain = twin(model)
    assert model(x).is_contiguous(memory_format=torch.channels_last) == plain(x).is_contiguous(
        memory_format=torch.channels_last
    )


# -- all together --------------------------------------------------------------------------------


MATRIX = list(itertools.product(
    ["plain", "Checkpointed", "torch_checkpoint", "save_on_cpu"],  # wrapped in
    [False, True],  # parameter hooks
    [0.0, 0.25],  # dropout
    ["additive", "affine"],
    [(0, None), (1, None), (0, 2)],  # store_last_blocks, keep_input_every
))


@pytest.mark.parametrize("wrapper,hooks,dropout,coupling,storage", MATRIX)
def test_compositions(wrapper, hooks, dropout, coupling, storage):
    model = film_sequence(depth=4, coupling=coupling, dropout=dropout, memory=Reconstruct(*storage))
    plain = twin(model)
    if hooks:
        for m in (model, plain):
            for p in m.parameters():
                p.register_hook(lambda grad: grad * 0.5)
            m[1].g.register_forward_hook(lambda mod, args, out: None)
    x, t = inputs()
    args, args_plain = leaves(x, t), leaves(x, t)
    for seed in range(2):
        step(model, *args, seed=seed, wrap=WRAPPERS[wrapper])
        step(plain, *args_plain, seed=seed, wrap=WRAPPERS[wrapper])
    assert_same_training(model, plain, args, args_plain)
