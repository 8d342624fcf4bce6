import pytest
import torch
from torch import nn

import revnets
from revnets import Reconstruct, Store
from revnets.memory import measure_memory

from conftest import make_stack, max_grad_error, rel_error, twin

COUPLINGS = ["additive", "affine"]


RECONSTRUCT = [Reconstruct(), Reconstruct(store_last_blocks=1), Reconstruct(store_last_blocks=2)]


@pytest.fixture(params=RECONSTRUCT, ids=["recompute_all", "store_last_block", "store_last_2"])
def memory(request):
    """Tests that take this run three times: with all blocks recomputed in backward, with the last
    block's graph kept from the forward pass instead, and with the last two blocks' graphs kept
    (a mix of stored and recomputed blocks in the deeper stacks, all stored in depth-2 ones)."""
    return request.param


def run(model, x, seed=1, loss=lambda out: out.square().sum()):
    torch.manual_seed(seed)
    out = model(x)
    loss(out).backward()
    return out


def run_released(model, x, seed=1):
    """``run``, but nothing holds the output during backward (as in a training loop), so the
    engine may reconstruct into its memory and add into the incoming gradient."""
    torch.manual_seed(seed)
    out = model(x)
    value, node = out.detach().clone(), out.grad_fn.name()
    loss = out.square().sum()
    del out
    loss.backward()
    return value, node


@pytest.mark.parametrize("output", ["held", "released"])
@pytest.mark.parametrize("depth", [1, 6])
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_float64_gradients_equal_ordinary_backprop(coupling, depth, output, memory):
    model = make_stack(depth, coupling=coupling, memory=memory).double()
    plain = twin(model)
    x = torch.randn(3, 8, 5, 5, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    if output == "held":
        out = run(model, x)
        node = out.grad_fn.name()
    else:
        out, node = run_released(model, x)
    out_plain = run(plain, x_plain)
    assert node == "ReversibleFunctionBackward"
    assert torch.equal(out, out_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10


class SubtractCoupling(revnets.Coupling):
    """A user-written coupling: y = x - 2h."""

    def combine(self, x, h):
        return x - 2 * h

    def uncombine(self, y, h):
        return y + 2 * h


def test_user_coupling_protocol(memory):
    blocks = [
        revnets.ReversibleBlock(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Tanh()),
                                coupling=SubtractCoupling(), split_dim=-1)
        for _ in range(4)
    ]
    model = revnets.ReversibleSequence(blocks, memory).double()
    plain = twin(model)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    run(model, x), run(plain, x_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10


class Counted(nn.Module):
    """Runs ``module``, counting its calls through ``tick``, a closure: the replay puts back
    what modules hold (a dict of counts among it) as the forward found it, so a count kept there
    would show one call."""

    def __init__(self, module, tick):
        super().__init__()
        self.module, self.tick = module, tick

    def forward(self, x):
        self.tick()
        return self.module(x)


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_each_transform_runs_once_in_forward_and_at_most_once_in_backward(coupling, memory):
    model = make_stack(4, memory=memory, coupling=coupling)
    calls = {}

    def counter(key):
        def tick():
            calls[key] += 1
        return tick

    for i, block in enumerate(model):
        for name in "fg":
            calls[i, name] = 0
            setattr(block, name, Counted(getattr(block, name), counter((i, name))))
    run(model, torch.randn(2, 8, 4, 4, requires_grad=True))
    for (i, name), count in calls.items():
        expected = 1 if i >= len(model) - memory.store_last_blocks else 2
        assert count == expected, (i, name)


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_inverse_reconstructs_input(coupling):
    model = make_stack(3, coupling=coupling).double().eval()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(model.inverse(model(x)), x, atol=1e-12)
        block = model[0]
        assert torch.allclose(block.inverse(block(x)), x, atol=1e-12)


def test_affine_scale_is_bounded_away_from_zero():
    coupling = revnets.AffineCoupling(dim=1, max_log_scale=2.0)
    h = torch.cat([torch.full((1, 2), -1e6), torch.zeros(1, 2)], dim=1)
    scale, _ = coupling._scale_shift(h)
    assert torch.all(scale >= torch.exp(torch.tensor(-2.0)) - 1e-6)
    x = torch.randn(1, 2)
    assert torch.allclose(coupling.uncombine(coupling.combine(x, h), h), x, atol=1e-5)


def test_batchnorm_statistics_updated_once_per_step(memory):
    model = make_stack(4, memory=memory).double()
    plain = twin(model)
    for step in range(3):
        x = torch.randn(4, 8, 5, 5, dtype=torch.float64, requires_grad=True)
        run(model, x, seed=step)
        run(plain, x.detach().clone().requires_grad_(), seed=step)
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        if name.endswith("num_batches_tracked"):
            assert a.item() == 3, name
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name


def assert_draws_as_plain(model, batch: int, seed: int = 7) -> None:
    """Output and float64 gradients equal ordinary autograd's under the same seed, and the
    generator left as ordinary autograd leaves it."""
    plain = twin(model)
    x = torch.randn(batch, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    out, out_plain = run(model, x, seed=seed), run(plain, x_plain, seed=seed)
    assert torch.equal(out, out_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
    after_reversible = torch.rand(3)
    run(plain, x_plain, seed=seed)
    assert torch.equal(after_reversible, torch.rand(3))


def test_dropout_masks_replayed(memory):
    assert_draws_as_plain(make_stack(4, memory=memory, dropout=0.5).double(), batch=2)


def test_drop_path_masks_kept_for_backward(memory):
    """Stochastic depth on the blocks, with dropout inside f and g too."""
    model = make_stack(4, memory=memory, dropout=0.5, drop_path=0.5).double()
    model[1].register_forward_hook(lambda *args: None)  # one block on the hooked path
    assert_draws_as_plain(model, batch=6)


def test_hooks_on_a_block_fire_once_and_a_replacing_one_is_refused(memory):
    """Also on the blocks ``store_last_blocks`` keeps: those run their hooks as recomputed
    blocks do (a stored block runs f and g alone)."""
    model = make_stack(3, memory=memory, drop_path=0.5).double()
    plain = twin(model)
    seen = {"reversible": [], "plain": []}
    for name, m in (("reversible", model), ("plain", plain)):
        # The pre-hook draws, so a block drawing its masks before it would draw others.
        m[2].register_forward_pre_hook(lambda mod, args, name=name: seen[name].append(
            torch.rand(1)) and None)
        m[2].register_forward_hook(lambda mod, args, out, name=name: seen[name].append(out))
    x = torch.randn(4, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    out, out_plain = run(model, x), run(plain, x_plain)
    assert len(seen["reversible"]) == len(seen["plain"]) == 2
    for a, b in zip(seen["reversible"], seen["plain"]):
        assert torch.equal(a, b)
    assert torch.equal(out, out_plain)
    assert max_grad_error(model, plain) <= 1e-10
    model[2].register_forward_hook(lambda mod, args, out: out * 0)
    with pytest.raises(RuntimeError, match="forward hook on the block replaced"):
        run(model, x)


def test_drop_path_drops_whole_samples_and_scales_the_kept_ones():
    """y1 = x1 + m * f(x2), m per sample: 0, or 1 / (1 - drop_path); no mask in eval mode."""
    block = revnets.ReversibleBlock(nn.Linear(4, 4), nn.Linear(4, 4), split_dim=-1,
                                    drop_path=0.5).double()
    x1, x2 = torch.randn(64, 4, dtype=torch.float64), torch.randn(64, 4, dtype=torch.float64)
    with torch.no_grad():
        y1, _ = block.forward_halves(x1, x2)
        scale = ((y1 - x1) / block.f(x2)).mean(dim=-1)
        assert torch.allclose(scale, (scale > 1).double() * 2, atol=1e-12)
        assert 0 < (scale > 1).sum() < 64
        block.eval()
        assert torch.allclose(block.forward_halves(x1, x2)[0], x1 + block.f(x2), atol=1e-12)


def test_inverting_a_block_that_drops_paths_is_refused_in_training():
    block = revnets.ReversibleBlock(nn.Linear(4, 4), nn.Linear(4, 4), split_dim=-1, drop_path=0.1)
    y = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="drop_path=0.1.*block.eval"):
        block.inverse(y)
    x = torch.randn(2, 8)
    torch.testing.assert_close(block.eval().inverse(block(x)), x)


@pytest.mark.parametrize("drop_path,coupling,error,message", [
    (1.5, "additive", ValueError, r"drop_path must lie in \[0, 1\], got 1.5"),
    (-0.1, "additive", ValueError, r"drop_path must lie in \[0, 1\], got -0.1"),
    (float("nan"), "additive", ValueError, r"drop_path must lie in \[0, 1\], got nan"),
    ("0.1", "additive", TypeError, "drop_path must be a number, got '0.1'"),
    (None, "additive", TypeError, "drop_path must be a number, got None"),
    (0.1, "affine", ValueError, "drop_path needs an additive coupling"),
])
def test_bad_drop_path_is_named_when_built_and_when_set(drop_path, coupling, error, message):
    with pytest.raises(error, match=message):
        revnets.ReversibleBlock(nn.Linear(4, 8), nn.Linear(4, 8), coupling, split_dim=-1,
                                drop_path=drop_path)
    block = revnets.ReversibleBlock(nn.Linear(4, 8), nn.Linear(4, 8), coupling, split_dim=-1)
    with pytest.raises(error, match=message):
        block.drop_path = drop_path  # as a schedule raising the rate sets it
        block(torch.randn(2, 8))


def test_drop_path_of_one_drops_every_sample():
    """As timm's DropPath: at rate 1 the block is the identity in training."""
    block = revnets.ReversibleBlock(nn.Linear(4, 4), nn.Linear(4, 4), split_dim=-1, drop_path=1.0)
    x = torch.randn(3, 8)
    assert torch.equal(block(x), x)


def test_rng_left_as_after_plain_forward_backward(memory):
    model = make_stack(2, memory=memory, dropout=0.5)
    plain = twin(model)
    x = torch.randn(2, 8, 4, 4)
    run(model, x, seed=3)
    after_reversible = torch.rand(3)
    run(plain, x, seed=3)
    assert torch.equal(after_reversible, torch.rand(3))


def test_bfloat16_autocast_on_cpu(memory):
    model = make_stack(4, memory=memory)
    plain = twin(model)
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        out_plain = plain(x_plain)
    assert torch.equal(out, out_plain)
    out.float().square().sum().backward()
    out_plain.float().square().sum().backward()
    # Reconstruction in bfloat16-rounded arithmetic: close, not identical.
    assert rel_error(x.grad, x_plain.grad) < 5e-2
    assert max_grad_error(model, plain) < 5e-2


def test_eval_and_no_grad_run_plain_forward():
    model = make_stack(3)
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    with torch.no_grad():
        reference = model.forward_plain(x)
        assert torch.equal(model(x), reference)
    with torch.inference_mode():
        assert torch.equal(model(x), reference)
    model.eval()
    out = model(x)
    assert out.grad_fn is not None and "Reversible" not in out.grad_fn.name()


def test_input_without_grad_and_frozen_parameters(memory):
    model = make_stack(3, memory=memory).double()
    plain = twin(model)
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64)
    run(model, x), run(plain, x)
    assert max_grad_error(model, plain) <= 1e-10
    for p in model.parameters():
        p.requires_grad_(False)
    x.requires_grad_()
    x_plain = x.detach().clone().requires_grad_()
    for p in plain.parameters():
        p.requires_grad_(False)
    run(model, x), run(plain, x_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10


def test_gradient_accumulation(memory):
    model = make_stack(3, memory=memory).double()
    plain = twin(model)
    for seed in range(3):
        x = torch.randn(2, 8, 4, 4, dtype=torch.float64)
        run(model, x, seed), run(plain, x, seed)
    assert max_grad_error(model, plain) <= 1e-10


def test_autograd_grad_leaves_dot_grad_alone(memory):
    model = make_stack(3, memory=memory).double()
    plain = twin(model)
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    grads_plain = torch.autograd.grad(plain(x).square().sum(), [x, *plain.parameters()])
    assert all(p.grad is None for p in model.parameters())
    assert max(rel_error(a, b) for a, b in zip(grads, grads_plain)) <= 1e-10


def test_partly_used_output(memory):
    model = make_stack(3, memory=memory).double()
    plain = twin(model)
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    only_first_channels = lambda out: out[:, :3].sum()  # noqa: E731
    run(model, x, loss=only_first_channels), run(plain, x_plain, loss=only_first_channels)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10


def test_parameters_shared_between_blocks(memory):
    shared = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    blocks = [revnets.ReversibleBlock(shared, nn.Linear(4, 4), split_dim=-1) for _ in range(3)]
    model = revnets.ReversibleSequence(blocks, memory).double()
    plain = twin(model)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    run(model, x), run(plain, x.detach().clone().requires_grad_())
    assert len(list(model.parameters())) == 2 + 3 * 2
    assert max_grad_error(model, plain) <= 1e-10


def test_identity_transforms(memory):
    model = revnets.ReversibleSequence(
        [revnets.ReversibleBlock(nn.Identity(), nn.Identity(), split_dim=-1) for _ in range(3)]
    ).double()
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    run(model, x), run(twin(model), x_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10


def test_caller_tensors_untouched(memory):
    model = make_stack(4, memory=memory)
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    before, version = x.detach().clone(), x._version
    out = model(x)
    out_copy, out_version = out.detach().clone(), out._version
    out.square().sum().backward()
    assert x._version == version and torch.equal(x.detach(), before)
    assert out._version == out_version and torch.equal(out.detach(), out_copy)


def square_mean_step(model, x):
    model(x).square().mean().backward()


def stack_peak(depth: int, memory: Reconstruct | Store = Reconstruct()) -> int:
    """Activation peak of a training step of a stack with 8-channel halves under ``memory``."""
    model = make_stack(depth, half=8, memory=memory)
    x = torch.randn(4, 16, 16, 16, requires_grad=True)
    return measure_memory(square_mean_step, model, x).above_model_state_bytes


def test_memory_flat_in_depth():
    assert stack_peak(16) == stack_peak(4)
    assert stack_peak(16, Store()) > 3 * stack_peak(4, Store())


def test_reconstruction_check_reports_every_block():
    model = make_stack(5).double()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    with revnets.check_reconstruction() as report:
        model(x).sum().backward()
    assert sorted(d.block for d in report.drifts) == list(range(5))
    assert 0 <= report.max_rel_error < 1e-12
    assert "reconstructions" in report.table()


def test_reconstruction_drift_grows_in_float32():
    torch.manual_seed(0)
    model = make_stack(12)
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    with revnets.check_reconstruction() as report:
        model(x).sum().backward()
    by_distance = {d.reconstructions: d.max_abs_error for d in report.drifts}
    assert by_distance[12] > 0 and by_distance[12] >= by_distance[1]



@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_kept_inputs_give_float64_gradients_of_ordinary_backprop(coupling, every):
    model = make_stack(7, coupling=coupling, memory=Reconstruct(keep_input_every=every)).double()
    plain = twin(model)
    x = torch.randn(3, 8, 5, 5, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    before = x.detach().clone()
    run(model, x), run(plain, x_plain)
    assert torch.equal(x.detach(), before)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10


def test_kept_inputs_bound_the_drift():
    def drifts(every):
        torch.manual_seed(0)
        model = make_stack(12, memory=Reconstruct(keep_input_every=every))
        x = torch.randn(2, 8, 4, 4, requires_grad=True)
        with revnets.check_reconstruction() as report:
            model(x).sum().backward()
        return {d.block: d.max_abs_error for d in report.drifts}

    free, kept = drifts(None), drifts(4)
    assert all(kept[block] == 0 for block in (0, 4, 8))
    assert free[0] > 0 and max(kept.values()) < free[0]


def test_kept_inputs_cost_one_input_each():
    def activation_peak(depth):
        return stack_peak(depth, Reconstruct(keep_input_every=4))

    input_bytes = 4 * 16 * 16 * 16 * 4
    # Blocks 0 and 4 keep their inputs at depth 8, blocks 0, 4, 8 and 12 at depth 16; block 0's
    # is the caller's input, held anyway.
    assert activation_peak(16) - activation_peak(8) == 2 * input_bytes


def test_stored_blocks_trade_memory_for_recomputation():
    def activation_peak(depth, stored):
        return stack_peak(depth, Reconstruct(store_last_blocks=stored))

    peaks = [activation_peak(8, stored) for stored in range(4)]
    # The last block's graph costs nothing where the peak falls in backward (the benchmark
    # stack), but here it falls at the loss, where the kept graph is still live.
    assert peaks[0] <= peaks[1] < peaks[2] < peaks[3]
    assert peaks[3] - peaks[2] == peaks[2] - peaks[1]  # one block's graph each
    assert activation_peak(16, 3) == peaks[3]  # still flat in depth


def test_parameter_gradients_cost_nothing_after_zero_grad_and_one_copy_when_accumulating():
    def step(model, x, set_to_none):
        model.zero_grad(set_to_none=set_to_none)
        square_mean_step(model, x)

    def activation_peak(depth, set_to_none):
        model = make_stack(depth, half=8)
        x = torch.randn(4, 16, 16, 16, requires_grad=True)
        step(model, x, True)  # .grad tensors exist from here on
        return measure_memory(step, model, x, set_to_none).above_model_state_bytes

    assert activation_peak(64, True) == activation_peak(4, True)
    # Accumulating, the peak falls in backward at both depths, with the gradients of the blocks
    # done so far held alongside it: 32 blocks' worth more at depth 64.
    block_gradient_bytes = 4 * sum(p.numel() for p in make_stack(1, half=8).parameters())
    extra = activation_peak(64, False) - activation_peak(32, False)
    assert 32 * block_gradient_bytes <= extra <= 33 * block_gradient_bytes


def test_more_stored_blocks_than_blocks_is_ordinary_backprop():
    model = make_stack(3, memory=Reconstruct(store_last_blocks=5)).double()
    plain = twin(model)
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    run(model, x), run(plain, x_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10


@pytest.mark.parametrize("stored", [-1, 1.5, "2"])
def test_bad_store_last_blocks_is_named(stored):
    with pytest.raises(ValueError, match="store_last_blocks must be a non-negative integer"):
        revnets.ReversibleSequence(make_stack(2).blocks, Reconstruct(store_last_blocks=stored))


@pytest.mark.parametrize("every", [0, -2, 1.5, True])
def test_bad_keep_input_every_is_named(every):
    with pytest.raises(ValueError, match="keep_input_every must be a positive integer"):
        revnets.ReversibleSequence(make_stack(2).blocks, Reconstruct(keep_input_every=every))

# -- bad input ------------------------------------------------------------------------------------


def test_odd_split_is_named():
    model = make_stack(2)
    with pytest.raises(ValueError, match=r"cannot split .*\(size 7 is odd\)"):
        model(torch.randn(2, 7, 4, 4, requires_grad=True))


def test_blocks_of_functions_and_a_bare_block_are_refused_when_built():
    """A function as f was accepted, left out of the block's repr, and failed in the sequence
    with an AttributeError; a string split_dim failed in the first step."""
    with pytest.raises(TypeError, match=r"f must be an nn.Module, got function.*wrap the"):
        revnets.ReversibleBlock(lambda z: z, nn.Identity())
    with pytest.raises(TypeError, match=r"g must be an nn.Module, got NoneType"):
        revnets.ReversibleBlock(nn.Identity(), None)
    with pytest.raises(TypeError, match=r"split_dim must be an int, got '1'"):
        revnets.ReversibleBlock(nn.Identity(), nn.Identity(), split_dim="1")
    block = revnets.ReversibleBlock(nn.Identity(), nn.Identity())
    with pytest.raises(TypeError, match=r"takes a list of blocks, got one ReversibleBlock"):
        revnets.ReversibleSequence(block)


def test_shape_changing_transform_is_named():
    block = revnets.ReversibleBlock(nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.Identity())
    with pytest.raises(ValueError, match=r"ReversibleBlock.f \(Conv2d\) returned shape"):
        revnets.ReversibleSequence([block])(torch.randn(1, 8, 4, 4, requires_grad=True))


def test_in_place_transform_is_named():
    f = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(4, 4, 1))
    block = revnets.ReversibleBlock(f, nn.Identity())
    with pytest.raises(RuntimeError, match=r"ReversibleBlock.f \(Sequential\) modified its input"):
        revnets.ReversibleSequence([block])(torch.randn(1, 8, 4, 4, requires_grad=True))


def test_non_invertible_module_in_sequence_is_named():
    with pytest.raises(TypeError, match=r"block 1 is a Conv2d, neither a ReversibleBlock nor a "
                                        r"revnets.Invertible"):
        revnets.ReversibleSequence([make_stack(1)[0], nn.Conv2d(8, 8, 3)])


def test_block_parameters_outside_f_and_g_are_refused():
    class ScaledBlock(revnets.ReversibleBlock):
        def __init__(self):
            super().__init__(nn.Identity(), nn.Identity())
            self.scale = nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match=r"block 0 has parameters outside f and g \(scale\)"):
        revnets.ReversibleSequence([ScaledBlock()])


def test_float16_without_cpu_kernel_is_named():
    class Zeta(nn.Module):
        def forward(self, x):
            return torch.special.zeta(x.abs() + 2, x.abs() + 1)

    block = revnets.ReversibleBlock(Zeta(), nn.Identity(), split_dim=-1)
    x = torch.rand(2, 4, dtype=torch.float16, requires_grad=True)
    with pytest.raises(TypeError, match="no float16 kernel on CPU; use bfloat16"):
        revnets.ReversibleSequence([block])(x)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_reconstructing_sequence_under_torch_func_is_refused_by_name_and_runs_stored(transform):
    """The engine is an autograd.Function without ``setup_context``, which torch.func's
    transforms cannot run: it failed with torch's words about ``setup_context``. Stored, the
    sequence gives torch.func ordinary autograd's gradients."""
    torch.manual_seed(0)
    blocks = [revnets.ReversibleBlock(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(2)]
    x = torch.randn(5, 3, 4)

    def gradients(sequence):
        def loss(params, x):
            return torch.func.functional_call(sequence, params, (x,)).sum()
        params = dict(sequence.named_parameters())
        if transform == "vmap":
            return list(torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
                        .values())
        return list(torch.func.grad(loss)(params, x[0]).values())

    with pytest.raises(RuntimeError, match=r"ReversibleSequence: reconstructing under "
                                           r"torch.func.*memory=revnets.Store\(\)"):
        gradients(revnets.ReversibleSequence(blocks))
    stored = gradients(revnets.ReversibleSequence(blocks, revnets.Store()))
    plain = gradients(nn.Sequential(*blocks))
    for a, b in zip(stored, plain, strict=True):
        assert torch.allclose(a, b)


def test_second_backward_is_refused_clearly():
    model = make_stack(2)
    out = model(torch.randn(1, 8, 4, 4, requires_grad=True))
    loss = out.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time is not supported"):
        loss.backward()


def test_nested_sequences_match_ordinary_backprop(memory):
    """A reversible sequence as f and g of an outer one: the inner ones run plainly in the outer
    forward (no grad) and reversibly in its recomputation."""
    model = revnets.ReversibleSequence(
        (
            revnets.ReversibleBlock(make_stack(2, half=2), make_stack(2, half=2))
            for _ in range(3)
        ),
        memory,
    ).double()
    plain = twin(model)
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    out, out_plain = run(model, x), run(plain, x_plain)
    assert torch.equal(out, out_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name  # statistics updated once


def test_compiled_model_matches_ordinary_backprop(memory):
    model = make_stack(3, memory=memory).double()
    plain = twin(model)
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    run(torch.compile(model), x), run(plain, x_plain)
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
    for (name, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name  # statistics updated once


def test_double_backward_is_refused_clearly():
    model = make_stack(2)
    x = torch.randn(1, 8, 4, 4, requires_grad=True)
    head = nn.Linear(8, 1)
    # The gradient of the output depends on the head's weight, not on the output: without the
    # check, differentiating the input gradient would quietly give the head a gradient and the
    # blocks none of theirs.
    loss = head(model(x).mean((2, 3))).sum()
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_output_modified_in_place_is_refused(memory):
    model = make_stack(2, memory=memory)
    out = model(torch.randn(1, 8, 4, 4, requires_grad=True))
    loss = out.sum()
    with torch.no_grad():
        out.mul_(2)
    if memory.store_last_blocks:  # nothing is reconstructed from the output: harmless
        loss.backward()
        return
    with pytest.raises(RuntimeError, match="modified in place after the forward pass"):
        loss.backward()


def test_weights_swapped_for_the_forward_only_are_refused(memory):
    """torch.func.functional_call puts other weights in for the forward call only; recomputing
    with the module's own would silently differentiate the wrong weights."""
    model = make_stack(4, memory=memory)  # blocks 0 and 1 are recomputed whatever is stored
    weights = {name: p.detach() * 2 for name, p in model.named_parameters()}
    weights["blocks.1.g.0.weight"].requires_grad_()
    out = torch.func.functional_call(model, weights, (torch.randn(1, 8, 4, 4),))
    with pytest.raises(RuntimeError, match=r"ReversibleSequence: blocks.\d.[fg].0.weight is not "
                                           r"the tensor the forward pass used.*functional_call"):
        out.sum().backward()


def test_kept_input_modified_in_place_is_refused():
    model = make_stack(4, memory=Reconstruct(keep_input_every=2))
    x = torch.randn(1, 8, 4, 4)
    out = model(x)
    x.mul_(2)  # the caller's input, which block 0 kept
    with pytest.raises(RuntimeError, match="input of block 0, kept by keep_input_every, was modif"):
        out.sum().backward()


def test_parameters_modified_between_forward_and_backward_is_refused(memory):
    model = make_stack(2, memory=memory)
    loss = model(torch.randn(1, 8, 4, 4, requires_grad=True)).sum()
    with torch.no_grad():
        next(model.parameters()).add_(1)
    # Stored blocks' graphs are checked by autograd itself, recomputed ones by the engine.
    with pytest.raises(RuntimeError, match="modified (by an inplace operation|in place between)"):
        loss.backward()


def test_unknown_coupling_is_named():
    with pytest.raises(ValueError, match="unknown coupling 'multiplicative'"):
        revnets.ReversibleBlock(nn.Identity(), nn.Identity(), coupling="multiplicative")


class AddParameter(nn.Module):
    """(x + p) * 2: autograd hands the same gradient tensor to x and to p."""

    def __init__(self, shape):
        super().__init__()
        self.p = nn.Parameter(torch.randn(shape))

    def forward(self, x):
        return (x + self.p) * 2


def test_gradients_that_alias_each_other(memory):
    blocks = [revnets.ReversibleBlock(AddParameter(3), AddParameter(3), split_dim=-1)
              for _ in range(3)]
    model = revnets.ReversibleSequence(blocks, memory).double()
    plain = twin(model)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    run(model, x, loss=lambda out: (out * torch.arange(6.0)).sum())
    run(plain, x_plain, loss=lambda out: (out * torch.arange(6.0)).sum())
    assert rel_error(x.grad, x_plain.grad) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10
