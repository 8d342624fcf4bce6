"""make_reversible: a pretrained stack (timm's ViT blocks, Hugging Face GPT-2 and Llama decoder
layers, a ResNet's identity-shortcut blocks) run as one reversible stage reusing its weights.
Its gradients equal ordinary autograd's of the same converted network (float64), its buffers
update once, its reconstruction is exact on the grid under bfloat16, its activation memory is
flat in depth (measured, predicted to the byte), and its step-0 distance from the pretrained
network is bounded by the scale (NOTE [ Reversible conversion ])."""

import copy
import os
import pickle
import re
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import revnets
from revnets.conversion import (
    MEFT,
    Difference,
    Momentum,
    ReconstructionDriftWarning,
    ReversibleLayers,
    amplification,
    find_stack,
    make_reversible,
)

from conftest import max_grad_error

SCALES = [1.0, 0.5, 0.125]
# Every construction, at parameters whose inverse divides by 1, 2, 8 and 4.
# Where a test converts with a stream whose reconstruction drifts on purpose (drift.py).
DRIFTS = "ignore::revnets.conversion.ReconstructionDriftWarning"
CONSTRUCTIONS = [Difference(1.0), Difference(0.5), Difference(0.125), Momentum(0.5),
                 MEFT(0.5, 0.5)]


def vit(depth: int = 4, **options) -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10,
                             depth=depth, embed_dim=32, num_heads=2, **options)


def images(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def hugging_face(name: str, layers: int = 3, **options) -> nn.Module:
    t = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # token ids of the default configs outside the vocabulary
        if name == "gpt2":
            return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_embd=32, n_layer=layers,
                                                  n_head=2, n_positions=32, **options))
        return t.LlamaForCausalLM(t.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, **options))


def tokens(n: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(1, 64, (n, length), generator=torch.Generator().manual_seed(0))


def stored(model: nn.Module) -> nn.Module:
    """The same converted network with ordinary autograd: the reference."""
    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, ReversibleLayers):
            module.memory = revnets.Store()
    return reference


def grads_of(model: nn.Module, loss, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)  # dropout drawn alike in model and reference
    model.zero_grad(set_to_none=True)
    loss(model).backward()
    return model


@pytest.mark.parametrize("construction", CONSTRUCTIONS, ids=str)
@pytest.mark.parametrize("family", ["vit", "gpt2", "llama"])
def test_gradients_equal_ordinary_autograd_of_the_converted_network(family, construction):
    torch.manual_seed(0)
    if family == "vit":
        model = vit(drop_rate=0.1, attn_drop_rate=0.1).double()
        x, y = images()
        x = x.double()

        def loss(m):
            return F.cross_entropy(m(x), y)
    else:  # GPT-2 with its dropout on, three layers (the last block's g is zero)
        model = hugging_face(family).double().train()
        ids = tokens()

        def loss(m):
            return m(input_ids=ids, labels=ids).loss
    converted = make_reversible(model, construction=construction)
    assert isinstance(converted.get_submodule(find_stack(converted)), ReversibleLayers)
    reference = stored(converted)
    grads_of(converted, loss)
    grads_of(reference, loss)
    assert max_grad_error(converted, reference) < 1e-10


def test_the_state_dict_is_the_pretrained_one_key_for_key():
    pretrained = vit()
    converted = make_reversible(copy.deepcopy(pretrained))
    assert list(converted.state_dict()) == list(pretrained.state_dict())
    assert dict(converted.named_parameters()).keys() == dict(pretrained.named_parameters()).keys()
    fresh = make_reversible(vit())
    fresh.load_state_dict(pretrained.state_dict())  # pretrained weights load into a conversion
    x, _ = images()
    assert torch.equal(fresh.eval()(x), converted.eval()(x))
    converted(x)  # the stage's output is held weakly: the whole model still saves and loads
    again = pickle.loads(pickle.dumps(converted))
    assert torch.equal(again(x), converted(x))


def test_one_converted_layer_is_the_pretrained_layer():
    # Rule 1: the first layer reads the input and adds its update to it, whatever the scale.
    pretrained = vit(depth=1).double().eval()
    x, _ = images()
    for scale in SCALES:
        converted = make_reversible(copy.deepcopy(pretrained), "blocks", scale).eval()
        torch.testing.assert_close(converted(x.double()), pretrained(x.double()), rtol=0,
                                   atol=1e-12)
    for other in (Momentum(0.5), MEFT(0.5, 0.5)):  # their first layers are moved too
        assert not other.first_layer_exact()
        converted = make_reversible(copy.deepcopy(pretrained), "blocks", construction=other)
        converted.eval()
        assert not torch.allclose(converted(x.double()), pretrained(x.double()))


def step0_gap(pretrained: nn.Module, construction) -> float:
    """The largest distance of the converted network's logits from the pretrained one's,
    relative to their largest magnitude."""
    x, _ = images(8)
    with torch.no_grad():
        reference = pretrained.eval()(x.double())
        converted = make_reversible(copy.deepcopy(pretrained), construction=construction)
        out = converted.eval()(x.double())
    return ((out - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.filterwarnings(DRIFTS)  # step 0 alone: nothing is reconstructed
@pytest.mark.parametrize("family", [Difference, Momentum, lambda p: MEFT(p, 1.0)],
                         ids=["Difference", "Momentum", "MEFT"])
def test_the_step0_gap_of_each_construction_shrinks_with_its_parameter_in_proportion(family):
    # Rule 1: each construction's layers differ from the pretrained ones by its parameter
    # times an update (Difference, Momentum) or a hidden state (MEFT), so for small parameters
    # the gap is linear in it, and monotone from 1/2 down.
    pretrained = vit(depth=6).double()
    gaps = {p: step0_gap(pretrained, family(p)) for p in (0.5, 2**-3, 2**-6, 2**-9)}
    assert gaps[0.5] > gaps[2**-3] > gaps[2**-6] > gaps[2**-9] > 0
    assert gaps[2**-6] / gaps[2**-9] == pytest.approx(8, rel=0.05)


def test_the_step0_gap_of_the_difference_is_below_meft_at_the_same_division():
    # At the same stream scale (the inverse divides by 1/4 alike), the difference moves the
    # function by a fraction of an update, MEFT by a fraction of the hidden state.
    pretrained = vit(depth=6).double()
    assert step0_gap(pretrained, Difference(0.25)) < step0_gap(pretrained, MEFT(0.5, 0.5)) / 2


def test_a_resnets_identity_shortcut_blocks_convert_and_update_their_statistics_once():
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10).double()
    converted = make_reversible(model, "layer1", dim=1)  # its two blocks keep their shape
    reference = stored(converted)
    x, y = images()

    def loss(m):
        return F.cross_entropy(m(x.double()), y)

    grads_of(converted, loss)
    grads_of(reference, loss)
    assert max_grad_error(converted, reference) < 1e-10
    for (name, a), b in zip(converted.named_buffers(), reference.buffers()):
        assert torch.equal(a, b), name  # BatchNorm's running statistics and counts: once


def test_a_layer_that_changes_the_shape_is_refused_naming_the_way_out():
    model = make_reversible(timm.create_model("resnet18", num_classes=10), "layer2", dim=1)
    with pytest.raises(ValueError, match=r"BasicBlock maps shape \(4, 64, 8, 8\) to \(4, 128, 4, "
                                         r"4\).*convert only layers that keep it"):
        model(images()[0])


@pytest.mark.filterwarnings(DRIFTS)  # scale 0.125 at 8 layers: the drift compared
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_conversion_reconstructs_to_the_bit_where_a_scale_drifts(dtype):
    torch.manual_seed(0)
    pretrained = vit(depth=8)
    x, y = images(8)

    def drift(**options) -> float:
        model = make_reversible(copy.deepcopy(pretrained), **options)
        with revnets.check_reconstruction() as report:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        assert len(report.drifts) == 4  # every block's input compared
        return report.max_rel_error

    assert drift(exact=True) == 0.0
    assert 0 < drift(scale=0.5) < drift(scale=0.125)  # rule 2: round-off grows by 1 / scale
    for construction in (Difference(0.5), Momentum(0.5), MEFT(0.5, 0.5)):  # the lost bits kept
        assert drift(construction=construction, exact=True) == 0.0, construction


@pytest.mark.parametrize("options", [{}, {"store_last_blocks": 1}, {"keep_input_every": 2}],
                         ids=["default", "store_last_blocks", "keep_input_every"])
@pytest.mark.parametrize("construction", [Difference(0.5), Momentum(0.5), MEFT(0.5, 0.25)],
                         ids=str)
def test_exact_scaled_gradients_equal_the_exact_network_with_ordinary_autograd(construction,
                                                                                options):
    # Rule 4: the bits a scale 2^-k drops are kept, the inverse is exact, the gradients are
    # ordinary autograd's of the same rounded function (float64 streams).
    torch.manual_seed(0)
    model = make_reversible(Loop(5).double(), construction=construction, exact=True,
                            memory=revnets.Reconstruct(**options))
    x, shifts = torch.randn(3, 8).double(), [torch.randn(8).double() for _ in range(5)]
    reference = stored(model)
    grads_of(model, lambda m: m(x, shifts).square().sum())
    grads_of(reference, lambda m: m(x, shifts).square().sum())
    assert max_grad_error(model, reference) < 1e-10


def test_exact_scaled_memory_grows_by_the_kept_bits_alone_predicted_to_the_byte():
    # One byte per element of a stream per layer (NOTE [ Exact reversibility ], rule 7).
    x, y = images(8)
    peaks = {}
    for depth in (4, 8):
        model = make_reversible(vit(depth), scale=0.5, exact=True)
        measured = revnets.measure_memory(train_step, model, x, y)
        assert revnets.predict_memory(train_step, model, x, y).peak_bytes == measured.peak_bytes
        peaks[depth] = measured.above_model_state_bytes
    stream = 8 * (16 + 1) * 32  # batch x (patches + class token) x width, one byte each
    assert peaks[8] - peaks[4] == 4 * stream


def test_exact_gradients_equal_the_exact_network_with_ordinary_autograd_in_bfloat16():
    torch.manual_seed(0)
    converted = make_reversible(vit(), exact=True)
    reference = stored(converted)
    x, y = images()

    def loss(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(m(x).float(), y)

    grads_of(converted, loss)
    grads_of(reference, loss)
    assert max_grad_error(converted, reference) < 1e-4  # sums of bfloat16 products, reordered


def train_step(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


@pytest.mark.filterwarnings(DRIFTS)  # Momentum(0.5) at 32 layers: its memory is measured
@pytest.mark.parametrize("construction", [Difference(), Momentum(0.5)], ids=str)
@pytest.mark.parametrize("depth", [4, 8, 16, 32])
def test_activation_memory_is_flat_in_depth_measured_and_predicted(depth, construction):
    x, y = images(8)
    converted = make_reversible(vit(depth), construction=construction)
    measured = revnets.measure_memory(train_step, converted, x, y)
    predicted = revnets.predict_memory(train_step, converted, x, y)
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.above_model_state_bytes == measured.above_model_state_bytes
    at_four = revnets.measure_memory(
        train_step, make_reversible(vit(4), construction=construction), x, y)
    assert measured.above_model_state_bytes == at_four.above_model_state_bytes
    stored_peak = revnets.measure_memory(train_step, stored(converted), x, y)
    assert stored_peak.above_model_state_bytes > (depth / 4) * 0.9 * (
        at_four.above_model_state_bytes)  # the same network stored grows with its depth


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_hugging_face_loop_over_converted_layers_is_predicted_to_the_byte(family):
    # The model's own loop runs the stage (rule 3), on fake tensors too.
    model = make_reversible(hugging_face(family, use_cache=False))
    ids = tokens()

    def step(m):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()

    measured = revnets.measure_memory(step, model)
    assert revnets.predict_memory(step, model).peak_bytes == measured.peak_bytes


def test_a_hugging_face_model_keeps_its_outputs_its_cache_and_generate():
    torch.manual_seed(0)
    model = make_reversible(hugging_face("llama"))
    ids = tokens()
    out = model(input_ids=ids, labels=ids)  # training mode, use_cache on: the cache is left out
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.loss.requires_grad
    reference = stored(model).eval()
    model.eval()
    with torch.no_grad():  # the layers run once each, filling the cache
        first = model(input_ids=ids[:, :8], use_cache=True)
        assert first.past_key_values.get_seq_length() == 8
        after = model(input_ids=ids[:, 8:], past_key_values=first.past_key_values)
        whole = model(input_ids=ids)
    torch.testing.assert_close(after.logits, whole.logits[:, 8:], rtol=1e-4, atol=1e-5)
    assert torch.equal(model.generate(ids[:, :4], max_new_tokens=6, do_sample=False),
                       reference.generate(ids[:, :4], max_new_tokens=6, do_sample=False))


def test_lora_adapters_on_a_converted_base_get_the_gradients_of_ordinary_autograd():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = make_reversible(hugging_face("llama").double())
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, config)
    for module in model.modules():  # LoRA's B starts at zero: make the gradients non-trivial
        if isinstance(module, nn.Linear) and module.weight.requires_grad:
            nn.init.normal_(module.weight, std=0.02)
    reference = stored(model)
    ids = tokens()

    def loss(m):
        return m(input_ids=ids, labels=ids).loss

    grads_of(model, loss)
    grads_of(reference, loss)
    trained = [name for name, p in model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in name for name in trained)
    assert max_grad_error(model, reference) < 1e-10


def test_auto_checkpoint_plans_around_a_converted_stack_predicted_to_the_byte():
    model = make_reversible(vit(8))
    x, y = images(8)

    def loss(out):
        return F.cross_entropy(out, y)

    unplanned = revnets.auto_checkpoint(model, x, 2**40, loss).memory_plan.peak_bytes
    least = None
    try:
        revnets.auto_checkpoint(model, x, 1, loss)
    except revnets.PlanningError as error:
        least = error.smallest_budget
    assert least is not None and least <= unplanned
    planned = revnets.auto_checkpoint(model, x, least, loss)
    measured = revnets.measure_memory(train_step, planned, x, y).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= least


@pytest.mark.parametrize("call, message", [
    (lambda: make_reversible(vit(), "head"), "head is a Linear, not a stack of layers"),
    (lambda: make_reversible(vit(), "stack"), "has no module 'stack'.*e.g. 'blocks'"),
    (lambda: make_reversible(vit(), scale=0), r"scale must be a number in \(0, 1\]"),
    (lambda: make_reversible(vit(), scale=0.3, exact=True), "exact=True needs a stream scale"),
    (lambda: make_reversible(vit(), construction=Momentum(0.1), exact=True),
     r"exact=True needs a stream scale \+-2\^-k.*Momentum\(gamma=0.1\) multiplies a stream by "
     r"-0.1"),
    (lambda: make_reversible(vit(), scale=0.5, construction=MEFT()), "give one"),
    (lambda: Momentum(1.0), r"Momentum's gamma must be a number in \(0, 1\)"),
    (lambda: MEFT(0.1, 0.0), r"MEFT's beta must be a number in \(0, 1\]"),
    (lambda: make_reversible(make_reversible(vit()), "blocks"), "blocks is converted already"),
    (lambda: make_reversible(nn.Linear(2, 2)), "has no stack of alike layers"),
])
def test_what_cannot_be_converted_is_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_an_exact_sequence_refuses_a_scale_off_the_grid():
    block = revnets.ReversibleBlock(nn.Linear(2, 2), nn.Linear(2, 2), revnets.ScaledCoupling(0.3))
    with pytest.raises(TypeError, match=r"keeps the grid only with a scale \+-2\^-k"):
        revnets.ReversibleSequence([block], exact=True)


class Res(nn.Module):
    """A residual layer taking an optional per-layer argument (a mask, a shift)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, shift=None):
        return x + torch.tanh(self.fc(x) + (0 if shift is None else shift))


class Loop(nn.Module):
    """A model whose forward loops over its layers, as transformers' do; ``skip`` drops layers
    (LayerDrop), ``edit`` writes the hidden state between layers, ``shifts`` gives each layer
    an argument of its own (Qwen2's and Gemma's per-layer masks)."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Res() for _ in range(n))

    def forward(self, x, shifts=None, skip=(), edit=False):
        for i, layer in enumerate(self.layers):
            if i in skip:
                continue
            x = layer(x, None if shifts is None else shifts[i])
            if edit:
                x[:, 0] = 0
        return x


def converted_function(layers, x, arguments, scale=1.0):
    """The documented function (NOTE [ Reversible conversion ], rule 1), written out."""
    before = last = x
    for layer, argument in zip(layers, arguments):
        before, last = last, scale * before + layer(last, argument) - scale * last
    return last


def test_each_layer_gets_its_own_arguments():
    torch.manual_seed(0)
    model = make_reversible(Loop().double(), scale=0.5)
    x, shifts = torch.randn(3, 8).double(), [torch.randn(8).double() for _ in range(4)]
    layers = [model.layers.layer(i) for i in range(4)]
    torch.testing.assert_close(model(x, shifts), converted_function(layers, x, shifts, 0.5),
                               rtol=0, atol=1e-12)
    reference = stored(model)
    grads_of(model, lambda m: m(x, shifts).square().sum())
    grads_of(reference, lambda m: m(x, shifts).square().sum())
    assert max_grad_error(model, reference) < 1e-10


def momentum_resnet(layers, x, arguments, gamma):
    """Momentum ResNets (Sander et al. 2021) as written there: a velocity, from zero."""
    v = torch.zeros_like(x)
    for layer, argument in zip(layers, arguments):
        v = gamma * v + (1 - gamma) * (layer(x, argument) - x)
        x = x + v
    return x


def meft1(layers, x, arguments, lam, beta):
    """MEFT1 (Liao et al. 2023) as written there at its start, the adapter G zero: per layer,
    y1 = lam * x1 + L(x2), y2 = beta * x2 + G(y1), the streams then swapped."""
    x1 = x2 = x
    for layer, argument in zip(layers, arguments):
        y1 = lam * x1 + layer(x2, argument)
        y2 = beta * x2 + 0 * y1
        x1, x2 = y2, y1
    return x2


@pytest.mark.parametrize("construction, written_out", [
    (Momentum(0.25), lambda ls, x, a: momentum_resnet(ls, x, a, 0.25)),
    (MEFT(0.5, 0.25), lambda ls, x, a: meft1(ls, x, a, 0.5, 0.25)),
], ids=["Momentum", "MEFT"])
def test_each_construction_computes_its_papers_recurrence(construction, written_out):
    torch.manual_seed(0)
    model = make_reversible(Loop(5).double(), construction=construction)
    x, shifts = torch.randn(3, 8).double(), [torch.randn(8).double() for _ in range(5)]
    layers = [model.layers.layer(i) for i in range(5)]
    torch.testing.assert_close(model(x, shifts), written_out(layers, x, shifts), rtol=0,
                               atol=1e-12)
    reference = stored(model)
    grads_of(model, lambda m: m(x, shifts).square().sum())
    grads_of(reference, lambda m: m(x, shifts).square().sum())
    assert max_grad_error(model, reference) < 1e-10


def test_a_loop_that_calls_the_first_layer_apart_still_runs_each_layer_once():
    model = make_reversible(Loop())
    x = torch.randn(3, 8)
    hidden = model.layers[0](x, None)
    for layer in model.layers[1:]:
        hidden = layer(hidden, None)
    torch.testing.assert_close(hidden, model(x))


@pytest.mark.parametrize("misuse, message", [
    (lambda m, x: m.layers[0](x, None) + 1, "add on the hidden state between two layers"),
    (lambda m, x: m(x, skip=(1,)), r"layer 2 .* called after layer 0; layers 1..1 were skipped"),
    (lambda m, x: m(x, edit=True), "on the hidden state between two layers"),
    (lambda m, x: torch.stack([m.layers[0](x, None)]), "stack on the hidden state"),
])
def test_what_reads_between_the_layers_or_skips_one_is_refused(misuse, message):
    # A layer called alone, LayerDrop, a write between layers: each would see or skip a hidden
    # state the one reversible stage never computes (NOTE [ Reversible conversion ], rule 3).
    with pytest.raises(RuntimeError, match=message):
        misuse(make_reversible(Loop()), torch.randn(3, 8))


def test_timm_intermediate_features_are_refused_not_made_up():
    model = make_reversible(vit()).eval()
    with pytest.raises(RuntimeError, match="is not computed"):
        model.forward_intermediates(images()[0])


def test_hugging_face_hidden_states_of_every_layer_are_refused_not_made_up():
    model = make_reversible(hugging_face("llama")).eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match="output_hidden_states=True"):
        model(input_ids=tokens(), output_hidden_states=True)
    with torch.no_grad():
        assert model(input_ids=tokens(), output_attentions=False).logits.shape[-1] == 64


def test_layers_keep_the_modes_set_inside_them():
    model = make_reversible(timm.create_model("resnet18", num_classes=10), "layer1", dim=1)
    x, _ = images()
    with torch.no_grad():
        model.eval()(x)
    model.train()
    for module in model.modules():  # a frozen-BatchNorm recipe
        if isinstance(module, nn.BatchNorm2d):
            module.eval()
    norm = model.layer1.layer(0).bn1
    before = norm.running_mean.clone()
    model(x).sum().backward()
    assert not norm.training and torch.equal(norm.running_mean, before)


def test_a_stack_keeps_its_own_names_and_attributes_set_through_the_loop():
    torchvision = pytest.importorskip("torchvision")
    options = dict(image_size=32, patch_size=8, num_layers=4, num_heads=2, hidden_dim=32,
                   mlp_dim=64, num_classes=10)
    pretrained = torchvision.models.VisionTransformer(**options)
    converted = make_reversible(torchvision.models.VisionTransformer(**options), "encoder.layers")
    assert list(converted.state_dict()) == list(pretrained.state_dict())
    converted.load_state_dict(pretrained.state_dict())
    model = make_reversible(vit())
    for block in model.blocks:
        block.marker = 1  # set through the loop: on the layer itself
    assert model.blocks.layer(3).marker == 1


def test_a_filled_cache_in_a_training_step_is_refused_an_empty_one_left_out_saying_so():
    model = make_reversible(hugging_face("llama")).train()
    ids = tokens()
    with pytest.warns(UserWarning, match="without the key-value cache"):
        out = model(input_ids=ids[:, :8], use_cache=True)
    with torch.no_grad():
        filled = model(input_ids=ids[:, :8], use_cache=True).past_key_values
    with pytest.raises(RuntimeError, match="got a key-value cache holding 8 positions"):
        model(input_ids=ids[:, 8:], past_key_values=filled)
    assert out.loss is None and out.logits.requires_grad


def test_a_layer_called_alone_gives_no_value_and_the_layer_itself_is_at_hand():
    model = make_reversible(vit())
    x = torch.randn(2, 17, 32)
    assert model.blocks[0].attn is model.blocks.layer(0).attn  # the layer's attributes
    assert model.blocks[0](hidden_states=x).shape == x.shape  # by keyword too; its shape only
    with pytest.raises(RuntimeError, match="is not computed"):
        model.blocks[0](x).sum()


def test_hooks_on_a_layer_run_once_per_forward_and_save_on_cpu_keeps_the_gradients():
    # Inside the others: a layer's forward hook fires as in the model's forward (not again in
    # the reconstruction), and torch's save_on_cpu around the step changes no gradient.
    torch.manual_seed(0)
    model = make_reversible(vit(drop_rate=0.1).double())
    calls = []
    model.blocks.layer(1).register_forward_hook(lambda *_: calls.append(1))
    x, y = images()
    reference = stored(model)

    def loss(m):
        with torch.autograd.graph.save_on_cpu():
            return F.cross_entropy(m(x.double()), y)

    grads_of(model, loss)
    assert len(calls) == 1
    grads_of(reference, loss)
    assert max_grad_error(model, reference) < 1e-10


def test_the_model_itself_as_the_stack_is_refused():
    with pytest.raises(ValueError, match="the model itself .* is the stack"):
        make_reversible(nn.Sequential(Res(), Res()))


def _ddp_worker(rank: int, world: int, store: str, results: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(make_reversible(vit().double()))
        x, y = images(4)
        part = slice(2 * rank, 2 * rank + 2)
        F.cross_entropy(model(x[part].double()), y[part]).backward()
        if rank == 0:
            torch.save({n: p.grad for n, p in model.module.named_parameters()}, results)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_over_two_processes_equals_one_process_on_the_whole_batch(tmp_path):
    import torch.multiprocessing as mp

    results = tmp_path / "grads.pt"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "store"), str(results)), nprocs=2)
    torch.manual_seed(0)
    model = make_reversible(vit().double())
    x, y = images(4)
    F.cross_entropy(model(x.double()), y).backward()
    for name, grad in torch.load(results).items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad,
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, value", [("construction", Momentum(0.5)), ("exact", True)])
def test_an_option_set_after_a_forward_computes_as_converted_with_it_and_so_does_a_copy(name,
                                                                                         value):
    torch.manual_seed(0)
    pretrained = Loop(5).double()
    x, shifts = torch.randn(3, 8).double(), [torch.randn(8).double() for _ in range(5)]
    given = {"construction": Difference(0.5)}

    def converted(**options):
        return make_reversible(copy.deepcopy(pretrained), **options)

    model = converted(**given)
    before = model(x, shifts)  # its stage built
    setattr(model.layers, name, value)
    expected = converted(**{**given, name: value})(x, shifts)
    assert not torch.equal(expected, before)  # the option changes the function
    torch.testing.assert_close(model(x, shifts), expected, rtol=0, atol=0)
    torch.testing.assert_close(copy.deepcopy(model)(x, shifts), expected, rtol=0, atol=0)


def test_an_option_set_after_converting_is_checked_as_when_converting():
    model = make_reversible(Loop(4), scale=0.5, exact=True)
    with pytest.raises(ValueError, match=r"exact=True needs a stream scale \+-2\^-k"):
        model.layers.construction = Momentum(0.1)
    with pytest.raises(TypeError, match="construction must be a revnets.conversion Construction"):
        model.layers.construction = 0.25
    assert model.layers.construction == Difference(0.5)  # kept


def _drift_warnings(**options) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_reversible(Loop(options.pop("layers")), **options)
    return [str(w.message) for w in caught if w.category is ReconstructionDriftWarning]


@pytest.mark.parametrize("options, message", [
    ({"layers": 6, "construction": MEFT(0.1, 0.1)},
     r"MEFT\(lam=0.1, beta=0.1\) divides by \|stream\| = 0.01 in each of the 5 layers its stack "
     r"of 6 reconstructs one from the next: round-off grows 1.0e\+10 times, and float32 "
     r"gradients err by about 6.0e\+02 relative.*exact=True with a stream scale \+-2\^-k.*"
     r"keep_input_every=2\).*a stream scale of at least 0.158 \(Difference\(0.5\) up to 14 "
     r"layers, scale=1 at any depth\).*memory=revnets.Store\(\)"),
    ({"layers": 6, "construction": Momentum(0.1)}, r"grows 1.0e\+05 times.*keep_input_every=3"),
    # Measured: Difference(0.5)'s float32 gradients err by 1.5 at 32 layers, 9e-3 at 16.
    ({"layers": 32, "scale": 0.5}, r"grows 2.1e\+09 times.*keep_input_every=7"),
    ({"layers": 16, "scale": 0.5}, r"grows 3.3e\+04 times"),
], ids=["meft-6", "momentum-6", "difference-32", "difference-16"])
def test_a_conversion_whose_float32_gradients_would_not_be_its_own_warns_naming_the_fixes(
        options, message):
    found = _drift_warnings(**options)
    assert len(found) == 1 and re.search(message, found[0]), found


@pytest.mark.parametrize("options", [
    {"layers": 14, "scale": 0.5},  # amplification 2^13
    {"layers": 64, "scale": 1.0},
    {"layers": 32, "scale": 0.5, "exact": True},  # exact to the bit
    {"layers": 6, "construction": MEFT(0.5, 0.5), "exact": True},
    {"layers": 6, "construction": MEFT(0.1, 0.1), "memory": revnets.Store()},  # not reconstructed
    {"layers": 6, "construction": MEFT(0.1, 0.1),
     "memory": revnets.Reconstruct(keep_input_every=2)},  # 2 layers in a chain: 1e4
], ids=["difference-14", "scale-1", "exact", "exact-meft", "store", "keep-input"])
def test_a_conversion_within_the_threshold_or_exact_or_stored_does_not_warn(options):
    assert _drift_warnings(**options) == []


def test_switching_a_stored_conversion_to_reconstruct_warns_as_converting_would():
    model = make_reversible(Loop(6), construction=MEFT(0.1, 0.1), memory=revnets.Store())
    with pytest.warns(ReconstructionDriftWarning, match="grows 1.0e"):
        model.layers.memory = revnets.Reconstruct()


@pytest.mark.parametrize("construction, depth, memory", [
    (Difference(0.5), 8, revnets.Reconstruct()),
    (Difference(0.5), 16, revnets.Reconstruct()),
    (Momentum(0.1), 4, revnets.Reconstruct()),
    (Momentum(0.1), 6, revnets.Reconstruct()),
    (MEFT(0.1, 0.1), 2, revnets.Reconstruct()),
    (MEFT(0.1, 0.1), 4, revnets.Reconstruct()),
    (Momentum(0.1), 8, revnets.Reconstruct(keep_input_every=2)),
    (Momentum(0.1), 8, revnets.Reconstruct(store_last_blocks=2)),
], ids=str)
@pytest.mark.filterwarnings(DRIFTS)  # the drift the warning predicts, measured
def test_the_predicted_amplification_gives_the_float32_gradient_error_to_its_order(
        construction, depth, memory):
    # drift.py: the largest relative error of float32 gradients against the same network in
    # float64 is about 2^-24 times the amplification, each reconstructed layer dividing by
    # |stream| (cases with amplification >= 100, above the ~10 x 2^-24 any float32 step errs).
    torch.manual_seed(0)
    model = make_reversible(vit(depth), construction=construction, memory=memory)
    reference = stored(model).double()
    x, y = images()
    grads_of(model, lambda m: F.cross_entropy(m(x), y))
    grads_of(reference, lambda m: F.cross_entropy(m(x.double()), y))
    predicted = 2.0 ** -24 * amplification(construction, depth, memory)
    assert predicted / 10 < max_grad_error(model, reference) < predicted * 10


@pytest.mark.parametrize("call", [
    lambda: make_reversible(Loop(), scale=torch.tensor(0.5)),
    lambda: Difference(torch.tensor(0.5)),
    lambda: revnets.ScaledCoupling(torch.tensor(0.5)),
], ids=["make_reversible", "Difference", "ScaledCoupling"])
def test_a_tensor_given_as_a_scale_is_refused_naming_float(call):
    # A scale is a fixed number: a tensor (which may require grad, or sit on a device) is not
    # silently read as one.
    with pytest.raises(TypeError, match=r"scale must be a number, got a tensor \(tensor\(0.5000\)"
                                        r"\); give float\(scale\)"):
        call()


def test_numpy_scalars_are_numbers_kept_as_python_floats():
    np = pytest.importorskip("numpy")
    coupling = revnets.ScaledCoupling(np.float32(0.5))
    assert type(coupling.scale) is float and coupling.scale == 0.5
    torch.manual_seed(0)
    pretrained = Loop().double()
    x = torch.randn(3, 8).double()
    given = make_reversible(copy.deepcopy(pretrained), scale=np.float32(0.5))
    assert given.layers.construction == Difference(0.5)
    assert type(given.layers.construction.scale) is float
    assert type(Momentum(np.float64(0.25)).gamma) is float
    torch.testing.assert_close(given(x), make_reversible(pretrained, scale=0.5)(x), rtol=0, atol=0)


@pytest.mark.parametrize("call, message", [
    (lambda: make_reversible(Loop(), None, Momentum(0.1)),
     r"Momentum\(gamma=0.1\) was given as scale, the third positional argument.*"
     r"make_reversible\(model, layers, construction=Momentum\(gamma=0.1\)\)"),
    (lambda: make_reversible(Loop(), None, MEFT), r"MEFT was given as scale.*construction=MEFT"),
    (lambda: make_reversible(Loop(), construction=Momentum),
     r"construction=Momentum is the class; give one of its constructions, e.g. "
     r"construction=Momentum\(gamma=0.1\)"),
    (lambda: make_reversible(Loop(), construction=0.5),
     "construction must be a revnets.conversion Construction"),
], ids=["instance-as-scale", "class-as-scale", "class-as-construction", "number"])
def test_a_construction_given_in_the_wrong_place_or_as_its_class_is_refused_naming_the_call(
        call, message):
    with pytest.raises(TypeError, match=message):
        call()


# -- composing with torch's own wrappers -----------------------------------------------------------


@pytest.mark.parametrize("family, backend", [
    ("vit", "aot_eager"),
    pytest.param("gpt2", "aot_eager", marks=pytest.mark.slow),  # about 10 s
    pytest.param("vit", "inductor", marks=pytest.mark.slow),  # about 15 s of compiling
])
def test_a_compiled_converted_model_gets_the_gradients_of_the_uncompiled_one(family, backend):
    # float32. aot_eager runs the same kernels as eager (measured: equal to the bit); inductor
    # fuses them and reorders float32 sums (measured 5e-7 relative): 1e-5 bounds both.
    torch.manual_seed(0)
    if family == "vit":
        model = make_reversible(vit(), scale=0.5)
        x, y = images()

        def loss(m):
            return F.cross_entropy(m(x), y)
    else:  # the model's own loop over the converted layers; no dropout to draw alike
        model = make_reversible(hugging_face("gpt2", resid_pdrop=0.0, embd_pdrop=0.0,
                                             attn_pdrop=0.0, use_cache=False), scale=0.5)
        ids = tokens()

        def loss(m):
            return m(input_ids=ids, labels=ids).loss
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    try:
        for _ in range(2):  # the second step runs what the first compiled
            model.zero_grad(set_to_none=True)
            loss(compiled).backward()
    finally:
        torch._dynamo.reset()
    grads_of(eager, loss)
    assert max_grad_error(model, eager) < 1e-5


def test_a_converted_resnet_stage_in_channels_last_gets_the_gradients_of_a_contiguous_one():
    torch.manual_seed(0)
    resnet = timm.create_model("resnet18", num_classes=10).double()
    contiguous = make_reversible(resnet, "layer1", dim=1)
    channels_last = copy.deepcopy(contiguous).to(memory_format=torch.channels_last)
    assert channels_last.layer1.layer(0).conv1.weight.is_contiguous(
        memory_format=torch.channels_last)
    x, y = images()
    x = x.double()
    grads_of(contiguous, lambda m: F.cross_entropy(m(x), y))
    grads_of(channels_last, lambda m: F.cross_entropy(
        m(x.contiguous(memory_format=torch.channels_last)), y))
    assert max_grad_error(channels_last, contiguous) < 1e-10  # float64: round-off alone


def _fsdp_worker(rank: int, world: int, store: str, results: str, sharded: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = make_reversible(vit().double())
        if sharded == "stack":
            fully_shard(model.blocks, reshard_after_forward=False)
        fully_shard(model)
        x, y = images(4)
        part = slice(2 * rank, 2 * rank + 2)
        F.cross_entropy(model(x[part].double()), y[part]).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, results)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("sharded", ["model", "stack"])
def test_fsdp2_over_two_processes_equals_one_process_on_the_whole_batch(sharded, tmp_path):
    # fully_shard on the model (its hooks gather the stack's parameters with its own) or on the
    # converted stack too, which the model calls whole; gradients gathered back to full tensors.
    import torch.multiprocessing as mp

    results = tmp_path / "grads.pt"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "store"), str(results), sharded), nprocs=2)
    torch.manual_seed(0)
    model = make_reversible(vit().double())
    x, y = images(4)
    F.cross_entropy(model(x.double()), y).backward()
    grads = torch.load(results)
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, rtol=1e-10, atol=1e-12)


@pytest.fixture
def one_process(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_a_layer_of_a_converted_stack_is_refused_naming_where_to_shard(one_process):
    from torch.distributed.fsdp import fully_shard

    model = make_reversible(vit())
    fully_shard(model.blocks.layer(1))
    fully_shard(model)
    with pytest.raises(RuntimeError, match=r"layer 1 of a converted stack is sharded with FSDP2's "
                                           r"fully_shard.*shard the converted stack where the "
                                           r"model calls it whole \(fully_shard\(stack\)"):
        model(images()[0])


def test_fsdp2_on_a_stack_the_models_loop_calls_layer_by_layer_is_refused_naming_the_model(
        one_process):
    from torch.distributed.fsdp import fully_shard

    model = make_reversible(hugging_face("gpt2", use_cache=False))
    fully_shard(model.transformer.h)
    fully_shard(model)
    with pytest.raises(RuntimeError, match=r"this model's own loop calls its layers one by one.*"
                                           r"shard the model holding it alone "
                                           r"\(fully_shard\(model\)\)"):
        model(input_ids=tokens())
