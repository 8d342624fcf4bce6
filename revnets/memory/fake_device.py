"""The dispatch mode under which a prediction's fake tensors act as the real device's tensors
(:mod:`revnets.memory.predict` runs a call under it): real tensors the call reaches outside its
arguments, scalars that keep their values, the CPU's own kernels' outputs and workspaces, and
views computed by the view kernels themselves."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)
from torch.utils.weak import WeakIdKeyDictionary

from revnets.facts.tensors import storage_key
from revnets.memory.call_arguments import rebuilt
from revnets.memory.cpu_kernels import CPU_KERNELS, CPU_OUTPUTS, UNKNOWN_KERNELS
from revnets.memory.fake_copies import (
    NUMBERS_KEPT,
    StandIns,
    is_cpu_scalar,
    replaced,
    scalar_to_fake,
)
from revnets.replay.watch import DEVICE_QUERY, operator_tensors

__all__ = ["LikeTheDevice", "layout_of"]

_CHECK_AND_UNSCALE = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
# Views whose fake outputs keep their input's dispatch keys (the fake mode's wrapping does).
_KEEP_DISPATCH_KEYS = (torch.ops.aten.alias.default, torch.ops.aten.detach.default)
_RESIZES = {getattr(op, overload) for op in (torch.ops.aten.resize_, torch.ops.aten.resize_as_,
                                               torch.ops.aten.set_)
            for overload in op.overloads()}
_SET_STORAGE = (torch.ops.aten.set_.source_Storage,
                torch.ops.aten.set_.source_Storage_storage_offset)


def layout_of(tensor: Tensor) -> tuple:
    """What a tensor is laid out as: a change to any of it (``param.data = ...``, ``.double()``,
    ``.to(memory_format=...)``) makes it another tensor to a prediction."""
    return (tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.device,
            storage_key(tensor))


# NOTE [ Real tensors in a prediction ]
# A prediction meets real tensors besides the fakes made of its arguments: tensors a closure holds
# (labels, a counter, a scheduler's or GradScaler's state) and scalars the call makes from numbers
# (``torch.tensor(0.0)``, ``torch.full((), 2.0)``: Adam's step counts, a GradScaler's scale).
# 1. Made from numbers, a scalar stays a real tensor, with its value (``.item()``, ``.numpy()``
#    and ``torch.save`` work on it; ASGD's ``mu = torch.ones(())``, a GradScaler's scale), and
#    so does any tensor of up to ``NUMBERS_KEPT`` elements made from numbers (positions
#    ``torch.arange(T)``, a mask of ones; not ``torch.empty``'s) and a tensor of integers or
#    booleans given as an argument (token ids, an attention mask, labels; ``keeps_values``):
#    code reads their values to choose its path, as transformers reads its position ids and
#    attention masks to skip a mask where nothing is masked, and then runs the kernels a real
#    run runs. Operators on real tensors alone that write nothing run for real: their outputs
#    are made in a real run too, and counted as there. (A deep copy of a real tensor puts new
#    memory under a fake one, ``set_``: refused by name.)
# 2. A real tensor is never written. The first operator that writes one gets a fake of it instead
#    (for a CPU scalar, a constant copy, so that its value still rises: Adam's
#    ``torch._foreach_add_(steps, 1)``), and that fake stands for it in every operator after. The
#    write's output, and a view of a written tensor, are real tensors over the user's memory, as
#    in a real run, so that the tracker counts that memory once; a view stands for the same view
#    of the fake. Fakes are held weakly: a real tensor lives as long as in a real run.
# 3. A real scalar read along with fakes joins as a constant, so that operators on constants
#    alone compute their values (the fake mode computes on constants for real).
# 4. What the call reads of a written tensor is the fake's value; read from the real tensor
#    directly (``.numpy()``), it is the value from before the call (for a scalar the call made
#    too). A write that changes a real tensor's shape (``unsqueeze_``, ``resize_``, ``set_``)
#    would have to change the user's tensor: refused by name.
# 5. A real leaf that requires gradients (a parameter of a module a closure holds) gets a fake
#    gradient from the backward; its gradient from before is put back after the call, and so is
#    the data of every real tensor the call met (``p.data = ...`` is no operator). An argument's
#    tensor reached through a closure stands for its copy; a gradient through it, or one changed
#    on it, is refused.
# 6. GradScaler's check for infinite gradients has no values to check; it is taken to find none
#    (its ``found_inf`` is left as it was, 0), so that the scaler steps the optimizer.
# 7. Nothing of the prediction's own holds a fake of an argument's tensor while the call runs
#    (``StandIns``, the copy memo, the predictor's fakes kept for the next prediction, all weak
#    or dropped), so that one the call drops is freed when the real run frees its tensor: a
#    buffer reassigned (``self.ema = self.ema * m + ...``), a tensor a module keeps between
#    steps (its last output) and lets go of in this one. Where something else holds the real
#    tensor (a list of the user's, a ``state_dict()``, a view: ``held_elsewhere``), the real
#    run keeps it, and the prediction holds its fake to the end. A real module a closure holds
#    that the call gives a fake parameter or buffer gets its own back after the call
#    (``real_modules_kept``).


# Factories whose values are not given: what they allocate stays fake.
_UNFILLED = (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_permuted,
             torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided)


def _made_from_numbers(func: Any, out: FakeTensor) -> bool:
    """Whether an operator's output, made from numbers alone, is a real tensor (NOTE [ Real
    tensors in a prediction ], 1)."""
    if out.dim() == 0 and out.is_cpu:
        return True
    return (func.overloadpacket not in _UNFILLED and out.device.type != "meta"
            and out.layout is torch.strided and 0 < out.numel() <= NUMBERS_KEPT)


class LikeTheDevice(TorchDispatchMode):
    """Where fake tensors would behave unlike real ones, in ways the code can see.

    - Fake kernels draw no random numbers, but code that decides whether to keep a generator's
      state (a checkpoint replaying dropout) looks at whether the generator moved. One real draw
      per random operator makes it move as in a real run; :meth:`Predictor.predict` restores the
      default generators after, and :meth:`restore` every other one drawn from (a layer's own
      ``torch.Generator``).
    - Operators on real tensors alone (a generator's state, kept aside) run for real, but never
      write a real tensor.
    - Real tensors are never written, and scalars keep their values: NOTE [ Real tensors in
      a prediction ].
    """

    def __init__(
        self, mode: FakeTensorMode, device: torch.device, stand_ins: StandIns
    ) -> None:
        super().__init__()
        self.mode = mode
        self.device = device if device.type in ("cpu", "cuda") else torch.device("cpu")
        # A real tensor and the fake that stands for it in every operator: the copy of an
        # argument's (a model's weight a closure reaches too), or a fake that took a write and
        # every later read. Held weakly: a real tensor's memory lives as long as in a real run.
        self.stand_ins = stand_ins
        self.written = _Written(stand_ins)
        # A real scalar read along with fake tensors, and its constant.
        self.constants: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Real tensors the call met (a closure's, and the arguments' own), with what is put
        # back after it: an alias of their data (``p.data = ...`` replaces it) and their
        # gradient (the backward gives a closure's parameters fakes; ``zero_grad`` drops them).
        self.met: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t, _ in stand_ins.items():
            self._meet(t)
        # Generators drawn from by name, with their states before the call.
        self.generators: dict[int, tuple[torch.Generator, Tensor]] = {}

    def active(self) -> bool:
        """Whether this thread is inside the prediction."""
        return any(m is self for m in _get_current_dispatch_mode_stack())

    def _meet(self, t: Tensor) -> None:
        if t not in self.met:
            with _disable_current_modes():
                self.met[t] = (t.detach(), t.grad if t.is_leaf else None)

    def restore(self) -> list[Tensor]:
        """Put back the data and gradients of the real tensors the call met; return the
        arguments' tensors whose gradients it changed (through a closure)."""
        for generator, state in self.generators.values():
            generator.set_state(state)
        changed = []
        for t, (data, grad) in list(self.met.items()):
            if layout_of(t) != layout_of(data):
                t.data = data
            if t.is_leaf and t.grad is not grad:
                t.grad = grad
                if t in self.stand_ins:
                    changed.append(t)
        return changed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_QUERY:  # NOTE [ Device queries ]
            return args[0].device if isinstance(args[0], FakeTensor) else func(*args, **kwargs)
        tensors = operator_tensors(args, kwargs)
        if func in UNKNOWN_KERNELS:
            raise ValueError(
                f"predict_memory: {UNKNOWN_KERNELS[func]}, so its memory cannot be predicted; "
                f"measure the step with measure_memory instead"
            )
        for t in tensors:
            if not isinstance(t, FakeTensor):
                # A view's gradient goes to its base (a tied weight's ``.T`` made beforehand).
                leaf = t if t.is_leaf or t._base is None else t._base
                self._meet(t)
                self._meet(leaf)
                if (leaf.requires_grad and leaf in self.stand_ins and torch.is_grad_enabled()
                        and func is not torch.ops.aten.detach.default):
                    raise ValueError(
                        f"predict_memory: the call computes gradients through a tensor of an "
                        f"argument (shape {tuple(leaf.shape)}) that it reaches another way (a "
                        f"closure), which in a prediction is another leaf than the argument's "
                        f"copy; reach it through the argument (model.weight of the model passed)"
                    )
        if (func in _SET_STORAGE and isinstance(args[0], FakeTensor)
                and args[1].device.type != "meta"):
            raise ValueError(
                "predict_memory: the call puts a real tensor's memory under a new tensor "
                "(aten.set_, as copy.deepcopy or a storage copy of a tensor does), which a "
                "prediction cannot follow without writing it; copy tensors with .clone() in the "
                "predicted call"
            )
        written = self._real_ones_written(func, args, kwargs) if func._schema.is_mutable else []
        if written or (self.written and any(t in self.written for t in tensors)):
            real_args, real_kwargs = args, kwargs
            args, kwargs = replaced(args, self.written), replaced(kwargs, self.written)
            if written and (torch.Tag.inplace_view in func.tags or func in _RESIZES):
                raise ValueError(
                    f"predict_memory: the call changes the shape of a tensor it reaches outside "
                    f"its arguments ({func}, shape {tuple(written[0].shape)}), which a prediction "
                    f"cannot do without changing the user's tensor; pass it as an argument, or "
                    f"change a copy of it"
                )
            if written:
                out = self._as_real(self.__torch_dispatch__(func, types, args, kwargs), written)
                if func is _CHECK_AND_UNSCALE:
                    self.written.forget(real_args[1])  # NOTE [ Real tensors in a prediction ], 6
                return out
            if func.is_view and not any(isinstance(t, FakeTensor) for t in tensors):
                # A view of a written tensor is a view of the user's, as in a real run (its
                # memory counted once), that stands for the same view of the fake.
                out = self.__torch_dispatch__(func, types, args, kwargs)
                with _disable_current_modes():
                    real = func(*real_args, **real_kwargs)
                for r, f in zip(operator_tensors(real), operator_tensors(out)):
                    self.written[r] = f
                return real
            tensors = operator_tensors(args, kwargs)
        fakes = [isinstance(t, FakeTensor) for t in tensors]
        if tensors and not func._schema.is_mutable and not any(fakes):
            # Only real tensors in, nothing written: what the real run computes, computed (a
            # generator's state kept aside by a checkpoint must stay a real one to restore; a
            # scalar ``torch.tensor(2.0)`` makes stays a real one to save or turn to numpy).
            with _disable_current_modes():
                return func(*args, **kwargs)
        if not all(fakes) and any(is_cpu_scalar(t) for t in tensors):
            # A real scalar (``torch.tensor(1.0)`` added to Adam's step counts) joins as a
            # constant, so that operators on constants alone still compute their values.
            for t in tensors:
                if is_cpu_scalar(t) and not isinstance(t, FakeTensor):
                    self._fake_of(t, self.constants)
            args, kwargs = replaced(args, self.constants), replaced(kwargs, self.constants)
            tensors = operator_tensors(args, kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.get("generator")
            with _disable_current_modes():
                device = generator.device if generator is not None else self.device
                if generator is not None and id(generator) not in self.generators:
                    # One the call holds (a layer's own): put back by restore().
                    self.generators[id(generator)] = (generator, generator.get_state())
                torch.empty(1, device=device).uniform_(generator=generator)
            return func(*args, **kwargs)
        on_cpu = all(t.device.type == "cpu" for t in tensors)  # the kernel that would run
        if on_cpu and func in CPU_OUTPUTS and self._ours(
            [t for t in tensors if isinstance(t, FakeTensor)]
        ):  # real tensors among them (statistics a closure holds) are read for their sizes
            out = CPU_OUTPUTS[func](*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func.is_view and not func._schema.is_mutable:
            out = self._view(func, args, kwargs, tensors)
        elif func._schema.is_mutable:
            out = self._uncached(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
            if isinstance(out, Tensor) and out.layout is not torch.strided:
                raise ValueError(
                    f"predict_memory: the call makes a {out.layout} tensor ({func}: a sparse "
                    f"gradient, nn.Embedding(sparse=True), say), whose number of entries depends "
                    f"on values, which a prediction does not compute; measure the step with "
                    f"measure_memory, or use dense gradients"
                )
        if on_cpu and func in CPU_KERNELS:
            return CPU_KERNELS[func](out, args, kwargs)
        if not tensors and isinstance(out, FakeTensor) and _made_from_numbers(func, out):
            # NOTE [ Real tensors in a prediction ], 1: made from numbers.
            with _disable_current_modes():
                return func(*args, **kwargs)
        return out

    def _real_ones_written(self, func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
        """The real tensors the operator writes (a counter a closure holds,
        ``counter.add_(1)``), each given a fake in ``self.written`` that takes the write in its
        place: the fake mode would write the user's tensor itself (it computes on real CPU
        tensors as constants)."""
        found: list[Tensor] = []
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = (args[i] if i < len(args) and not argument.kwarg_only
                     else kwargs.get(argument.name))
            # Written tensors or lists of them, where schemas nest; no recursive closure (a
            # reference cycle would keep the tensors alive past their time).
            for t in operator_tensors((value,)):
                if not isinstance(t, FakeTensor):
                    self._fake_of(t, self.written)
                    found.append(t)
        return found

    def _fake_of(self, real: Tensor, fakes: WeakIdKeyDictionary | _Written) -> None:
        """Make the fake that stands for ``real`` in ``fakes``, once. Scalars keep their values
        (Adam's step counts, which ``torch._foreach_add_`` raises and ``.item()`` reads), in a
        copy."""
        if real not in fakes:
            with _disable_current_modes():
                fakes[real] = (scalar_to_fake(real, self.mode) if is_cpu_scalar(real)
                               else self.mode.from_tensor(real, static_shapes=True))

    def _as_real(self, value: Any, written: list[Tensor]) -> Any:
        """An operator's output, the fakes of the user's tensors it wrote given back as theirs."""
        if isinstance(value, FakeTensor):
            return next((real for real in written if self.written.get(real) is value), value)
        if isinstance(value, (list, tuple)):
            return rebuilt(value, (self._as_real(v, written) for v in value))
        return value

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
        if len(tensors) == 1 and func not in _KEEP_DISPATCH_KEYS:
            # A view of one fake tensor is on its device: what the fake mode's wrapping finds,
            # without its search of the arguments for a common device (a windowed transformer's
            # operators are largely views).
            fake = functools.partial(self.mode.fake_tensor_converter.from_meta_and_device,
                                     self.mode, device=tensors[0].device)
            return fake(out) if isinstance(out, Tensor) else rebuilt(out, map(fake, out))
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


class _Written:
    """Real tensors and the fakes that take their writes and every later read: fakes made for a
    write held as long as their real tensor lives, the arguments' stand-ins weakly (NOTE [ Real
    tensors in a prediction ], 2 and 7)."""

    def __init__(self, stand_ins: StandIns) -> None:
        self.made = WeakIdKeyDictionary()
        self.stand_ins = stand_ins

    def get(self, real: Tensor, default: Any = None) -> Any:
        fake = self.made.get(real)
        return fake if fake is not None else self.stand_ins.get(real, default)

    def __contains__(self, real: Tensor) -> bool:
        return real in self.made or real in self.stand_ins

    def __setitem__(self, real: Tensor, fake: Tensor) -> None:
        self.made[real] = fake

    def __bool__(self) -> bool:
        return bool(self.made) or bool(self.stand_ins)

    def forget(self, real: Tensor) -> None:
        self.made.pop(real, None)
