"""Operators as a chain's profile runs them on the meta device: every tensor they read or make a
meta one, batch norm's outputs as the CPU's kernel makes them, and each signature run once: the
meta kernels of many operators are Python (torch's references and meta registrations: 0.1 to
0.5 ms each, against microseconds for the C++ ones), and a chain repeats a few signatures many
times (a recurrent layer's cell at every time step, a transformer's blocks). Sizes only rank
plans: the exact prediction of the plan taken runs every operator on fake tensors of the real
device."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from revnets.facts.tensors import storage_key
from revnets.memory.call_arguments import rebuilt
from revnets.memory.cpu_kernels import CPU_OUTPUTS

__all__ = ["MetaMemo", "all_meta"]

# Returns a view of its input without saying so in its schema: never made anew.
_UNANNOTATED_ALIASES = frozenset({torch.ops.aten._unsafe_view.default})
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
          torch.memory_format)


class MetaMemo:
    """What meta kernels made, by operator and arguments (sizes, strides, dtypes and the
    values of everything else), for one profile."""

    def __init__(self) -> None:
        self._made: dict[tuple, tuple | None] = {}

    def run(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
        """The operator's arguments made meta (:func:`all_meta`), and its output on them."""
        args, kwargs = all_meta(args, kwargs)
        # Batch norm's meta kernel is a slow decomposition (NOTE [ CPU kernels that allocate
        # unlike their meta kernels ]): its outputs are made as the CPU's kernel makes them.
        out = CPU_OUTPUTS[func](*args, **kwargs) if func in CPU_OUTPUTS else NotImplemented
        if out is NotImplemented:
            out = self._remembered(func, args, kwargs)
        return args, kwargs, out

    def _remembered(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` on meta tensors: new tensors of the sizes and strides it
        made before for the same arguments, where it makes new tensors only; for an in-place
        pointwise operator that broadcasts its other tensors to the one it writes, that one
        (a meta kernel changes nothing else)."""
        schema = func._schema
        if schema.is_mutable:
            if torch.Tag.pointwise in func.tags and _writes_first_only(schema) and args \
                    and isinstance(args[0], Tensor) and _same_kind(args[0], (args[1:], kwargs)):
                shapes = [t.shape for t in _tensors((args[1:], kwargs))]
                if torch.broadcast_shapes(args[0].shape, *shapes) == args[0].shape:
                    return args[0]
            return func(*args, **kwargs)
        if func.is_view or func in _UNANNOTATED_ALIASES or any(
                r.alias_info is not None for r in schema.returns):
            return func(*args, **kwargs)
        key = _key((func, torch.get_default_dtype(), args, kwargs))
        if key is None or not _tensors(args):
            return func(*args, **kwargs)
        if key in self._made:
            made = self._made[key]
            if made is not None:
                return _new(made)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = {storage_key(t) for t in _tensors((args, kwargs))}
        self._made[key] = _described(out, inputs)
        return out


def all_meta(args: Any, kwargs: dict) -> tuple[Any, dict]:
    """An operator's arguments with every tensor a meta one, made on the meta device (a layer
    making a tensor on the model's real device by its own means, noise from a generator of its
    own, gets a meta tensor of the same size, and draws nothing)."""
    # An operator's arguments nest tensors in lists one deep (its schema's Tensor[]); walked
    # here rather than by pytree, whose every flattening leaves a cycle for the collector.
    def meta(value: Any) -> Any:
        if isinstance(value, Tensor) and not value.is_meta and value.dim() > 0:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                       device="meta").requires_grad_(value.requires_grad)
        if isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) for v in value):
            return rebuilt(value, map(meta, value))
        return value

    args, kwargs = tuple(map(meta, args)), {key: meta(v) for key, v in kwargs.items()}
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "meta":
        kwargs = {**kwargs, "device": torch.device("meta")}
    generator = kwargs.get("generator")
    if generator is not None and generator.device.type != "meta":
        kwargs = {**kwargs, "generator": None}
    return args, kwargs


def _writes_first_only(schema: Any) -> bool:
    """Whether the operator writes its first argument alone, and returns it."""
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return (len(written) == 1 and written[0] is schema.arguments[0] and len(schema.returns) == 1
            and schema.returns[0].alias_info is not None)


def _same_kind(written: Tensor, others: Any) -> bool:
    """Whether an in-place operator's other arguments are of the written tensor's dtype (a
    tensor), or numbers it holds without promotion; anything else runs the kernel, which
    refuses what it cannot write (a float into an integer tensor)."""
    floating = written.is_floating_point() or written.is_complex()
    for value in _values(others):
        if isinstance(value, Tensor):
            if value.dtype != written.dtype:
                return False
        elif isinstance(value, float) and not floating:
            return False
        elif isinstance(value, int) and not isinstance(value, bool) \
                and written.dtype == torch.bool:
            return False
        elif isinstance(value, complex) and not written.is_complex():
            return False
        elif not isinstance(value, (type(None), bool, int, float, complex)):
            return False
    return True


def _values(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [v for part in value for v in _values(part)]
    if isinstance(value, dict):
        return [v for part in value.values() for v in _values(part)]
    return [value]


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _key(value: Any) -> Any:
    """A hashable key of an operator's arguments, or None where one is not plain. Numbers keep
    their type (``1``, ``1.0`` and ``True`` promote unlike)."""
    if isinstance(value, Tensor):
        return (Tensor, tuple(value.shape), value.stride(), value.dtype, value.storage_offset(),
                value.is_conj(), value.is_neg())
    if isinstance(value, _PLAIN):
        return type(value), value
    if isinstance(value, (list, tuple)):
        keys = tuple(map(_key, value))
        return None if any(k is None for k in keys) else (type(value), keys)
    if isinstance(value, dict):
        keys = tuple((name, _key(v)) for name, v in value.items())
        return None if any(k is None for _, k in keys) else (dict, keys)
    if isinstance(value, torch._ops.OpOverload):
        return value
    return None


def _described(out: Any, inputs: set[int]) -> tuple | None:
    """The sizes, strides and dtypes of new tensors an operator made, each holding the least
    storage they need; None for anything else (a view of an input, a number, a storage
    larger than the tensor), which is computed each time."""
    if isinstance(out, Tensor):
        storage = out.untyped_storage()
        if storage_key(out) in inputs or out.storage_offset() or out.layout is not torch.strided:
            return None
        if storage.nbytes() != _least_bytes(out):
            return None
        return (Tensor, tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (list, tuple)) and out:
        parts = tuple(_described(o, inputs) for o in out)
        return None if any(p is None for p in parts) else (type(out), parts)
    return None


def _least_bytes(tensor: Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()


def _new(made: tuple) -> Any:
    kind, *rest = made
    if kind is Tensor:
        shape, stride, dtype = rest
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return kind(_new(part) for part in rest[0])
