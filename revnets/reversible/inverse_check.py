"""The one check of a user's inverse against its forward, on the first input it reconstructs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from revnets.replay import forked_rng
from revnets.reversible.coupling import STOCK_COUPLINGS, Coupling

__all__ = ["check_inverse_once", "check_uncombine_once", "mark_inverse_checked"]

# NOTE [ A user's inverse is checked once ]
# Reconstruction trusts ``inverse`` (an Invertible's) and ``uncombine`` (a Coupling's): one that
# does not undo its forward (a typo, a forward that is not injective: a ReLU declared
# invertible) reconstructs wrong inputs, and the gradients are silently wrong while the outputs
# are right. revnets' own couplings and invertible layers are tested; a user's is checked the
# first time a reversible sequence's training step will reconstruct through it, on the input it
# was given: its inverse of the output must return the input.
# - Tolerance: round-off scales with the largest value the forward met (the input, the output,
#   a coupling's transform h), so the error is taken relative to that: within 1e-3 in float32
#   and float64, 0.1 under autocast or in a 16-bit dtype, it passes round-off (a Glow coupling
#   with a zero half, a bf16 stack) and fails a wrong formula (errors of order 1). A NaN fails.
# - Only where the inverse will run: not for a block whose input is kept (keep_input_every) or
#   whose graph is stored (store_last_blocks), and on every path that reconstructs (a block with
#   forward hooks too).
# - Once per object: a flag on it (``_revnets_inverse_checked``), set only once it passed, so a
#   refused module is checked again at the next step. Copies (deepcopy, a prediction's fakes)
#   carry it, so a prediction of a step runs the check where the real step does.
#   ``revnets.check_invertible`` sets it when it passes: a module checked that way is not
#   checked again in a step.
# - The check runs the same operators on fake tensors as on real ones (a prediction counts its
#   temporaries: a coupling's output made again, the inverse's output and their difference,
#   each of one input's size, freed at once; the first step's peak can be that much higher) and
#   reads no value there (nor sets the flag on the real module). It draws from no generator
#   the step sees (forked around it). Under torch.compile it is skipped, and eager steps check.
_FLAG = "_revnets_inverse_checked"


def check_inverse_once(
    owner: object, name: str, x: Tensor, inverse_of_forward: Callable[[], Tensor],
    met: Sequence[Tensor] = (),
) -> None:
    """Raise if ``inverse_of_forward()`` (the inverse of the forward of ``x``) is not ``x``,
    the first time for ``owner``; ``met``: the other values the forward met (or their largest
    magnitudes, 0-dim), read after ``inverse_of_forward`` ran, whose magnitude round-off scales
    with (NOTE [ A user's inverse is checked once ])."""
    if getattr(owner, _FLAG, False) or torch.compiler.is_dynamo_compiling():
        return
    with torch.no_grad(), forked_rng(x.device):
        back = inverse_of_forward()
        if back.shape != x.shape:
            raise ValueError(
                f"{name}: its inverse returned shape {tuple(back.shape)} for an input of shape "
                f"{tuple(x.shape)}; the inverse must return the forward's input"
            )
        error = _largest(back - x)
        del back
        scale = torch.stack([_largest(t) for t in (x, *met)]).amax()
        relative = error / scale.clamp_min(torch.finfo(torch.float32).tiny)
    if is_fake(relative) or relative.device.type == "meta":
        mark_inverse_checked(owner)
        return
    low = torch.is_autocast_enabled(x.device.type) or torch.finfo(x.dtype).bits <= 16
    tolerance = 0.1 if low else 1e-3
    value = relative.item()
    if not value <= tolerance:  # NaN too
        raise ValueError(
            f"{name}: its inverse does not undo its forward on this input (relative error "
            f"{value:.2e}, above {tolerance:g}), so reconstructing its input in backward "
            f"would give wrong gradients. Fix the inverse (revnets.check_invertible tests one), "
            f"or keep the module out of the reversible sequence if its forward is not invertible"
        )
    mark_inverse_checked(owner)


def check_uncombine_once(coupling: Coupling, x: Tensor, h: Tensor) -> None:
    """A user's coupling's ``uncombine`` checked once, before a block reconstructs with it."""
    if type(coupling) in STOCK_COUPLINGS:
        return
    met = [h]

    def inverse_of_forward() -> Tensor:
        y = coupling.combine(x, h)
        met.append(torch.linalg.vector_norm(y, float("inf")))
        return coupling.uncombine(y, h)

    check_inverse_once(coupling, f"the coupling {coupling!r}", x, inverse_of_forward, met)


def mark_inverse_checked(owner: object) -> None:
    """A step need not check ``owner``'s inverse again (NOTE [ A user's inverse is checked
    once ])."""
    object.__setattr__(owner, _FLAG, True)


def _largest(t: Tensor) -> Tensor:
    """The largest magnitude in ``t`` (a 0-dim float32 tensor; ``t`` itself if 0-dim)."""
    return (t if t.dim() == 0 else torch.linalg.vector_norm(t, float("inf"))).float()
