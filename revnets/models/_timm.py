"""What timm's model factory and its torch.fx feature extraction need from the zoo, beyond
the model classes themselves.

``build`` is timm's ``build_model_with_cfg`` taking timm's ``device=`` and ``dtype=`` factory
keywords (``timm.create_model(name, device="meta")``): the model is built on that device (as
under ``with torch.device(...)``), then cast to that dtype; and ``exact=True``, the arithmetic of
every reversible sequence of the model (NOTE [ Exact reversibility ]), which no memory plan
changes.

torch.fx (timm's ``create_feature_extractor`` and ``features_only=True, feature_cls="fx"``)
keeps a :class:`~revnets.ReversibleSequence` whole, as one leaf of the graph: its forward
chooses between the reversible autograd Function and the plain blocks by whether anything
needs a gradient, which a symbolic trace cannot decide, and the Function is what saves the
memory. Features are therefore taken at the sequences' outputs (the zoo's ``feature_info``
taps), and a traced model trains reversibly as the model does. Invertible modules (i-RevNet's
space-to-depth stem) stay whole too: they check their input's shape in Python, naming what
does not fit. The planner's tracer (:mod:`revnets.graph.trace`) keeps both whole as well.
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar

import torch
from timm.layers import register_notrace_module
from timm.models import build_model_with_cfg
from torch import nn

from revnets.reversible import ReversibleSequence
from revnets.reversible.invertible import Invertible

__all__ = ["build"]

Model = TypeVar("Model", bound=nn.Module)

register_notrace_module(ReversibleSequence)
register_notrace_module(Invertible)


def build(
    cls: type[Model],
    variant: str,
    pretrained: bool,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    exact: bool = False,
    **kwargs: Any,
) -> Model:
    """``build_model_with_cfg(cls, variant, pretrained, **kwargs)`` on ``device`` in ``dtype``,
    its reversible sequences ``exact``."""
    if not isinstance(exact, bool):
        raise TypeError(f"{variant}: exact must be True or False, got {exact!r}")
    where = torch.device(device) if device is not None else contextlib.nullcontext()
    with where:
        model = build_model_with_cfg(cls, variant, pretrained, **kwargs)
    if dtype is not None:
        model.to(dtype=dtype)
    if exact:
        sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
        if not sequences:
            raise ValueError(
                f"{variant} has no reversible sequence, so exact=True (exact reconstruction) "
                f"has nothing to make exact; drop it, or choose a reversible model (a RevNet)"
            )
        for sequence in sequences:
            sequence.exact = True
    return model
