"""Reversible residual blocks (Gomez et al. 2017) and the engine that backpropagates through a run
of them by reconstructing each block's input from its output instead of storing it.

A :class:`ReversibleBlock` splits its input into halves ``(x1, x2)`` and computes::

    y1 = combine(x1, f(x2))        additive: y1 = x1 + f(x2)
    y2 = combine(x2, g(y1))        additive: y2 = x2 + g(y1)

which is inverted exactly, whatever f and g are::

    x2 = uncombine(y2, g(y1))      additive: x2 = y2 - g(y1)
    x1 = uncombine(y1, f(x2))      additive: x1 = y1 - f(x2)

A :class:`ReversibleSequence` runs a list of blocks as one autograd Function. Its forward keeps
nothing but the final output. Its backward walks the blocks in reverse, recomputing g(y1) and
f(x2) once each with grad enabled; the same results serve both to reconstruct the block input and
to backpropagate, so f and g run twice per step in all (4/3 of the cost of ordinary backprop for
convolutional f and g), and activation memory does not grow with the number of blocks.

Read top down:

- ``coupling.py``: the couplings (pure maths);
- ``grid.py``: the grid arithmetic of exact sequences (NOTE [ Exact reversibility ]);
- ``block.py``: the block (split, merge, the checks on f and g);
- ``sequence.py``: the sequence (the module users build);
- ``function.py``: the autograd Function: forward records a tape, backward walks it;
- ``tape.py``: the tape and what steps hand each other (NOTE [ Layout ]);
- ``steps/``: one step per block, forward and reverse, behind one interface (``step.py``): a
  coupling recomputed (``recomputed.py``) or stored (``stored.py``), sharing their backward
  (``coupling_backward.py``) and the coupling's in-place and kept-bits arithmetic
  (``arithmetic.py``), and an invertible module (``invertible.py``); ``hooked.py``: the graph a
  hooked block's forward builds for its hooks, and the refusal to backpropagate into it;
- ``compiled.py``: f and g compiled inside the engine, when asked (NOTE [ Compiled transforms ]);
- ``gradient_memory.py``: which gradients backward may write into (NOTE [ Gradient memory ]);
- ``reach.py``: what is differentiated, and the refusal of anything else (NOTE [ What the engine
  differentiates ]);
- :mod:`revnets.replay`: how user code is run again exactly (NOTE [ Replay ]), shared with
  :mod:`revnets.checkpoint`.
"""

from revnets.reversible.block import ReversibleBlock
from revnets.reversible.coupling import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    ExactAdditiveCoupling,
    ExactScaledCoupling,
    ScaledCoupling,
)
from revnets.reversible.sequence import ReversibleSequence, SequenceOptions

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "Coupling",
    "ExactAdditiveCoupling",
    "ExactScaledCoupling",
    "ReversibleBlock",
    "ReversibleSequence",
    "ScaledCoupling",
    "SequenceOptions",
]
