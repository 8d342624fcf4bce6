"""revnets' own composites of known layers are recorded without the dispatcher's watch (NOTE [ Known
layers ], NOTE [ Known calls ]): a ReversibleBlock with one of revnets' couplings and the steps of a
traced graph calling torch.nn layers, torch functions and Tensor methods. Each case trains exactly
like the same modules under ordinary autograd (float64, 1e-10, batch norm statistics equal), or is
shown to take the watched path."""

import enum

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import revnets
from revnets.models.reversible_vit import reversible_vit_block
from revnets.planning import as_graph_chain
from revnets.replay.known import known_run

from conftest import max_grad_error, rel_error, twin

CPU = torch.device("cpu")
WIDTH = 6


def unit(first_inplace=False):
    return nn.Sequential(
        nn.ReLU(inplace=True) if first_inplace else nn.Identity(),
        nn.Linear(WIDTH, WIDTH, bias=False), nn.BatchNorm1d(WIDTH), nn.ReLU(inplace=True),
        nn.Dropout(0.3), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
    )


class MyCoupling(revnets.AdditiveCoupling):
    pass


class Functional(nn.Module):
    """Functions and methods torch made, with dropout, batch norm and in-place writes into
    memory the forward made."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, 2 * WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.a(x)
        u, v = h.chunk(2, dim=-1)
        u = F.relu(self.norm(u), True)  # in place, positionally, into the norm's output
        h = u * torch.sigmoid(v)
        h = F.dropout(h, 0.25)  # drawing in both modes: a trace must not read self.training
        h = h.transpose(0, 1).contiguous().transpose(0, 1)
        h += x  # in place into memory the forward made
        return self.b(h).tanh()


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x.mul_(2)
        return self.a(x)


class ReadsABuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.ones(WIDTH))

    def forward(self, x):
        return self.a(x) * self.scale


class DrawsFromItsGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x):
        return self.a(x) + torch.randn(x.shape, generator=self.generator, dtype=x.dtype)


def twice_as_wide():
    return nn.Sequential(unit(), nn.Linear(WIDTH, 2 * WIDTH))


KNOWN_BLOCKS = {
    "additive": lambda: revnets.ReversibleBlock(unit(), unit(), split_dim=-1),
    "affine": lambda: revnets.ReversibleBlock(
        twice_as_wide(), twice_as_wide(), "affine", split_dim=-1
    ),
    "rev_vit": lambda: reversible_vit_block(WIDTH, num_heads=2),
    "rev_vit_attention_dropout": lambda: reversible_vit_block(WIDTH, 2, attn_drop=0.1),
}


@pytest.mark.parametrize("make", KNOWN_BLOCKS.values(), ids=KNOWN_BLOCKS.keys())
def test_a_reversible_block_of_known_layers_is_recorded_without_the_watch(make):
    assert known_run([make()], CPU, keep_random=True) is not None


def test_attention_draws_only_with_a_dropout_rate_in_training():
    """F.scaled_dot_product_attention has no Python signature: its ``dropout_p`` keyword says
    whether it draws (a run that draws keeps the generator's state for the replay)."""
    quiet, dropping = reversible_vit_block(WIDTH, 2), reversible_vit_block(WIDTH, 2, attn_drop=0.1)
    assert not known_run([quiet], CPU, keep_random=True).draws
    assert known_run([dropping], CPU, keep_random=True).draws
    assert not known_run([dropping.eval()], CPU, keep_random=True).draws


def test_a_block_that_drops_paths_is_known_and_draws_in_training_only():
    """The block draws its drop-path masks itself (NOTE [ Drop path outside the transforms ]):
    a recording of it keeps the generator's state for the replay, in training only."""
    block = reversible_vit_block(WIDTH, 2, drop_path=0.1)
    assert known_run([block], CPU, keep_random=True).draws
    assert not known_run([block.eval()], CPU, keep_random=True).draws


WATCHED_BLOCKS = {
    # f would write into a view of the caller's tensor
    "f_writes_its_input": lambda: revnets.ReversibleBlock(unit(first_inplace=True), unit()),
    "coupling_of_ones_own": lambda: revnets.ReversibleBlock(unit(), unit(), MyCoupling()),
    # its grid code reads values
    "exact_coupling": lambda: revnets.ReversibleBlock(
        unit(), unit(), revnets.ExactAdditiveCoupling()
    ),
    "hook_on_the_block": lambda: _hooked(revnets.ReversibleBlock(unit(), unit())),
    "method_on_the_instance": lambda: _with_method(revnets.ReversibleBlock(unit(), unit())),
    "user_f": lambda: revnets.ReversibleBlock(WritesItsInput(), unit()),
    # timm's DropPath is code of its own
    "timm_drop_path_in_f": lambda: revnets.ReversibleBlock(
        nn.Sequential(unit(), timm.layers.DropPath(0.1)), unit()),
    # v writes into the attention's input, the block's own (q made fresh memory, from it)
    "rev_vit_v_writes_its_input": lambda: _v_in_place(reversible_vit_block(WIDTH, num_heads=2)),
}


def _v_in_place(block):
    block.f.norm = nn.Identity()
    block.f.body.q, block.f.body.v = nn.Tanh(), nn.ReLU(inplace=True)
    return block


def _hooked(m):
    m.register_forward_hook(lambda *args: None)
    return m


def _with_method(m):
    m.merge = lambda a, b: torch.cat((a, b), dim=-1)
    return m


@pytest.mark.parametrize("make", WATCHED_BLOCKS.values(), ids=WATCHED_BLOCKS.keys())
def test_a_block_with_anything_else_is_watched(make):
    assert known_run([make()], CPU, keep_random=True) is None


def test_the_steps_of_a_traced_graph_of_known_calls_are_recorded_without_the_watch():
    assert known_run([as_graph_chain(Functional())], CPU, keep_random=True) is not None


class ScaledNorm(nn.LayerNorm):
    """A layer without submodules made outside torch (as timm's LayerNorm is), whose forward
    calls known functions only."""

    def forward(self, x):
        return 2 * F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def with_a_user_made_layer():
    return as_graph_chain(nn.Sequential(nn.Linear(WIDTH, WIDTH), ScaledNorm(WIDTH), nn.GELU()))


def test_a_user_made_layer_is_traced_into_known_calls():
    # Called as a module, it was user code, and the whole segment went to the watch.
    assert known_run([with_a_user_made_layer()], CPU, keep_random=True) is not None
    trains_like_ordinary_autograd(
        lambda: revnets.checkpoint_segments(with_a_user_made_layer(), 2), width=WIDTH)


class WritesAWeightThroughOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        w = self.a.weight.data
        torch.mul(w, 0.5, out=w)
        return self.a(x)


class RenormalisesItsEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, WIDTH))

    def forward(self, x):
        return F.embedding(x.long().clamp(0, 9), self.table, max_norm=1.0)


class MovesToAnotherDevice(nn.Module):
    def forward(self, x):
        return F.dropout(x.to("meta"), 0.5)


@pytest.mark.parametrize("make", [
    WritesItsInput, ReadsABuffer, DrawsFromItsGenerator, WritesAWeightThroughOut,
    RenormalisesItsEmbedding, MovesToAnotherDevice,
], ids=["writes_its_input", "reads_a_buffer", "own_generator", "out_argument",
        "embedding_max_norm", "moves_device"])
def test_graph_steps_calling_anything_else_are_watched(make):
    assert known_run([as_graph_chain(make())], CPU, keep_random=True) is None


class ReturnsAViewOfItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        self.a(x)  # fresh memory, which the returned view is not
        return x.view(-1)


class WritesAView(nn.Module):
    def forward(self, x):
        v = x.view(-1)
        v.mul_(2)
        return v


class NamesAFreshValueView(nn.Module):
    """A graph whose value ``view`` is fresh, beside one whose ``view`` is the caller's."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        self.a(x).view(-1)
        return x.view(-1)


def test_a_layer_after_graph_steps_that_return_the_callers_memory_is_watched():
    steps = nn.Sequential(*as_graph_chain(ReturnsAViewOfItsInput()), nn.ReLU(inplace=True))
    assert known_run([steps], CPU, keep_random=True) is None


def test_values_of_two_graphs_with_the_same_names_are_told_apart():
    fresh_view = as_graph_chain(NamesAFreshValueView())
    writes = as_graph_chain(WritesAView())
    assert any(s.label == "view" for s in fresh_view) and any(s.label == "view" for s in writes)
    assert known_run([nn.Sequential(*fresh_view, *writes)], CPU, keep_random=True) is None


def test_torch_functions_a_coupling_calls_are_checked_as_made(monkeypatch):
    block = KNOWN_BLOCKS["affine"]()
    assert known_run([block], CPU, keep_random=True) is not None
    monkeypatch.setattr(torch, "exp", lambda t: torch.special.exp2(t))
    assert known_run([block], CPU, keep_random=True) is None


def test_a_patched_dropout_kernel_entry_sends_dropout_layers_to_the_watch():
    layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5))
    assert known_run([layers], CPU, keep_random=True) is not None
    torch._VF.dropout = lambda x, p, train: x  # F.dropout calls torch._VF.dropout
    try:
        assert known_run([layers], CPU, keep_random=True) is None
    finally:
        del torch._VF.dropout  # back to the entry torch made (found through the module)
    assert known_run([layers], CPU, keep_random=True) is not None


@pytest.mark.parametrize("on", [nn.Module, nn.Linear])
def test_a_method_another_library_adds_to_torchs_classes_keeps_layers_known(on):
    """transformers adds ``smart_apply`` to ``nn.Module`` itself when it initialises a model's
    weights: a name no code of torch's looks up. Known layers stay known (after it the replay
    watched every layer, and predictions came out 32 bytes apart with the order tests ran in);
    a method that replaces or shadows one torch made (``__call__``, ``register_forward_hook``)
    is a patch."""
    layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5))
    for name, expected in (("smart_apply", True), ("__call__", False),
                           ("register_forward_hook", False)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(on, name, lambda self, *args: None, raising=False)
            assert (known_run([layers], CPU, keep_random=True) is not None) is expected, name
    assert known_run([layers], CPU, keep_random=True) is not None


def checkpointed_functionals():
    return revnets.checkpoint_segments(as_graph_chain(nn.Sequential(Functional(), Functional())), 3)


def test_every_checkpointed_segment_of_a_traced_graph_is_recorded_without_the_watch(monkeypatch):
    # Segments after the first receive a tuple of values: the device is found inside it.
    import revnets.replay.recording

    verdicts = []

    def spy(roots, device, keep_random, verified=None):
        verdict = known_run(roots, device, keep_random, verified)
        verdicts.append(verdict is not None)
        return verdict

    monkeypatch.setattr(revnets.replay.recording, "known_run", spy)
    model = checkpointed_functionals()
    model(torch.randn(4, WIDTH)).sum().backward()
    assert verdicts == [True, True]


def test_a_positional_inplace_flag_marks_the_step_that_writes():
    steps = list(as_graph_chain(Functional()))
    relu = next(s for s in steps if s.target is F.relu)
    assert relu.writes_in_place
    assert relu.mutated is not None and steps[relu.mutates_from].label == relu.mutated


def trains_like_ordinary_autograd(make, width, steps=3):
    torch.manual_seed(0)
    model = make().double()
    reference = twin(model)
    x = torch.randn(8, width, dtype=torch.float64)
    x, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    for seed in range(steps):
        for m, xi in ((model, x), (reference, x_reference)):
            torch.manual_seed(seed)
            m(xi).square().sum().backward()
    assert rel_error(x.grad, x_reference.grad) <= 1e-10
    assert max_grad_error(model, reference) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(a, b), name


def test_checkpointed_reversible_blocks_train_like_ordinary_autograd():
    # Dropout and batch norm inside f and g: the replay draws the same masks and updates the
    # statistics once.
    def make():
        return nn.Sequential(*(
            revnets.Checkpointed(revnets.ReversibleBlock(unit(), unit(), split_dim=-1))
            for _ in range(3)
        ))

    trains_like_ordinary_autograd(make, width=2 * WIDTH)


def test_checkpointed_graph_steps_train_like_ordinary_autograd():
    trains_like_ordinary_autograd(checkpointed_functionals, width=WIDTH)


class Noisy:
    """A result type of the user's own: its ``mul`` draws from a generator it holds."""

    def __init__(self, t, generator):
        self.t, self.generator = t, generator

    def mul(self, k):
        return self.t * k + torch.randn(self.t.shape, generator=self.generator, dtype=self.t.dtype)


class MakesNoisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x):
        if x.shape[0] == 0:  # control flow torch.fx cannot trace: the module is kept whole
            return x
        return Noisy(x, self.generator)


class CallsAMethodOfItsOwnType(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.make, self.b = nn.Linear(WIDTH, WIDTH), MakesNoisy(), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        noisy = self.make(self.a(x))
        # ``mul`` and ``tanh``: names of Tensor methods; ``x`` is handed on beside ``noisy``
        return self.b(noisy.mul(2).tanh()) + x


def test_a_method_called_on_a_value_of_the_users_own_type_is_watched():
    """The second segment starts from a ``Noisy``, whose ``mul`` a traced step calls by name:
    its draw from the user's generator is replayed only by the watch (NOTE [ Known calls ])."""

    def make():
        steps = list(as_graph_chain(CallsAMethodOfItsOwnType()))
        cut = next(i for i, s in enumerate(steps) if s.target == "mul")
        return nn.Sequential(revnets.Checkpointed(nn.Sequential(*steps[:cut])),
                             revnets.Checkpointed(nn.Sequential(*steps[cut:])))

    trains_like_ordinary_autograd(make, width=WIDTH)


class Scale(enum.Enum):
    """A constant torch.fx keeps in the graph as it is, with a method of the user's own."""

    HALF = 0.5

    def __rmul__(self, other):  # what ``x * Scale.HALF`` calls
        return other * self.value


class MultipliesByAConstantOfItsOwn(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.a(x) * Scale.HALF


class OwnParameter(nn.Parameter):
    pass


def test_constants_and_parameters_of_the_users_own_types_are_watched():
    assert known_run([as_graph_chain(MultipliesByAConstantOfItsOwn())], CPU, True) is None
    layer = nn.Linear(WIDTH, WIDTH)
    assert known_run([layer], CPU, keep_random=True) is not None
    layer.weight = OwnParameter(layer.weight.detach())
    assert known_run([layer], CPU, keep_random=True) is None


class DrawsOnBilinear(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` draws from a generator of its own."""

    generator = torch.Generator().manual_seed(1)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is F.bilinear:
            out = out * (1 + torch.rand(out.shape, generator=cls.generator, dtype=out.dtype))
        return out


def test_a_keyword_input_of_a_checkpointed_layer_is_checked_as_plain():
    """``input2=`` reaches nn.Bilinear, a known layer, by keyword: a subclass there is user
    code, so the run is watched and its draw replayed (the gradient of ordinary autograd)."""
    torch.manual_seed(0)
    layer = nn.Bilinear(4, 3, 5).double()
    checkpointed, reference = revnets.Checkpointed(layer), twin(layer)
    x = torch.randn(2, 4, dtype=torch.float64)
    other = torch.randn(2, 3, dtype=torch.float64).as_subclass(DrawsOnBilinear)
    for m in (checkpointed, reference):
        DrawsOnBilinear.generator.manual_seed(1)
        m(x, input2=other).square().sum().backward()
    assert max_grad_error(layer, reference) <= 1e-10


class Observes(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_sends_known_layers_to_the_watch_and_a_default_device_does_not():
    layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5))
    with Observes():
        assert known_run([layers], CPU, keep_random=True) is None
    with torch.device("cpu"):
        assert known_run([layers], CPU, keep_random=True) is not None
