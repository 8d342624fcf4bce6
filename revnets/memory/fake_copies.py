"""Fake copies of what a prediction is given, and the training state it reaches otherwise.

:mod:`revnets.memory.predict` runs a call on fake tensors. Tensors, optimizers, learning-rate
schedulers and GradScalers among its arguments are copied here over fake tensors, so the call
steps the copies; optimizers and schedulers it reaches any other way (a closure) are kept as
found. The arguments' tensors stand in for the real ones where the call reaches those otherwise
(NOTE [ Real tensors in a prediction ] in fake_device.py has the tensors' rules).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from revnets.facts import storage_uses
from revnets.memory.call_arguments import rebuilt
from revnets.replay.held import modules_held, reached
from revnets.replay.state import own_attributes


def is_cpu_scalar(tensor: Tensor) -> bool:
    return tensor.dim() == 0 and tensor.device.type == "cpu" and not isinstance(
        tensor, nn.Parameter)


NUMBERS_KEPT = 2**24  # elements: NOTE [ Real tensors in a prediction ], 1, in fake_device.py


def keeps_values(tensor: Tensor) -> bool:
    """Whether a tensor of integers or booleans stays real in a prediction, its values
    computed (NOTE [ Real tensors in a prediction ], 1, in fake_device.py)."""
    return (not tensor.is_floating_point() and not tensor.is_complex()
            and tensor.device.type != "meta" and tensor.layout is torch.strided
            and 0 < tensor.numel() <= NUMBERS_KEPT)


def scalar_to_fake(tensor: Tensor, mode: FakeTensorMode) -> Tensor:
    """Scalars keep their value (optimizers read their step counts with ``.item()``), in a
    copy: the fake mode computes on a constant for real, in place too (``step += 1``), and the
    original is the user's."""
    return mode.fake_tensor_converter.from_real_tensor(mode, tensor.clone(), make_constant=True)


def sole_fake(tensor: Tensor, mode: FakeTensorMode) -> Tensor | None:
    """A fake of ``tensor`` made directly over meta memory of its size, where it is a plain
    tensor or parameter that alone holds all of its storage: what the fake mode's conversion
    makes of it (a parameter being a fake tensor marked as one, as ``nn.Parameter`` marks a
    subclass), at a thirtieth of the cost (the conversion describes the tensor and its storage
    in Python, and a parameter's copy clones and detaches it through the fake mode: 0.4 ms a
    parameter, most of a large model's first prediction). None for any other tensor: a view, a
    storage something else holds too (tied by storage, a ``state_dict()`` alias), a subclass,
    a layout or device of its own, which the fake mode converts, keeping what they share."""
    if type(tensor) not in (Tensor, nn.Parameter) or not tensor.is_leaf or tensor.is_meta \
            or tensor.layout is not torch.strided or tensor.device.type not in ("cpu", "cuda") \
            or tensor._base is not None or tensor.storage_offset() \
            or tensor.is_quantized or tensor.is_conj() or tensor.is_neg() \
            or is_cpu_scalar(tensor):
        return None
    storage, nbytes = tensor.untyped_storage(), tensor.numel() * tensor.element_size()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    if storage.nbytes() != nbytes or (nbytes and extent * tensor.element_size() != nbytes) \
            or torch._C._storage_Use_Count(storage._cdata) != _LONE_STORAGE:
        return None  # a storage of other size than its tensor, or elements that overlap
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    fake = FakeTensor(mode, meta, tensor.device)
    if tensor.requires_grad:
        fake.requires_grad_()
    if isinstance(tensor, nn.Parameter):
        fake._is_param = True
    return fake


def _lone_storage_count() -> int:
    """The use count of a storage only its tensor holds, seen with one Python storage object
    of it alive (as ``sole_fake`` sees it)."""
    tensor = torch.empty(1)
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata)


_LONE_STORAGE = _lone_storage_count()


def tensor_to_fake(tensor: Tensor, mode: FakeTensorMode, device: torch.device) -> Tensor:
    if tensor.is_meta and device.type != "meta":
        # A meta input stands for one on the model's device (a batch too large to allocate).
        fake = mode.fake_tensor_converter.from_meta_and_device(mode, tensor, device)
        return fake.requires_grad_(tensor.requires_grad) if tensor.is_leaf else fake
    if is_cpu_scalar(tensor):
        return scalar_to_fake(tensor, mode)
    return mode.from_tensor(tensor, static_shapes=True)


def scalars_held(module: nn.Module) -> list[Tensor]:
    """The CPU scalars ``module`` and its submodules hold (buffers, plain attributes, in
    lists, dicts and plain objects: NOTE [ What a module holds ]), whose values code reads
    (``float(self.scales[0])``) and a fake copy keeps (``scalar_to_fake``)."""
    found, seen = [t for t in module.buffers() if is_cpu_scalar(t)], set()
    for m in module.modules():
        own = vars(m)
        found += [v for key in own_attributes(tuple(own)) for _, v in reached(own[key], seen)
                  if isinstance(v, Tensor) and is_cpu_scalar(v)]
    return found


def module_copy_seeded(module: nn.Module, memo: dict[int, Any], mode: FakeTensorMode) -> None:
    """Enter in the ``memo`` of a fake deep copy of ``module`` what the copy takes as found or
    makes faster than ``copy.deepcopy`` would, for every module it copies (those held
    unregistered too: a planned model's chain of a few thousand steps):

    - every generator, as itself: a generator holds no tensor memory, a fake run draws nothing
      from it (fake tensors have no values), and its state cannot be copied over fake tensors;
    - new empty dicts and sets for the empty ones (most hook registries), as the copy would make
      them: its generic path takes tens of microseconds for each (MaxViT-T's planned chain: 0.38
      to 0.2 s of copying per prediction, timed by hand);
    - the fakes of parameters and buffers: made directly for those that hold their storage
      alone (``sole_fake``), by the fake mode for the others, which keeps what they share. A
      parameter's own deep copy clones it, and its clone holds no more than itself: a
      parameter over a slice of a larger storage, or a buffer viewing a parameter, was
      predicted with other memory than the step holds."""
    modules, generators = modules_held(module)
    memo.update((id(g), g) for g in generators)
    for m in modules:
        for value in vars(m).values():
            if type(value) in _EMPTY_COPIES and not value and id(value) not in memo:
                memo[id(value)] = type(value)()
        for table in (m._parameters, m._buffers):
            for tensor in table.values():
                if tensor is not None and id(tensor) not in memo \
                        and type(tensor) in (Tensor, nn.Parameter):
                    fake = sole_fake(tensor, mode)
                    memo[id(tensor)] = fake if fake is not None else _converted(tensor, mode)


_EMPTY_COPIES = (dict, collections.OrderedDict, set)


def _converted(tensor: Tensor, mode: FakeTensorMode) -> Tensor:
    """The fake mode's copy of a parameter or buffer that shares its storage. A parameter is
    converted through a new alias: the mode remembers a fake by the tensor object, and a
    parameter keeps its object when its data changes (``module.double()``, ``p.data = ...``),
    so converted as itself, a second prediction got the first one's fake."""
    if not isinstance(tensor, nn.Parameter):
        return mode.from_tensor(tensor, static_shapes=True)
    fake = mode.from_tensor(tensor.detach(), static_shapes=True)
    fake.requires_grad_(tensor.requires_grad)
    fake._is_param = True
    return fake


def optimizer_to_fake(
    optimizer: torch.optim.Optimizer, mode: FakeTensorMode, memo: dict[int, Any]
) -> torch.optim.Optimizer:
    """The same optimizer over the fake copies of its parameters, with its state.

    A shallow copy rather than a new instance: constructors differ (AdamW's defaults hold a key
    its constructor does not take), and some create state. Its attributes are the real one's
    (hooks, a fused optimizer's ``_step_supports_amp_scaling``, a subclass's own), lists and
    dicts copied with parameters mapped to their fakes (LBFGS's ``_params``).
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
    for name, value in vars(optimizer).items():
        if name not in ("param_groups", "state", "step", "defaults"):
            setattr(fake, name, _parameters_mapped(value, memo))
    fake.param_groups = groups
    fake.state = collections.defaultdict(dict)
    for p, state in optimizer.state.items():
        fake.state[memo[id(p)]] = {
            k: tensor_to_fake(v, mode, v.device) if isinstance(v, Tensor) else v
            for k, v in state.items()
        }
    if hasattr(vars(optimizer).get("step"), "_wrapped_by_lr_sched"):
        # A scheduler wrapped the real one's step to see it called (and warn otherwise); the
        # copy's own, seen the same way.
        fake.step = _step_seen_by_schedulers(weakref.ref(fake))
    _COPIES.add(fake)
    return fake


# Every optimizer copy a prediction made (a prediction inside another steps its own).
_COPIES: weakref.WeakSet = weakref.WeakSet()


def _parameters_mapped(value: Any, memo: dict[int, Any]) -> Any:
    if isinstance(value, (list, tuple)):
        return rebuilt(value, (memo.get(id(v), v) for v in value))
    if isinstance(value, dict):
        copied = copy.copy(value)  # its type kept (an OrderedDict of hooks)
        copied.update((k, memo.get(id(v), v)) for k, v in value.items())
        return copied
    return value


def _step_seen_by_schedulers(optimizer: weakref.ref) -> Callable[..., Any]:
    def step(*args: Any, **kwargs: Any) -> Any:
        optimizer()._opt_called = True
        return type(optimizer()).step(optimizer(), *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


def scheduler_to_fake(scheduler: LRScheduler, memo: dict[int, Any]) -> LRScheduler:
    if id(scheduler.optimizer) not in memo:
        raise ValueError(
            "predict_memory: pass the optimizer a learning-rate scheduler steps before the "
            "scheduler in the argument list"
        )
    return copy.deepcopy(scheduler, memo)  # over the optimizer's copy, found in the memo


def scaler_to_fake(
    scaler: torch.amp.GradScaler, to_fake: Callable[[Any], Any]
) -> torch.amp.GradScaler:
    """Its scale is made on first use, and changed by every step: a copy, with its own."""
    fake = copy.copy(scaler)
    fake._scale, fake._growth_tracker = to_fake(scaler._scale), to_fake(scaler._growth_tracker)
    fake._per_optimizer_states = copy.deepcopy(scaler._per_optimizer_states)
    return fake


@contextlib.contextmanager
def real_modules_kept(predicting: Callable[[], bool]) -> Iterator[None]:
    """A real module's parameter or buffer that the call replaces with a fake (a loss module a
    closure holds, keeping a running centre: ``self.center = 0.9 * self.center + ...``) is
    put back after it; it stays the fake for the rest of the call, as the real run's module
    holds the new tensor. An assignment is no operator, which LikeTheDevice would see."""
    found: list[tuple[dict, str, Tensor]] = []

    def kept(table: str) -> Callable[[nn.Module, str, Any], None]:
        def hook(module: nn.Module, name: str, value: Any) -> None:
            old = getattr(module, table).get(name)
            if (isinstance(value, FakeTensor) and isinstance(old, Tensor)
                    and not isinstance(old, FakeTensor) and predicting()):
                found.append((getattr(module, table), name, old))

        return hook

    handles = [register_module_buffer_registration_hook(kept("_buffers")),
               register_module_parameter_registration_hook(kept("_parameters"))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for table, name, old in reversed(found):  # the first one found last: as before the call
            table[name] = old


# Optimizers whose step reads tensors' values (NOTE [ Real tensors in a prediction ]: a fake
# tensor has none), refused by name: what each reads.
_STEPS_READ_VALUES = {
    torch.optim.LBFGS: "reads values with .item() (its line search and convergence tests)",
    torch.optim.Adafactor: "reads its step count's value with .item()",
}


@contextlib.contextmanager
def kept_as_found(
    optimizers: list[torch.optim.Optimizer], predicting: Callable[[], bool]
) -> Iterator[None]:
    """The real ``optimizers`` (given as arguments, so copied) and the schedulers that step
    them, as they were before the call, whatever a closure did to them (a scheduler stepped).
    An optimizer step in the call other than a prediction's copy is refused: one a closure
    holds would step the user's parameters and state, not the prediction's."""
    schedulers = [s for o in optimizers for s in _schedulers_of(o)]
    groups = [[dict(group) for group in o.param_groups] for o in optimizers]
    # What they refer to stays itself; their own lists and numbers, as they are now.
    memo: dict[int, Any] = {id(x): x for x in (*optimizers, *schedulers)}
    attributes = [copy.deepcopy(vars(s), memo) for s in schedulers]

    def refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        reads = next((why for kind, why in _STEPS_READ_VALUES.items()
                      if isinstance(optimizer, kind)), None)
        if reads is not None and predicting():
            raise ValueError(
                f"predict_memory: the call steps torch.optim.{type(optimizer).__name__}, whose "
                f"step {reads}, which a prediction on fake tensors does not compute; measure it "
                f"with revnets.measure_memory instead, or predict it with another optimizer"
            )
        if optimizer not in _COPIES and predicting():
            raise ValueError(
                f"predict_memory: the call steps a {type(optimizer).__name__} it reaches "
                f"outside its arguments, which would update the real parameters and state, not "
                f"the prediction's; pass the model and then the optimizer as arguments"
            )

    handle = register_optimizer_step_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()
        for optimizer, found in zip(optimizers, groups):
            for group, old in zip(optimizer.param_groups, found):
                group.clear()
                group.update(old)
        for scheduler, found in zip(schedulers, attributes):
            vars(scheduler).clear()
            vars(scheduler).update(found)


def _schedulers_of(optimizer: torch.optim.Optimizer) -> list[LRScheduler]:
    """The learning-rate schedulers that hold ``optimizer`` (they are what refers to it)."""
    found = []
    for holder in gc.get_referrers(optimizer):
        if isinstance(holder, LRScheduler):
            found.append(holder)
        elif type(holder) is dict and holder.get("optimizer") is optimizer:
            # An instance's __dict__ (Python 3.10 reports the dict, not the instance).
            found += [s for s in gc.get_referrers(holder)
                      if isinstance(s, LRScheduler) and vars(s) is holder]
    return found


class StandIns:
    """The argument modules' parameters and buffers, each with the fake that stands for it where
    the call reaches it some other way (a closure). Both are held weakly: a fake the call drops
    (a buffer it reassigns) is freed where the real one would be (NOTE [ Real tensors in a
    prediction ], 7 in fake_device.py)."""

    def __init__(self) -> None:
        self._fakes = WeakIdKeyDictionary()

    def __setitem__(self, real: Tensor, fake: Tensor) -> None:
        self._fakes[real] = weakref.ref(fake)

    def get(self, real: Tensor, default: Any = None) -> Any:
        held = self._fakes.get(real)
        fake = held() if held is not None else None
        return default if fake is None else fake

    def __contains__(self, real: Tensor) -> bool:
        return self.get(real) is not None

    def __bool__(self) -> bool:
        return bool(self._fakes)

    def items(self) -> list[tuple[Tensor, Tensor]]:
        return [(real, fake) for real in list(self._fakes.keys())
                if (fake := self.get(real)) is not None]


def held_elsewhere(owners: list[Any], own: list[Tensor]) -> set[int]:
    """The ids of the argument modules' tensors (parameters, buffers, tensor attributes, the
    parameters' gradients) that something besides those modules holds: a list of the user's
    or an optimizer (the Python object), a view or ``state_dict()``'s detached alias (the
    storage), autograd's graph (the tensor itself, in C++); ``own``: what the predictor holds
    of them. Dropped by its module in the call, such a tensor stays alive in the real run, and
    its fake is held through the prediction too (NOTE [ Real tensors in a prediction ], 7, in
    fake_device.py). Counted from reference counts against those of a tensor only a dict (a
    gradient: its parameter) holds, on the same path (the interpreter's own references
    cancel); a holder missed errs towards holding the fake: the safe side."""
    slots: collections.Counter[int] = collections.Counter(id(t) for t in own)
    tensors: dict[int, Tensor] = {}
    grads: dict[int, Tensor] = {}  # held by their parameters, not by a module's tables
    for owner in owners:
        if not isinstance(owner, nn.Module):
            continue
        for m in owner.modules():
            for table in (m._parameters, m._buffers, vars(m)):
                for value in table.values():
                    if isinstance(value, Tensor):
                        slots[id(value)] += 1
                        tensors[id(value)] = value
            grads.update((id(p.grad), p.grad) for p in m._parameters.values()
                         if p is not None and p.grad is not None)
    python, tensor, storage = _references({0: torch.empty(())})[0]
    held = {key for key, (p, t, s) in _references(tensors).items()
            if p - slots[key] > python or t > tensor or s > storage}
    probe = nn.Parameter(torch.empty(()))
    probe.grad = torch.empty(())
    python, tensor, storage = _references({0: probe.grad})[0]
    return held | {key for key, (p, t, s) in _references(grads).items()
                   if p > python or t > tensor or s > storage}


def _references(tensors: dict[int, Tensor]) -> dict[int, tuple[int, int, int]]:
    return {key: (sys.getrefcount(t), t._use_count(), storage_uses(t))
            for key, t in tensors.items()}




def stand_ins_of(owners: list[Any], memo: dict[int, Any]) -> StandIns:
    """The argument modules' parameters and buffers and their fakes (made into ``memo``)."""
    found = StandIns()
    for owner in owners:
        if isinstance(owner, nn.Module):
            for t in (*owner.parameters(), *owner.buffers()):
                if id(t) in memo:
                    found[t] = memo[id(t)]
    return found


def replaced(value: Any, fakes: Any) -> Any:
    """``value`` (an operator's arguments) with each real tensor in ``fakes`` replaced by its
    fake."""
    if isinstance(value, Tensor):
        return fakes.get(value, value)
    if isinstance(value, (list, tuple)):
        return rebuilt(value, (replaced(v, fakes) for v in value))
    if isinstance(value, dict):
        return {k: replaced(v, fakes) for k, v in value.items()}
    return value
