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
  counts (``.item()``): NOTE [ Real tensors in a prediction ].

Modules and optimizers among the arguments are copied with one copy memo, so parameters a model
shares between its layers (tied embeddings) stay one parameter, as they are one storage for the
real run. :class:`revnets.memory.MemoryTracker` then counts the fake storages as it counts real
ones.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeCopyMode,
    FakeTensorMode,
)

from revnets.memory.call_arguments import device_of, owners_in, rebuilt, refuse_uninitialised
from revnets.memory.fake_copies import (
    held_elsewhere,
    is_cpu_scalar,
    keeps_values,
    kept_as_found,
    module_copy_seeded,
    optimizer_to_fake,
    real_modules_kept,
    scalar_to_fake,
    scalars_held,
    scaler_to_fake,
    scheduler_to_fake,
    sole_fake,
    stand_ins_of,
    tensor_to_fake,
)
from revnets.memory.fake_device import LikeTheDevice, layout_of
from revnets.memory.measure import MemoryReport, Watch, measure_call
from revnets.replay.state import forked_rng

__all__ = ["Predictor", "predict_call", "predict_memory"]


def predict_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Predict the peak memory of ``fn(*args, **kwargs)`` without computing anything.

    Modules, optimizers and tensors among the arguments are copied to fake tensors on their own
    device (the originals are left alone), then the call is measured there, as
    :func:`revnets.measure_memory` measures it. ``fn`` must not read tensor values (printing,
    data-dependent control flow); reading scalars made from Python numbers (an optimizer's step
    count) is fine. For very large models, build the model on the meta device to begin with
    (``with torch.device("meta"): ...``): it is then predicted with the meta device's kernels.
    """
    return predict_call(fn, args, kwargs)


def predict_call(
    fn: Callable[..., Any], args: tuple, kwargs: dict, watch: Watch | None = None
) -> MemoryReport:
    """predict_memory's work, with ``watch`` as :func:`~revnets.memory.measure.measure_call`
    takes it (a timeline's)."""
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

    def __init__(self, held: set[int] | None = None) -> None:
        # The ids of the arguments' tensors something else holds (held_elsewhere), where known
        # before the caller took references of its own (a planner's); else counted per call.
        self.held = held
        # A tensor the call reaches outside its arguments (a closure) is made fake on first use.
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        # id(real): (real, fake, the real one's layout when made): ``param.data = ...`` and
        # ``module.double()`` or ``.to(memory_format=...)`` change a tensor under the same object.
        self._made: dict[int, tuple[Tensor, Tensor, tuple]] = {}
        self._hooks: list[Any] = []  # handles of the parameters' hooks, on their fakes

    def predict(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, watch: Watch | None = None
    ) -> MemoryReport:
        owners = owners_in(args, kwargs)
        refuse_uninitialised("predict_memory", owners)
        held = self.held if self.held is not None else held_elsewhere(
            owners, [real for real, _, _ in self._made.values()])
        # A call that takes no tensors (a closure) makes fakes of its tensors on their devices.
        device = device_of(owners, args, kwargs) or torch.device("cpu")
        memo: dict[int, Any] = {key: fake for key, (real, fake, layout) in self._made.items()
                                if layout_of(real) == layout}
        fake_args = tuple(self._to_fake(a, memo, device) for a in args)
        fake_kwargs = {k: self._to_fake(v, memo, device) for k, v in kwargs.items()}
        mode = self.mode
        optimizers = [o for o in owners if isinstance(o, torch.optim.Optimizer)]
        like = LikeTheDevice(mode, device, stand_ins_of(owners, memo))
        # The fakes the call is given are held by its arguments alone while it runs, and those
        # of tensors something else holds (NOTE [ Real tensors in a prediction ], 7, in
        # fake_device.py).
        pinned = [fake for key, fake in memo.items() if key in held]  # noqa: F841
        del memo
        weak = {key: (real, weakref.ref(fake), layout)
                for key, (real, fake, layout) in self._made.items()}
        self._made = {}
        try:
            with (kept_as_found(optimizers, like.active), real_modules_kept(like.active),
                  forked_rng(device), mode, like):
                report = measure_call(fn, fake_args, fake_kwargs, predicted=True, watch=watch,
                                      stand_ins=like.stand_ins)
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            raise ValueError(
                f"predict_memory: the call reads the value of a tensor ({error.func}: .item(), "
                f".tolist(), bool() or a shape that depends on values), which a prediction "
                f"does not compute (only scalars made from numbers keep theirs); keep such "
                f"reads out of the predicted call, or measure it with measure_memory"
            ) from error
        finally:
            # Those the call kept (not a buffer it reassigned) serve the next prediction.
            self._made = {key: (real, fake, layout) for key, (real, ref, layout) in weak.items()
                          if (fake := ref()) is not None}
            changed = like.restore()
            # Autocast keeps the casts of leaf tensors (weights) until its outermost region
            # ends: inside a user's region, the next prediction with the same fake weights
            # would find them cast already, and leave out the casts a step makes (a plan of a
            # bf16 transformer was predicted low, and went over its budget). The user's own
            # casts go too, to be made again.
            torch.clear_autocast_cache()
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
        if changed:
            raise ValueError(
                f"predict_memory: the call changed the gradients of {len(changed)} tensors of its "
                f"arguments, reaching them another way (a closure: zero_grad on the model it "
                f"was given, or a view made before the call); they are put back. Reach them "
                f"through the arguments"
            )
        return report

    def _to_fake(self, obj: Any, memo: dict[int, Any], device: torch.device) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        mode = self.mode
        if isinstance(obj, nn.Module):
            # Scalars it holds (batch norm's num_batches_tracked, a number in a list) keep their
            # values, made anew for every prediction: code reads them (momentum=None), and the
            # run changes them.
            memo.update((id(b), scalar_to_fake(b, mode)) for b in scalars_held(obj)
                        if id(b) not in memo)
            module_copy_seeded(obj, memo, mode)
            with FakeCopyMode(mode):
                fake = copy.deepcopy(obj, memo)
            self._made_once(obj.named_buffers(remove_duplicate=False),
                            fake.named_buffers(remove_duplicate=False))
            for old, new in self._made_once(obj.named_parameters(remove_duplicate=False),
                                            fake.named_parameters(remove_duplicate=False)):
                # Gradients left from an earlier step are alive until zero_grad, or accumulate.
                # Made anew for each prediction: ``module.double()`` changes a gradient under
                # the same object.
                new.grad = None if old.grad is None else self._grad_to_fake(old.grad, memo)
                new.requires_grad_(old.requires_grad)
                # Its hooks (a gradient freed once accumulated, an optimizer run in the
                # backward), for this prediction.
                self._hooks += [new.register_hook(hook)
                                for hook in (old._backward_hooks or {}).values()]
                self._hooks += [new.register_post_accumulate_grad_hook(hook) for hook in
                                (getattr(old, "_post_accumulate_grad_hooks", None) or {}).values()]
        elif isinstance(obj, torch.optim.Optimizer):
            fake = optimizer_to_fake(obj, mode, memo)
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            fake = scheduler_to_fake(obj, memo)
        elif isinstance(obj, torch.amp.GradScaler):
            fake = scaler_to_fake(obj, lambda t: self._to_fake(t, memo, device))
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
            # Token ids, masks, labels stay real: NOTE [ Real tensors in a prediction ], 1.
            fake = obj if keeps_values(obj) else tensor_to_fake(obj, mode, device)
        elif isinstance(obj, (list, tuple)):
            fake = rebuilt(obj, (self._to_fake(o, memo, device) for o in obj))
        elif isinstance(obj, dict):
            fake = {k: self._to_fake(v, memo, device) for k, v in obj.items()}
        else:
            return obj
        memo[id(obj)] = fake
        return fake

    def _grad_to_fake(self, grad: Tensor, memo: dict[int, Any]) -> Tensor:
        """The fake of a parameter's gradient, once for a tensor on several parameters or also
        an argument."""
        if id(grad) not in memo:
            fake = sole_fake(grad, self.mode)
            memo[id(grad)] = fake if fake is not None else self.mode.from_tensor(
                grad.detach(), static_shapes=True)
        return memo[id(grad)]

    def _made_once(
        self, real: Iterator[tuple[str, Tensor]], fake: Iterator[tuple[str, Tensor]]
    ) -> list[tuple[Tensor, Tensor]]:
        """Pairs of a module's tensors and their fake copies, remembered for the next
        prediction."""
        pairs = [(old, new) for (_, old), (_, new) in zip(real, fake)]
        self._made.update((id(old), (old, new, layout_of(old))) for old, new in pairs
                          if not is_cpu_scalar(old))
        return pairs
