"""The recording of one run of user code and its replay (NOTE [ Replay ] in the package's
face, revnets/replay/__init__.py): :class:`Recording`."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import UninitializedTensorMixin
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from revnets.facts import storage_key, version_of
from revnets.replay.autocast import uncached_parametrizations
from revnets.replay.computed import parameters_standing_in, written_after_read
from revnets.replay.containers import ContainerCopy, as_found
from revnets.replay.held import AttributesCopy
from revnets.replay.hooks import (
    HookWatch,
    ReplayedHook,
    hooks_hidden_since,
    recomputing,
)
from revnets.replay.known import known_run
from revnets.replay.names import module_names
from revnets.replay.norms import frozen_running_stats
from revnets.replay.state import (
    MISSING,
    Census,
    Loose,
    RecordingChain,
    Slot,
    put_attribute,
    same_state,
    without_added,
)
from revnets.replay.stateless import StatelessDraws
from revnets.replay.unchanged import changed_since
from revnets.replay.watch import Watch, recomputed_wrong

__all__ = ["Recording"]


class Recording:
    """One run of user code (a transform f or g, an invertible module, a checkpointed module) and
    what its replay needs (NOTE [ Replay ]).

    Use it around the run, then replay with :meth:`replayed`::

        recording = Recording([module], preserve_rng=True)
        with recording:
            out = module(x)
        ...
        recording.check("owner", "remedy")
        with recording.replayed():
            out_again = module(x)
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        preserve_rng: bool = True,
        keep_left_state: bool = False,
        root_owner: str | None = None,
        chain: RecordingChain | None = None,
        device: torch.device | None = None,
        prefix: str = "",
        given: Sequence[Any] = (),
        torch_recomputes: bool = False,
    ) -> None:
        self.modules = list(modules)
        # Torch's checkpoint recomputes the run (NOTE [ Recomputed wrong by torch ]).
        self.torch_recomputes = torch_recomputes
        # What the call is given (its arguments): the containers and plain objects among them
        # are state the run may change (a cache it fills), as the modules' own (rule 2).
        self.given = tuple(given)
        self.prefix = prefix  # the modules' dotted name, for what the run is refused for
        self.preserve_rng = preserve_rng
        self.keep_left_state = keep_left_state
        self.root_owner = root_owner
        self.chain = chain if chain is not None else RecordingChain()
        self.device = device  # where the run's tensors are, for NOTE [ Known layers ]
        self._python_found: dict[int, tuple[Any, Any]] = {}
        self.slots: list[Slot] = []
        self.changed: list[Slot] = []
        self.computed: list[Slot] = []  # parameters the run computed (rule 3)
        self.norms: list[nn.Module] = []
        self.generators: list[tuple[Any, Tensor | None]] = []
        self.python: list[tuple[random.Random, Any]] = []
        self.hooks: list[ReplayedHook] = []
        self.scalars: list[tuple[dict, str, Any]] = []
        self.external: list[tuple[Tensor, Tensor]] = []
        # the modules' containers and plain objects' attributes, as found
        self.containers: list[ContainerCopy | AttributesCopy] = []
        self.attribute_names: list[tuple[dict, frozenset[str]]] = []  # the modules', after it
        self.held: list[Slot] = []  # tensors of modules held unregistered that the run read
        self.loose: list[Loose] = []  # tensors in containers and plain objects it read
        self.assigned: list[Slot] = []  # tensor attributes the run created or reassigned
        self._run: contextlib.ExitStack | None = None
        self._draws: StatelessDraws | None = None  # NOTE [ Generators without state ]
        self._census: Census | None = None
        self.walked: list[nn.Module] = []  # every module below ``modules``, once
        self.hook_serial = 0  # the id the next hook registered anywhere gets
        # Set on entering: recorded as known layers (NOTE [ Known layers ]), not watched, and
        # whether one of them draws random numbers.
        self.known = False
        self.known_draws = False

    # -- the recorded run ----------------------------------------------------------------------
    def __enter__(self) -> Recording:
        self.hook_serial = RemovableHandle.next_id
        if self.torch_recomputes and any(type(m) is nn.RReLU and m.training
                                         for root in self.modules for m in root.modules()):
            raise recomputed_wrong()  # NOTE [ Recomputed wrong by torch ] in watch.py
        known = known_run(self.modules, self.device, self.preserve_rng, self.chain.verified)
        self.known, self.known_draws = known is not None, known is not None and known.draws
        # Known layers draw nothing from Python's or numpy's generators.
        census = self._census = Census.take(
            self.modules, self.preserve_rng and known is None, reach=known is None,
            given=self.given,
        )
        self.given = ()  # the census holds what it needs of them
        self.norms = census.norms
        self.slots = census.slots
        self.scalars = census.scalars
        self._run = contextlib.ExitStack()
        if known is not None:  # nothing to watch, and no hooks
            self._watch, self._hooks = known, None
            return self
        self._refuse_uninitialised(census.slots)
        self._draws = StatelessDraws(census.stateless) if census.stateless else None
        if self._draws is not None:
            self._draws.refuse_unseen(module_names(self.modules), self.prefix)
            self._run.enter_context(self._draws)
        # Running statistics of training-mode BatchNorms are left alone by the replay (rule 2),
        # so nothing else may read them; the name is found only for the error message.
        exempt: dict[int, tuple[nn.Module, str] | None] = {
            storage_key(b): (m, key) if key in ("running_mean", "running_var") else None
            for m in census.norms
            for key, b in m._buffers.items()
            if b is not None
        }
        watched: dict[int, list[Slot]] = {}
        for s in self.slots:
            if s.storage is not None:
                watched.setdefault(s.storage, []).append(s)
        self.chain.user_code_runs()
        self._python_found = self.chain.begin(census.python)
        reads = frozenset(s.storage for s in (*self.slots, *census.loose)
                          if (s.reached if isinstance(s, Slot) else True)
                          and s.storage is not None)
        self._watch = Watch(watched, self.preserve_rng, exempt, reads, self.torch_recomputes)
        self._hooks = HookWatch(census.hooked, self.modules, self.root_owner)
        self._run.enter_context(uncached_parametrizations())
        self._run.enter_context(self._hooks)
        self._run.enter_context(self._watch)
        return self

    def __exit__(self, *exc: Any) -> None:
        run, self._run = self._run, None
        run.__exit__(*exc)
        watch, self._watch = self._watch, None
        self.hooks = self._hooks.transforming if self._hooks is not None else []
        self._hooks = None
        if exc[0] is not None:
            self.chain.cut()
            return
        if self._draws is not None:
            self._draws.refuse_drawn(module_names(self.modules), self.prefix)
        if watch.params_written:
            raise written_after_read(self._name(watch.params_written[0]))
        if watch.exempt_read is not None:
            module, key = watch.exempt_read
            name = module_names(self.modules).get(id(module), "") + key
            raise RuntimeError(
                f"{name} of a BatchNorm in training mode is read by other code in the forward "
                "pass. The replay in backward leaves BatchNorm's running statistics "
                "as the forward left them, so that code would read other values. Read them "
                "outside the recomputed part, or put the BatchNorm in eval mode. (A "
                "saved_tensors_hooks pack hook that copies what the forward saves reads them "
                "too: register it around the checkpointed call instead.)"
            )
        self.generators = list(watch.generators.values())
        if self._python_found:
            left = self.chain.end(self._census.python)
            self.python = [
                (g, state)
                for key, (g, state) in self._python_found.items()
                if not same_state(g, left[key][1], state)
            ]
            self._python_found = {}
        self.external = list(watch.external.values())
        if self.known:
            # Known layers assign no attribute and replace no slot's tensor or its .data; they
            # write only into running statistics, which are no slots (NOTE [ Known layers ]):
            # every slot is as the run found it.
            self.walked, self._census = self._census.modules, None
            return
        for s in self.slots:
            now = s.current()
            copy = watch.written.get(s.storage)
            if now is s.tensor and copy is None:
                if s.storage is not None and storage_key(now) != s.storage:
                    raise RuntimeError(
                        f"{self._name(s)}'s .data was replaced during the forward pass, which "
                        "no operator shows: the replay in backward could not see the value the "
                        "forward found. Assign the tensor instead (self.x = ...) or update it in "
                        "place (self.x.copy_(...))."
                    )
                continue
            if s.table == "_parameters" and s.storage in watch.computed:
                if now is not s.tensor:  # computed, then another parameter put in its place
                    raise written_after_read(self._name(s))
                s.version = version_of(now)  # checked as the run left it (rule 3)
                self.computed.append(s)
                continue
            s.found = copy if copy is not None else s.tensor
            self.changed.append(s)
            if self.keep_left_state:
                s.left = now.detach().clone() if isinstance(now, Tensor) else now
        census, self._census = self._census, None
        self.walked = census.modules
        self.containers = census.containers
        self.attribute_names = census.attribute_names()
        created = census.new_tensor_attributes()
        self.scalars = self.scalars + census.new_plain_attributes()
        reassigned = [s for s in self.changed if s.table == "__dict__"]
        for s in created:
            self.changed.append(s)  # the replay runs without them, as the forward did
            if self.keep_left_state:
                s.left = s.current()
        self.assigned = created + reassigned
        changed = {id(s) for s in self.changed}
        # Unchanged slots are checked later by identity and version only: the tensor itself
        # stays where it is (no reference beyond the module's own).
        kept = [s for s in self.slots if id(s) not in changed]
        self.slots = [s for s in kept if not s.reached]
        # A held module's tensor the run read is to the replay what a saved tensor is to
        # autograd: the one the run read, unless written since; its slot may be reassigned.
        self.held = [s for s in kept if s.reached and s.storage in watch.read]
        # So is a tensor held in a container or plain object, unless the run wrote it (then
        # replayed from its copy).
        self.loose = [t for t in census.loose if t.storage in watch.read
                      and t.storage not in watch.written and t.storage not in watch.external]

    def _refuse_uninitialised(self, slots: Sequence[Slot]) -> None:
        # A lazy module draws its parameters' initial values in its first call, which a replay
        # would not: checkpoints run that call as it is, where they see the module
        # (checkpoint_forward, ReversibleSequence); one held unregistered is refused here.
        lazy = next((s for s in slots if isinstance(s.tensor, UninitializedTensorMixin)), None)
        if lazy is not None:
            raise RuntimeError(
                f"{self._name(lazy)} is a lazy module's parameter or buffer, made in its first "
                f"call from torch's random generators, which a recomputation would not draw "
                f"again. Run one forward of the model first (with torch.no_grad()), or register "
                f"the module as a submodule"
            )

    def _name(self, s: Slot) -> str:
        return self.prefix + s.name(module_names(self.modules))

    # -- before a replay -----------------------------------------------------------------------
    def check(self, owner: str, remedy: str, prefix: str = "") -> None:
        """Raise if a tensor the run read was swapped, modified in place or had its
        ``requires_grad`` changed since (NOTE [ Replay ], rule 3); ``prefix`` is the module's
        dotted name, for the message."""
        for s in (*self.held, *self.loose):  # by version only: its place may be reassigned
            if version_of(s.tensor) != s.version or s.tensor.requires_grad != s.requires_grad:
                self._refuse(s, s.tensor, owner, remedy, prefix)
        for s in self.slots:
            now = s.current()
            if now is s.tensor and (now is None or (
                (s.version is None or version_of(now) == s.version)
                and now.requires_grad == s.requires_grad
            )):
                continue
            self._refuse(s, now, owner, remedy, prefix)

    def _refuse(self, s: Slot, now: Any, owner: str, remedy: str, prefix: str) -> None:
        name = prefix + s.name(module_names(self.modules))
        raise changed_since(owner, name, s.tensor, s.requires_grad, now, remedy)

    # -- the replay ----------------------------------------------------------------------------
    def replayed(self) -> contextlib.AbstractContextManager[None]:
        """Run the replay: same random numbers, the module state the run found, transforming
        hooks only; everything put back afterwards."""
        return _Replay(self)

    @contextlib.contextmanager
    def left_state(self) -> Iterator[None]:
        """Run an inverse with the module state the run left (recorded with
        ``keep_left_state``), and the random numbers the run drew."""
        with (
            self._random_replayed(),
            hooks_hidden_since(self.hook_serial, self.walked),
            self._state_as(lambda s: s.left),
            frozen_running_stats(self.norms, tracked=True),
            recomputing(self.walked, walked=True),
        ):
            yield

    def restore_random(self) -> None:
        """Set the generators to where the run found them (inside :meth:`replayed` or
        :meth:`left_state`, to replay a second piece of code with the same numbers)."""
        for generator, state in self.generators:
            if generator is not None:
                generator.set_state(state)
        for g, state in self.python:
            g.setstate(state)

    @contextlib.contextmanager
    def _random_replayed(self) -> Iterator[None]:
        live = [g for g, _ in self.generators if g is not None]
        if not live and not self.python:
            yield
            return
        current = [(g, g.get_state()) for g in live]
        python = [(g, g.getstate()) for g, _ in self.python]
        self.restore_random()
        try:
            yield
        finally:
            for g, state in current:
                g.set_state(state)
            for g, state in python:
                g.setstate(state)

    def _scalars_found(self) -> list[tuple[dict, str, Any]]:
        """Put the plain numbers and flags the run found; return what to put back."""
        current = [(d, k, d.get(k, MISSING)) for d, k, _ in self.scalars]
        for d, k, v in self.scalars:
            put_attribute(d, k, v)
        return current

    @contextlib.contextmanager
    def _external_found(self) -> Iterator[None]:
        current = [(flat, flat.clone()) for flat, _ in self.external]
        for flat, found in self.external:
            flat.copy_(found)
        try:
            yield
        finally:
            for flat, now in current:
                flat.copy_(now)

    @contextlib.contextmanager
    def _state_as(self, value: Any) -> Iterator[None]:
        current = [(s, s.current()) for s in self.changed]
        for s in self.changed:
            s.put(value(s))
        try:
            yield
        finally:
            for s, now in current:
                s.put(now)

    @contextlib.contextmanager
    def _held_found(self) -> Iterator[None]:
        moved = [(s, s.current()) for s in self.held if s.current() is not s.tensor]
        for s, _ in moved:
            s.put(s.tensor)
        try:
            yield
        finally:
            for s, now in moved:
                s.put(now)

    def drop(self) -> None:
        """Forget what the replay needed (the copies of changed state, the generators' states)."""
        self.changed, self.generators, self.python, self.slots = [], [], [], []
        self.computed = []
        self.scalars, self.external, self.assigned, self.containers = [], [], [], []
        self.held, self.loose, self.attribute_names = [], [], []


class _Replay:
    """:meth:`Recording.replayed`, written out rather than stacked from generator context managers
    (it is entered for every transform of every step): what the run left undone on the rare paths
    (random numbers, changed state) goes on an ExitStack, the rest is set and put back directly,
    in reverse order."""

    __slots__ = ("recording", "rare", "scalars", "frozen", "marked", "uncached")

    def __init__(self, recording: Recording) -> None:
        self.recording = recording

    def __enter__(self) -> None:
        r = self.recording
        self.rare = rare = contextlib.ExitStack()
        self.scalars = self.frozen = self.marked = self.uncached = None
        try:
            if r.generators or r.python:
                rare.enter_context(r._random_replayed())
            if r.external:
                rare.enter_context(r._external_found())
            if r.containers:
                rare.enter_context(as_found(r.containers))
            if r.attribute_names:
                rare.enter_context(without_added(r.attribute_names))
            if r.held:
                rare.enter_context(r._held_found())
            if RemovableHandle.next_id != r.hook_serial:  # hooks registered since (rule 4)
                rare.enter_context(hooks_hidden_since(r.hook_serial, r.walked))
            if r.changed:
                rare.enter_context(r._state_as(_found_copy))
            if r.computed:
                rare.enter_context(parameters_standing_in(r.computed, r._name))
            self.scalars = r._scalars_found()
            if r.norms:
                self.frozen = frozen_running_stats(r.norms, tracked=True, uncounted=r.known)
                self.frozen.__enter__()
            self.marked = recomputing(r.walked, r.hooks, walked=True)
            self.marked.__enter__()
            if parametrize._cache_enabled:  # a cache entered inside the run is the run's own
                self.uncached = uncached_parametrizations()
                self.uncached.__enter__()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            for entered in (self.uncached, self.marked, self.frozen):
                if entered is not None:
                    entered.__exit__(None, None, None)
            if self.scalars is not None:
                for d, k, v in self.scalars:
                    put_attribute(d, k, v)
        finally:
            self.rare.__exit__(*exc)


def _found_copy(slot: Slot) -> Tensor | None:
    # A copy: whatever the replay writes into it is dropped (NOTE [ Replay ], rule 2).
    return None if slot.found is None else slot.found.clone()
