"""How far a converted stack's reconstruction drifts, predicted when it is converted (NOTE
[ Reversible conversion ], rule 2, in the package's face), and the warning where float32
gradients would not be the network's.

Each layer's inverse divides by the construction's ``stream``, so round-off in the
reconstructed hidden state grows by ``1 / |stream|`` per layer reconstructed from the next
(the recurrence's growing mode: ``-1 / stream`` for Difference, ``1 / gamma`` for Momentum,
about ``-1 / (lam * beta)`` for MEFT). Over a chain of ``L`` such layers it grows by the
amplification ``A = |stream|^-L``, and the float32 gradients' largest relative error is about
``2^-24 * A`` (measured on timm ViTs of 2 to 16 layers, Difference(0.5), Momentum(0.1),
MEFT(0.1, 0.1): within 1/2x to 10x of it, until it saturates near 1; tests/test_conversion.py).

The chain, for a stack of ``N`` layers: ``N - 1`` (the stage's output holds the last layer's
input exactly; the first layer's parameters are reached after ``N - 1`` divisions);
``2 * (k - 1)`` with ``keep_input_every=k`` (every k-th block's input kept exactly); the
``N - 2 * b`` layers before the stored ones with ``store_last_blocks=b``. ``exact=True``
reconstructs to the bit and ``memory=Store()`` does not reconstruct: amplification 1.

The threshold, ``A > 1e4``: a predicted relative error of ``2^-24 * 1e4 = 6e-4`` (measured up
to a few times that) in float32, below the rounding of a bfloat16 gradient (``2^-8 = 4e-3``)
that mixed-precision training tolerates, so that below it the gradients train as the network's;
past it the error grows tenfold per layer at ``|stream| = 0.1`` and reaches 1 within a few
layers (Momentum(0.1): 2e-2 at 6 layers, 0.7 at 8). Streams in bfloat16 (a model cast to it,
not autocast, which keeps the streams float32) tolerate ``2^16`` times less, which the warning,
given before any dtype is known, does not count.
"""

from __future__ import annotations

import math
import warnings

from revnets.conversion.construction import Construction
from revnets.plan import Reconstruct, Store

__all__ = ["THRESHOLD", "ReconstructionDriftWarning", "amplification", "warn_of_drift"]

#: The amplification above which a conversion warns (the module's docstring).
THRESHOLD = 1e4

FLOAT32_ROUNDOFF = 2.0 ** -24


class ReconstructionDriftWarning(UserWarning):
    """A converted stack whose float32 reconstruction drifts so far that its gradients are not
    the converted network's (revnets/conversion/drift.py)."""


def chain(layers: int, memory: Reconstruct | Store) -> int:
    """The most layers reconstructed one from the next (the module's docstring)."""
    if isinstance(memory, Store):
        return 0
    longest = layers - 1 if not memory.store_last_blocks else layers - 2 * memory.store_last_blocks
    if memory.keep_input_every is not None:
        longest = min(longest, 2 * (memory.keep_input_every - 1))
    return max(longest, 0)


def amplification(construction: Construction, layers: int,
                  memory: Reconstruct | Store = Reconstruct(), exact: bool = False) -> float:
    """How many times round-off grows in reconstructing a stack of ``layers`` layers written by
    ``construction`` (the float32 gradients' relative error is about ``2^-24`` times it)."""
    if exact:
        return 1.0
    return abs(construction.stream) ** -chain(layers, memory)


def warn_of_drift(construction: Construction, layers: int, memory: Reconstruct | Store,
                  exact: bool, stacklevel: int) -> None:
    """Warn (ReconstructionDriftWarning) where the amplification passes THRESHOLD, naming it and
    the fixes."""
    found = amplification(construction, layers, memory, exact)
    if found <= THRESHOLD:
        return
    stream = abs(construction.stream)
    # keep_input_every=k: 2 * (k - 1) layers in a chain, |stream|^-(2 * (k - 1)) <= THRESHOLD.
    per_layer = math.log(THRESHOLD) / math.log(1 / stream)  # layers in a chain within it
    every = math.floor(per_layer / 2 + 1e-9) + 1  # 1e-9: log(1e4) / log(100) is 1.99...
    # The least stream scale a stack of these layers reconstructs within THRESHOLD.
    least = THRESHOLD ** (-1 / max(chain(layers, Reconstruct()), 1))
    warnings.warn(
        f"make_reversible: {construction} divides by |stream| = {stream:.3g} in each of the "
        f"{chain(layers, memory)} layers its stack of {layers} reconstructs one from the next: "
        f"round-off grows {found:.1e} times, and float32 gradients err by about "
        f"{FLOAT32_ROUNDOFF * found:.1e} relative (revnets/conversion/drift.py). Fixes: "
        f"exact=True with a stream scale +-2^-k (scale=0.5, Momentum(0.5), MEFT(0.5, 0.5)), "
        f"exact to the bit for one byte per element per layer; "
        f"memory=revnets.Reconstruct(keep_input_every={every}), every {every}-th block's input "
        f"kept; a stream scale of at least {least:.3g} (Difference(0.5) up to "
        f"{math.floor(math.log2(THRESHOLD)) + 1} layers, scale=1 at any depth); or "
        f"memory=revnets.Store()", ReconstructionDriftWarning, stacklevel=stacklevel + 1)
