import copy

import pytest
import timm
import torch

import revnets
from revnets.models.residual import ResidualNet

from conftest import rel_error

# Parameter counts of the official RevNet code (../shared/references.md).
PARAMETERS = {
    "resnet32": (464_154, 470_004),
    "resnet110": (1_727_962, 1_733_812),
    "resnet164": (1_703_258, 1_726_388),
    "revnet38": (464_890, 475_060),
    "revnet110": (1_729_194, 1_740_804),
    "revnet164": (1_748_778, 1_794_948),
}
IMAGENET_PARAMETERS = {"preact_resnet101": 44_541_480, "revnet104": 45_428_072}


def count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", PARAMETERS)
def test_cifar_parameter_counts_match_the_paper(name):
    assert count(timm.create_model(name)) == PARAMETERS[name][0]
    assert count(timm.create_model(name, num_classes=100)) == PARAMETERS[name][1]


@pytest.mark.parametrize("name", IMAGENET_PARAMETERS)
def test_imagenet_parameter_counts_match_the_paper(name):
    with torch.device("meta"):  # no need to allocate 45M parameters to count them
        model = timm.create_model(name)
    assert count(model) == IMAGENET_PARAMETERS[name]


def test_pretrained_cfg_and_pretrained_refused():
    model = timm.create_model("revnet38", num_classes=100)
    assert model.pretrained_cfg["input_size"] == (3, 32, 32)
    assert len(model.pretrained_cfg["mean"]) == 3 and len(model.pretrained_cfg["std"]) == 3
    assert timm.create_model("revnet104").pretrained_cfg["input_size"] == (3, 224, 224)
    with pytest.raises(ValueError, match="no pretrained weights are published for revnet38"):
        timm.create_model("revnet38", pretrained=True)


def test_every_model_is_listed_by_timm():
    names = set(timm.list_models())
    zoo = {*PARAMETERS, *IMAGENET_PARAMETERS, "resnet1001", "revnet992", "irevnet163",
           "irevnet301", "irevnet1000", "revvit_small_patch16_224", "revvit_base_patch16_224"}
    assert zoo <= names


def test_memory_plan_validation_and_state_dict_unchanged():
    model = timm.create_model("revnet38")
    assert model.memory == revnets.PRESETS["reversible"]
    assert model.memory == revnets.MemoryPlan(stages=revnets.Reconstruct(), rest=revnets.Store())
    keys = list(model.state_dict())
    for preset in revnets.PRESETS:
        model.set_memory(preset)
        assert list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="'reversible' does not fit a ResNet: a ResNet has no rev"):
        timm.create_model("resnet32", memory="reversible")
    with pytest.raises(ValueError, match="unknown memory plan 'recompute'; presets: none, check"):
        model.set_memory("recompute")
    model.set_grad_checkpointing(True)
    assert model.memory.name == "reversible+checkpoint"
    model.set_memory("reversible(store_last_blocks=2, keep_input_every=3)")
    assert model.memory.stages == revnets.Reconstruct(store_last_blocks=2, keep_input_every=3)
    sequence = model.stages[0].reversible
    assert sequence.memory == revnets.Reconstruct(store_last_blocks=2, keep_input_every=3)
    model.set_memory(revnets.MemoryPlan(revnets.Checkpoint(segments=2)))
    assert sequence.memory == revnets.Store()  # its blocks are checkpointed by the model


def small_revnet(bottleneck: bool) -> ResidualNet:
    return ResidualNet(units=(2, 3), channels=(8, 8, 16), bottleneck=bottleneck, reversible=True)


def steps(model, inputs, targets):
    """A few SGD steps; returns the gradients of the last one."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(zip(inputs, targets)):
        optimizer.zero_grad()
        torch.manual_seed(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return grads


def assert_matches_baseline(baseline, strategy: str, batch: int, steps_taken: int = 3) -> None:
    """Same gradients (float64, 1e-10) and BatchNorm statistics as ``baseline`` under ``none``."""
    torch.manual_seed(0)
    baseline = baseline.double().set_memory("none")
    model = copy.deepcopy(baseline).set_memory(strategy)
    inputs = [torch.randn(batch, 3, 8, 8, dtype=torch.float64) for _ in range(steps_taken)]
    targets = [torch.randint(0, 10, (batch,)) for _ in range(steps_taken)]
    expected, got = steps(baseline, inputs, targets), steps(model, inputs, targets)
    assert max(rel_error(a, b) for a, b in zip(got, expected)) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), baseline.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name
    assert any(
        "num_batches_tracked" in n and b.item() == steps_taken for n, b in model.named_buffers()
    )


@pytest.mark.parametrize("bottleneck", [False, True])
@pytest.mark.parametrize("strategy", ["checkpoint", "reversible", "reversible+checkpoint"])
def test_strategies_match_the_baseline(strategy, bottleneck):
    assert_matches_baseline(small_revnet(bottleneck), strategy, batch=4)


def test_revnet_units_are_reversible_where_the_shape_allows():
    model = timm.create_model("revnet38")
    stages = list(model.stages)
    # Stage 1 keeps 32 channels at stride 1: all three units invertible. Stages 2 and 3 open
    # with a downsampling unit, stored like an ordinary layer.
    assert stages[0].units == torch.nn.ModuleList() or len(stages[0].units) == 0
    assert len(stages[0].reversible) == 3
    assert [len(s.units) for s in stages[1:]] == [1, 1]
    assert [len(s.reversible) for s in stages[1:]] == [2, 2]


def test_checkpoint_plan_stores_no_segment_of_a_stage_another_follows():
    """Only the network's last segment runs stored: a stage's last one would otherwise stay
    stored through the rest of the forward (4 of 16 units a stage here, about 28 % of `none`)."""

    def forward(model, x):
        return model(x).sum()

    x = torch.randn(4, 3, 32, 32)
    kept = {
        preset: revnets.measure_memory(
            forward, timm.create_model("resnet32", units=(16, 16, 16), memory=preset), x
        ).retained_bytes
        for preset in ("none", "checkpoint")
    }
    assert kept["checkpoint"] < kept["none"] / 6


def test_eval_forward_same_for_all_strategies():
    model = timm.create_model("revnet38").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        outputs = [model.set_memory(s)(x) for s in revnets.PRESETS]
    with torch.inference_mode():  # what serving code uses; inference tensors have no versions
        outputs += [model.set_memory(s)(x) for s in revnets.PRESETS]
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
    assert outputs[0].shape == (2, 10)


@pytest.mark.parametrize("name", ["revnet38", "resnet32"])
def test_odd_image_sizes_train_as_in_torchvisions_resnets(name):
    """A stage's strided convolution rounds an odd size up and its pooled shortcut rounded it
    down: a 33x33 image failed with a size mismatch deep in the first downsampling unit."""
    model = timm.create_model(name)
    out = model(torch.randn(2, 3, 33, 33))
    out.sum().backward()
    assert out.shape == (2, 10)


@pytest.mark.parametrize(
    "name, size, reductions", [("revnet38", 32, [1, 1, 2, 4]), ("revnet104", 64, [2, 4, 8, 16, 32])]
)
def test_timm_features_only(name, size, reductions):
    """timm's backbone interface (detection and segmentation heads take these)."""
    model = timm.create_model(name, features_only=True)
    features = model(torch.randn(2, 3, size, size))
    assert [f.shape[1] for f in features] == model.feature_info.channels()
    assert [size // f.shape[-1] for f in features] == reductions == model.feature_info.reduction()
    # The stages still train reversibly behind the feature taps.
    assert features[2].grad_fn.name() == "ReversibleFunctionBackward"
    picked = timm.create_model(name, features_only=True, out_indices=(1, 2))
    assert [f.shape[1] for f in picked(torch.randn(2, 3, size, size))] == [
        model.feature_info.channels()[i] for i in (1, 2)
    ]


def test_timm_forward_intermediates_and_getter():
    model = timm.create_model("revnet38").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, taps = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x))
        assert [t.shape[1] for t in taps] == [f["num_chs"] for f in model.feature_info]
        last_two = model.forward_intermediates(x, indices=2, norm=True, intermediates_only=True)
        assert torch.equal(last_two[0], taps[2]) and torch.equal(last_two[1], final)
    getter = timm.create_model("revnet38", features_only=True, feature_cls="getter",
                               out_indices=(1, 2))
    assert len(getter.model.stages) == 2  # pruned behind the last tap
    features = getter(x)
    assert [f.shape[1] for f in features] == [32, 64]
    assert features[1].grad_fn.name() == "ReversibleFunctionBackward"


def test_timm_feature_interface():
    model = timm.create_model("revnet38", num_classes=100)
    x = torch.randn(2, 3, 32, 32)
    features = model.forward_features(x)
    assert features.shape == (2, 112, 8, 8)
    assert model.forward_head(features, pre_logits=True).shape == (2, 112)
    model.reset_classifier(7)
    assert model(x).shape == (2, 7)


def test_reversible_activation_memory_flat_in_depth():
    def step(model, x, y):
        torch.nn.functional.cross_entropy(model(x), y).backward()

    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))

    def activations(units, memory):
        model = ResidualNet(units=units, channels=(8, 8, 16, 32), reversible=True, memory=memory)
        return revnets.measure_memory(step, model, x, y).above_model_state_bytes

    # Flat up to bytes (BatchNorm's per-channel batch statistics live at slightly different times).
    assert activations((6, 6, 6), "reversible") <= 1.01 * activations((2, 2, 2), "reversible")
    assert activations((6, 6, 6), "none") > 2 * activations((2, 2, 2), "none")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet1001", "revnet992"])
def test_thousand_layer_models_train_a_step(name):
    model = timm.create_model(name)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():  # untrained, in eval mode: nothing normalizes, nothing may overflow
        assert model.eval()(x).isfinite().all()


@pytest.mark.parametrize("name", ["revnet38", "revnet110", "revnet164"])
@pytest.mark.parametrize("strategy", ["reversible", "reversible+checkpoint"])
def test_zoo_revnets_match_their_baseline(name, strategy):
    assert_matches_baseline(timm.create_model(name), strategy, batch=2, steps_taken=2)


ZOO = ["revnet38", "resnet32", "preact_resnet101", "revvit_small_patch16_224", "irevnet163"]


def small(name, **kwargs):
    """A zoo model at a size tests afford, built through timm.create_model."""
    if name.startswith("revvit"):
        kwargs = dict(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, **kwargs)
    if name.startswith("irevnet"):
        kwargs = dict(units=(2, 2, 2), **kwargs)
    return timm.create_model(name, **kwargs).eval()


@pytest.mark.parametrize("name", ZOO)
def test_no_classifier_and_no_pooling_as_timm_models_do(name):
    """timm's own CNNs (resnet18 here) return unpooled feature maps for num_classes=0,
    global_pool=''; so do the zoo's (a Rev-ViT its map of tokens, NHWC as timm's Swin)."""
    reference = timm.create_model("resnet18", num_classes=0, global_pool="").eval()
    x = torch.randn(2, 3, 32, 32)
    assert reference(x).dim() == 4
    model = small(name, num_classes=0, global_pool="")
    out = model(x)
    assert out.dim() == 4
    assert out.shape[-1 if name.startswith("revvit") else 1] == model.num_features
    assert torch.equal(out, model.forward_features(x))


@pytest.mark.parametrize("name", ZOO)
def test_reset_classifier_as_timm_models_do(name):
    x = torch.randn(2, 3, 32, 32)
    for model in (timm.create_model("resnet18").eval(), small(name)):
        model.reset_classifier(7)
        assert model(x).shape == (2, 7) and model.get_classifier().out_features == 7
        model.reset_classifier(0)
        assert model(x).shape == (2, model.num_features)  # pooled, no classifier
        model.reset_classifier(0, "")
        assert model(x).dim() > 2  # unpooled
        model.reset_classifier(5, "avg")
        assert model(x).shape == (2, 5)


def test_create_model_keywords_override_the_builders_defaults():
    model = timm.create_model("revnet38", channels=(16, 16, 32, 64), units=(1, 1, 1))
    assert model.stages[2].units[0].f[-1].out_channels == 32  # half of 64
    assert model.stages[2].reversible is None  # one unit a stage: no reversible run after it
    model = timm.create_model("revvit_small_patch16_224", depth=3, embed_dim=64, num_heads=4)
    assert len(model.blocks) == 3 and model.num_features == 128


@pytest.mark.parametrize("name", ZOO)
def test_group_matcher_and_layer_decay_with_timms_optimizer_factory(name):
    from timm.models import group_parameters
    from timm.optim import create_optimizer_v2

    model = small(name)
    for coarse in (True, False):
        groups = group_parameters(model, model.group_matcher(coarse=coarse))
        names = [n for group in groups.values() for n in group]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.7)
    scales = {group["lr_scale"] for group in optimizer.param_groups}
    assert len(scales) > 2  # earlier layers learn slower
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for n, p in model.named_parameters():
        if n in model.no_weight_decay() or p.ndim <= 1:
            assert id(p) not in decayed, n


@pytest.mark.parametrize("name", ZOO)
def test_pretrained_cfg_is_complete(name):
    """The keys timm's data pipeline and fine-tuning helpers read, as resnet18 has them."""
    keys = ("input_size", "pool_size", "crop_pct", "interpolation", "mean", "std",
            "first_conv", "classifier", "num_classes")
    reference = timm.create_model("resnet18").pretrained_cfg
    model = small(name)
    assert all(key in reference for key in keys)
    assert all(key in model.pretrained_cfg for key in keys)
    # i-RevNet's stem has no convolution: its first one takes the first stream.
    first_conv = model.get_submodule(model.pretrained_cfg["first_conv"])
    assert first_conv.in_channels == (16 if name.startswith("irevnet") else 3)
    assert model.get_submodule(model.pretrained_cfg["classifier"]) is model.get_classifier()
    config = timm.data.resolve_data_config({}, model=model)
    assert config["input_size"] == model.pretrained_cfg["input_size"]


def test_fx_feature_extraction_keeps_each_reversible_sequence_whole():
    """timm's torch.fx feature extraction (what detection and segmentation code uses) traces a
    zoo model with every ReversibleSequence as one leaf: the taps at the sequences' outputs are
    forward_intermediates' features, and the traced model still trains reversibly."""
    from timm.models import create_feature_extractor

    model = timm.create_model("revnet38")
    nodes = {"stages.0.reversible": "0", "stages.1.reversible": "1", "stages.2.reversible": "2"}
    extractor = create_feature_extractor(model, nodes)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        taps = model.eval().forward_intermediates(x, indices=(1, 2, 3), intermediates_only=True)
        traced = extractor.eval()(x)
    assert all(torch.equal(traced[k], tap) for k, tap in zip("012", taps))
    features = extractor.train()(x)
    assert features["2"].grad_fn.name() == "ReversibleFunctionBackward"


def test_timm_factory_device_and_dtype_keywords():
    """timm.create_model(name, device=..., dtype=...) as for timm's own models: every parameter
    and buffer made there, and a new classifier follows the model's device, dtype and mode."""
    for name in ("revnet38", "irevnet163", "revvit_small_patch16_224"):
        model = timm.create_model(name, device="meta", dtype=torch.float64).eval()
        tensors = [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]
        assert all(t.device.type == "meta" and t.dtype == torch.float64 for t in tensors)
        assert model.in_chans == 3
        model.reset_classifier(7)
        head = model.get_classifier()
        assert head.weight.device.type == "meta" and head.weight.dtype == torch.float64
        assert not head.training


def test_zero_init_last_starts_every_residual_branch_at_zero():
    """timm's zero_init_last: every unit starts as its shortcut (a RevNet's f and g give 0)."""
    from revnets.layers import ResidualUnit, RevNetDownsampleUnit

    def shortcut_of(unit, x):
        if isinstance(unit, ResidualUnit):
            return unit.shortcut(x)
        if isinstance(unit, RevNetDownsampleUnit):
            x1, x2 = x.chunk(2, dim=1)
            return torch.cat((unit.shortcut1(x1), unit.shortcut2(x2)), dim=1)
        return x  # a reversible block: y1 = x1 + f(x2) = x1, y2 = x2 + g(y1) = x2

    seen = []
    for reversible in (False, True):
        model = ResidualNet(units=(2, 2), channels=(8, 8, 16), reversible=reversible,
                            zero_init_last=True).eval()
        for unit in model.modules():
            if isinstance(unit, (ResidualUnit, RevNetDownsampleUnit, revnets.ReversibleBlock)):
                unit.register_forward_hook(
                    lambda m, args, out: seen.append(torch.equal(out, shortcut_of(m, args[0]))))
        model(torch.randn(2, 3, 16, 16))
    assert len(seen) == 8 and all(seen)
