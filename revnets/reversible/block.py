"""The reversible residual block: ``y1 = combine(x1, f(x2))``, ``y2 = combine(x2, g(y1))``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from revnets.facts import version_of
from revnets.replay.known import KnownWalk, known_composite
from revnets.reversible.coupling import KNOWN_COUPLINGS, Coupling, make_coupling

__all__ = ["ReversibleBlock", "split_halves"]


def split_halves(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"ReversibleBlock: split_dim={dim} does not exist for an input of shape "
            f"{tuple(x.shape)}"
        )
    if x.shape[dim] % 2:
        raise ValueError(
            f"ReversibleBlock: cannot split an input of shape {tuple(x.shape)} into two equal "
            f"halves along split_dim={dim} (size {x.shape[dim]} is odd)"
        )
    x1, x2 = x.chunk(2, dim=dim)
    return x1, x2


@known_composite()
class ReversibleBlock(nn.Module):
    """One reversible residual unit: ``y1 = combine(x1, f(x2))``, ``y2 = combine(x2, g(y1))``.

    Args:
        f: transform of the second half, added to the first. Must return the shape the coupling
            asks for (for ``"additive"``: the shape of its input) and must not modify its input.
        g: transform of the new first half, added to the second; same rules as f.
        coupling: ``"additive"`` (RevNet), ``"affine"`` or a :class:`Coupling` instance.
        split_dim: the dimension split into two equal halves (channels for NCHW images,
            the last dimension for transformer tokens).
        drop_path: stochastic depth, the probability that a sample's f (and, drawn apart, its g)
            is dropped in training, the kept ones scaled by ``1 / (1 - drop_path)`` (timm's
            ``DropPath``); checked whenever it is set. Additive couplings only. The block draws
            the masks itself, outside f and g (NOTE [ Drop path outside the transforms ]).

    Calling the block runs it with ordinary autograd. Memory is saved by running blocks inside a
    :class:`ReversibleSequence`. ``block.inverse(y)`` reconstructs the input of ``block(y)``.

    Extra arguments are *context*, passed unchanged to every call of f and g after the half:
    ``block(x, t)`` computes ``f(x2, t)`` and ``g(y1, t)`` (a time or class embedding for FiLM,
    the encoder output for cross-attention). Tensors among them get exact gradients.
    """

    def __init__(
        self,
        f: nn.Module,
        g: nn.Module,
        coupling: str | Coupling = "additive",
        split_dim: int = 1,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        for name, transform in (("f", f), ("g", g)):
            if not isinstance(transform, nn.Module):
                raise TypeError(
                    f"ReversibleBlock: {name} must be an nn.Module, got "
                    f"{type(transform).__name__}: the block's replay follows a module's state "
                    f"(BatchNorm statistics updated once, dropout drawn again alike); wrap the "
                    f"function in an nn.Module (nn.Identity() for nothing)"
                )
        if isinstance(split_dim, bool) or not isinstance(split_dim, int):
            raise TypeError(f"ReversibleBlock: split_dim must be an int, got {split_dim!r}")
        self.f = f
        self.g = g
        self.coupling = make_coupling(coupling, split_dim)
        self.split_dim = split_dim
        self.drop_path = drop_path
        self._check_coupling()  # refused now rather than in the first step

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The two halves of ``x`` along ``split_dim`` (views, no copy)."""
        return split_halves(x, self.split_dim)

    def merge(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.cat((a, b), dim=self.split_dim)

    def forward(self, x: Tensor, *context: Any) -> Tensor:
        return self.merge(*self.forward_halves(*self.split(x), *context))

    def inverse(self, y: Tensor, *context: Any) -> Tensor:
        return self.merge(*self.inverse_halves(*self.split(y), *context))

    def forward_halves(self, x1: Tensor, x2: Tensor, *context: Any) -> tuple[Tensor, Tensor]:
        scales = self.drop_path_scales(x1)
        y1 = self.coupling.combine(x1, self.transform("f", x2, *context, scale=scales["f"]))
        y2 = self.coupling.combine(x2, self.transform("g", y1, *context, scale=scales["g"]))
        return y1, y2

    def inverse_halves(self, y1: Tensor, y2: Tensor, *context: Any) -> tuple[Tensor, Tensor]:
        if self.training and self.drop_path:
            raise RuntimeError(
                f"ReversibleBlock.inverse: the block drops paths in training (drop_path="
                f"{self.drop_path}), and the masks of the forward being inverted are not known; "
                "invert in eval mode (block.eval())"
            )
        x2 = self.coupling.uncombine(y2, self.transform("g", y1, *context))
        x1 = self.coupling.uncombine(y1, self.transform("f", x2, *context))
        return x1, x2

    # NOTE [ Drop path outside the transforms ]
    # Stochastic depth on a reversible block scales each sample's h = f(x2) (and g(y1)) by a
    # mask drawn per sample, 0 or 1 / (1 - drop_path). The block draws both masks before f runs
    # (one call, in the ordinary forward and in the reversible engine's alike, so both draw the
    # same numbers in the same order), and the engine keeps them for the recomputation: two
    # numbers per sample and block, where replaying a draw inside f would keep a generator's
    # state (5 KB on a CPU) and make f draw. f and g themselves then draw nothing, so they may run
    # compiled inside the engine (NOTE [ Compiled transforms ], rule 2) and the block's backward
    # step with them (NOTE [ Compiled block backward ]): inductor's random numbers are not
    # eager's, and a mask drawn inside a compiled graph could not be promised to the
    # recomputation. Inverting a block that drops paths needs its forward's masks: ``inverse``
    # refuses in training mode.

    @property
    def drop_path(self) -> float:
        return self._drop_path

    @drop_path.setter
    def drop_path(self, rate: float) -> None:
        # Checked on every assignment: a schedule raising the rate sets it between steps.
        if isinstance(rate, bool) or not isinstance(rate, (int, float, Tensor)):
            raise TypeError(f"ReversibleBlock: drop_path must be a number, got {rate!r}")
        rate = float(rate)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"ReversibleBlock: drop_path must lie in [0, 1], got {rate}")
        self._drop_path = rate

    def _check_coupling(self) -> None:
        if self.drop_path and not self.coupling.is_additive:
            raise ValueError(
                f"ReversibleBlock: drop_path needs an additive coupling, got {self.coupling!r}; "
                "put a drop path inside f and g instead"
            )

    def drop_path_scales(self, x1: Tensor) -> dict[str, Tensor | None]:
        """The per-sample scales of f's and g's outputs for one forward (NOTE [ Drop path outside
        the transforms ]): drawn here, in training with ``drop_path`` set; else None."""
        self._check_coupling()  # the rate or the coupling may have been set since
        if not (self.training and self.drop_path):
            return {"f": None, "g": None}
        keep = 1.0 - self.drop_path
        shape = (2, x1.shape[0]) + (1,) * (x1.dim() - 1)
        masks = torch.empty(shape, dtype=x1.dtype, device=x1.device).bernoulli_(keep)
        f, g = masks.div_(keep) if keep > 0 else masks  # timm's DropPath: all dropped at 1
        return {"f": f, "g": g}

    def transform(
        self, name: str, half: Tensor, *context: Any,
        call: Callable[..., Tensor] | None = None, scale: Tensor | None = None,
    ) -> Tensor:
        """Run ``f`` or ``g`` (by ``name``) on a half, checking what reversibility relies on.
        ``call(fn, half, *context)``, where given, runs it instead of ``fn(half, *context)`` (a
        compiled function: NOTE [ Compiled transforms ]); ``scale``, where given, multiplies its
        output per sample (drop path: NOTE [ Drop path outside the transforms ])."""
        fn = self.f if name == "f" else self.g
        version = _version(half)
        try:
            h = fn(half, *context) if call is None else call(fn, half, *context)
        except (RuntimeError, NotImplementedError) as error:
            message = str(error)
            if half.is_leaf and half.requires_grad and "in-place operation" in message:
                raise self._modified_input_error(name, fn) from error
            if half.device.type == "cpu" and ("'Half'" in message or "Got Half" in message):
                raise TypeError(
                    f"ReversibleBlock.{name} ({type(fn).__name__}) uses an operation that has no "
                    "float16 kernel on CPU; use bfloat16 on CPU (torch.autocast('cpu', "
                    "dtype=torch.bfloat16)) or float32"
                ) from error
            raise
        if version is not None and half._version != version:
            raise self._modified_input_error(name, fn)
        if not isinstance(h, Tensor):
            raise TypeError(
                f"ReversibleBlock.{name} ({type(fn).__name__}) must return a single Tensor, "
                f"got {type(h).__name__}"
            )
        expected = self.coupling.transform_shape(half.shape)
        if h.shape != expected:
            raise ValueError(
                f"ReversibleBlock.{name} ({type(fn).__name__}) returned shape {tuple(h.shape)} for "
                f"an input half of shape {tuple(half.shape)}; {self.coupling!r} needs "
                f"{tuple(expected)}. A module that changes the shape (strided or "
                "channel-changing) is not invertible: keep it outside the reversible sequence "
                "(wrap it in revnets.Checkpointed to save its memory)"
            )
        return h if scale is None else h * scale.to(h.dtype)

    def walk_known(self, walk: KnownWalk) -> bool:
        """Whether a call runs only known code (NOTE [ Known layers ]): f on a view of the
        input, then g on the coupling's fresh output."""
        coupling = self.coupling
        if type(coupling) not in KNOWN_COUPLINGS or any(map(callable, vars(coupling).values())):
            return False
        walk.kinds.add(type(coupling))
        walk.draws = walk.draws or bool(self.training and self.drop_path)
        if not walk.module(self.f):
            return False
        walk.fresh = True
        return walk.module(self.g)

    @staticmethod
    def _modified_input_error(name: str, fn: nn.Module) -> RuntimeError:
        return RuntimeError(
            f"ReversibleBlock.{name} ({type(fn).__name__}) modified its input in place; a "
            "reversible block needs its input intact to be inverted (look for inplace=True "
            "on the first layer of f or g, or an in-place op such as add_ on the input)"
        )

    def extra_repr(self) -> str:
        drop_path = f", drop_path={self.drop_path}" if self.drop_path else ""
        return f"coupling={self.coupling!r}, split_dim={self.split_dim}{drop_path}"


def _version(half: Tensor) -> int | None:
    """The version counter that catches f or g modifying its input in place (None: unchecked).

    Inference tensors keep no version counter. Under torch.compile neither ``is_inference()``
    nor a version compared after f ran traces (dynamo breaks the graph there, and every break
    inside a block recompiles the code after it for each block shape), so compiled code leaves
    the check out. It guards reconstruction, which compiled code never does: the reversible
    engine runs eagerly (``torch.compiler.disable``), its checks included; stored and
    checkpointed blocks are ordinary autograd. Only a compiled ``block.inverse`` goes unchecked.
    """
    return None if torch.compiler.is_dynamo_compiling() else version_of(half)
