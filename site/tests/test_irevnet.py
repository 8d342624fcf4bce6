"""Fully invertible networks (i-RevNet): the blocks as the public code writes them against the
couplings they run as, the zoo models' reversible path against ordinary autograd on the same
weights (dropout on), the published parameter count, and memory flat in depth and stages."""

import copy

import pytest
import timm
import torch
import torch.nn.functional as F

import revnets
from revnets.layers import IRevNetBlock, irevnet_bottleneck, irevnet_stage
from revnets.memory import measure_memory

from conftest import max_grad_error, rel_error


def tiny(**kwargs):
    """An i-RevNet a test can afford: 16x16 grey images, ImageNet's stem, 3 stages (odd, even and
    odd block counts), 4 channels per stream at first."""
    args = dict(units=(3, 2, 1), channels=(8, 32, 128), strides=(2, 2, 2), stem_block_size=2,
                in_chans=1, num_classes=5, block_drop_rate=0.2)
    return timm.create_model("irevnet301", **{**args, **kwargs})


def test_irevnet301_has_the_public_codes_parameter_count():
    with torch.device("meta"):
        model = timm.create_model("irevnet301")
    assert sum(p.numel() for p in model.parameters()) == 125_120_356
    assert model.num_features == 3072  # 3072 x 7 x 7 = 3 x 224 x 224: bijective to the head


@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("stride", [1, 2])
def test_a_stage_of_couplings_equals_i_revnet_blocks_run_one_by_one(count, stride):
    torch.manual_seed(0)
    width = 4 * stride**2
    transforms = [
        irevnet_bottleneck(4 if j == 0 else width, width, stride if j == 0 else 1)
        for j in range(count)
    ]
    x = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    sequence = revnets.ReversibleSequence(irevnet_stage(transforms, stride)).double()
    expected = x
    for j, transform in enumerate(transforms):
        expected = IRevNetBlock(transform, stride if j == 0 else 1).double()(expected)
    # Equal up to round-off: BatchNorm reduces a view of the merged tensor in one, a copy in the
    # other.
    assert torch.allclose(sequence(x), expected, rtol=0, atol=1e-12)
    assert torch.allclose(sequence.inverse(sequence(x)), x, rtol=0, atol=1e-12)


def test_an_i_revnet_block_inverts_exactly():
    block = IRevNetBlock(irevnet_bottleneck(4, 16, stride=2), stride=2).double()
    assert revnets.check_invertible(block, torch.randn(2, 8, 8, 8, dtype=torch.float64),
                                    tolerance=1e-12) <= 1e-12


@pytest.mark.parametrize("name,units", [("irevnet301", None), ("irevnet163", (3, 2, 1))])
def test_the_reversible_path_trains_like_ordinary_autograd_with_dropout(name, units):
    """ImageNet's stem (space to depth) and CIFAR's (zero channels); stages with odd counts run
    an IRevNetBlock first, even ones couplings after psi on both streams."""
    if name == "irevnet301":
        model, x = tiny(), torch.randn(3, 1, 16, 16, dtype=torch.float64)
    else:
        model = timm.create_model(name, units=units, block_drop_rate=0.2)
        x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    model = model.double()
    plain = copy.deepcopy(model).set_memory("none")
    x_model, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    for m, xi in ((model, x_model), (plain, x_plain)):
        torch.manual_seed(0)
        m(xi).square().sum().backward()
    assert rel_error(x_model.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), b in zip(model.named_buffers(), plain.buffers()):
        # BatchNorm statistics updated once, alike (up to round-off: a view's reduction order).
        assert torch.allclose(a, b, rtol=1e-12, atol=0), name


def test_checkpoint_strategy_trains_like_ordinary_autograd():
    model = tiny().double().set_memory("checkpoint")
    plain = copy.deepcopy(model).set_memory("none")
    x = torch.randn(2, 1, 16, 16, dtype=torch.float64)
    for m in (model, plain):
        torch.manual_seed(0)
        m(x).square().sum().backward()
    assert max_grad_error(model, plain) <= 1e-10


def _activation_bytes(model, batch=4):
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    return measure_memory(train_step, model, x, y).above_model_state_bytes


def train_step(model, x, y):
    F.cross_entropy(model(x), y).backward()


def test_memory_does_not_grow_from_three_stages_worth_of_depth_to_ten_times_that():
    """CIFAR's i-RevNet plan (16-64-256 channels per stream), measured on CPU."""
    shallow = _activation_bytes(timm.create_model("irevnet163", units=(3, 3, 3)))
    deep = _activation_bytes(timm.create_model("irevnet163", units=(30, 30, 30)))
    plain = _activation_bytes(timm.create_model("irevnet163", units=(30, 30, 30), memory="none"))
    assert deep <= 1.05 * shallow
    assert plain >= 10 * deep  # what ordinary autograd stores at that depth


def test_memory_does_not_grow_with_the_number_of_stages():
    """Every stage holds as many values as the input (space to depth keeps them all), and no
    stage boundary is stored: one stage or four, the forward keeps the head's input only (and
    BatchNorm's running statistics per block, for the replay). The step's peak grows with the
    parameters' gradients instead, which the deeper stages have more of."""
    def kept(stages):
        model = timm.create_model("irevnet163", units=(2,) * stages, channels=(4, 16, 64, 256)[
            :stages], strides=(1, 2, 2, 2)[:stages])
        x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
        return measure_memory(forward_loss, model, x, y).retained_bytes

    activation = 4 * 8 * 32 * 32 * 4  # batch 4, 8 channels at 32x32 or the same values later
    assert 2 * activation <= kept(1) <= kept(4) <= 1.05 * kept(1)


def forward_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def test_widths_that_space_to_depth_cannot_make_are_refused_by_name():
    with pytest.raises(ValueError, match="stage 1 has 48 channels per stream.*use that width"):
        timm.create_model("irevnet163", channels=(16, 48, 256))
    with pytest.raises(ValueError, match="widen channels\\[0\\]"):
        timm.create_model("irevnet163", channels=(1, 4, 16))


def test_timm_interfaces():
    model = tiny().eval()
    x = torch.randn(2, 1, 16, 16)
    final, taps = model.forward_intermediates(x)
    assert [t.shape[1:] for t in taps] == [(16, 4, 4), (64, 2, 2), (256, 1, 1)]
    assert torch.allclose(model.forward_head(final), model(x), atol=1e-6)
    features = timm.create_model("irevnet301", features_only=True, out_indices=(0, 2),
                                 units=(2, 2, 2), channels=(8, 32, 128), strides=(2, 2, 2),
                                 in_chans=1).eval()
    assert [f.shape[1] for f in features(x)] == [16, 256]
    model.reset_classifier(0, "")
    assert model(x).shape == (2, 256, 1, 1)
    model.set_grad_checkpointing(True)
    assert model.memory.name == "checkpoint"


def test_features_only_taps_every_stage_and_prunes_the_rest():
    """timm's features_only: by default every stage's output (irevnet163 has three stages, not
    timm's five); the getter keeps only the blocks up to the last tap, and their outputs are
    those of the whole network."""
    args = dict(units=(2, 2, 2), in_chans=1)
    full = timm.create_model("irevnet163", **args).eval()
    features = timm.create_model("irevnet163", features_only=True, **args).eval()
    assert features.feature_info.channels() == [32, 128, 512]
    features.model.load_state_dict(full.state_dict(), strict=False)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        taps = full.forward_intermediates(x, intermediates_only=True)
        assert all(torch.equal(a, b) for a, b in zip(features(x), taps))
    first = timm.create_model("irevnet163", features_only=True, out_indices=(0,), **args)
    assert len(first.model.blocks) == first.model.stage_ends[0] < len(full.blocks)
    assert isinstance(first.model.final_act, torch.nn.Identity)
