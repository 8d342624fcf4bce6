"""The memory meter on cases whose answer is known by arithmetic."""

import gc

import pytest
import torch
from torch import nn

import revnets
from revnets.memory import MemoryTracker, measure_memory, predict_memory

from conftest import make_stack

KiB = 1024
MiB = 2**20


def test_peak_of_known_allocations():
    def fn():
        a = torch.empty(256 * KiB, dtype=torch.uint8)
        b = torch.empty(512 * KiB, dtype=torch.uint8)
        del a
        c = torch.empty(128 * KiB, dtype=torch.uint8)
        d = c.view(-1)[:10]  # a view: no new storage
        return b.numel() + d.numel()

    report = measure_memory(fn)
    assert report.peak_bytes == (512 + 256) * KiB
    assert report.activations == (512 + 256) * KiB
    assert report.result == 512 * KiB + 10


def test_a_call_that_names_no_device_is_counted_where_its_tensors_are():
    """A closure's step on a GPU was counted on the CPU, where it holds almost nothing. Fake CUDA
    tensors stand in for the GPU's here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fn():
        small = torch.empty(KiB, dtype=torch.uint8)
        on_the_gpu = torch.empty(64 * KiB, dtype=torch.uint8, device="cuda:0")
        return small.numel() + on_the_gpu.numel()

    with FakeTensorMode():
        report = measure_memory(fn)
    assert report.device == "cuda:0"
    assert report.peak_bytes == 64 * KiB


def test_a_closure_is_counted_where_it_computes_not_where_its_data_or_meta_tensors_are():
    """Tensors it only reads (a data set it slices) do not decide its device, nor do larger
    meta tensors (shapes a planner keeps) where it computes on a real device."""
    data = torch.randn(1000, 64)  # 256 KiB, read only
    shapes = torch.empty(MiB, device="meta")
    w = torch.randn(64, 64, requires_grad=True)

    def step():
        shapes * 2
        (data[:8] @ w).relu().sum().backward()

    report = measure_memory(step)
    assert report.device == "cpu"
    assert data.nbytes <= report.peak_bytes < shapes.untyped_storage().nbytes()


def test_storages_allocated_on_cuda_count_as_the_allocators_512_byte_blocks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake CUDA tensors: no GPU needed
        start = torch.empty(3, device="cuda:0")  # alive before: counted as its 12 bytes
        with MemoryTracker(inputs=[start], device="cuda:0") as tracker:
            one = start + 1  # 12 bytes: one 512-byte block
            torch.empty(1000, device="cuda:0")  # 4000 bytes: 4096, while ``one`` lives
            del one
            torch.empty(0, device="cuda:0")  # nothing allocated
    assert tracker.bytes_at_start() == 12
    assert tracker.report().peak_bytes == 12 + 512 + 4096


def test_under_the_measuring_mode_autograd_sums_a_gradients_parts_out_of_place():
    """A value two operations read gets its gradient in two parts. A plain eager backward
    adds the second into the first in place; under any TorchDispatchMode (torch's InputBuffer
    then takes every tensor for a subclass), as measure_memory and predict_memory run a step,
    into a new tensor: for a moment the value's gradient is there three times. The planner's
    chain model counts that moment (NOTE [ Gradients in flight ] in planning/search/chain_model.py);
    a step nobody observes holds one value less there, which no dispatch mode can count."""
    x = torch.randn(64, 64, requires_grad=True)
    addresses: dict[str, int] = {}

    def step(tag: str) -> None:
        y = x * 2
        a, b = y.sin(), y.cos()
        a.grad_fn.register_hook(lambda inputs, _: addresses.update(sin=inputs[0].data_ptr()))
        b.grad_fn.register_hook(lambda inputs, _: addresses.update(cos=inputs[0].data_ptr()))
        y.register_hook(lambda grad: addresses.update({tag: grad.data_ptr()}))
        (a * b).sum().backward()

    step("eager")
    assert addresses["eager"] in (addresses["sin"], addresses["cos"])  # summed in place
    measure_memory(lambda: step("measured"))
    assert addresses["measured"] not in (addresses["sin"], addresses["cos"])  # a new tensor


def test_freed_memory_is_reused_in_the_count():
    def fn():
        for _ in range(10):
            torch.empty(100 * KiB, dtype=torch.uint8)
        return None

    assert measure_memory(fn).peak_bytes == 100 * KiB


def test_training_step_categories():
    linear = nn.Linear(256, 128, bias=False)  # 128 KiB of float32 weight
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(64, 256)  # 64 KiB

    def step(model, optimizer, x):
        optimizer.zero_grad(set_to_none=False)
        model(x).sum().backward()
        optimizer.step()

    step(linear, optimizer, x)  # creates .grad and the momentum buffer
    report = measure_memory(step, linear, optimizer, x)
    assert report.parameters == 128 * KiB
    assert report.gradients == 128 * KiB
    assert report.optimizer_state == 128 * KiB
    assert report.inputs == 64 * KiB
    # The output (64 x 128 floats = 32 KiB) and the weight gradient before it is accumulated
    # (128 KiB) are the largest things the step allocates at once.
    assert report.peak_bytes == report.model_state_bytes + report.inputs + report.activations
    assert 128 * KiB <= report.activations <= 128 * KiB + 2 * 32 * KiB


def test_activations_of_a_relu_chain_scale_with_depth():
    def forward(model, x):
        return model(x)

    x = torch.randn(1024, requires_grad=True)  # 4 KiB
    for depth in (1, 4, 16):
        chain = nn.Sequential(*(nn.Softplus() for _ in range(depth)))
        report = measure_memory(forward, chain, x)
        # Every Softplus output is kept (the next one saves it for backward).
        assert report.activations == depth * 4 * KiB


def test_tracker_as_context_manager_sees_backward():
    w = nn.Parameter(torch.randn(1000))
    with MemoryTracker() as tracker:
        (w * 2).sum().backward()
    assert tracker.report().peak_bytes >= 2 * 4000


def test_prediction_equals_measurement():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))

    def step(model, optimizer, x, y):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step(model, optimizer, x, y)
    measured = measure_memory(step, model, optimizer, x, y)
    predicted = predict_memory(step, model, optimizer, x, y)
    assert (predicted.device, predicted.method) == ("cpu", "fake-tensor-storage")
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.above_model_state_bytes == measured.above_model_state_bytes
    assert predicted.optimizer_state == measured.optimizer_state > 0


def test_prediction_of_a_reversible_stack():
    from conftest import make_stack

    model = make_stack(6, half=8)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)

    def step(model, x):
        model(x).square().mean().backward()

    # Predicted first: the measured step leaves gradients behind, and a step that accumulates
    # into them needs more (the prediction copies them too).
    predicted = revnets.predict_memory(step, model, x)
    measured = measure_memory(step, model, x)
    assert predicted.above_model_state_bytes == measured.above_model_state_bytes
    assert revnets.predict_memory(step, model, x).peak_bytes == measure_memory(
        step, model, x
    ).peak_bytes


def test_retained_bytes_are_what_a_forward_keeps_for_backward():
    def forward(model, x):
        return model(x)

    x = torch.randn(1024, requires_grad=True)  # 4 KiB
    chain = nn.Sequential(*(nn.Softplus() for _ in range(5)))
    report = measure_memory(forward, chain, x)
    # Four outputs are saved by the next Softplus; the fifth is the returned output itself.
    assert report.retained_bytes == 5 * 4 * KiB
    del report
    assert measure_memory(lambda m, x: m(x).sum().item(), chain, x).retained_bytes == 0


def _optimizers() -> list[type]:
    """Every optimizer torch.optim ships, but LBFGS and Adafactor (their steps read loss, gradient
    or parameter values with .item(): data-dependent, which nothing on the meta device can
    predict) and SparseAdam (sparse gradients only)."""
    return sorted(
        (
            cls
            for cls in vars(torch.optim).values()
            if isinstance(cls, type)
            and issubclass(cls, torch.optim.Optimizer)
            and cls.__name__ not in ("Optimizer", "LBFGS", "Adafactor", "SparseAdam")
        ),
        key=lambda cls: cls.__name__,
    )


def _train_step(model, optimizer, x):
    optimizer.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    optimizer.step()


@pytest.mark.parametrize("optimizer_class", _optimizers(), ids=lambda cls: cls.__name__)
def test_prediction_equals_measurement_for_every_optimizer_after_any_number_of_steps(
    optimizer_class,
):
    # Matrices only: Muon takes nothing else.
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    for _ in range(3):  # before the first step (no state yet), after one, after two
        predicted = predict_memory(_train_step, model, optimizer, x)
        measured = measure_memory(_train_step, model, optimizer, x)
        assert predicted.peak_bytes == measured.peak_bytes
        assert predicted.optimizer_state == measured.optimizer_state


def test_prediction_equals_measurement_for_a_reversible_stack_with_dropout():
    model = make_stack(6, dropout=0.3)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    _train_step(model, optimizer, x)
    predicted = predict_memory(_train_step, model, optimizer, x)
    measured = measure_memory(_train_step, model, optimizer, x)
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.above_model_state_bytes == measured.above_model_state_bytes


def test_random_number_state_is_the_only_memory_that_grows_with_depth():
    """Blocks that draw random numbers keep the CPU generator's state for their replay: 5056
    bytes of mt19937 state per transform, counted and predicted; nothing else grows."""
    state_bytes = torch.get_rng_state().numel()
    above = {}
    for depth in (4, 8):
        for dropout in (0.0, 0.3):
            model = make_stack(depth, dropout=dropout)
            x = torch.randn(2, 8, 6, 6, requires_grad=True)
            report = measure_memory(lambda m, x: m(x).square().sum().backward(), model, x)
            above[depth, dropout] = report.above_model_state_bytes
    assert above[8, 0.0] == above[4, 0.0]
    assert above[8, 0.3] - above[4, 0.3] == 4 * 2 * state_bytes


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_the_generator_states_torchs_checkpoint_keeps_are_measured_and_predicted(use_reentrant):
    """torch.utils.checkpoint copies the CPU generator's state for each call, outside the
    dispatcher (NOTE [ Generator states torch keeps ]): keeping them peaks whole states above
    keeping none, measured == predicted; revnets' checkpoint, whose replay keeps the state
    itself and has torch keep none, peaks where torch's does."""
    state_bytes = torch.get_rng_state().numel()
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1)) for _ in range(3))
    x = torch.randn(8, 64, requires_grad=True)

    def step(run):
        x.grad = None
        layers.zero_grad(set_to_none=True)
        h = x
        for layer in layers:
            h = run(layer, h)
        h.sum().backward()

    runs = {
        keeps: lambda layer, h, keeps=keeps: torch.utils.checkpoint.checkpoint(
            layer, h, use_reentrant=use_reentrant, preserve_rng_state=keeps)
        for keeps in (True, False)}
    peaks = {}
    for keeps, run in runs.items():
        step(run)
        peaks[keeps] = measure_memory(step, run).peak_bytes
        assert predict_memory(step, run).peak_bytes == peaks[keeps]
    kept = peaks[True] - peaks[False]
    assert kept > 0 and kept % state_bytes == 0
    if not use_reentrant:
        assert measure_memory(step, revnets.checkpoint).peak_bytes == peaks[True]


def test_tracker_device_without_index_means_the_current_one():
    assert MemoryTracker(device="cpu").device == torch.device("cpu")
    assert MemoryTracker(device="meta").device == torch.device("meta")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tracker_on_cuda_without_index_records():
    tracker = MemoryTracker(device="cuda")
    assert tracker.device == torch.device("cuda", torch.cuda.current_device())
    with tracker:
        a = torch.empty(KiB, dtype=torch.uint8, device="cuda")
        del a
    assert tracker.report().peak_bytes == KiB


def _warm_cuda_step() -> tuple:
    """A model, its optimizer and a batch on the GPU, after one training step (gradients and
    momentum exist)."""
    model = make_stack(4).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 8, 16, 16, device="cuda", requires_grad=True)
    _train_step(model, optimizer, x)
    return model, optimizer, x


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_categories_are_split_at_the_allocator_peak():
    step = _warm_cuda_step()
    report = measure_memory(_train_step, *step)
    assert report.method == "cuda-allocator"
    parts = (report.parameters + report.gradients + report.optimizer_state + report.inputs
             + report.activations)
    assert parts == report.peak_bytes
    assert report.gradients > 0  # at the allocator's peak (in backward) gradients exist


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_closure_on_cuda_is_measured_on_the_allocator():
    """It was counted on the CPU, where it holds nothing. Given no arguments, the closure's
    model counts from its first use (as on CPU), its gradients freed at the start not at all."""
    model, optimizer, x = _warm_cuda_step()
    with_arguments = measure_memory(_train_step, model, optimizer, x)
    closure = measure_memory(lambda: _train_step(model, optimizer, x))
    assert closure.method == "cuda-allocator" and closure.device.startswith("cuda")
    assert closure.peak_bytes == pytest.approx(with_arguments.peak_bytes, rel=0.1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prediction_on_cuda_is_within_five_percent_of_the_allocator():
    """Fake CUDA tensors counted in the allocator's 512-byte blocks (NOTE [ Bytes the CUDA
    allocator counts ]); cuDNN's and cuBLAS's workspaces are beyond a prediction's reach."""
    model, optimizer, x = _warm_cuda_step()
    measured = measure_memory(_train_step, model, optimizer, x).peak_bytes
    predicted = predict_memory(_train_step, model, optimizer, x).peak_bytes
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prediction_refuses_cudnns_rnn_by_name():
    lstm = nn.LSTM(8, 16).cuda()
    x = torch.randn(5, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="cuDNN's RNN kernel"):
        predict_memory(lambda m, x: m(x)[0].sum().backward(), lstm, x)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_leaves_out_tensors_the_call_never_sees():
    """64 MiB on the device beside the call are not counted. The two measurements need not agree
    to the byte: the caching allocator may serve a request from a larger cached block, and on an
    H200 (2026-11-26) the second read 2,048 B more, gradients alive at its peak; they must
    agree within a thousandth of what lies beside them."""
    step = _warm_cuda_step()
    alone = measure_memory(_train_step, *step)
    elsewhere = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # e.g. another model
    beside = measure_memory(_train_step, *step)
    del elsewhere
    assert abs(beside.peak_bytes - alone.peak_bytes) <= 64 * KiB
    assert abs(beside.above_model_state_bytes - alone.above_model_state_bytes) <= 64 * KiB


def test_prediction_takes_the_cpus_fused_attention_kernel():
    """On meta tensors torch computes attention the math way (the full attention matrix); a CPU
    run takes the fused flash kernel, and the prediction follows it."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 3, 64, 64)

    def step(model, optimizer, x):
        optimizer.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        optimizer.step()

    step(model, optimizer, x)
    predicted = predict_memory(step, model, optimizer, x)
    measured = measure_memory(step, model, optimizer, x)
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.above_model_state_bytes == measured.above_model_state_bytes


@pytest.mark.parametrize("meter", [measure_memory, predict_memory])
def test_a_measurement_leaves_no_reference_cycle_per_tensor(meter):
    """Each tensor's record and the callback that ends it once its storage is freed used to hold
    each other: a reference cycle per tensor, left for Python's cycle collector to find (after
    a planner's predictions, every tensor they made). Records now go with the tracker."""
    model, x = make_stack(6, half=8), torch.randn(2, 16, 8, 8)
    gc.collect()
    gc.disable()
    try:
        meter(lambda m, x: m(x).sum().backward(), model, x)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycles = [o for o in gc.garbage if type(o).__name__ == "_Storage"]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cycles == []


@pytest.mark.parametrize("meter", [measure_memory, predict_memory])
def test_a_storage_resized_in_place_counts_its_old_size_only_until_the_resize(meter):
    def step(x):
        t = torch.empty(1000)  # 4000 bytes
        t.resize_(2000)  # a new 8000-byte allocation; the 4000 end here
        u = torch.empty(1500)  # 6000 bytes, while t holds 8000
        return t.sum() + u.sum()

    # t and u with the input (4 bytes), the two sums and their total (4 bytes each). The old
    # 4000 used to count again from the resize until t was freed.
    assert meter(step, torch.zeros(1)).peak_bytes == 8000 + 6000 + 4 + 3 * 4
