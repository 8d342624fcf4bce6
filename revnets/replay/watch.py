"""The dispatcher's view of a run: what it draws and what it writes (NOTE [ Replay ], rules 1
to 3)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from revnets.facts import storage_key
from revnets.replay.known import kept_generator_state
from revnets.replay.state import (
    Slot,
    default_generator,
    device_of_op,
)

__all__ = ["DEVICE_QUERY", "Watch", "operator_tensors", "recomputed_wrong"]


# NOTE [ Device queries ]
# C++ asks a fake tensor for its device through the dispatcher (prim.device), several times per
# operator of a prediction, and every mode on the stack would pass each query on down to the
# fake mode. A mode answers it at once with what the fake mode answers: the device the tensor
# stands for (FakeTensor.device; the fake mode's own kernels, which get "meta", run below the
# modes and never ask them). Not an operator of the run: nothing is recorded.
DEVICE_QUERY = torch.ops.prim.device.default


_aten = torch.ops.aten
# Kernels whose schemas do not declare what they write: batch norm's running statistics (the
# arguments written, from the arguments), updated in training only; SyncBatchNorm's gathering
# of statistics across processes (with counts; without, as older code gathers them) and
# batch_norm_update_stats update them always (a None is not written).
_UNDECLARED_WRITES = {
    **{op: lambda args: (3, 4) if len(args) > 5 and args[5] else ()
       for op in (
           _aten.native_batch_norm.default,
           _aten.cudnn_batch_norm.default,
           _aten.miopen_batch_norm.default,
       )},
    **{op: lambda args: (3, 4) for op in (_aten.batch_norm_gather_stats_with_counts.default,
                                          _aten.batch_norm_gather_stats.default)},
    _aten.batch_norm_update_stats.default: lambda args: (1, 2),
}


# Operators that read batch norm's running statistics as batch norm does (training-mode batch
# norm's output does not depend on them, and its count is read and advanced by the module).
_READS_STATISTICS = {
    _aten.native_batch_norm.default,
    _aten.cudnn_batch_norm.default,
    _aten.miopen_batch_norm.default,
    _aten._native_batch_norm_legit.default,
}
# Operators that read them only to update them (what they return does not depend on them).
_UPDATES_STATISTICS = {
    _aten.batch_norm_gather_stats_with_counts.default,
    _aten.batch_norm_gather_stats.default,
    _aten.batch_norm_update_stats.default,
}


# Operators that overwrite their first argument whole without reading it (copy_, fill_, zero_,
# and the random fills nn.init calls): the first of a parameter's writes that may come before
# any read of it (NOTE [ Replay ], rule 3). Arguments written as ``out=`` are overwritten too.
_OVERWRITES = {
    _aten.copy_.default, _aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default,
    _aten.normal_.default, _aten.uniform_.default, _aten.bernoulli_.float,
    _aten.bernoulli_.Tensor, _aten.random_.default, getattr(_aten.random_, "from"),
    _aten.random_.to, _aten.exponential_.default, _aten.cauchy_.default,
    _aten.log_normal_.default, _aten.geometric_.default,
}


@functools.cache
def _facts(func: Any) -> tuple[bool, tuple[tuple[int, str], ...] | None, bool | int,
                               frozenset[int] | None]:
    """What the watch asks of an operator, once per operator: whether it is seeded, which
    arguments it may write into (position and name; None: it writes nothing), whether it may
    read batch norm's statistics other than as batch norm in training mode does (a view of them
    reads nothing; for batch norm itself, the position of its ``training`` flag: in eval mode
    it reads them), and which of the written arguments it overwrites whole without reading them
    (None: a view, which reads no values at all)."""
    schema = func._schema
    is_view = any(a.alias_info is not None and not a.alias_info.is_write for a in schema.returns)
    written = tuple(
        (k, a.name)
        for k, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    writes = schema.is_mutable or func in _UNDECLARED_WRITES
    overwritten = frozenset(k for k, _ in written
                            if (k == 0 and func in _OVERWRITES) or schema.arguments[k].kwarg_only)
    return (
        torch.Tag.nondeterministic_seeded in func.tags,
        written if writes else None,
        _training_flag(schema) if func in _READS_STATISTICS
        else func not in _UPDATES_STATISTICS and not is_view,
        None if is_view else overwritten,
    )


def _training_flag(schema: Any) -> int:
    return next(k for k, a in enumerate(schema.arguments) if a.name == "training")


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs[name]


# NOTE [ Recomputed wrong by torch ]
# Randomized leaky ReLU in training (nn.RReLU, F.rrelu) draws its slopes into a noise tensor
# its backward reads. Recomputed by torch's checkpoint, the backward reads other slopes than the
# forward used: wrong gradients, in torch.utils.checkpoint alone too (torch 2.14), whatever the
# generators' states. A run torch's checkpoint recomputes (revnets.checkpoint, plans of modules)
# is refused where it calls it; a reversible block's transform, recomputed by revnets' own
# engine, differentiates the same slopes and may call it.
_RECOMPUTED_WRONG = {_aten.rrelu_with_noise.default, _aten.rrelu_with_noise_.default}


def recomputed_wrong() -> RuntimeError:
    """The refusal of NOTE [ Recomputed wrong by torch ]."""
    return RuntimeError(
        "nn.RReLU (F.rrelu) in training mode runs in a checkpoint: torch's checkpoint "
        "recomputes its random slopes into a noise tensor that its backward then reads "
        "otherwise, which gives wrong gradients (torch.utils.checkpoint alone too). Put it in "
        "eval mode there, use another activation (LeakyReLU), or keep it out of the "
        "checkpointed part")


def _draws(func: Any, args: tuple) -> bool:
    """Whether a seeded operator draws here: attention kernels take a ``dropout_p`` and draw
    nothing when it is 0 (the other seeded operators draw whatever their probabilities)."""
    for k, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            return (args[k] if k < len(args) else argument.default_value) != 0
    return True



class Watch(TorchDispatchMode):
    """Sees every operator of one run: keeps each generator's state at its first draw (NOTE
    [ Replay ], rule 1), copies a watched slot's tensor before the run first writes into it
    (rule 2) and tells a parameter the run computes from one it reads and then writes (rule 3)."""

    def __init__(
        self,
        watched: dict[int, list[Slot]],
        draws: bool,
        exempt: dict[int, tuple[nn.Module, str] | None],
        reads: frozenset[int] = frozenset(),
        torch_recomputes: bool = False,
    ) -> None:
        super().__init__()
        self.torch_recomputes = torch_recomputes  # NOTE [ Recomputed wrong by torch ]
        self.watched = watched
        self.draws = draws
        # Training BatchNorm's statistics, by storage: never copied; the names of the running
        # mean and variance, whose reads by anything but batch norm are noted.
        self.exempt = exempt
        self.generators: dict[int, tuple[Any, Tensor | None]] = {}
        self.written: dict[int, Tensor] = {}  # storage key -> copy made before the first write
        # Memory no slot holds (a list, a global, a closure) that the run wrote into: its whole
        # storage as a flat tensor, and a copy made before the first write.
        self.external: dict[int, tuple[Tensor, Tensor]] = {}
        self.created: set[int] = set()
        # Parameters by storage (rule 3): those the run has not touched yet; those it overwrote
        # whole before reading them and has not read since (written still: being computed); all
        # it overwrote first (``computed``); the slots of the first one written otherwise.
        self.parameters = frozenset(k for k, slots in watched.items()
                                    if any(s.table == "_parameters" for s in slots))
        self.untouched = set(self.parameters)
        self.computing: set[int] = set()
        self.computed: set[int] = set()
        self.params_written: list[Slot] = []
        self.exempt_read: tuple[nn.Module, str] | None = None
        # Storages of modules held unregistered (Census): which of them the run read.
        self.reads = reads
        self.read: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY and isinstance(args[0], FakeTensor):
            return args[0].device  # NOTE [ Device queries ]
        kwargs = kwargs or {}
        if _COPYING:  # a nested watch's own copy: no operator of the run
            return func(*args, **kwargs)
        if self.torch_recomputes and func in _RECOMPUTED_WRONG and (
                args[4] if len(args) > 4 else kwargs.get("training", False)):
            raise recomputed_wrong()  # NOTE [ Recomputed wrong by torch ]
        seeded, written, reads_exempt, overwritten = _facts(func)
        if seeded and self.draws and _draws(func, args):
            self._note_draw(args, kwargs)
        if (self.untouched or self.computing) and overwritten is not None:
            self._note_parameter_use(written or (), overwritten, args, kwargs)
        if written is not None:
            self._note_writes(func, written, args, kwargs)
        if self.reads:
            self.read.update(k for k in map(storage_key, _tensor_arguments(args, kwargs))
                             if k in self.reads)
        if reads_exempt is not False and self.exempt and self.exempt_read is None:
            if reads_exempt is True or not _argument(args, kwargs, reads_exempt, "training"):
                self._note_exempt_reads(args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            key = storage_key(out)
            if key is not None:
                self.created.add(key)
        else:
            for t in _tensors_in(out):
                key = storage_key(t)
                if key is not None:
                    self.created.add(key)
        return out

    def _note_exempt_reads(self, args: Any, kwargs: dict) -> None:
        for t in _tensor_arguments(args, kwargs):
            read = self.exempt.get(storage_key(t))
            if read is not None:
                self.exempt_read = read
                return

    def _note_parameter_use(
        self, written: tuple[tuple[int, str], ...], overwritten: frozenset[int], args: Any,
        kwargs: dict,
    ) -> None:
        """Follow each parameter from the run's first touch of it (NOTE [ Replay ], rule 3): an
        operator that overwrites it whole, reading it nowhere else, makes it one the run computes
        (an in-place update after that still computes it), until an operator reads it; any other
        first touch reads it."""
        positions = {k for k, _ in written}
        names = {name for _, name in written}
        sources = [v for k, v in enumerate(args) if k not in positions]
        sources += [v for name, v in kwargs.items() if name not in names]
        read = {k for k in map(storage_key, _tensors_in(sources))
                if k in self.untouched or k in self.computing}
        self.untouched -= read
        self.computing -= read
        for k, name in written:
            value = args[k] if k < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                key = storage_key(t) if isinstance(t, Tensor) else None
                if key not in self.untouched or key in read:
                    continue
                self.untouched.discard(key)
                if k in overwritten and self._covers(t, key):
                    self.computing.add(key)
                    self.computed.add(key)

    def _covers(self, t: Tensor, key: int) -> bool:
        """Whether ``t`` is the whole of the parameter whose storage is ``key``."""
        p = next(s.tensor for s in self.watched[key] if s.table == "_parameters")
        return t.storage_offset() == p.storage_offset() and t.numel() == p.numel() and (
            (t.shape == p.shape and t.stride() == p.stride())
            or (t.is_contiguous() and p.is_contiguous()))

    def _note_draw(self, args: Any, kwargs: dict) -> None:
        generator = next(
            (v for v in (*args, *kwargs.values()) if isinstance(v, torch.Generator)), None
        )
        device = generator.device if generator is not None else device_of_op(args, kwargs)
        key = ("meta",) if device.type == "meta" else id(generator or default_generator(device))
        if key not in self.generators:
            self.generators[key] = kept_generator_state(device, generator)

    def _note_writes(
        self, func: Any, written: tuple[tuple[int, str], ...], args: Any, kwargs: dict
    ) -> None:
        if func in _UNDECLARED_WRITES:
            written += tuple((k, "") for k in _UNDECLARED_WRITES[func](args))
        for k, name in written:
            value = args[k] if k < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, Tensor):
                    continue
                key = storage_key(t)
                if (key in self.parameters and key not in self.computing
                        and not self.params_written):
                    self.params_written = self.watched[key]  # read before (rule 3)
                if key is None or key in self.written or key in self.external:
                    continue
                if key in self.watched:
                    slots = self.watched[key]
                    with _copying():
                        self.written[key] = slots[0].tensor.detach().clone()
                elif key not in self.created and key not in self.exempt:
                    # A view, where ``set_`` would put a real storage under a fake tensor
                    # in a prediction (which then writes the fake of it, never the user's).
                    flat = t.detach().as_strided(
                        (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
                    with _copying():
                        self.external[key] = (flat, flat.clone())


# A watch's copies of what a run writes (rule 2) are the watch's, not the run's: a watch around
# it (a checkpoint inside a checkpoint, a sequence inside a checkpoint) does not see them, so that
# a copy of a parameter is not taken for the run reading it (rule 3).
_COPYING: list[bool] = []


@contextlib.contextmanager
def _copying() -> Iterator[None]:
    _COPYING.append(True)
    try:
        yield
    finally:
        _COPYING.pop()


def _tensor_arguments(args: Any, kwargs: dict) -> Iterator[Tensor]:
    """The tensors an operator is called with."""
    return _tensors_in((*args, *kwargs.values()))


def _tensors_in(values: Any) -> Iterator[Tensor]:
    """The tensors among an operator's arguments or results (schemas nest lists one deep)."""
    if not isinstance(values, (tuple, list)):
        return
    for value in values:
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, Tensor):
                    yield v


def operator_tensors(args: Any, kwargs: dict | None = None) -> list[Tensor]:
    """The tensors an operator call takes (``args`` and ``kwargs``) or returns (``args`` alone:
    a tensor, or a tuple or list of them). A dispatch mode sees every operator of a run, and
    operator schemas nest lists one deep: this is a loop, where a pytree flatten would cost
    more than the rest of the mode."""
    if isinstance(args, Tensor):
        return [args]
    found = list(_tensors_in(args))
    if kwargs:
        found += _tensors_in(tuple(kwargs.values()))
    return found