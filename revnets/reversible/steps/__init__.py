"""One step per block: how each kind of block runs in the forward pass, what it records on the
tape, and how its backward reconstructs its input and backpropagates through it.

Every step implements :class:`BlockStep` (step.py, with what the steps of one forward and of one
backward share): ``forward`` takes the block's input halves and returns its output halves,
``reverse`` takes a :class:`~revnets.reversible.tape.Carry` of the block's output and its
gradient and leaves the block's input and its gradient in it. Three kinds:

- :class:`CouplingStep` (recomputed.py): a coupling recomputed in backward, the usual case;
- :class:`StoredCouplingStep` (stored.py): one of the last blocks, whose graphs are kept from
  the forward;
- :class:`InvertibleStep` (invertible.py): a :class:`~revnets.Invertible` module, inverted with
  its ``inverse``.

The two coupling steps share their backward (coupling_backward.py) and the coupling's
arithmetic as the engine applies it, in place and with the bits an exact scaling drops
(arithmetic.py). Read in that order: step, arithmetic, coupling_backward, recomputed, stored,
invertible; each imports only those before it, absolutely, and none imports this face.
"""

from revnets.reversible.steps.invertible import InvertibleStep
from revnets.reversible.steps.recomputed import CouplingStep
from revnets.reversible.steps.step import REMEDY, Backward, BlockPlan, BlockStep, ForwardRun
from revnets.reversible.steps.stored import StoredCouplingStep

__all__ = [
    "REMEDY",
    "Backward",
    "BlockPlan",
    "BlockStep",
    "CouplingStep",
    "ForwardRun",
    "InvertibleStep",
    "StoredCouplingStep",
]
