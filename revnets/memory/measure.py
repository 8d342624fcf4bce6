"""Measuring (and predicting) the peak memory of a training step, split by what it holds.

On CPU, process RSS says little (freed memory stays in the heap), so revnets counts live tensor
storage instead: a ``TorchDispatchMode`` sees every tensor every operator returns and touches,
holds a weak reference to each storage, and notes when it is freed. That is exact and repeatable on
any device, including fake tensors, where nothing is computed: running a step on them *predicts*
its peak memory (:mod:`revnets.memory.predict`), which is how 1000-layer, large-batch figures are
obtained on a small machine. On CUDA the allocator's own peak statistic gives the total.

Memory that kernels allocate privately (workspaces, im2col buffers) is not tensor storage and is
not counted; on CUDA it is included in the allocator peak.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from revnets.facts import MiB
from revnets.memory.call_arguments import device_of, owners_in, refuse_uninitialised
from revnets.memory.fake_copies import StandIns
from revnets.memory.generator_states import shown_generator_states
from revnets.replay.watch import DEVICE_QUERY, operator_tensors

__all__ = ["MemoryReport", "MemoryTracker", "Watch", "measure_call", "measure_memory"]


# NOTE [ Bytes the CUDA allocator counts ]
# The caching allocator hands out blocks in multiples of 512 bytes (a 4-byte tensor takes 512),
# and its peak statistic counts blocks. A storage the tracked call allocates on CUDA therefore
# counts as its size rounded up to 512, measured or predicted, so that a prediction on fake CUDA
# tensors adds up the way the allocator does. Storages alive at the start count as their size:
# a measurement adds them to the allocator's rise during the call, which does not include them.
# A tensor a closure holds, first met during the call, counts as a block from then on, measured
# (added to the rise likewise) and predicted (its fake is made there).
# What remains beyond a prediction's reach is memory no tensor holds (cuDNN and cuBLAS
# workspaces, a fused kernel's scratch) and a cached block reused whole for a smaller request.
CUDA_BLOCK = 512

PARAMETERS, GRADIENTS, OPTIMIZER, INPUTS, ACTIVATIONS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "inputs",
    "activations",
)


@dataclass(frozen=True)
class MemoryReport:
    """Live tensor memory at the peak of a measured call, by category, in bytes.

    - ``parameters``: parameters and buffers of the modules involved.
    - ``gradients``: their ``.grad`` tensors.
    - ``optimizer_state``: tensors held in the optimizers' ``state``.
    - ``inputs``: tensors passed to the measured call that are none of the above (the batch).
    - ``activations``: everything the call allocated that is none of the above: activations kept
      for backward, temporaries, outputs.

    These six describe the moment of the overall peak. ``above_model_state_bytes`` is the peak
    over time of inputs + activations alone, the memory a training step needs above parameters,
    gradients and optimizer state (its own peak can fall at another moment). ``retained_bytes``
    counts the activations the call left alive: for a forward pass that returns its loss, the
    activations kept for backward.
    """

    peak_bytes: int
    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    activations: int
    above_model_state_bytes: int  # the peak over time of inputs + activations
    retained_bytes: int  # activations still alive when the call returned (e.g. a forward's graph)
    device: str
    method: str  # "tensor-storage", "cuda-allocator" or "fake-tensor-storage" (predicted)
    result: Any = None

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state: what does not depend on the batch."""
        return self.parameters + self.gradients + self.optimizer_state


    def __str__(self) -> str:
        rows = [
            ("peak", self.peak_bytes),
            (PARAMETERS, self.parameters),
            (GRADIENTS, self.gradients),
            (OPTIMIZER, self.optimizer_state),
            (INPUTS, self.inputs),
            (ACTIVATIONS, self.activations),
            ("above state", self.above_model_state_bytes),
            ("retained", self.retained_bytes),
        ]
        lines = [f"memory at peak on {self.device} ({self.method}):"]
        lines += [f"  {name:<16}{nbytes / MiB:10.2f} MiB" for name, nbytes in rows]
        return "\n".join(lines)


class _Storage:
    __slots__ = ("nbytes", "allocated", "freed", "ref", "device", "module", "found")

    def __init__(self, nbytes: int, allocated: int, ref: weakref.ref, device: torch.device):
        self.nbytes = nbytes
        self.allocated = allocated
        self.freed: int | None = None
        self.ref = ref
        self.device = device
        self.module: str | None = None  # the top-level module whose forward allocated it
        # First met as an operator's input: made before the call (a tensor a closure holds) or
        # outside the dispatcher. It counts from that first use.
        self.found = False


# ``torch.tensor(...)`` makes its tensor outside the dispatcher and hands it to a lift, whose
# output is the tensor the code holds: the same storage in a real run, a fake one in a prediction.
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _storage_freed(tracker: weakref.ref, key: int, index: int, _ref: weakref.ref) -> None:
    """A tracked storage was freed: its record (``index`` in the tracker's history) ends now."""
    self = tracker()
    if self is None:
        return
    record = self._history[index]
    if record.freed is None:  # a storage resized in place ended its old allocation already
        record.freed = self.clock
    if self._storages.get(key) is record:
        del self._storages[key]


class MemoryTracker(TorchDispatchMode):
    """Context manager recording every tensor storage alive while it is active.

    Pass the modules and optimizers the measured code uses so that their tensors are attributed
    to parameters, gradients and optimizer state, and the tensors that exist before it starts as
    ``inputs`` (any other tensor counts from its first use)::

        with MemoryTracker(model, optimizer) as tracker:
            train_step()
        print(tracker.report())
    """

    def __init__(
        self,
        *owners: nn.Module | torch.optim.Optimizer,
        inputs: Iterable[Tensor] = (),
        device: str | None = None,
    ):
        super().__init__()
        self.owners = owners
        self.inputs = list(inputs)
        self.device = _indexed(torch.device(device)) if device is not None else None
        # CUDA devices whose allocator peak is followed, (peak, the tick that reached it) each;
        # None: the tracker's own device if it is CUDA (named, or found at the first tensor).
        self.allocator_devices: list[torch.device] | None = None
        self._allocator_peaks: dict[torch.device, tuple[int, int]] = {}
        self.clock = 0  # operators seen so far: a record's ticks count them
        self._storages: dict[int, _Storage] = {}  # by id of the live storage object
        self._history: list[_Storage] = []
        self._start_labels: dict[int, str] = {}
        self._end_labels: dict[int, str] = {}
        self.module: str | None = None  # set by a timeline while a top-level module runs
        # id(real storage): a fake tensor whose storage stands for it (a prediction's copy of a
        # model's parameter, reached through a closure too), held weakly (NOTE [ Real tensors in
        # a prediction ], 7 in fake_device.py).
        self.stand_ins: dict[int, tuple[Any, weakref.ref[Tensor]]] = {}
        self._weak_self = weakref.ref(self)

    # -- recording -------------------------------------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        labels = _label_owned(self.owners)
        for tensor, label in labels:
            record = self._see(tensor, allocated=0)
            if record is not None:
                self._start_labels.setdefault(id(record), label)
        for tensor in self.inputs:
            self._see(tensor, allocated=0)
        if self.device is None:
            self.device = next((t.device for t, _ in labels), None)
        self._generator_states = shown_generator_states(
            lambda state: self._see(state, allocated=self.clock))
        self._generator_states.__enter__()  # NOTE [ Generator states torch keeps ]
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._generator_states.__exit__(*exc)
        for tensor, label in _label_owned(self.owners):
            storage = self._storages.get(_storage_key(tensor))
            if storage is not None:
                self._end_labels.setdefault(id(storage), label)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:  # NOTE [ Device queries ]
            if isinstance(args[0], FakeTensor):
                return args[0].device
            return func(*args, **(kwargs or {}))
        self.clock += 1
        for t in () if func in _LIFTS else operator_tensors(args, kwargs):
            # An unknown storage here was made outside the dispatcher (torch.get_rng_state,
            # from_numpy) or before tracking began; it counts from its first use.
            self._see(t, allocated=self.clock, found=True)
        out = func(*args, **(kwargs or {}))
        for t in operator_tensors(out):
            self._see(t, allocated=self.clock)
        devices = self.allocator_devices
        if devices is None:
            cuda = self.device is not None and self.device.type == "cuda"
            devices = [self.device] if cuda else []
        for device in devices:
            # The allocator's peak only grows: the last operator that raised it is where the
            # step peaked, and that is the moment the categories are split at.
            peak = torch.cuda.max_memory_allocated(device)
            if peak > self._allocator_peaks.get(device, (0, 0))[0]:
                self._allocator_peaks[device] = (peak, self.clock)
        return out

    def allocator_peak_tick(self, device: torch.device) -> int:
        """The clock tick of the operator that raised ``device``'s allocator peak last."""
        return self._allocator_peaks.get(device, (0, 0))[1]

    @property
    def allocator_peak_at(self) -> int:
        """The clock tick of the allocator's peak on the tracker's device, on CUDA."""
        return self.allocator_peak_tick(self.device) if self.device is not None else 0

    def busiest_device(self) -> torch.device | None:
        """The device where the tracked call's own allocations peaked highest: tensors it only
        read (a data set it slices) do not decide, nor does the meta device where a real one
        was used."""
        made = [r for r in self._history if not r.found and r.allocated]
        devices = {r.device for r in made}
        real = {d for d in devices if d.type != "meta"}
        return max(real or devices, default=None,
                   key=lambda d: _peak_of(r for r in made if r.device == d)[0])

    def _see(self, tensor: Tensor, allocated: int, found: bool = False) -> _Storage | None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
            return None
        key = id(storage)
        held = self.stand_ins.get(key)
        fake = held[1]() if held is not None else None
        if fake is not None:
            return self._see(fake, allocated, found)
        record = self._storages.get(key)
        # A fake tensor's storage is a meta storage; the tensor names the device it stands for.
        device = tensor.device if isinstance(tensor, FakeTensor) else storage.device
        if record is not None and record.nbytes == _counted(storage, device, record.allocated):
            return record
        if record is not None:  # resized in place: the old allocation ends here
            record.freed = self.clock
        nbytes = _counted(storage, device, allocated)
        if self.device is None:
            self.device = _indexed(tensor.device)
        record = _Storage(nbytes, allocated, None, device)  # type: ignore[arg-type]
        record.found = found and key not in self._storages
        record.module = self.module
        # The callback holds the tracker weakly and the record by its place in the history: a
        # record holding its own callback would make a reference cycle per storage, left for the
        # cycle collector to find (auto_checkpoint pauses it while predicting, then pays for all).
        record.ref = weakref.ref(storage, functools.partial(
            _storage_freed, self._weak_self, key, len(self._history)))
        self._storages[key] = record
        self._history.append(record)
        return record

    # -- reporting -------------------------------------------------------------------------------
    def label(self, record: _Storage) -> str:
        """The category a record counts in: its owner's (parameters, gradients, optimizer state)
        at the start or else at the end, else inputs if alive at the start, else activations."""
        label = self._start_labels.get(id(record)) or self._end_labels.get(id(record))
        if label is None:
            label = INPUTS if record.allocated == 0 else ACTIVATIONS
        return label

    def records(self, labels: Iterable[str] | None = None) -> list[_Storage]:
        """The storages seen on the tracker's device, in the order met, only those in
        ``labels`` if given."""
        wanted = set(labels) if labels is not None else None
        return [
            r
            for r in self._history
            if (self.device is None or r.device == self.device)
            and (wanted is None or self.label(r) in wanted)
        ]

    def peak(self, labels: Iterable[str] | None = None) -> tuple[int, int]:
        """(peak live bytes, the clock tick reaching it), counting only ``labels`` if given."""
        return _peak_of(self.records(labels))

    def bytes_at_start(self) -> int:
        """What the owners and inputs held when tracking began."""
        return sum(r.nbytes for r in self.records() if r.allocated == 0)

    def report(self, result: Any = None, at: int | None = None) -> MemoryReport:
        """The peak and its split by category, at the peak of live tensor storage or at the
        clock tick ``at``."""
        peak, peak_at = self.peak()
        at = peak_at if at is None else at
        by_label = dict.fromkeys((PARAMETERS, GRADIENTS, OPTIMIZER, INPUTS, ACTIVATIONS), 0)
        for r in self.records():
            if r.allocated <= at and (r.freed is None or r.freed >= at):
                by_label[self.label(r)] += r.nbytes
        working_peak, _ = self.peak((INPUTS, ACTIVATIONS))
        retained = sum(
            r.nbytes
            for r in self.records((ACTIVATIONS,))
            if r.freed is None and r.ref() is not None
        )
        device = str(self.device) if self.device is not None else "cpu"
        return MemoryReport(
            peak_bytes=peak,
            parameters=by_label[PARAMETERS],
            gradients=by_label[GRADIENTS],
            optimizer_state=by_label[OPTIMIZER],
            inputs=by_label[INPUTS],
            activations=by_label[ACTIVATIONS],
            above_model_state_bytes=working_peak,
            retained_bytes=retained,
            device=device,
            method="tensor-storage",
            result=result,
        )


def _peak_of(records: Iterable[_Storage]) -> tuple[int, int]:
    events: dict[int, int] = {}
    for r in records:
        events[2 * r.allocated] = events.get(2 * r.allocated, 0) + r.nbytes
        if r.freed is not None:  # frees at tick t happen after tick t's allocations
            events[2 * r.freed + 1] = events.get(2 * r.freed + 1, 0) - r.nbytes
    live = peak = peak_at = 0
    for t in sorted(events):
        live += events[t]
        if live > peak:
            peak, peak_at = live, t // 2
    return peak, peak_at


def _counted(storage: torch.UntypedStorage, device: torch.device, allocated: int) -> int:
    """The bytes a storage counts for (NOTE [ Bytes the CUDA allocator counts ])."""
    if allocated and device.type == "cuda":
        return -(-storage.nbytes() // CUDA_BLOCK) * CUDA_BLOCK
    return storage.nbytes()


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:0`` (the current device): storages report their device with an index."""
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    return torch.device(device.type, torch.get_device_module(device.type).current_device())


def _storage_key(tensor: Tensor) -> int | None:
    try:
        return id(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _label_owned(owners: Iterable[Any]) -> list[tuple[Tensor, str]]:
    labelled: list[tuple[Tensor, str]] = []
    for owner in owners:
        if isinstance(owner, nn.Module):
            for p in owner.parameters():
                labelled.append((p, PARAMETERS))
                if p.grad is not None:
                    labelled.append((p.grad, GRADIENTS))
            labelled += [(b, PARAMETERS) for b in owner.buffers()]
        elif isinstance(owner, torch.optim.Optimizer):
            for state in owner.state.values():
                labelled += [(v, OPTIMIZER) for v in state.values() if isinstance(v, Tensor)]
            for group in owner.param_groups:
                for p in group["params"]:
                    labelled.append((p, PARAMETERS))
                    if p.grad is not None:
                        labelled.append((p.grad, GRADIENTS))
    return labelled


def measure_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Run ``fn(*args, **kwargs)`` once and report its peak memory by category.

    Modules and optimizers among the arguments are recognised, so their tensors count as
    parameters, gradients and optimizer state; tensors among the arguments count as inputs.
    Pass everything the call uses as an argument: a tensor captured by a closure counts only from
    its first use, as an activation. The call's return value is kept in ``report.result``.

    On CUDA, the peak is the caching allocator's highest count during the call (kernel
    workspaces included) above its count at the start, plus the model state and inputs alive at
    the start: tensors the call never sees (another model, a data set already on the device)
    are left out, as they are on CPU. The model-state categories still come from storage
    tracking.
    """
    return measure_call(fn, args, kwargs)


Watch = Callable[["MemoryTracker", list], contextlib.AbstractContextManager]


def measure_call(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    predicted: bool = False,
    watch: Watch | None = None,
    stand_ins: StandIns | None = None,
) -> MemoryReport:
    """measure_memory's work; ``watch(tracker, owners)``, if given, is a context entered around
    the call inside the tracker (a timeline attributes storages to modules with it).
    ``predicted``: the call runs on fake tensors, whose storage is all there is to count;
    ``stand_ins``: real tensors the call may reach (through a closure) and the fakes whose
    storage is theirs in the prediction."""
    owners = owners_in(args, kwargs)
    if not predicted:  # predict_memory refused them already
        refuse_uninitialised("measure_memory", owners)
    named = device_of(owners, args, kwargs)
    # Fake tensors (a prediction, or a call inside the caller's FakeTensorMode) allocate nothing.
    allocator = not predicted and not any(
        isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())
    # A call whose arguments name no device (a closure) is counted on the device where its own
    # allocations peak highest; if CUDA is in use, the current device's allocator is followed.
    if named is not None:
        named = _indexed(named)
        watched = [named] if named.type == "cuda" and allocator else []
    else:
        watched = [] if not allocator or not torch.cuda.is_initialized() else [
            torch.device("cuda", torch.cuda.current_device())]
    starts = {}
    for device in watched:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        starts[device] = torch.cuda.memory_allocated(device)
    leaves, _ = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    tracker = MemoryTracker(*owners, inputs=tensors, device=str(named) if named else None)
    tracker.allocator_devices = watched
    if stand_ins:
        tracker.stand_ins = {id(storage): (storage, weakref.ref(fake))  # storage held: ids
                             for real, fake in stand_ins.items()  # stay theirs
                             for storage in [real.untyped_storage()]}
    with tracker, watch(tracker, owners) if watch else contextlib.nullcontext():
        result = fn(*args, **kwargs)
    if named is None:
        tracker.device = tracker.busiest_device() or torch.device("cpu")
    device = tracker.device
    if predicted:
        return replace(tracker.report(result), method="fake-tensor-storage")
    if device not in starts:
        return tracker.report(result)
    torch.cuda.synchronize(device)
    at = tracker.allocator_peak_tick(device)
    report = tracker.report(result, at=at)
    # The allocator's rise leaves out what was allocated before the call: the arguments' tensors,
    # and those a closure holds, which count from their first use as they do on CPU and in a
    # prediction; one freed before the peak lowered the rise by its size.
    found = sum(r.nbytes for r in tracker.records() if r.found and r.allocated <= at)
    peak = (torch.cuda.max_memory_allocated(device) - starts[device] + tracker.bytes_at_start()
            + found)
    rest = report.model_state_bytes + report.inputs
    return MemoryReport(
        peak_bytes=peak,
        parameters=report.parameters,
        gradients=report.gradients,
        optimizer_state=report.optimizer_state,
        inputs=report.inputs,
        activations=max(peak - rest, 0),
        above_model_state_bytes=max(peak - report.model_state_bytes, 0),
        retained_bytes=report.retained_bytes,
        device=str(device),
        method="cuda-allocator",
        result=result,
    )
