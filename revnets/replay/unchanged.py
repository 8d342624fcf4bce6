"""The refusals of a replay whose run read what has changed since (NOTE [ Replay ], rule 3)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["changed_since"]


def changed_since(
    owner: str, name: str, then: Tensor, requires_grad: bool, now: Any, remedy: str
) -> RuntimeError:
    """Why the tensor named ``name`` that the run read (``then``, which required grad as
    ``requires_grad`` says) is not as the run read it, where ``now`` holds its place (``then``
    itself, another tensor or None); ``owner`` and ``remedy`` frame the message."""
    if now is then and now.requires_grad != requires_grad:
        return RuntimeError(
            f"{owner}: {name}.requires_grad was {requires_grad} in the forward pass and "
            f"is {now.requires_grad} now, so the recomputation would differentiate other "
            "weights than the forward used. Freeze or unfreeze weights before the forward "
            f"pass or after backward. {remedy}"
        )
    if now is not then:
        return RuntimeError(
            f"{owner}: {name} is not the tensor the forward pass used, so recomputing in "
            "backward would differentiate other weights than the forward used. Something "
            "swapped the module's parameters or buffers between forward and backward "
            "(torch.func.functional_call and other stateless calls swap them for the "
            f"forward call only). {remedy}"
        )
    return RuntimeError(
        f"{owner}: {name} was modified in place between the forward pass and backward "
        "(an optimizer step, a manual update, a frozen weight or an eval-mode statistic "
        "changed by hand), so the recomputation would not see what the forward saw. "
        "Ordinary autograd refuses the same for the tensors it saves. Run backward before "
        "changing it, or change it out of place. " + remedy
    )
