"""How a converted stack writes its streams: the constructions that make a pretrained stack
reversible, each one recurrence over the same two streams (NOTE [ Reversible conversion ],
rule 1, in the package's face).

Every construction computes, for layer n of the stack (``L_n`` the pretrained layer, the
streams ``z_0 = x`` and ``z_{-1} = start * x`` at the start, ``x`` the stack's input)::

    z_n = stream * z_{n-2} + layer * L_n(z_{n-1}) + skip * z_{n-1}

that is the coupling ``y = stream * x1 + h(x2)`` with ``h = layer * L + skip * id``. They differ
in the three numbers, hence in how far step 0 is from the pretrained function and in how far
reconstruction drifts (its inverse divides by ``stream``):

- :class:`Difference` (revnets' own): ``z_n = L_n(z_{n-1}) + scale * (z_{n-2} - z_{n-1})``.
- :class:`Momentum` (Momentum ResNets, Sander et al. 2021; revlib's ``momentum_net``): the
  velocity ``v_n = gamma * v_{n-1} + (1 - gamma) * F_n(z_{n-1})``, ``z_n = z_{n-1} + v_n``,
  written over the two streams (``v_{n-1} = z_{n-1} - z_{n-2}``).
- :class:`MEFT` (Liao et al. 2023, MEFT1): ``y1 = lam * x1 + L(x2)``, ``y2 = beta * x2 + G(y1)``
  with the layer as F, the streams swapped after each layer; its adapter G is zero at MEFT's
  start and left out here (a LoRA or the layers themselves train instead), so the two
  couplings of a layer are one, ``z_n = lam * beta * z_{n-2} + L_n(z_{n-1})``, from
  ``z_{-1} = x / beta`` (MEFT's first layer adds ``lam * x``). Its output is the stream
  written last, as for every construction (MEFT's code averages the two streams).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

__all__ = ["MEFT", "Construction", "Difference", "Momentum", "construction_of", "real"]


def real(owner: str, name: str, value: object) -> float:
    """``value``, a real number (a Python or numpy one), as a float; a tensor or anything else
    refused by name. A construction's numbers are fixed: a tensor, which may be trained or live
    on a device, is not taken for one."""
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{owner}: {name} must be a number, got a tensor ({value!r}); give "
            f"float({name}) if it is a fixed one (it is not trained: the inverse divides by it)")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    return float(value)


def _fraction(owner: str, name: str, value: object, *, closed: bool) -> float:
    """``value`` as a float in (0, 1] (``closed``) or (0, 1), refused by name otherwise."""
    value = real(owner, name, value)
    if not (0 < value <= 1 if closed else 0 < value < 1):
        interval = "(0, 1]" if closed else "(0, 1)"
        raise ValueError(f"make_reversible: {owner}'s {name} must be a number in {interval}, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class Construction:
    """``z_n = stream * z_{n-2} + layer * L_n(z_{n-1}) + skip * z_{n-1}`` from
    ``z_{-1} = start * x``, ``z_0 = x`` (the module's docstring): its four numbers. Subclasses
    name them from their own parameters."""

    @property
    def stream(self) -> float:
        """What the older stream is multiplied by; the inverse divides by it."""
        raise NotImplementedError

    @property
    def layer(self) -> float:
        """What the layer's output is multiplied by."""
        return 1.0

    @property
    def start(self) -> float:
        """What the older stream starts as, times the stack's input."""
        return 1.0

    @property
    def skip(self) -> float:
        """What the stream the layer reads is multiplied by and added."""
        return 0.0

    @property
    def additive(self) -> bool:
        """Whether the coupling is the RevNet sum ``y = x1 + h`` (exact on the grid)."""
        return self.stream == 1.0

    def first_layer_exact(self) -> bool:
        """Whether the first layer computes the pretrained one: ``z_1 = L_1(x)`` needs
        ``stream * start + skip == 0`` and ``layer == 1``."""
        return self.stream * self.start + self.skip == 0 and self.layer == 1


@dataclass(frozen=True)
class Difference(Construction):
    """``z_n = L_n(z_{n-1}) + scale * (z_{n-2} - z_{n-1})``: revnets' construction. The first
    layer is the pretrained one at any scale; each later one differs from it by ``scale`` times
    the previous layer's update. ``scale=1``: the RevNet coupling ``z_n = z_{n-2} + F_n``."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", _fraction("Difference", "scale", self.scale,
                                                    closed=True))

    @property
    def stream(self) -> float:
        return self.scale

    @property
    def skip(self) -> float:
        return -self.scale


@dataclass(frozen=True)
class Momentum(Construction):
    """Momentum ResNets' ``v_n = gamma * v_{n-1} + (1 - gamma) * F_n(z_{n-1})``,
    ``z_n = z_{n-1} + v_n`` (``F_n = L_n - id``, ``v_0 = 0``): each update is scaled by
    ``1 - gamma`` (the first layer's too) and carries ``gamma`` times the previous velocity.
    The inverse divides by ``gamma``; the pretrained function is kept only as it goes to 0."""

    gamma: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "gamma", _fraction("Momentum", "gamma", self.gamma,
                                                    closed=False))

    @property
    def stream(self) -> float:
        return -self.gamma

    @property
    def layer(self) -> float:
        return 1.0 - self.gamma

    @property
    def skip(self) -> float:
        return 2.0 * self.gamma


@dataclass(frozen=True)
class MEFT(Construction):
    """MEFT1's couplings (``y1 = lam * x1 + L(x2)``, ``y2 = beta * x2 + G(y1)``, the streams
    swapped) at MEFT's start, where its adapter G is zero: ``z_n = lam * beta * z_{n-2} +
    L_n(z_{n-1})`` from ``z_{-1} = x / beta``. Each layer differs from the pretrained one by
    ``lam * beta`` times the hidden state two layers back (the first by ``lam * x``; the
    paper: 0.1 each); the inverse divides by both."""

    lam: float = 0.1
    beta: float = 0.1

    def __post_init__(self) -> None:
        for name in ("lam", "beta"):
            object.__setattr__(self, name, _fraction("MEFT", name, getattr(self, name),
                                                     closed=True))

    @property
    def stream(self) -> float:
        return self.lam * self.beta

    @property
    def start(self) -> float:
        return 1.0 / self.beta


def construction_of(value: object) -> Construction:
    """``value``, a Construction; a class given for one (``construction=Momentum``) or anything
    else refused by name."""
    if isinstance(value, type) and issubclass(value, Construction):
        try:
            example = repr(value())
        except TypeError:
            example = f"{value.__name__}(...)"
        raise TypeError(f"make_reversible: construction={value.__name__} is the class; give one "
                        f"of its constructions, e.g. construction={example}")
    if not isinstance(value, Construction):
        raise TypeError(f"make_reversible: construction must be a revnets.conversion "
                        f"Construction (Difference, Momentum, MEFT), got {value!r}")
    return value
