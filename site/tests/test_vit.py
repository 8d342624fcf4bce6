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
    assert features.shape == (2, 4, 4, 32)  # a 4x4 grid of patches (NHWC), two streams of 16
    assert model.output_fmt == "NHWC"
    assert torch.equal(model.forward_head(features), model(x))
    assert model.forward_head(features, pre_logits=True).shape == (2, 32)
    final, taps = model.forward_intermediates(x, indices=2)
    assert [t.shape for t in taps] == [(2, 32, 4, 4)] * 2
    assert torch.allclose(final, features)
    tokens = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)
    assert torch.equal(tokens[0].reshape(2, 4, 4, 32).permute(0, 3, 1, 2), taps[-1])
    model.reset_classifier(0, "")
    assert model(x).shape == (2, 4, 4, 32)  # the unpooled map
    assert model.no_weight_decay() == {"patch_embed.pos_embed"}
    model.set_grad_checkpointing(True)
    assert model.memory.name == "reversible+checkpoint"


def test_features_only():
    model = timm.create_model("revvit_small_patch16_224", features_only=True, out_indices=(1, 3),
                              img_size=32, patch_size=8, embed_dim=16, depth=4, num_heads=2)
    maps = model(torch.randn(2, 3, 32, 32))
    assert [m.shape for m in maps] == [(2, 32, 4, 4)] * 2
    # By default the last three blocks, as for timm's ViT.
    default = timm.create_model("revvit_small_patch16_224", features_only=True, img_size=32,
                                patch_size=8, embed_dim=16, depth=4, num_heads=2)
    assert len(default(torch.randn(1, 3, 32, 32))) == len(default.feature_info.channels()) == 3


def test_wrong_input_size_is_named_and_img_size_resamples_the_position_embedding():
    with pytest.raises(AssertionError, match=r"an input of 64x64 pixels; the position embedding "
                                             r"is for 32x32: create the model with img_size"):
        tiny()(torch.randn(1, 3, 64, 64))
    cfg = timm.create_model("revvit_small_patch16_224", device="meta").pretrained_cfg
    assert cfg["fixed_input_size"] and cfg["pool_size"] == (14, 14)
    model = tiny(drop_path_rate=0.0).eval()
    grid = model.patch_embed.pos_embed.detach().reshape(1, 4, 4, 16)
    model.set_input_size(img_size=64)  # as timm's ViT: an 8x8 grid, the embedding resampled
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5)
    resampled = torch.nn.functional.interpolate(
        grid.permute(0, 3, 1, 2), size=(8, 8), mode="bicubic", antialias=True)
    expected = resampled.permute(0, 2, 3, 1).reshape(1, 64, 16)
    assert torch.allclose(model.patch_embed.pos_embed, expected)


def test_dynamic_img_size_resamples_the_position_embedding_per_input():
    """dynamic_img_size=True, as timm's ViT: any size divisible by the patch, the embedding
    resampled to the input's grid; at the model's own size it is the fixed-size model."""
    fixed = tiny(drop_path_rate=0.0).eval()
    dynamic = tiny(drop_path_rate=0.0, dynamic_img_size=True).eval()
    dynamic.load_state_dict(fixed.state_dict())
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(dynamic(x), fixed(x))
    wide = torch.randn(2, 3, 32, 48)
    assert dynamic.forward_features(wide).shape == (2, 4, 6, 32)
    resized = tiny(drop_path_rate=0.0, img_size=(32, 48)).eval()
    resized.load_state_dict(dynamic.state_dict() | {"patch_embed.pos_embed": resized_pos_embed(
        dynamic.patch_embed.pos_embed, (4, 6))})
    assert torch.allclose(dynamic(wide), resized(wide), atol=1e-6)
    padded = tiny(drop_path_rate=0.0, dynamic_img_size=True, dynamic_img_pad=True).eval()
    assert padded.forward_features(torch.randn(1, 3, 30, 45)).shape == (1, 4, 6, 32)


def test_torch_fx_traces_dynamic_img_size_once_for_every_input_size():
    """timm's fx feature extraction of a dynamic_img_size Rev-ViT: one trace, then the graph
    resamples the position embedding for each input as the model does."""
    from timm.models import create_feature_extractor

    model = tiny(drop_path_rate=0.0, dynamic_img_size=True).eval()
    traced = create_feature_extractor(model, {"head": "logits"})
    for size in ((32, 32), (48, 40)):
        x = torch.randn(1, 3, *size)
        assert torch.equal(traced(x)["logits"], model(x))


def resized_pos_embed(pos_embed, grid):
    return revnets.models.reversible_vit.resampled_pos_embed(pos_embed.detach(), grid, (4, 4))


def test_unknown_strategy_is_named():
    with pytest.raises(ValueError, match="unknown memory plan 'sparse'; presets: none"):
        tiny().set_memory("sparse")


def test_is_part_of_the_public_zoo():
    assert isinstance(tiny(), revnets.models.ReversibleVisionTransformer)
    assert "revvit_base_patch16_224" in timm.list_models("revvit*")
