"""The one check of a user's inverse against its forward, on the first input it reconstructs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from revnets.replay import forked_rng

__all__ = ["check_inverse_once"]

# NOTE [ A user's inverse is checked once ]
# Reconstruction trusts ``inverse`` (an Invertible's) and ``uncombine`` (a Coupling's): one that
# does not undo its forward (a typo, a forward that is not injective: a ReLU declared
# invertible) reconstructs wrong inputs, and the gradients are silently wrong while the outputs
# are right. revnets' own couplings and invertible layers are tested; a user's is checked the
# first time a reversible sequence runs it in training, on the input it was given: its inverse
# of the output must return the input, to within a tolerance that passes round-off (1e-3
# relative in float32 and float64, 0.1 under autocast or in a 16-bit dtype) and fails a wrong
# formula (errors of order 1). A failure raises, naming the module.
# - Once per object: a flag on it (``_revnets_inverse_checked``), which copies (deepcopy, a
#   prediction's fakes) carry, so a prediction of a step runs the check where the real step does.
# - The check runs the same operators on fake tensors as on real ones (a prediction counts its
#   temporaries: the inverse's output and a difference, of one input's size, freed at once) and
#   reads no value there. It draws from no generator the step sees (forked around it).
# - Under torch.compile it is skipped: the flag is left unset, and eager steps check.
_FLAG = "_revnets_inverse_checked"


def check_inverse_once(
    owner: object, name: str, x: Tensor, inverse_of_forward: Callable[[], Tensor]
) -> None:
    """Raise if ``inverse_of_forward()`` (the inverse of the forward of ``x``) is not ``x``,
    the first time for ``owner`` (NOTE [ A user's inverse is checked once ])."""
    if getattr(owner, _FLAG, False) or torch.compiler.is_compiling():
        return
    with torch.no_grad(), forked_rng(x.device):
        back = inverse_of_forward()
        if back.shape != x.shape:
            raise ValueError(
                f"{name}: its inverse returned shape {tuple(back.shape)} for an input of shape "
                f"{tuple(x.shape)}; the inverse must return the forward's input"
            )
        inf = float("inf")
        error = torch.linalg.vector_norm(back.float() - x.float(), inf)
        scale = torch.linalg.vector_norm(x.float(), inf).clamp_min(1e-30)
        relative = error / scale
    object.__setattr__(owner, _FLAG, True)
    if is_fake(relative) or relative.device.type == "meta":
        return
    low = torch.is_autocast_enabled(x.device.type) or torch.finfo(back.dtype).bits <= 16
    tolerance = 0.1 if low else 1e-3
    if relative.item() > tolerance:
        raise ValueError(
            f"{name}: its inverse does not undo its forward on this input (relative error "
            f"{relative.item():.2e}, above {tolerance:g}), so reconstructing its input in "
            f"backward would give wrong gradients. Fix the inverse (revnets.check_invertible "
            f"tests one), or keep the module out of the reversible sequence if its forward is "
            f"not invertible"
        )
