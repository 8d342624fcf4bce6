"""Predicting the peak memory of a call without computing it.

The call runs on fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``): tensors that
carry shapes, dtypes and a device but no data, whose operators run torch's meta kernels. Unlike
a bare run on the ``meta`` device, a fake CPU tensor *is* a CPU tensor to the code that sees it,
so the prediction takes the paths a real run takes, with no patching of torch:

- autocast, which is per device type, casts as on the real device;
- composite operators choose the real device's kernels (the CPU's fused flash attention, its
  oneDNN LSTM layer with its workspace), also inside graphs torch.fx traced;
- a real tensor the call reaches without it being an argument (labels a loss function closes
  over) takes part as a fake one, and counts from its first use as measure_memory counts it;
- scalar tensors made from Python numbers keep their values, so optimizers can read their step
  counts (``.item()``).

Modules and optimizers among the arguments are copied with one copy memo, so parameters a model
shares between its layers (tied embeddings) stay one parameter, as they are one storage for the
real run. :class:`revnets.memory.MemoryTracker` then counts the fake storages as it counts real
ones.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import (
    FakeCopyMode,
    FakeTensor,
    FakeTensorMode,
    in_kernel_invocation_manager,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from revnets.memory import (
    _DEVICE_QUERY,
    _LIFTS,
    MemoryReport,
    Watch,
    _device_of,
    _measure,
    _owners_in,
)
from revnets.replay.watch import operator_tensors

__all__ = ["predict_memory"]


def predict_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Predict the peak memory of ``fn(*args, **kwargs)`` without computing anything.

    Modules, optimizers and tensors among the arguments are copied to fake tensors on their own
    device (the originals are left alone), then the call is measured there, as
    :func:`revnets.measure_memory` measures it. ``fn`` must not read tensor values (printing,
    data-dependent control flow); reading scalars made from Python numbers (an optimizer's step
    count) is fine. For very large models, build the model on the meta device to begin with
    (``with torch.device("meta"): ...``): it is then predicted with the meta device's kernels.
    """
    return _predict(fn, args, kwargs)


def _predict(
    fn: Callable[..., Any], args: tuple, kwargs: dict, watch: Watch | None = None
) -> MemoryReport:
    return Predictor().predict(fn, args, kwargs, watch)


class Predictor:
    """Predictions of several calls over the same modules (a planner's candidate plans of one
    model) in one fake mode, where each parameter and buffer is made fake once: making a
    model's tensors fake is most of what copying it costs, a large share of a prediction.

    Each prediction starts from the real parameters' gradients and ``requires_grad``, as a
    fresh one does (a tensor changed under the same object, by ``module.double()`` say, is
    made fake again), and from copies of scalar buffers and optimizer state (step counts),
    which it reads and changes; what else a call leaves on the fake tensors kept (their values,
    which fake tensors do not have; version counters, only ever compared within a run) holds
    no memory. Everything else (the modules themselves, inputs, tensors a closure reaches, optimizer
    state, scalars kept as constants) is made anew each time: the mode remembers a fake tensor
    only while something holds it.
    """

    def __init__(self) -> None:
        # A tensor the call reaches outside its arguments (a closure) is made fake on first use.
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        # id(real): (real, fake, the real one's layout when made): ``param.data = ...`` and
        # ``module.double()`` or ``.to(memory_format=...)`` change a tensor under the same object.
        self._made: dict[int, tuple[Tensor, Tensor, tuple]] = {}

    def predict(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, watch: Watch | None = None
    ) -> MemoryReport:
        device = _device_of(_owners_in(*args, **kwargs), args, kwargs)
        memo: dict[int, Any] = {key: fake for key, (real, fake, layout) in self._made.items()
                                if _layout(real) == layout}
        fake_args = tuple(self._to_fake(a, memo, device) for a in args)
        fake_kwargs = {k: self._to_fake(v, memo, device) for k, v in kwargs.items()}
        mode = self.mode
        with _random_state_kept(device), mode, _LikeTheDevice(mode, device):
            return _measure(fn, fake_args, fake_kwargs, predicted=True, watch=watch)

    def _to_fake(self, obj: Any, memo: dict[int, Any], device: torch.device) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        mode = self.mode
        if isinstance(obj, nn.Module):
            # Scalar buffers (batch norm's num_batches_tracked) keep their values, made anew for
            # every prediction: code reads them (momentum=None), and the run changes them.
            memo.update((id(b), _scalar_to_fake(b, mode)) for b in obj.buffers()
                        if _is_cpu_scalar(b) and id(b) not in memo)
            with FakeCopyMode(mode):
                fake = copy.deepcopy(obj, memo)
            self._made_once(obj.named_buffers(remove_duplicate=False),
                            fake.named_buffers(remove_duplicate=False))
            for old, new in self._made_once(obj.named_parameters(remove_duplicate=False),
                                            fake.named_parameters(remove_duplicate=False)):
                # Gradients left from an earlier step are alive until zero_grad, or accumulate.
                # Made from a new object each time: the fake mode remembers fakes by object, and
                # ``module.double()`` changes a gradient under the same one.
                new.grad = None if old.grad is None else mode.from_tensor(
                    old.grad.detach(), static_shapes=True)
                new.requires_grad_(old.requires_grad)
        elif isinstance(obj, torch.optim.Optimizer):
            fake = _optimizer_to_fake(obj, mode, memo)
        elif isinstance(obj, Tensor):
            if obj.requires_grad and obj.grad_fn is not None:
                # Its history is the caller's: a backward through it reaches tensors the call
                # never sees, which a fake copy (a leaf) cannot follow.
                raise ValueError(
                    f"predict_memory: an argument is a tensor computed from others "
                    f"({type(obj.grad_fn).__name__}, shape {tuple(obj.shape)}), whose backward "
                    f"reaches beyond the call; pass a leaf (x.detach().requires_grad_()) or "
                    f"compute it inside the call"
                )
            fake = _tensor_to_fake(obj, mode, device)
        elif isinstance(obj, (list, tuple)):
            fake = type(obj)(self._to_fake(o, memo, device) for o in obj)
        elif isinstance(obj, dict):
            fake = {k: self._to_fake(v, memo, device) for k, v in obj.items()}
        else:
            return obj
        memo[id(obj)] = fake
        return fake

    def _made_once(
        self, real: Iterator[tuple[str, Tensor]], fake: Iterator[tuple[str, Tensor]]
    ) -> list[tuple[Tensor, Tensor]]:
        """Pairs of a module's tensors and their fake copies, remembered for the next
        prediction."""
        pairs = [(old, new) for (_, old), (_, new) in zip(real, fake)]
        self._made.update((id(old), (old, new, _layout(old))) for old, new in pairs
                          if not _is_cpu_scalar(old))
        return pairs


def _layout(tensor: Tensor) -> tuple:
    return (tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.device,
            tensor.untyped_storage()._cdata)


@contextlib.contextmanager
def _random_state_kept(device: torch.device) -> Iterator[None]:
    """A prediction draws nothing the user's generators remember (Python's included: code that
    drops layers at random draws from it)."""
    devices = [device] if device.type == "cuda" else []
    python = random.getstate()
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        random.setstate(python)


class _LikeTheDevice(TorchDispatchMode):
    """Where fake tensors would behave unlike real ones, in ways the code can see.

    - Fake kernels draw no random numbers, but code that decides whether to keep a generator's
      state (a checkpoint replaying dropout) looks at whether the generator moved. One real draw
      per random operator makes it move as in a real run; :func:`_predict` restores every
      generator after.
    - Operators on real tensors alone (a generator's state, kept aside) run for real, but never
      write a real tensor.
    - Scalars made from numbers keep their values.
    """

    def __init__(self, mode: FakeTensorMode, device: torch.device) -> None:
        super().__init__()
        self.mode = mode
        self.device = device if device.type in ("cpu", "cuda") else torch.device("cpu")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE_QUERY:  # a fake tensor's device, asked at every operator
            return func(*args, **kwargs)
        tensors = operator_tensors(args, kwargs)
        if func in _LIFTS and _is_cpu_scalar(args[0]) and not isinstance(args[0], FakeTensor):
            # ``torch.tensor(0.0)`` (Adam's first step count): a scalar made from a number, kept
            # as one, so that in-place updates (``torch._foreach_add_``) change its value. In a
            # copy: the fake mode computes on a constant for real, and ``torch.from_numpy``
            # lifts memory the user's array owns.
            with _disable_current_modes():
                value = args[0].clone()
            return self.mode.fake_tensor_converter.from_real_tensor(
                self.mode, value, make_constant=True
            )
        if func._schema.is_mutable:
            args, kwargs = self._real_ones_not_written(func, args, kwargs)
            tensors = operator_tensors(args, kwargs)
        if tensors and not func._schema.is_mutable and not any(
            isinstance(t, FakeTensor) for t in tensors
        ):
            # Only real tensors in, nothing written: what the real run computes, computed (a
            # generator's state kept aside by a checkpoint must stay a real one to restore).
            with _disable_current_modes():
                return func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.get("generator")
            with _disable_current_modes():
                device = generator.device if generator is not None else self.device
                torch.empty(1, device=device).uniform_(generator=generator)
            return func(*args, **kwargs)
        if self.device.type == "cpu" and func in _CPU_OUTPUTS and self._ours(
            [t for t in tensors if isinstance(t, FakeTensor)]
        ):  # real tensors among them (statistics a closure holds) are read for their sizes
            return _CPU_OUTPUTS[func](*args, **kwargs)
        if func.is_view and not func._schema.is_mutable:
            out = self._view(func, args, kwargs, tensors)
        elif func._schema.is_mutable:
            out = self._uncached(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.device.type == "cpu" and func in _CPU_KERNELS:
            return _CPU_KERNELS[func](out, args, kwargs)
        if not tensors and isinstance(out, FakeTensor) and out.dim() == 0 and out.is_cpu:
            # A scalar made from numbers (ASGD's ``mu = torch.ones(())``) keeps its value, to be
            # read back with ``.item()`` as from a real one.
            with _disable_current_modes():
                real = func(*args, **kwargs)
            return self.mode.fake_tensor_converter.from_real_tensor(
                self.mode, real, make_constant=True
            )
        return out

    def _real_ones_not_written(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments, a real tensor that the operator writes (a counter a closure holds,
        ``counter.add_(1)``) replaced by its fake: the fake mode would write the user's tensor
        itself (it computes on real CPU tensors as constants). The mode remembers the fake, so
        later reads of the real tensor see the written one."""
        def fake(value: Any) -> Any:
            if isinstance(value, Tensor) and not isinstance(value, FakeTensor):
                return self.mode.from_tensor(value, static_shapes=True)
            if isinstance(value, (list, tuple)):
                return type(value)(fake(v) for v in value)
            return value

        args, kwargs = list(args), dict(kwargs)
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            if i < len(args) and not argument.kwarg_only:
                args[i] = fake(args[i])
            elif argument.name in kwargs:
                kwargs[argument.name] = fake(kwargs[argument.name])
        return tuple(args), kwargs

    def _view(self, func: Any, args: tuple, kwargs: dict, tensors: list[Tensor]) -> Any:
        """A view of this mode's fake tensors, from the view kernel itself on their meta
        storage: what the device's kernel computes (strides of size-1 dimensions included), at
        a fifth of the cost of the fake mode's own path, which runs the view's Python
        decomposition."""
        if not self._ours(tensors):
            return self._uncached(func, args, kwargs)
        try:
            with in_kernel_invocation_manager(self.mode):
                out = func(*args, **kwargs)
        except NotImplementedError:  # no meta kernel
            return self._uncached(func, args, kwargs)
        return self.mode.wrap_meta_outputs_with_default_device_logic(out, func, tensors, None)

    def _ours(self, tensors: list[Tensor]) -> bool:
        """Whether these are this mode's fake tensors, none of them a constant (the fake mode
        computes on constants for real)."""
        return all(isinstance(t, FakeTensor) and t.fake_mode is self.mode
                   and t.constant is None for t in tensors)

    def _uncached(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Outputs the fake mode's dispatch cache rebuilds for views and in-place operators
        differ from the kernel's own (the reversible engine, which reuses memory only a tensor
        holds alone, sees the difference): computed each time."""
        cached, self.mode.cache_enabled = self.mode.cache_enabled, False
        try:
            return func(*args, **kwargs)
        finally:
            self.mode.cache_enabled = cached


def _tensor_to_fake(tensor: Tensor, mode: FakeTensorMode, device: torch.device) -> Tensor:
    if tensor.is_meta and device.type != "meta":
        # A meta input stands for one on the model's device (a batch too large to allocate).
        fake = mode.fake_tensor_converter.from_meta_and_device(mode, tensor, device)
        return fake.requires_grad_(tensor.requires_grad) if tensor.is_leaf else fake
    if _is_cpu_scalar(tensor):
        return _scalar_to_fake(tensor, mode)
    return mode.from_tensor(tensor, static_shapes=True)


def _is_cpu_scalar(tensor: Tensor) -> bool:
    return tensor.dim() == 0 and tensor.device.type == "cpu" and not isinstance(
        tensor, nn.Parameter)


def _scalar_to_fake(tensor: Tensor, mode: FakeTensorMode) -> Tensor:
    """Scalars keep their value (optimizers read their step counts with ``.item()``), in a
    copy: the fake mode computes on a constant for real, in place too (``step += 1``), and the
    original is the user's."""
    return mode.fake_tensor_converter.from_real_tensor(mode, tensor.clone(), make_constant=True)


def _optimizer_to_fake(
    optimizer: torch.optim.Optimizer, mode: FakeTensorMode, memo: dict[int, Any]
) -> Any:
    """The same optimizer over the fake copies of its parameters, with its state.

    A shallow copy rather than a new instance: constructors differ (AdamW's defaults hold a key
    its constructor does not take), and some create state.
    """
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) not in memo:
                raise ValueError(
                    "predict_memory: pass the model whose parameters the optimizer updates "
                    "before the optimizer in the argument list"
                )
            params.append(memo[id(p)])
        groups.append({**group, "params": params})
    fake = copy.copy(optimizer)
    fake.param_groups = groups
    fake.state = collections.defaultdict(dict)
    for p, state in optimizer.state.items():
        fake.state[memo[id(p)]] = {
            k: _tensor_to_fake(v, mode, v.device) if isinstance(v, Tensor) else v
            for k, v in state.items()
        }
    return fake


# NOTE [ CPU kernels that allocate unlike their meta kernels ]
# Fake tensors run the meta kernels, which give the shapes and dtypes of every output. Where the
# CPU kernel's outputs differ, the outputs are corrected here, exactly:
# - batch norm (native_batch_norm, and the operators compiled and exported graphs call), group
#   norm and layer norm on a reduced-precision input with float32 parameters (autocast) keep
#   their saved mean and inverse standard deviation in float32 (the meta kernels: the input's
#   dtype); native_group_norm_backward returns the input's gradient in the input's dtype (the
#   meta kernel: float32 when the parameters are);
# - mkldnn_rnn_layer (each layer and direction of nn.LSTM) returns a oneDNN workspace whose size
#   oneDNN computes from the shapes, the instruction set and its version (the meta kernel: empty).
#   Its size is asked of oneDNN itself: the layer runs once for real, on zeros of the same shapes,
#   and the size is remembered for those shapes. Its backward returns the gradients of the two
#   biases in two tensors (the meta kernel: one).
# Batch norm's meta kernels are Python decompositions, which the fake mode runs op by op for
# every new shape (tens of milliseconds per layer of a DenseNet): its outputs are made directly,
# as the CPU kernels allocate them (the output and the input's gradient in the input's suggested
# memory format; the saved statistics per channel in training, empty in evaluation, in float32
# when mixed as above; the parameters' gradients in the weight's dtype; no input gradient where
# the input needs none), real statistics a closure holds included.


def _batch_norm(out: Any, args: tuple, kwargs: dict) -> Any:
    return _float32_statistics(out, args[0], args[1:5])


def _batch_norm_without_statistics(out: Any, args: tuple, kwargs: dict) -> Any:
    return _float32_statistics(out, args[0], args[1:3])


def _layer_norm(out: Any, args: tuple, kwargs: dict) -> Any:
    return _float32_statistics(out, args[0], args[2:4])


def _batch_norm_outputs(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, training: bool, momentum: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    channels = x.shape[1] if training else 0
    dtype = torch.float32 if _mixed(x, (weight, bias, running_mean, running_var)) else x.dtype
    return (_like_input(x), x.new_empty((channels,), dtype=dtype),
            x.new_empty((channels,), dtype=dtype))


def _batch_norm_backward_outputs(
    grad_out: Tensor, x: Tensor, weight: Tensor | None, *statistics: Any
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    mask = statistics[-1]
    per_channel = ((x.shape[1],), weight.dtype if weight is not None else x.dtype)
    return (_like_input(x) if mask[0] else None,
            x.new_empty(per_channel[0], dtype=per_channel[1]) if mask[1] else None,
            x.new_empty(per_channel[0], dtype=per_channel[1]) if mask[2] else None)


def _batch_norm_backward_with_reserve_outputs(
    grad_out: Tensor, x: Tensor, weight: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, save_mean: Tensor | None, save_var: Tensor | None,
    update: bool, eps: float, output_mask: list[bool], reserve: Tensor,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    return _batch_norm_backward_outputs(grad_out, x, weight, output_mask)


def _like_input(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=suggest_memory_format(x))


def _group_norm(out: Any, args: tuple, kwargs: dict) -> Any:
    return _float32_statistics(out, args[0], args[1:3])


def _group_norm_backward(out: Any, args: tuple, kwargs: dict) -> Any:
    grad_input, x = out[0], args[1]
    if grad_input is None or grad_input.dtype == x.dtype:
        return out
    return (grad_input.new_empty(grad_input.shape, dtype=x.dtype), *out[1:])


def _mixed(x: Tensor, parameters: Sequence[Tensor | None]) -> bool:
    """A reduced-precision input with float32 parameters (autocast): float32 statistics."""
    return x.dtype in (torch.bfloat16, torch.float16) and any(
        t is not None and t.dtype == torch.float32 for t in parameters)


def _float32_statistics(out: Any, x: Tensor, parameters: Sequence[Tensor | None]) -> Any:
    if not _mixed(x, parameters):
        return out
    y, mean, invstd, *rest = out  # batch norm with update: its reserve too
    return (y, mean.new_empty(mean.shape, dtype=torch.float32),
            invstd.new_empty(invstd.shape, dtype=torch.float32), *rest)


_RNN_WORKSPACE: dict[tuple, int] = {}


def _rnn_layer(out: Any, args: tuple, kwargs: dict) -> Any:
    def key(value: Any) -> Any:
        if isinstance(value, Tensor):
            return (tuple(value.shape), value.dtype)
        if isinstance(value, (list, tuple)):
            return tuple(key(v) for v in value)
        return value

    signature = key((args, sorted(kwargs.items())))
    if signature not in _RNN_WORKSPACE:
        def real(value: Any) -> Any:
            if isinstance(value, Tensor):
                return torch.zeros(value.shape, dtype=value.dtype)
            if isinstance(value, (list, tuple)):
                return type(value)(real(v) for v in value)
            return value

        with _disable_current_modes():
            workspace = torch.ops.aten.mkldnn_rnn_layer.default(
                *real(args), **real(kwargs)
            )[3]
        _RNN_WORKSPACE[signature] = workspace.numel()
    y, hy, cy, workspace = out
    return y, hy, cy, workspace.new_empty(_RNN_WORKSPACE[signature])


def _rnn_layer_backward(out: Any, args: tuple, kwargs: dict) -> Any:
    # The meta kernel returns one tensor as the gradient of both biases; the CPU kernel returns
    # two, which the two parameters keep as their gradients.
    return (*out[:4], out[4].new_empty(out[4].shape), *out[5:])


_CPU_KERNELS: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    torch.ops.aten.mkldnn_rnn_layer_backward.default: _rnn_layer_backward,
    torch.ops.aten.native_batch_norm.default: _batch_norm,
    torch.ops.aten._native_batch_norm_legit.default: _batch_norm,
    torch.ops.aten._native_batch_norm_legit.no_stats: _batch_norm_without_statistics,
    torch.ops.aten._native_batch_norm_legit_no_training.default: _batch_norm,
    torch.ops.aten._batch_norm_with_update.default: _batch_norm,
    torch.ops.aten._batch_norm_no_update.default: _batch_norm,
    torch.ops.aten.native_layer_norm.default: _layer_norm,
    torch.ops.aten.native_group_norm.default: _group_norm,
    torch.ops.aten.native_group_norm_backward.default: _group_norm_backward,
    torch.ops.aten.mkldnn_rnn_layer.default: _rnn_layer,
}

_CPU_OUTPUTS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.native_batch_norm.default: _batch_norm_outputs,
    torch.ops.aten.native_batch_norm_backward.default: _batch_norm_backward_outputs,
    torch.ops.aten.batch_norm_backward.default: _batch_norm_backward_with_reserve_outputs,
}
