"""Invertible modules beside couplings in a reversible sequence: i-RevNet's downsampling and
padding, and a user's own with parameters, against ordinary autograd (float64, 1e-10)."""

import pytest
import torch
from torch import nn

import revnets
from revnets.memory import measure_memory

from conftest import max_grad_error, rel_error, twin


def test_space_to_depth_uses_i_revnets_channel_order_and_inverts_exactly():
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    b, c = 2, 3
    y = revnets.SpaceToDepth(b)(x)
    assert y.shape == (2, 12, 3, 4)
    for i in range(b):
        for j in range(b):
            for channel in range(c):
                assert torch.equal(y[:, (i * b + j) * c + channel], x[:, channel, i::b, j::b])
    # torch's pixel_unshuffle: the same values, channels in another fixed order.
    assert torch.equal(y.sort(dim=1).values, nn.functional.pixel_unshuffle(x, b).sort(dim=1).values)
    assert torch.equal(revnets.SpaceToDepth(b).inverse(y), x)


def test_injective_padding_inverts_exactly():
    x = torch.randn(2, 3, 4, 4)
    pad = revnets.InjectivePad(5)
    assert pad(x).shape == (2, 8, 4, 4) and torch.equal(pad(x)[:, 3:], torch.zeros(2, 5, 4, 4))
    assert torch.equal(pad.inverse(pad(x)), x)


class ElementwiseAffine(revnets.Invertible):
    """A user's own invertible module with parameters: y = x * exp(s) + t per channel."""

    def __init__(self, channels):
        super().__init__()
        self.log_scale = nn.Parameter(0.1 * torch.randn(channels, 1, 1))
        self.shift = nn.Parameter(0.1 * torch.randn(channels, 1, 1))

    def forward(self, x):
        return x * self.log_scale.exp() + self.shift

    def inverse(self, y):
        return (y - self.shift) * (-self.log_scale).exp()


def unit(channels, dropout=0.0):
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
        nn.ReLU(), nn.Dropout(dropout),
    )


def stage(channels, depth, dropout=0.0):
    return [revnets.ReversibleBlock(unit(channels, dropout), unit(channels, dropout))
            for _ in range(depth)]


def invertible_network(depth=2, stages=3, dropout=0.1, **kwargs):
    """Couplings, downsampling by SpaceToDepth between stages, padding and a learnable affine:
    invertible end to end, from 8 channels at 16x16 to 128 (+4 padded) channels at 4x4."""
    blocks, channels = [], 8
    for index in range(stages):
        if index:
            blocks.append(revnets.SpaceToDepth(2))
            channels *= 4
        blocks += stage(channels // 2, depth, dropout)
    blocks += [ElementwiseAffine(channels), revnets.InjectivePad(4)]
    return revnets.ReversibleSequence(blocks, **kwargs).double()


@pytest.mark.parametrize("store_last_blocks,keep_input_every", [(0, None), (1, None), (0, 2)])
def test_a_fully_invertible_network_trains_like_ordinary_autograd(store_last_blocks,
                                                                  keep_input_every):
    model = invertible_network(memory=revnets.Reconstruct(store_last_blocks, keep_input_every))
    plain = twin(model)
    x = torch.randn(3, 8, 16, 16, dtype=torch.float64)
    x_model, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    for step in range(2):
        for m, xi in ((model, x_model), (plain, x_plain)):
            torch.manual_seed(step)
            m(xi).square().sum().backward()
    assert rel_error(x_model.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name
    assert torch.allclose(model.inverse(model.eval()(x)), x, rtol=0, atol=1e-10)


class ReluDeclaredInvertible(revnets.Invertible):
    def forward(self, x):
        return torch.relu(x)

    def inverse(self, y):
        return y


class SubtractingCoupling(revnets.Coupling):
    def combine(self, x, h):
        return x + h

    def uncombine(self, y, h):
        return y + h  # should subtract


def test_an_inverse_that_does_not_undo_its_forward_is_refused_in_the_first_step():
    """Outputs were right and gradients silently wrong (off by tens, float64): reconstruction
    trusts the inverse. The first training step checks it (NOTE [ A user's inverse is checked
    once ])."""
    x = torch.randn(3, 8, 4, 4)
    model = revnets.ReversibleSequence([*stage(4, 1), ReluDeclaredInvertible(), *stage(4, 1)])
    with pytest.raises(ValueError, match=r"block 1 of a ReversibleSequence "
                                         r"\(ReluDeclaredInvertible\): its inverse does not undo"):
        model(x)
    block = revnets.ReversibleBlock(unit(4), unit(4), coupling=SubtractingCoupling())
    with pytest.raises(ValueError, match=r"the coupling SubtractingCoupling\(\): its inverse "
                                         r"does not undo its forward"):
        revnets.ReversibleSequence([block])(x)


class GlowAffine(revnets.Coupling):
    """Glow's affine coupling as openai/glow writes it: round-off scales with the shift, not
    with the half it updates."""

    def combine(self, x, h):
        log_scale, shift = h.chunk(2, 1)
        return (x + shift) * torch.sigmoid(log_scale + 2.0)

    def uncombine(self, y, h):
        log_scale, shift = h.chunk(2, 1)
        return y / torch.sigmoid(log_scale + 2.0) - shift

    def transform_shape(self, half_shape):
        return torch.Size([half_shape[0], 2 * half_shape[1], *half_shape[2:]])


class SubclassedAdditive(revnets.AdditiveCoupling):
    pass


@pytest.mark.parametrize("coupling, first_half, dtype", [
    (GlowAffine(), torch.zeros(2, 4, 6, 6), torch.float32),
    (GlowAffine(), 1e-6 * torch.randn(2, 4, 6, 6), torch.float32),
    (SubclassedAdditive(), 1e-3 * torch.randn(2, 4, 6, 6), torch.bfloat16),
])
def test_a_correct_inverse_passes_its_check_whatever_the_input_s_magnitude(coupling, first_half,
                                                                          dtype):
    """Taken relative to the input alone, round-off of a zero or tiny half was an error of 6e22
    or 2.7e-2 (Glow), and a bf16 stack of a subclassed stock coupling was refused."""
    width = 8 if isinstance(coupling, GlowAffine) else 4
    block = revnets.ReversibleBlock(nn.Conv2d(4, width, 3, padding=1),
                                    nn.Conv2d(4, width, 3, padding=1), coupling=coupling)
    model = revnets.ReversibleSequence([block]).to(dtype)
    x = torch.cat([first_half, torch.randn(2, 4, 6, 6)], 1).to(dtype)
    model(x).float().sum().backward()
    assert coupling._revnets_inverse_checked


def test_the_check_runs_where_the_inverse_will_and_again_after_a_refusal():
    """A kept input is never reconstructed: no check (it refused a module whose inverse never
    ran). Forward hooks on a block took another path, unchecked, with gradients off by 88. A
    refusal set the flag, so the next step trained silently wrong; a NaN compared as passing."""
    kept = revnets.ReversibleSequence([*stage(4, 1), ReluDeclaredInvertible(), *stage(4, 1)],
                                      memory=revnets.Reconstruct(keep_input_every=1))
    kept(torch.randn(3, 8, 4, 4)).sum().backward()

    block = revnets.ReversibleBlock(unit(4), unit(4), coupling=SubtractingCoupling())
    block.register_forward_hook(lambda module, args, output: None)
    hooked = revnets.ReversibleSequence([block])
    for _ in range(2):
        with pytest.raises(ValueError, match="its inverse does not undo its forward"):
            hooked(torch.randn(3, 8, 4, 4))

    class CubeRoot(revnets.Invertible):
        def forward(self, x):
            return x ** 3

        def inverse(self, y):
            return y ** (1 / 3)  # NaN below zero

    with pytest.raises(ValueError, match=r"\(CubeRoot\): .*relative error nan"):
        revnets.ReversibleSequence([*stage(4, 1), CubeRoot()])(torch.randn(3, 8, 4, 4))


def test_the_check_of_a_users_inverse_runs_once_and_is_predicted(monkeypatch):
    model = invertible_network(dropout=0.0).float()
    x = torch.randn(2, 8, 16, 16)
    calls = []
    inverse = ElementwiseAffine.inverse
    monkeypatch.setattr(ElementwiseAffine, "inverse",
                        lambda self, y: calls.append(1) or inverse(self, y))

    def step(m, x):
        m(x).square().sum().backward()

    for inverses in (2, 1):  # the first step checks (one inverse more), later ones do not
        predicted = revnets.predict_memory(step, model, x).peak_bytes
        calls.clear()
        assert measure_memory(step, model, x).peak_bytes == predicted
        assert len(calls) == inverses


def test_memory_is_flat_in_depth_and_in_the_number_of_stages():
    """Only the input and the output are kept: no stage boundary is stored."""
    peaks = {}
    for depth in (1, 10):
        model = invertible_network(depth=depth, dropout=0.0).float()
        x = torch.randn(4, 8, 16, 16, requires_grad=True)
        report = measure_memory(lambda m, x: m(x).square().sum().backward(), model, x)
        # Parameter gradients arrive at the end of backward: counted apart.
        gradients = sum(p.numel() * 4 for p in model.parameters())
        peaks[depth] = report.above_model_state_bytes - gradients
    assert peaks[10] <= 1.05 * peaks[1]


def test_check_invertible_names_a_module_that_is_not():
    class Squash(revnets.Invertible):
        def forward(self, x):
            return x.clamp(-1, 1)

        def inverse(self, y):
            return y

    assert revnets.check_invertible(revnets.SpaceToDepth(2), torch.randn(1, 2, 4, 4)) == 0
    with pytest.raises(ValueError, match="Squash is not invertible on this input"):
        revnets.check_invertible(Squash(), 3 * torch.randn(1, 2, 4, 4))
    with pytest.raises(TypeError, match="Linear has no inverse method; subclass revnets.Inv"):
        revnets.check_invertible(nn.Linear(4, 4), torch.randn(1, 4))


def test_bad_settings_and_inputs_of_the_invertible_layers_are_named():
    with pytest.raises(ValueError, match=r"takes NCHW images, got an input of shape \(4, 4, 4\)"):
        revnets.SpaceToDepth()(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="channels must be a non-negative int, got 2.5"):
        revnets.InjectivePad(2.5)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 2.0"):
        revnets.SpaceToDepth(2.0)


@pytest.mark.parametrize("wrapper", ["Checkpointed", "save_on_cpu"])
def test_a_fully_invertible_network_inside_other_memory_savers(wrapper):
    model = invertible_network(depth=1)
    plain = twin(model)
    x = torch.randn(2, 8, 16, 16, dtype=torch.float64)
    x_model, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()

    def run(m, xi):
        if wrapper == "Checkpointed":
            return revnets.checkpoint(m, xi)
        with torch.autograd.graph.save_on_cpu():
            return m(xi)

    for m, xi in ((model, x_model), (plain, x_plain)):
        torch.manual_seed(0)
        run(m, xi).square().sum().backward()
    assert rel_error(x_model.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10


def test_a_hooked_invertible_module_fires_once_and_refuses_a_loss_on_what_it_saw():
    model = invertible_network(depth=1, dropout=0.0)
    seen = []
    assert isinstance(model[1], revnets.SpaceToDepth)
    model[1].register_forward_hook(lambda module, args, out: seen.append(out))
    x = torch.randn(2, 8, 16, 16, dtype=torch.float64, requires_grad=True)
    model(x).square().sum().backward()
    assert len(seen) == 1
    out = model(x)
    with pytest.raises(RuntimeError, match="a loss used an activation from inside block 1"):
        (out.square().sum() + seen[-1].sum()).backward()
