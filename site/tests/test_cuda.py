"""The core guarantees on a GPU: random numbers replayed from the device's generator, float16
autocast with a GradScaler, memory flat in depth by the allocator's own count. Skipped without
CUDA (the allocator tests sit in test_memory.py)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import make_stack, max_grad_error, rel_error, twin

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_dropout_on_the_device_is_replayed():
    model = make_stack(6, dropout=0.3).cuda().double()
    plain = twin(model)
    x = torch.randn(4, 8, 8, 8, device="cuda", dtype=torch.float64)
    grads = []
    for m in (model, plain):
        torch.manual_seed(0)
        x_leaf = x.clone().requires_grad_()
        m(x_leaf).square().sum().backward()
        grads.append(x_leaf.grad)
    assert rel_error(grads[0], grads[1]) <= 1e-10
    assert max_grad_error(model, plain) <= 1e-10


def test_float16_autocast_with_grad_scaler_matches_ordinary_autograd():
    model = make_stack(4).cuda()
    plain = twin(model)
    x = torch.randn(8, 8, 16, 16, device="cuda")
    for m in (model, plain):
        scaler = torch.amp.GradScaler("cuda")
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), torch.zeros_like(x))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    # float16 reconstruction round-off: gradients agree as float16 precision allows.
    assert max_grad_error(model, plain) <= 2e-2


def test_memory_is_flat_in_depth_on_the_allocator():
    peaks = []
    for depth in (4, 16):
        model = make_stack(depth, half=32).cuda()
        x = torch.randn(16, 64, 32, 32, device="cuda", requires_grad=True)
        model(x).square().sum().backward()  # warm-up: gradients exist in both measurements
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).square().sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] <= peaks[0] * 1.05
