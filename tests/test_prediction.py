"""predict_memory against measure_memory, to the byte on the CPU, where a bare meta device would
take other paths than the CPU: tensors the step reaches outside its arguments, tied parameters,
autocast, the CPU's own kernels, graphs torch.fx traced, buffers a forward leaves alone."""

import copy
import typing

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch._prims_common import suggest_memory_format

import revnets
from revnets.memory import (
    Predictor,
    measure_memory,
    predict_memory,
    predict_timeline,
    record_timeline,
)
from revnets.planning import as_graph_chain

from conftest import conv_unit, make_stack


def train_step(model, x, loss_fn=lambda out: out.float().sum()):
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()


def assert_predicted_exactly(step, *args):
    predicted = predict_memory(step, *args)
    measured = measure_memory(step, *args)
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.above_model_state_bytes == measured.above_model_state_bytes


def test_an_exact_sequence_is_predicted_exactly_and_its_range_check_is_flat_in_depth():
    """The range check of ``exact=True`` keeps two scalars whatever the depth (it kept two per
    block), and computes them on fake tensors too: dropout in f puts the peak in the forward,
    where they live. What exact adds to the peak is the same at depth 2 and 8."""
    added = {}
    for depth in (2, 8):
        peaks = {}
        for exact in (True, False):
            torch.manual_seed(0)
            sequence = make_stack(depth, dropout=0.2)
            sequence.exact = exact
            x = torch.randn(6, 8, 8, 8)
            assert_predicted_exactly(train_step, sequence, x)
            peaks[exact] = measure_memory(train_step, sequence, x).above_model_state_bytes
        added[depth] = peaks[True] - peaks[False]
    assert added[2] == added[8]


def hand_built(classes: int = 10) -> nn.Sequential:
    """Stem, reversible stage, transition, reversible stage, head."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), make_stack(2, half=8),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), make_stack(2, half=16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    )


def test_a_loss_closing_over_real_labels_is_predicted_and_planned():
    model = hand_built()
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))

    def loss_fn(out):
        return F.cross_entropy(out, y)  # y is real, reached through the closure

    def step(model, x):
        train_step(model, x, loss_fn)

    assert_predicted_exactly(step, model, x)
    budget = predict_memory(step, model, x).peak_bytes
    planned = revnets.auto_checkpoint(model, x, budget, loss_fn=loss_fn, measure_time=False)
    assert measure_memory(step, planned, x).peak_bytes <= budget


class TiedLM(nn.Module):
    """A GPT-2-like language model whose head is its token embedding."""

    def __init__(self, vocab: int = 512, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def test_tied_weights_are_counted_once():
    model = TiedLM()
    tokens = torch.randint(0, 512, (2, 16))
    assert_predicted_exactly(train_step, model, tokens)
    assert predict_memory(train_step, model, tokens).parameters == sum(
        p.numel() * p.element_size() for p in model.parameters()  # each shared parameter once
    )


class LaidOutEveryWay(nn.Module):
    """Parameters and buffers over storages of every kind: their own (contiguous, transposed,
    channels_last, frozen, integer), a slice of a larger one, a buffer viewing a parameter's
    storage, one aliased by a tensor the user keeps (a ``state_dict()``), and one whose elements
    overlap (stride 0 over a storage of its size)."""

    def __init__(self):
        super().__init__()
        self.own = nn.Parameter(torch.randn(16, 16))
        self.transposed = nn.Parameter(torch.randn(16, 16).t())
        self.channels_last = nn.Parameter(
            torch.randn(4, 16, 2, 2).contiguous(memory_format=torch.channels_last))
        self.frozen = nn.Parameter(torch.randn(16), requires_grad=False)
        self.sliced = nn.Parameter(torch.randn(40)[8:24])
        self.register_buffer("counts", torch.arange(16))
        self.register_buffer("viewing", self.own.detach()[0])
        self.aliased = nn.Parameter(torch.randn(16))
        self.overlapping = nn.Parameter(torch.randn(16).as_strided((16,), (0,)))

    def forward(self, x):
        y = x @ (self.own + self.transposed) + self.frozen + self.sliced + self.aliased
        y = y + self.overlapping
        y = y + self.viewing + self.counts.float()
        return F.conv2d(y.t().reshape(1, 16, 2, 2), self.channels_last, padding=1).flatten(1)


def test_tensors_of_every_layout_are_copied_as_the_fake_mode_copies_them():
    """A prediction makes the fakes of tensors that hold their storage alone directly, and of
    all others through the fake mode, which keeps what they share: a buffer viewing a parameter
    shares its memory, a parameter over a slice of a larger storage holds all of it, as
    in the step measured (a parameter's own deep copy cloned it: 928 bytes off). No parameter
    that holds its storage alone goes through the fake mode's conversion (most of a large
    model's first prediction)."""
    model = LaidOutEveryWay()
    kept = {"aliased": model.state_dict()["aliased"]}  # noqa: F841  held by the user
    x = torch.randn(4, 16)
    converted = set()
    convert = torch._subclasses.fake_tensor.FakeTensorConverter.from_real_tensor

    def counted(self, mode, tensor, *args, **kwargs):
        converted.add(tensor.untyped_storage()._cdata)
        return convert(self, mode, tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch._subclasses.fake_tensor.FakeTensorConverter, "from_real_tensor",
                      counted)
        assert_predicted_exactly(train_step, model, x)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {name for name, t in tensors.items() if t.untyped_storage()._cdata in converted} == {
        "own", "viewing", "sliced", "aliased", "overlapping"}


def test_a_predictor_reused_after_the_parameters_changed_under_them_predicts_them_anew():
    """One predictor, two predictions, the model cast to float64 between them (``double()``
    keeps each parameter object, with new data): the second prediction is the float64 step's,
    also for parameters whose storage the user shares (a ``state_dict()`` held), which the fake
    mode converts (it remembered the first fakes by those parameter objects)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    held = model.state_dict()  # noqa: F841
    x = torch.randn(4, 64)
    predictor = Predictor()
    predictor.predict(train_step, (model, x), {})
    model.double()
    held = model.state_dict()  # noqa: F841
    x = x.double()
    assert predictor.predict(train_step, (model, x), {}).peak_bytes == measure_memory(
        train_step, model, x).peak_bytes


class Masked(nn.Module):
    """Multiplies by a constant mask it keeps as a buffer (never modified)."""

    def __init__(self, channels: int):
        super().__init__()
        self.register_buffer("mask", (torch.arange(channels) % 2).float().view(1, -1, 1, 1))

    def forward(self, x):
        return x * self.mask


def masked_unit(channels: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), Masked(channels))


@pytest.mark.parametrize("where", ["reversible", "checkpointed"])
def test_eval_mode_batch_norm_is_predicted(where):
    """Eval-mode BatchNorm reads its running statistics and leaves them alone."""
    if where == "reversible":
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), make_stack(2, half=4))
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), revnets.Checkpointed(conv_unit(8)),
                              conv_unit(8))
    model.eval()
    assert_predicted_exactly(train_step, model, torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize("where", ["reversible", "checkpointed"])
def test_buffers_a_forward_leaves_alone_are_predicted(where):
    """A constant mask inside a reversible sequence or a checkpoint: the replay sees writes at
    the dispatcher (NOTE [ Replay ]) and never compares buffers by value, which fake tensors
    cannot answer."""
    if where == "reversible":
        stage = revnets.ReversibleSequence(
            revnets.ReversibleBlock(masked_unit(4), masked_unit(4)) for _ in range(2)
        )
    else:
        stage = revnets.Checkpointed(masked_unit(8))
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), stage, conv_unit(8))
    assert_predicted_exactly(train_step, model, torch.randn(2, 3, 8, 8))


def autocast_step(model, x):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().sum().backward()


@pytest.mark.parametrize("name", ["resnet18", "vit", "reversible", "groupnorm"])
def test_bfloat16_autocast_is_predicted(name):
    if name == "groupnorm":  # the CPU keeps a bfloat16 input's statistics in float32
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(2, 16), nn.GELU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
        x = torch.randn(2, 3, 8, 8)
    elif name == "resnet18":
        model, x = torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32)
    elif name == "vit":
        model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                  num_classes=10)
        x = torch.randn(2, 3, 32, 32)
    else:
        model, x = hand_built(), torch.randn(2, 3, 16, 16)
    assert_predicted_exactly(autocast_step, model, x)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, c))


def test_attention_in_a_traced_graph_takes_the_cpus_fused_kernel():
    """Graph steps call the function torch.fx recorded; the prediction must follow it too."""
    model = nn.Sequential(*(Attention(64, 4) for _ in range(4)))
    chain = as_graph_chain(model)
    x = torch.randn(2, 128, 64)
    assert_predicted_exactly(train_step, chain, x)


class AttentionStack(nn.Module):
    def __init__(self, depth: int = 4, width: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(Attention(width, 4) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_planned_attention_model_is_predicted_exactly():
    model, x = AttentionStack(), torch.randn(2, 128, 64)
    unplanned = measure_memory(train_step, model, x).peak_bytes
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    planned = revnets.auto_checkpoint(model, x, int(state + 0.7 * (unplanned - state)),
                                      measure_time=False)
    assert any(isinstance(m, revnets.Checkpointed) for m in planned.plan.modules())
    assert planned.memory_plan.peak_bytes == measure_memory(train_step, planned, x).peak_bytes


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_layers_are_predicted(kind):
    """The CPU runs LSTMs with oneDNN, whose workspace the meta kernel leaves out."""
    model = kind(16, 32, num_layers=2, bidirectional=True, batch_first=True)
    x = torch.randn(4, 10, 16)
    assert_predicted_exactly(lambda m, x: train_step(m, x, lambda out: out[0].sum()), model, x)


@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, True)])
@pytest.mark.parametrize("training", [True, False])
def test_an_lstm_without_grad_is_predicted_after_one_with_grad(layers, bidirectional, training):
    """oneDNN makes no workspace with grad disabled: the prediction crashed on the None it
    returns, or, where the same shapes were predicted with grad before, counted that
    workspace (nearly twice the measure)."""
    model = nn.LSTM(16, 24, layers, bidirectional=bidirectional, batch_first=True)
    model.train(training)
    x = torch.randn(2, 7, 16)

    def inference(model, x):
        with torch.no_grad():
            return model(x)[0]

    assert_predicted_exactly(lambda m, x: train_step(m, x, lambda out: out[0].sum()), model, x)
    assert_predicted_exactly(inference, model, x)


@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), (2, 3, 0), (4, 2, 2)])
def test_fold_and_unfold_keep_a_storage_the_size_of_their_input(kernel, stride, padding):
    """The CPU's im2col and col2im resize a tensor made like their input: a fold's output keeps
    a storage the size of its columns (nine times its own at a 3x3 kernel), and so does the
    gradient of an unfold's input. Predicted at the output's own size, a model folding
    patches was predicted at 38 % of its measure, and planned at twice its budget."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, 16)
    columns = F.unfold(x, kernel, padding=padding, stride=stride).requires_grad_()

    def fold(columns):
        with torch.no_grad():
            return F.fold(columns, (16, 16), kernel, padding=padding, stride=stride)

    assert_predicted_exactly(fold, columns)
    model = nn.Sequential(nn.Conv2d(8, 8, 1), nn.Unfold(kernel, padding=padding, stride=stride),
                          nn.Fold((16, 16), kernel, padding=padding, stride=stride))
    assert_predicted_exactly(train_step, model, x)


def test_a_transformer_fast_path_on_a_padded_batch_is_refused_by_name():
    """In evaluation without grad, nn.TransformerEncoder packs a padded batch into a nested
    tensor by the mask's values: an internal error of torch's before."""
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 5:] = True

    def inference(encoder, x, mask):
        with torch.no_grad():
            return encoder(x, src_key_padding_mask=mask)

    with pytest.raises(ValueError, match="fast path.*nested tensor.*measure_memory"):
        predict_memory(inference, encoder, torch.randn(2, 8, 32), mask)


def test_a_meta_batch_stands_for_one_on_the_models_device():
    """A batch too large to allocate is passed on the meta device; the model is on the CPU."""
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                              num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    assert predict_memory(train_step, model, x.to("meta")).peak_bytes == measure_memory(
        train_step, model, x
    ).peak_bytes


def test_views_have_the_strides_the_cpu_kernel_gives():
    """Views are computed by the view kernels themselves, so a size-1 dimension's stride (which
    a later ``is_contiguous`` or memory-format check may read) is the real run's, and views of
    views share one storage."""
    def views(x):
        tokens = x[:, 1:].transpose(1, 2)  # a ViT's patch tokens back to a grid
        grid = tokens.view(1, 96, 4, 4)
        parts = grid.permute(0, 2, 3, 1).unbind(1)
        return [(v.shape, v.stride(), v.storage_offset(), v.is_contiguous(),
                 v.is_contiguous(memory_format=torch.channels_last))
                for v in (tokens, grid, *parts, grid.detach(), grid.expand(2, -1, -1, -1))]

    seen = {}
    x = torch.randn(1, 17, 96)
    predict_memory(lambda t: seen.setdefault("predicted", views(t)), x)
    assert seen["predicted"] == views(x)


class MovingAverage(nn.Module):
    """Reassigns a buffer in its forward, and keeps a Python step count."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
        return x - self.avg


class LargeAverage(nn.Module):
    """Reassigns a buffer as large as its batch, and keeps its last output between steps."""

    def __init__(self, width: int, rows: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("ema", torch.zeros(rows, width))

    def forward(self, x):
        self.last = torch.tanh(self.linear(x))
        self.ema = 0.9 * self.ema + 0.1 * self.last.detach()
        return self.last * 2


@pytest.mark.parametrize("where", ["plain", "checkpointed"])
def test_a_buffer_the_forward_reassigns_is_freed_when_the_real_one_is(where):
    """The real run frees the old buffer once reassigned, and the output a module kept from
    the step before once replaced (for a checkpoint, once its replay no longer needs it); the
    prediction holds their fakes nowhere else (NOTE [ Real tensors in a prediction ], 7). It
    held them in its copy memo and stand-ins: 2 MiB over here, and a model keeping an output
    on a checkpointed block was predicted a block's output per block above its measure."""
    torch.manual_seed(0)
    wrap = revnets.Checkpointed if where == "checkpointed" else (lambda m: m)
    model = nn.Sequential(wrap(LargeAverage(64, 4096)), wrap(LargeAverage(64, 4096)),
                          nn.Linear(64, 1))
    x = torch.randn(4096, 64)
    train_step(model, x)  # the modules now hold a buffer and an output from this step
    assert_predicted_exactly(train_step, model, x)
    predictor = Predictor()  # the planner's: fakes kept between predictions
    again = [predictor.predict(train_step, (model, x), {}).peak_bytes for _ in range(2)]
    assert again == [measure_memory(train_step, model, x).peak_bytes] * 2


@pytest.mark.parametrize("holder", ["a list", "a state_dict", "a view"])
def test_a_reassigned_buffer_something_else_holds_stays_alive_as_in_the_real_run(holder):
    """The real run keeps the old buffer where the user holds it too (the tensor, or its
    storage through a detached alias or a view): its fake is held through the prediction,
    which came out a buffer below the measure (a plan over its budget) when it freed it."""
    torch.manual_seed(0)
    model = nn.Sequential(LargeAverage(64, 4096), LargeAverage(64, 4096), nn.Linear(64, 1))
    x = torch.randn(4096, 64)
    train_step(model, x)
    held = {"a list": lambda: [m.ema for m in model[:2]], "a state_dict": model.state_dict,
            "a view": lambda: [m.ema[:1] for m in model[:2]]}[holder]()
    assert_predicted_exactly(train_step, model, x)
    assert held  # alive through both steps


def test_gradients_the_user_holds_too_stay_alive_as_in_the_real_run():
    """``zero_grad(set_to_none=True)`` drops the parameters' gradients, which a list of the
    user's keeps alive through the step (an accumulation, a logger): their fakes are held too.
    The prediction came out their size below the measure when it freed them."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)), torch.randn(8, 64)
    train_step(model, x)
    held = [p.grad for p in model[0].parameters()]
    assert_predicted_exactly(train_step, model, x)
    assert all(g is not p.grad for g, p in zip(held, model[0].parameters()))  # others now


def test_a_prediction_leaves_the_buffers_of_a_module_a_closure_holds_as_they_were():
    """A loss module reached through a closure keeps a running centre, reassigned in the call:
    the prediction left the user's module holding a fake tensor."""
    class CentredLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("center", torch.zeros(1, 64))

        def forward(self, out):
            loss = ((out - self.center) ** 2).sum()
            self.center = 0.9 * self.center + 0.1 * out.detach().mean(0, keepdim=True)
            return loss

    criterion, model = CentredLoss(), nn.Linear(64, 64)
    center = criterion.center
    predict_memory(lambda model, x: train_step(model, x, criterion), model, torch.randn(512, 64))
    assert criterion.center is center


@pytest.mark.parametrize("grads", ["none", "left from a step"])
def test_a_predictor_reused_predicts_each_call_as_a_fresh_prediction(grads):
    """The planner predicts plan after plan in one Predictor, its modules' tensors made fake
    once: gradients the first run leaves, optimizer state and step counts it makes, buffers it
    writes or reassigns, must not reach the next run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), MovingAverage(), nn.BatchNorm1d(8), nn.ReLU(),
                          nn.Linear(8, 4))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 8, requires_grad=True)

    def step(model, optimizer, x):  # as a training loop's step, gradients from an earlier one
        model(x).sum().backward()
        optimizer.step()

    step(model, optimizer, x)  # the optimizer has state, the batch norm has counted a batch
    if grads == "none":
        optimizer.zero_grad(set_to_none=True)
    fresh = predict_memory(step, model, optimizer, x).peak_bytes
    predictor = Predictor()
    again = [predictor.predict(step, (model, optimizer, x), {}).peak_bytes for _ in range(3)]
    assert again == [fresh] * 3
    assert fresh == measure_memory(step, model, optimizer, x).peak_bytes


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                                  torch.optim.RAdam, torch.optim.NAdam, torch.optim.Adagrad])
def test_an_optimizers_first_step_is_predicted_as_measured(kind, implementation):
    """The first step makes the optimizer's state, step counts from ``torch.tensor(0.0)``
    included; the foreach implementation raises them with ``torch._foreach_add_`` and divides by
    ``1 - beta ** step`` read back (a count left at zero divided by zero)."""
    flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True},
             "fused": {"fused": True}}[implementation]
    if kind is torch.optim.SGD:
        flags["momentum"] = 0.9
    try:
        make = lambda model: kind(model.parameters(), **flags)  # noqa: E731
        make(nn.Linear(1, 1))
    except (RuntimeError, TypeError, ValueError):
        pytest.skip(f"{kind.__name__} has no {implementation} implementation on this device")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = make(model)
    x = torch.randn(4, 8)

    def step(model, optimizer, x):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    before = copy.deepcopy(optimizer.state_dict())  # Adagrad makes its state when built
    predicted = predict_memory(step, model, optimizer, x).peak_bytes
    assert str(optimizer.state_dict()) == str(before)  # the user's optimizer took no step
    assert predicted == measure_memory(step, model, optimizer, x).peak_bytes


def _layouts():
    for shape in [(2, 6, 5, 5), (2, 6, 3, 4, 4), (4, 6), (4, 6, 7)]:
        yield "contiguous", lambda s=shape: torch.randn(s)
        yield "permuted", lambda s=shape: torch.randn(*reversed(s)).permute(
            *reversed(range(len(s))))
        yield "every other channel", lambda s=shape: torch.randn(s[0], 2 * s[1], *s[2:])[:, ::2]
        if len(shape) in (4, 5):
            layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
            yield "channels_last", lambda s=shape, f=layout: torch.randn(s).contiguous(
                memory_format=f)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)], ids=str)
def test_batch_norm_outputs_are_allocated_as_the_cpu_kernels_allocate_them(training, dtypes):
    """Batch norm's outputs are made from its arguments in a prediction (its meta kernel is a
    slow decomposition): each output's shape, strides, dtype and storage, forward and backward,
    are the CPU kernel's, over layouts, ranks, affine or not, with or without statistics."""
    aten = torch.ops.aten

    def outputs(x, weight, mean, grad_out):
        y = aten.native_batch_norm(x, weight, weight, mean, mean, training, 0.1, 1e-5)
        grads = [aten.native_batch_norm_backward(grad_out, x, weight, mean, mean, y[1], y[2],
                                                 training, 1e-5, mask)
                 for mask in ([True, True, True], [True, False, False], [False, True, True])
                 if weight is not None or not mask[1]]
        return [None if t is None else (t.shape, t.stride(), t.dtype,
                                        t.untyped_storage().nbytes())
                for t in (*y, *(g for grad in grads for g in grad))]

    x_dtype, p_dtype = dtypes
    for name, make in _layouts():
        for affine, tracked in [(True, True), (False, True), (True, False), (False, False)]:
            if not (training or tracked):
                continue
            x = make().to(x_dtype)
            channels = x.shape[1]
            weight = torch.randn(channels, dtype=p_dtype) if affine else None
            mean = torch.zeros(channels, dtype=p_dtype) if tracked else None
            if mean is None and weight is None and x_dtype != p_dtype:
                continue  # no parameter to be of the other dtype
            grad_out = torch.randn(x.shape, dtype=x_dtype).contiguous(
                memory_format=suggest_memory_format(x))
            seen = {}
            predict_memory(lambda *a: seen.setdefault("predicted", outputs(*a)),
                           x, weight, mean, grad_out)
            assert seen["predicted"] == outputs(x, weight, mean, grad_out), (name, affine,
                                                                              tracked)


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.RAdam, torch.optim.ASGD])
def test_a_prediction_leaves_the_optimizers_step_counts_alone(kind):
    """Optimizers keep their step counts in scalar tensors, which a prediction reads for real;
    it counts its own steps in copies: the user's optimizer is where it was, and a Predictor
    asked again predicts the same step (ASGD's second prediction used to find its ``mu`` and
    ``eta`` without values, RAdam's rectification a step the real run never took)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = kind(model.parameters())
    x = torch.randn(2, 8)

    def step(model, optimizer, x):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(5):  # RAdam rectifies from its sixth step on
        step(model, optimizer, x)
    counts = {name: value.clone() for name, value in optimizer.state[model.weight].items()
              if torch.is_tensor(value) and value.dim() == 0}
    predictor = Predictor()
    predicted = [predictor.predict(step, (model, optimizer, x), {}).peak_bytes
                 for _ in range(2)]
    revnets.auto_checkpoint(model, x, budget=2**30, optimizer=optimizer)  # predicts the step
    assert all(torch.equal(optimizer.state[model.weight][name], value)
               for name, value in counts.items())
    assert predicted == [measure_memory(step, model, optimizer, x).peak_bytes] * 2


def test_a_predictor_sees_parameters_converted_in_place():
    """``module.double()`` and ``.to(memory_format=...)`` change parameters and gradients under
    the same tensor objects: a Predictor that made them fake before makes them again."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    x = torch.randn(2, 3, 8, 8)
    predictor = Predictor()
    train_step(model, x)  # gradients left
    predictor.predict(train_step, (model, x), {})
    model.to(memory_format=torch.channels_last)
    assert predictor.predict(train_step, (model, x), {}).peak_bytes == measure_memory(
        train_step, model, x).peak_bytes
    model.double()
    assert predictor.predict(train_step, (model, x.double()), {}).peak_bytes == measure_memory(
        train_step, model, x.double()).peak_bytes


@pytest.mark.parametrize("where", ["plain", "reversible", "checkpointed", "autocast"])
def test_batch_norm_without_momentum_reads_its_batch_count(where):
    """momentum=None averages by the batches counted, a scalar buffer it reads with float()."""
    if where == "reversible":
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), make_stack(2, half=4))
    elif where == "checkpointed":
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), revnets.Checkpointed(conv_unit(8)))
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for norm in norms:
        norm.momentum = None
    step = autocast_step if where == "autocast" else train_step
    x = torch.randn(2, 3, 6, 6)
    step(model, x)
    predicted = predict_memory(step, model, x).peak_bytes
    assert all(norm.num_batches_tracked == 1 for norm in norms)  # the prediction counted copies
    assert predicted == measure_memory(step, model, x).peak_bytes


def test_batch_norm_on_statistics_a_closure_holds_after_frozen_layers():
    """The input of a batch norm after frozen layers needs no gradient, and the CPU makes none,
    also when the statistics are real tensors a closure holds rather than buffers."""
    mean, var = torch.zeros(16), torch.ones(16)

    class Normalised(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3, padding=1).requires_grad_(False)
            self.weight, self.bias = nn.Parameter(torch.ones(16)), nn.Parameter(torch.zeros(16))

        def forward(self, x):
            return F.batch_norm(self.conv(x), mean, var, self.weight, self.bias, training=True)

    assert_predicted_exactly(train_step, Normalised(), torch.randn(4, 3, 8, 8))


@pytest.mark.parametrize("norm", ["layer_norm", "convnext"])
def test_layer_norm_keeps_float32_statistics_under_bfloat16_autocast(norm):
    """The CPU's layer norm keeps the mean and inverse deviation of a bfloat16 input in float32
    when its parameters are float32 (the meta kernel: bfloat16)."""
    if norm == "layer_norm":
        model, x = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), torch.randn(2, 4, 4, 8)
    else:
        model, x = torchvision.models.convnext_tiny(num_classes=10), torch.randn(1, 3, 32, 32)
    assert_predicted_exactly(autocast_step, model, x)


def test_batch_norm_of_compiled_graphs_is_allocated_as_on_the_cpu():
    """Graphs torch.compile and torch.export make call batch norm's other operators: their
    statistics are float32 for a bfloat16 input with float32 parameters, and no input gradient
    is made for an input that needs none."""
    aten = torch.ops.aten
    x16 = torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)
    weight, bias = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)

    def forward(op):
        def step(x, weight, bias):
            statistics = torch.zeros(4), torch.ones(4)
            out = op(x, weight, bias, *statistics)
            out[0].float().sum().backward()
        return step

    ops = {
        "legit": lambda x, w, b, m, v: aten._native_batch_norm_legit(
            x, w, b, m, v, True, 0.1, 1e-5),
        "legit_no_stats": lambda x, w, b, m, v: aten._native_batch_norm_legit(
            x, w, b, True, 0.1, 1e-5),
        "with_update": lambda x, w, b, m, v: aten._batch_norm_with_update(
            x, w, b, m, v, 0.1, 1e-5),
    }
    for name, op in ops.items():
        for x in (x16, x16.float()):  # bfloat16 input, then one that needs no gradient
            predicted = predict_memory(forward(op), x, weight, bias)
            measured = measure_memory(forward(op), x, weight, bias)
            assert predicted.peak_bytes == measured.peak_bytes, (name, x.dtype)


@pytest.mark.parametrize("made", ["view", "product"])
def test_an_input_with_a_history_is_refused_by_name(made):
    """A backward through an argument computed from other tensors reaches beyond the call, which
    a prediction on fake tensors cannot follow (it was predicted off, or crashed inside torch)."""
    base = torch.randn(2, 4, 10, requires_grad=True)
    x = base.reshape(2, 40) if made == "view" else base * 2
    with pytest.raises(ValueError, match="computed from others.*x.detach"):
        predict_memory(train_step, nn.Linear(x.shape[-1], 3), x)
    leaf = x.detach().requires_grad_()
    assert_predicted_exactly(train_step, nn.Linear(x.shape[-1], 3), leaf)


def test_a_prediction_registers_nothing_on_the_real_modules():
    """The predicted call runs on copies of the modules, their hook registries new ones too
    (made up front where empty, for speed): a hook the call registers stays on the copy."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def step(m, x):
        m[0].register_forward_hook(lambda *args: None)
        m[1].register_full_backward_hook(lambda *args: None)
        m(x).sum().backward()

    predict_memory(step, model, torch.randn(2, 4))
    assert not model[0]._forward_hooks and not model[1]._backward_hooks
    model(torch.randn(2, 4)).sum().backward()  # and the model runs as before


class SummedPair(nn.Module):
    """Two weights summed before use: autograd gives both one gradient storage."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(16, 16)), nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return x @ torch.stack([self.a, self.b]).sum(0)


@pytest.mark.parametrize("layout", ["own storage", "views of one buffer", "one storage shared",
                                    "one tensor on two parameters", "also an argument"])
def test_gradients_left_by_an_earlier_step_are_predicted_as_measured(layout):
    """A step that accumulates into the gradients an earlier one left, however they lie: each
    its own storage, as autograd makes them; views of one larger buffer (DDP's
    gradient_as_bucket_view), which counts whole; one storage under two gradients, as autograd
    leaves it for weights summed before use; one tensor set on two parameters; gradients the
    step is also given as an argument. A storage counts once, as in the real step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    if layout == "own storage":
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    elif layout == "views of one buffer":
        bucket, start = torch.zeros(sum(p.numel() for p in model.parameters()) + 1000), 0
        for p in model.parameters():
            p.grad = bucket[start:start + p.numel()].view_as(p)
            start += p.numel()
        del bucket
    elif layout == "one storage shared":
        model = SummedPair()
        model(torch.randn(4, 16)).sum().backward()
        assert model.a.grad.data_ptr() == model.b.grad.data_ptr()
    elif layout == "one tensor on two parameters":
        model[0].weight.grad = model[2].weight.grad = torch.zeros(16, 16)
    grads = []
    if layout == "also an argument":
        model(torch.randn(4, 16)).sum().backward()
        grads = [p.grad for p in model.parameters()]

    def step(model, grads, x):
        model(x).sum().backward()

    x = torch.randn(4, 16)
    assert predict_memory(step, model, grads, x).peak_bytes == measure_memory(
        step, model, grads, x).peak_bytes


class TokensNormedOnAGrid(nn.Module):
    """A pyramid ViT's last stage (timm's pvt_v2): tokens projected, layer-normed, put back on
    the grid and pooled; the norm's output gradient arrives as the grid's, transposed, and its
    input's goes to the Linear's backward."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(channels, channels)
        self.norm = nn.LayerNorm(channels)

    def forward(self, tokens):
        b, n, c = tokens.shape
        side = int(n**0.5)
        grid = self.norm(self.proj(tokens)).reshape(b, side, side, c).permute(0, 3, 1, 2)
        return grid.mean((2, 3))


def test_layer_norm_gradient_is_contiguous_as_the_cpus_kernel_makes_it():
    """The CPU's layer norm backward returns the input's gradient contiguous whatever the
    output gradient's strides (the meta kernel: the output gradient's), so the Linear's
    backward views it as a matrix without a copy (timm's pvt_v2 was predicted 32 KiB high):
    live bytes equal after every operator."""
    model, tokens = TokensNormedOnAGrid(), torch.randn(2, 64, 16)
    predicted = predict_timeline(train_step, model, tokens)[1].total
    measured = record_timeline(train_step, model, tokens)[1].total
    assert predicted == measured


@pytest.mark.parametrize("caller", ["predict_memory", "measure_memory", "auto_checkpoint"])
def test_a_lazy_module_before_its_first_call_is_refused_by_name(caller):
    """A lazy module makes its parameters in its first call: there is nothing to count or copy
    before it (torch's "uninitialized parameter" ValueError came from deep inside)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d(), nn.Flatten(), nn.Linear(64, 3))
    x, y = torch.randn(2, 3, 6, 6), torch.tensor([0, 1])
    loss = lambda out: F.cross_entropy(out, y)  # noqa: E731
    call = {
        "predict_memory": lambda: revnets.predict_memory(lambda m: loss(m(x)).backward(), model),
        "measure_memory": lambda: revnets.measure_memory(lambda m: loss(m(x)).backward(), model),
        "auto_checkpoint": lambda: revnets.auto_checkpoint(model, x, 10**6, loss_fn=loss,
                                                           measure_time=False),
    }[caller]
    with pytest.raises(ValueError, match=rf"{caller}: LazyBatchNorm2d \(1\) is a lazy module.*"
                                         r"Run one forward of the model first"):
        call()
    with torch.no_grad():
        model(x)
    call()


class Pair(typing.NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 64), nn.Linear(8, 64)
        self.rest = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)))

    def forward(self, pair: Pair) -> torch.Tensor:
        return self.rest(self.a(pair.x) * self.b(pair.y))


def test_a_namedtuple_argument_is_predicted_and_planned():
    """A namedtuple's constructor takes its fields one by one: made fake by calling its type on
    one iterable, as a tuple is, it raised a TypeError in predict_memory and auto_checkpoint."""
    def step(model, pair):
        model(pair).square().sum().backward()

    model, pair = PairModel(), Pair(torch.randn(256, 8), torch.randn(256, 8))
    predicted = predict_memory(step, model, pair).peak_bytes
    measured = measure_memory(step, model, pair).peak_bytes
    assert predicted == measured
    plain = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    planned = revnets.auto_checkpoint(model, pair, measured - 64 * 1024, measure_time=False,
                                      loss_fn=lambda out: out.square().sum())
    assert "checkpoint" in str(planned.memory_plan)
    step(planned, pair)
    step(plain, pair)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
