"""Per-layer costs of a chain: output size, what autograd saves for backward, forward time."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from revnets.facts.operators import SELECTIVE_OPS, flops_of
from revnets.facts.tensors import device_of, storage_key
from revnets.graph.step import GraphStep
from revnets.graph.trace_state import Attributes
from revnets.memory import measure_memory
from revnets.planning.costs.gradients import gradient_parts
from revnets.planning.costs.layer_profile import LayerProfile
from revnets.planning.costs.meta_attention import AttentionAsOn, may_attend
from revnets.planning.costs.meta_memo import MetaMemo
from revnets.replay import forked_rng, frozen_running_stats

__all__ = ["as_leaf", "bytes_of", "clock", "meta_like",
           "on_meta", "profile_chain", "timing_input", "writable", "writes_its_input"]


def _passes_gradients(layer: nn.Module) -> bool:
    """Whether the backward of ``layer`` may pass its output's gradient on (an addition, a
    view, a concatenation: a function or method a graph step calls), so that ``gradient_parts``
    is worth its backward; a module's makes new gradients of what it reads (a convolution's,
    a norm's), as the chain model assumes without one."""
    return isinstance(layer, GraphStep) and layer.op in ("call_function", "call_method")


def bytes_of(output: Any) -> int:
    tensors = [t for t in tree_leaves(output) if isinstance(t, Tensor)]
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def profile_chain(
    layers: Sequence[nn.Module], example_input: Any, repeats: int = 1,
    kernels_of: torch.device | None = None, loss_fn: Callable[[Any], Tensor] | None = None,
) -> list[LayerProfile]:
    """Run ``layers`` one after the other on ``example_input`` (training mode, grad on) and record
    each layer's costs. On the meta device only sizes are known, with attention's kernel the one
    ``kernels_of`` (the real device) would run (NOTE [ Attention on the meta device ]); elsewhere
    times are measured too (the fastest of ``repeats`` runs of each layer). What passes between
    layers may be a tensor or a tuple of tensors (a recurrent state, or the live values of a
    graph chain). On the meta device, ``loss_fn`` (of the last layer's output) is profiled too:
    the last profile's ``loss_bytes``. The layers are left as they were: BatchNorm running
    statistics and the random number generators are restored afterwards.
    """
    device = next(t for t in tree_leaves(example_input) if isinstance(t, Tensor)).device
    as_on = device.type == "meta" and kernels_of is not None  # where steps may attend, below
    attention = AttentionAsOn(kernels_of) if as_on else contextlib.nullcontext()
    with frozen_running_stats(list(layers)), forked_rng(device):
        with attention if any(map(may_attend, layers)) else contextlib.nullcontext():
            profiles, output = _profile(layers, example_input, repeats)
        if loss_fn is not None and profiles and device.type == "meta":
            with attention:
                profiles[-1] = replace(profiles[-1], loss_bytes=_loss_bytes(loss_fn, output))
        return profiles


def _loss_bytes(loss_fn: Callable[[Any], Tensor], output: Any) -> int:
    """The most ``loss_fn`` holds in its forward and backward from ``output`` (a leaf), on the
    meta device: the tensors a loss closes over (labels on the real device) are made meta as the
    layers' are. The backward reaches ``output`` alone (a loss module's own parameters keep
    their gradients), and the loss reads a copy of it (it may write it in place). A loss that
    cannot run there (one reading values: ``.item()``, a mask) counts nothing: this only ranks
    plans, and the exact prediction, on fake tensors of the real device, says what it reads."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
    copied = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, output)

    def step() -> None:
        with _SelectiveOutputs(MetaMemo()):
            loss_fn(copied).backward(inputs=leaves)

    try:
        return measure_memory(step).peak_bytes
    except Exception:  # noqa: BLE001  any failure of user code on meta: see the docstring
        return 0


@contextlib.contextmanager
def on_meta(layers: Sequence[nn.Module]) -> Iterator[None]:
    """The layers' parameters and buffers replaced by meta tensors (parameters by parameters) of
    the same shapes, dtypes and ``requires_grad`` while inside (one meta tensor for a tensor the
    layers share), so that sizes can be profiled on the meta device without copying the
    modules; put back on exit, also on an exception, with any state the run changed (NOTE
    [ Traced modules run as their graph ]: a kept-whole module caching a meta tensor)."""
    made: dict[int, Tensor] = {}
    swapped: list[tuple[dict, str, Tensor]] = []

    def meta(tensor: Tensor) -> Tensor:
        if id(tensor) not in made:
            copy = torch.empty_like(tensor, device="meta")
            made[id(tensor)] = (nn.Parameter(copy, tensor.requires_grad)
                                if isinstance(tensor, nn.Parameter)
                                else copy.requires_grad_(tensor.requires_grad))
        return made[id(tensor)]

    kept = Attributes(m for layer in layers for m in layer.modules())
    try:
        seen: set[int] = set()
        for layer in layers:
            for module in layer.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for slots in (module._parameters, module._buffers):
                    for name, tensor in slots.items():
                        if tensor is not None:
                            swapped.append((slots, name, tensor))
                            slots[name] = meta(tensor)
        yield
    finally:
        for slots, name, tensor in reversed(swapped):
            slots[name] = tensor
        kept.restore()


def clock(device: torch.device) -> Callable[[], float]:
    """Seconds on ``device``: a GPU runs kernels after their launch returns, so a step's time
    there is up to the last one's end."""
    return functools.partial(_synchronized_clock, device) if device.type == "cuda" \
        else time.perf_counter


def _synchronized_clock(device: torch.device) -> float:
    torch.cuda.synchronize(device)
    return time.perf_counter()


def writes_its_input(layer: nn.Module) -> bool:
    """Whether ``layer`` writes its input in place (ReLU(inplace=True), a graph step that
    overwrites a value), so that it runs on copies (:func:`writable`)."""
    return bool(getattr(layer, "inplace", False)) or (
        getattr(layer, "mutates_from", None) is not None)


def _profile(
    layers: Sequence[nn.Module], example_input: Any, repeats: int
) -> tuple[list[LayerProfile], Any]:
    """The layers' profiles, and the last one's output as a leaf."""
    # Parameters and buffers (BatchNorm's running statistics) are model state, not activations.
    params = {
        storage_key(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())
    }
    device = device_of(example_input)
    timed = device.type != "meta"
    memo = MetaMemo()
    now = clock(device)
    leaf = tree_map(as_leaf, example_input)
    profiles = []
    # Kept outputs by their storage, and the layer that keeps each: a later layer that writes any
    # alias of one (an Identity or a view passes it on, then ReLU(inplace=True) writes it) makes
    # that layer unsafe. The tensors are held so that no address is reused meanwhile.
    kept_by_storage: dict[int, int] = {}
    held: list[Tensor] = []
    unsafe: set[int] = set()
    # The storages of the values passed to the layer, by address: the key the first value that
    # carried each has in ``saved_values`` (an alias passed on keeps its key). The values are
    # alive while their addresses are looked up, so no address is reused meanwhile.
    first_names = list(getattr(layers[0], "inputs", None) or ["input"]) if layers else []
    carried = _carriers(leaf, first_names, {})
    names = first_names
    # And the layer that made each (-1: the input): a layer writing its input in place writes
    # the storage that layer made, whatever aliases (Identity, views) passed it on since.
    made_by = dict.fromkeys(carried, -1)
    for index, layer in enumerate(layers):
        saved: dict[int, int] = {}  # bytes by storage_key: views of one storage count once
        packed: list[bool] = []  # one per tensor saved, parameters too

        def pack(t: Tensor) -> Tensor:
            packed.append(True)
            if storage_key(t) not in params:
                saved[storage_key(t)] = t.untyped_storage().nbytes()
            return t

        seconds = math.inf
        # Copies, not leaves, for layers that write their input in place (ReLU(inplace=True)),
        # as inside a chain; the others read the leaves (copying a graph chain's whole live set
        # at every step would cost more than the steps).
        copies = writes_its_input(layer)
        kept = _SelectiveOutputs(None if timed else memo)
        if copies:
            unsafe |= _keepers(kept_by_storage, _written(layer, leaf))
        for _ in range(repeats if timed else 1):
            saved.clear()
            packed.clear()
            x = writable(layer, leaf) if copies else leaf
            start = now()
            try:
                # Untimed runs also see which outputs a selective checkpoint would keep.
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
                    contextlib.nullcontext() if timed else kept
                ):
                    y = layer(x)
            except RuntimeError:  # writes its input in place somewhere inside
                if copies:
                    raise
                copies = True
                unsafe |= _keepers(kept_by_storage, _written(layer, leaf, everything=True))
                saved.clear()
                packed.clear()
                x = writable(layer, leaf, everything=True)
                kept = _SelectiveOutputs(None if timed else memo)
                start = now()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), (
                    contextlib.nullcontext() if timed else kept
                ):
                    y = layer(x)
            seconds = min(seconds, now() - start)
        ends = _storage_ids(x) | _storage_ids(y)
        intermediate = sum(nbytes for key, nbytes in saved.items() if key not in ends)
        inplace = bool(getattr(layer, "inplace", False))
        named = _named_bytes(y, getattr(layer, "state_names", None), index)
        takes = layer.takes if isinstance(layer, GraphStep) else None
        passed_on = _carriers(y, list(named), carried)
        saved_values = {}
        for address, nbytes in saved.items():
            key = carried.get(address, passed_on.get(address))
            if key is not None:
                saved_values[key] = nbytes
        profiles.append(
            LayerProfile(
                index,
                type(layer).__name__,
                bytes_of(y),
                sum(saved.values()),
                seconds if timed else math.nan,
                inplace,
                named,
                getattr(layer, "mutates_from", min(
                    (made_by.get(storage_key(t), index - 1) for t in _written(layer, leaf)),
                    default=index - 1) if inplace else None),
                intermediate,
                kept.nbytes(),
                _kept_values(y, list(named), kept),
                kept.intact(),
                saved_values,
                product_flops=kept.flops,
                takes=takes,
                saves_nothing=not packed,
                # On copies, a step writing its input in place has no gradients of its own.
                gradient_parts=gradient_parts(x, y, names, list(named), takes)
                if _passes_gradients(layer) and not (timed or copies) else None,
            )
        )
        for t, _ in kept.outputs:
            kept_by_storage.setdefault(storage_key(t), index)
            held.append(t)
        leaf = tree_map(as_leaf, y)
        names = list(named)
        made_by = {address: made_by.get(address, index) for address in passed_on}
        carried = passed_on
    # A later layer that overwrites an earlier one's output in place makes that one unsafe (when
    # it keeps anything: kept outputs are not always tracked, and this errs on the safe side).
    for p in list(profiles):
        if p.mutates_from is not None and p.mutates_from >= 0 and p.mutates_from != p.index:
            unsafe.add(p.mutates_from)
    for i in unsafe - {p.index for p in profiles if not p.selective_bytes}:
        profiles[i] = replace(profiles[i], selective_safe=False)
    return _with_gradients(profiles, layers), leaf


def _with_gradients(
    profiles: list[LayerProfile], layers: Sequence[nn.Module]
) -> list[LayerProfile]:
    """``profiles`` with the parameter gradients each layer's backward makes (``grad_bytes``)."""
    last_user: dict[int, tuple[int, int]] = {}
    for index, layer in enumerate(layers):
        for parameter in layer.parameters():
            if parameter.requires_grad:
                last_user[id(parameter)] = (index, parameter.numel() * parameter.element_size())
    made = [0] * len(profiles)
    for index, nbytes in last_user.values():
        made[index] += nbytes
    return [replace(p, grad_bytes=nbytes) for p, nbytes in zip(profiles, made)]


class _SelectiveOutputs(TorchDispatchMode):
    """The outputs of a run's operators that a selective checkpoint keeps (SELECTIVE_OPS), with
    their versions when made. On the meta device, every tensor an operator makes or reads is a
    meta one: a layer making a tensor on the model's real device by its own means (noise from
    a ``torch.Generator`` of its own, ``torch.randn(x.shape, generator=g)``) gets a meta tensor of
    the same size, and draws nothing (``meta``: how operators run there, meta_memo.py)."""

    def __init__(self, meta: MetaMemo | None = None) -> None:
        super().__init__()
        self.meta = meta
        self.outputs: list[tuple[Tensor, int]] = []
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.meta is not None:
            args, kwargs, out = self.meta.run(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if func in SELECTIVE_OPS:
            self.outputs += [(t, t._version) for t in tree_leaves(out)
                             if isinstance(t, Tensor)]
            self.flops += flops_of(func, args, kwargs, out)
        return out

    def nbytes(self) -> int:
        return bytes_of([t for t, _ in self.outputs])

    def intact(self) -> bool:
        return all(t._version == version for t, version in self.outputs)


def _written(layer: nn.Module, leaf: Any, everything: bool = False) -> list[Tensor]:
    """The tensors of ``leaf`` that ``layer`` may write: the value a graph step overwrites, when
    it names it, else every tensor."""
    names, mutated = getattr(layer, "inputs", None), getattr(layer, "mutated", None)
    if not everything and isinstance(leaf, tuple) and names and len(names) == len(leaf) and (
        mutated in names
    ):
        return [t for name, t in zip(names, leaf) if name == mutated and isinstance(t, Tensor)]
    return [t for t in tree_leaves(leaf) if isinstance(t, Tensor)]


def writable(layer: nn.Module, leaf: Any, everything: bool = False) -> Any:
    """``leaf`` with copies of what ``layer`` may write (:func:`_written`)."""
    written = {id(t) for t in _written(layer, leaf, everything)}
    return tree_map(lambda t: t.clone() if id(t) in written else t, leaf)


def _keepers(kept_by_storage: dict[int, int], tensors: list[Tensor]) -> set[int]:
    """The layers whose kept outputs share storage with ``tensors``."""
    return {kept_by_storage[a] for a in map(storage_key, tensors) if a in kept_by_storage}


def _storage_ids(value: Any) -> set[int]:
    return {storage_key(t) for t in tree_leaves(value) if isinstance(t, Tensor)}


def _named_bytes(output: Any, names: Sequence[str] | None, index: int) -> dict[str, int]:
    values = output if isinstance(output, tuple) else (output,)
    if names is None or len(names) != len(values):
        names = [f"{index}.{j}" for j in range(len(values))]
    return {name: bytes_of(value) for name, value in zip(names, values)}


def _kept_values(output: Any, names: Sequence[str], kept: _SelectiveOutputs) -> dict[str, int]:
    """The bytes of each value of ``output`` (named ``names``) that ``kept`` keeps."""
    storages = {storage_key(t) for t, _ in kept.outputs}
    values = output if isinstance(output, tuple) else (output,)
    found = {name: [t for t in tree_leaves(value) if isinstance(t, Tensor)
                    and storage_key(t) in storages] for name, value in zip(names, values)}
    return {name: bytes_of(tensors) for name, tensors in found.items() if tensors}


def _carriers(
    output: Any, names: Sequence[str], carried: dict[int, tuple[str, int]]
) -> dict[int, tuple[str, int]]:
    """The storages of the values of ``output`` (named ``names``) by address, each keyed as in
    ``carried`` where a value passed in already carried it, else by its value's name and place."""
    values = output if isinstance(output, tuple) else (output,)
    found: dict[int, tuple[str, int]] = {}
    for name, value in zip(names, values):
        tensors = [t for t in tree_leaves(value) if isinstance(t, Tensor)]
        for place, tensor in enumerate(tensors):
            address = storage_key(tensor)
            found.setdefault(address, carried.get(address, (name, place)))
    return found


def as_leaf(value: Any) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.detach().requires_grad_()
    return value


def meta_like(value: Any) -> Any:
    """Meta tensors shaped like ``value`` (a tensor or a tuple of tensors), keeping
    requires_grad."""
    return tree_map(lambda t: torch.empty_like(t, device="meta").requires_grad_(
        t.requires_grad) if isinstance(t, Tensor) else t, value)


TIMED_BATCH = 8


def timing_input(example_input: Any) -> Any:
    """What forward times are measured on: the first ``TIMED_BATCH`` samples of a large batch
    (a tensor's first dimension), since times only order plans and scale alike with the batch;
    anything else as given."""
    if isinstance(example_input, Tensor) and example_input.dim() and (
        example_input.shape[0] > TIMED_BATCH
    ):
        return example_input[:TIMED_BATCH]
    return example_input
