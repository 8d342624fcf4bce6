"""Rev-ViT: the published architecture's parameter counts, its reversible path against ordinary
autograd on the same weights (drop path on), and timm's interfaces."""

import copy

import pytest
import timm
import torch

import revnets
from revnets.memory import measure_memory

from conftest import max_grad_error, rel_error


def tiny(**kwargs):
    """Rev-ViT at a size a test can afford: 32x32 images, 16 patches, width 16 per stream."""
    args = dict(img_size=32, patch_size=8, embed_dim=16, depth=4, num_heads=2, num_classes=5,
                drop_path_rate=0.3)
    return timm.create_model("revvit_small_patch16_224", **{**args, **kwargs})


@pytest.mark.parametrize("name,count", [
    ("revvit_small_patch16_224", 22_434_664),
    ("revvit_base_patch16_224", 87_335_656),
])
def test_parameter_counts_equal_the_official_code(name, count):
    with torch.device("meta"):
        model = timm.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == count


@pytest.mark.parametrize("strategy", ["reversible", "checkpoint", "reversible+checkpoint"])
def test_every_memory_strategy_trains_like_ordinary_autograd_with_drop_path(strategy):
    model = tiny().double().set_memory(strategy)
    plain = copy.deepcopy(model).set_memory("none")
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    x_model, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    for m, xi in ((model, x_model), (plain, x_plain)):
        torch.manual_seed(0)
        m(xi).square().sum().backward()
    assert rel_error(x_model.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain, skip=keys_bias) <= 1e-10
    for name in keys_bias(model):
        # Softmax does not see a bias added to every key: its true gradient is zero, and both
        # paths' are round-off.
        assert model.get_parameter(name).grad.abs().max() <= 1e-12


def keys_bias(model):
    return [name for name, _ in model.named_parameters() if name.endswith("k.bias")]


def test_drop_path_draws_per_sample_masks():
    model = tiny(drop_path_rate=0.9).train()
    x = torch.randn(8, 3, 32, 32)
    torch.manual_seed(0)
    a = model(x)
    torch.manual_seed(1)
    b = model(x)
    assert not torch.allclose(a, b)
    model.eval()
    assert torch.equal(model(x), model(x))


def test_activation_memory_does_not_grow_with_depth():
    above = {}
    for depth in (2, 8):
        model = tiny(depth=depth, drop_path_rate=0.0)
        x = torch.randn(4, 3, 32, 32)
        report = measure_memory(lambda m, x: m(x).sum().backward(), model, x)
        above[depth] = report.above_model_state_bytes
    # Parameter gradients of the extra blocks arrive at the end of backward: count them apart.
    extra = sum(p.numel() * 4 for b in list(tiny(depth=8).blocks)[2:] for p in b.parameters())
    assert above[8] - above[2] <= extra


def test_timm_interfaces():
    model = tiny(drop_path_rate=0.0).eval()
    x = torch.randn(2, 3, 32, 32)
    features = model.forward_features(x)
    assert features.shape == (2, 16, 32)  # tokens, two streams of 16
    assert torch.equal(model.forward_head(features), model(x))
    assert model.forward_head(features, pre_logits=True).shape == (2, 32)
    final, taps = model.forward_intermediates(x, indices=2)
    assert [t.shape for t in taps] == [(2, 32, 4, 4)] * 2
    assert torch.allclose(final, features)
    model.reset_classifier(0, "")
    assert model(x).shape == (2, 16, 32)  # unpooled tokens
    assert model.no_weight_decay() == {"patch_embed.pos_embed"}
    model.set_grad_checkpointing(True)
    assert model.memory.name == "reversible+checkpoint"


def test_features_only():
    model = timm.create_model("revvit_small_patch16_224", features_only=True, out_indices=(1, 3),
                              img_size=32, patch_size=8, embed_dim=16, depth=4, num_heads=2)
    maps = model(torch.randn(2, 3, 32, 32))
    assert [m.shape for m in maps] == [(2, 32, 4, 4)] * 2


def test_unknown_strategy_and_wrong_input_size_are_named():
    with pytest.raises(ValueError, match="unknown memory plan 'sparse'; presets: none"):
        tiny().set_memory("sparse")
    with pytest.raises(ValueError, match=r"the position embedding has 16 \(32 pixels square\)"):
        tiny()(torch.randn(1, 3, 64, 64))


def test_is_part_of_the_public_zoo():
    assert isinstance(tiny(), revnets.models.ReversibleVisionTransformer)
    assert "revvit_base_patch16_224" in timm.list_models("revvit*")
