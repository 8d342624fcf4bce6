"""Replaying a forward computation exactly during backward: random numbers, autocast, module state
and forward hooks.

Both memory strategies in revnets (reconstruction in :mod:`revnets.reversible` and recomputation in
:mod:`revnets.checkpoint`) run user code a second time in backward. Both record the first run with
:class:`Recording` and replay it with :meth:`Recording.replayed`; nothing else in revnets captures
or restores state.

# NOTE [ Replay ]
# A replay computes what the recorded run computed, and the step's side effects happen once:
#
# 1. Randomness. The recording watches every operator at the dispatcher: the first time an
#    operator draws from a generator (the device's default one, or any torch.Generator passed to
#    it, wherever user code keeps it), that generator's state is kept. The replay restores each of
#    them, and Python's ``random`` (the module's and the ``random.Random`` objects modules hold as
#    attributes), then puts every generator back as it found it. One whose state cannot be
#    taken (random.SystemRandom) is refused by name where the run draws from it (NOTE
#    [ Generators without state ], stateless.py).
# 2. Module state, by slot. A slot is a parameter, buffer or tensor attribute of a module. The
#    recording notes what each slot held and, at the dispatcher, copies a buffer just before the
#    run first writes into it (copy on write). A slot the run reassigned keeps its old tensor
#    intact, a slot it wrote into has its copy: the replay runs on those (copies of them), so it
#    computes with the state the run found, and whatever it writes is dropped: every update
#    happens once. An inverse (``left_state``) runs with the state the run left.
#    Training-mode BatchNorm is the one exception: its output does not depend on its running
#    statistics, so the replay leaves them alone instead of copying them. Plain numbers and
#    flags, and the lists, dicts, sets, deques and plain objects modules hold (nested ones too:
#    a history appended to, a cache filled, a config's counter; in order), and those among the
#    call's arguments (a key-value cache an attention layer is given and fills), are as the run
#    found them for the time of the replay, whoever changed them since, and as they were after
#    it: the replay's own changes to them are dropped.
#    A run's modules are the recorded ones, their submodules, and what they hold unregistered
#    (a helper in a list or a plain object, with its submodules: NOTE [ What a module holds ],
#    held.py); of a module that holds the
#    recorded one (a parent), only its own numbers, containers and tensors (Census, state.py).
# 3. Anything else the run read must be unchanged when the replay runs, by identity and version
#    counter and requires_grad: a parameter updated in place, swapped (an optimizer step,
#    functional_call) or frozen is refused by name. A run that writes into a parameter after
#    reading it, or into part of it, is refused too. One that overwrites a parameter whole
#    before reading it (ActNorm's data-dependent initialisation: copy_, fill_ under no_grad or
#    through .data) computes it: every read sees the parameter as the run left it, so the check
#    compares with that, the inverse reads it and the replay runs on a copy made with autograd
#    (its write dropped, its gradient the parameter's: computed.py). A module held unregistered
#    may be another part's (a neighbour the run never calls): a tensor of it that the run read
#    (as the watch saw) is to the replay what a saved tensor is to autograd: the replay reads
#    that tensor, refused if written since, wherever its slot points.
# 4. Forward hooks fire once, in the recorded run. A hook that replaced a module's output or
#    changed it in place is part of the computation: the replay runs it again (it can tell, with
#    :func:`is_recomputing`); every other forward hook is silenced. Forward pre-hooks always run
#    (they compute weights: weight_norm, spectral_norm, pruning). A hook registered after the run
#    (a forward pre-hook, a backward hook) is hidden from the replay, as autograd would not run
#    it for this step.
# 5. Parametrizations' caches (``torch.nn.utils.parametrize.cached``) are suspended in both runs:
#    a weight cached without a graph would reach backward without a path to its original.
#
# Watching costs a Python call per operator. A run of torch.nn's own layers only is recorded
# without the watch, with the same findings (NOTE [ Known layers ] in known.py); consecutive runs
# of one forward read Python's and numpy's generators once per boundary, and compare torch's
# namespaces with what torch made once per chain (RecordingChain, state.py), where only revnets'
# own code runs between them; user code there (a hook, a Coupling of one's own) cuts the chain.
"""

from __future__ import annotations

from revnets.replay.autocast import AutocastState
from revnets.replay.held import generators_held
from revnets.replay.hooks import (
    has_forward_hooks,
    is_recomputing,
    recomputing,
    silenced_tensor_hooks,
)
from revnets.replay.norms import frozen_running_stats
from revnets.replay.recording import Recording
from revnets.replay.state import RecordingChain, forked_rng, state_tensors, submodules

__all__ = [
    "AutocastState",
    "RecordingChain",
    "Recording",
    "forked_rng",
    "frozen_running_stats",
    "generators_held",
    "has_forward_hooks",
    "is_recomputing",
    "recomputing",
    "silenced_tensor_hooks",
    "state_tensors",
    "submodules",
]
