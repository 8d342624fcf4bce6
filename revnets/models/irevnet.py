"""Fully invertible networks (i-RevNet, Jacobsen et al. 2018), registered with timm.

Built as the public code (jhjacobsen/pytorch-i-revnet) builds them: an invertible stem (space to
depth at ImageNet's input, injective zero channels at CIFAR's), then stages of i-RevNet blocks
whose downsampling is invertible too (``psi`` on both streams), and a head of BatchNorm-ReLU,
average pooling and a linear classifier. Everything from the stem's output to the head's input is
one :class:`~revnets.ReversibleSequence`, so no stage boundary is stored either: training memory
is flat in depth and in the number of stages. The stem is parameter-free and autograd stores
nothing for it; the head's input is stored as for any classifier. CIFAR's zero channels are
added to each stream rather than after both (see :class:`PadStreams`).

The public code stores every activation; the memory saving is this library's. i-RevNet's blocks
pair into RevNet couplings (see :mod:`revnets.layers.irevnet`), which is how they run here.

Depth is counted as for ResNets: three convolutions per block plus the classifier, so
``irevnet301`` has 100 blocks (6-16-72-6) and ``irevnet1000`` 333 (111-111-111).

Memory plans (:class:`~revnets.plan.MemoryPlan`), switchable on the same weights (``set_memory``),
by preset: ``none`` (ordinary autograd), ``checkpoint`` (about sqrt(n) checkpointed segments of
blocks) and ``reversible`` (the default). Nothing outside the blocks is worth checkpointing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from revnets.layers.irevnet import irevnet_bottleneck, irevnet_stage
from revnets.models._timm import build
from revnets.models.head import PooledClassifier, check_pool
from revnets.models.residual import cifar_cfg, imagenet_cfg
from revnets.plan import PRESETS, Checkpoint, MemoryPlan, Reconstruct, Store
from revnets.plan.switchable import SwitchableMemory
from revnets.reversible import ReversibleSequence
from revnets.reversible.invertible import SpaceToDepth

__all__ = ["IRevNet", "PadStreams"]


class PadStreams(nn.Module):
    """The input's channels split as i-RevNet splits them (``C // 2`` to the first stream, the
    rest to the second), each stream then zero-padded to ``width`` channels: injective.

    The public code pads the merged channels at the end instead, so that the second stream starts
    as all zeros: the first block's F then computes on zeros, its first weights get no gradient,
    and inverting it means differentiating BatchNorm of a constant, which amplifies round-off
    (float64 gradients off by about 1e-10 instead of 1e-15). Padding each stream avoids that at
    no cost."""

    def __init__(self, in_chans: int, width: int) -> None:
        super().__init__()
        self.first = in_chans // 2
        self.pads = (width - self.first, width - (in_chans - self.first))

    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = x[:, : self.first], x[:, self.first :]
        x1 = F.pad(x1, (0, 0, 0, 0, 0, self.pads[0]))
        return torch.cat((x1, F.pad(x2, (0, 0, 0, 0, 0, self.pads[1]))), dim=1)

    def extra_repr(self) -> str:
        return f"pads={self.pads}"


class IRevNet(SwitchableMemory, PooledClassifier, nn.Module):
    """A fully invertible network.

    Args:
        units: i-RevNet blocks per stage, e.g. ``(6, 16, 72, 6)``.
        channels: channels of each stream in each stage, e.g. ``(24, 96, 384, 1536)``; a stage
            with stride 2 has 4x the channels of the one before (``psi`` makes them).
        strides: stride of each stage's first block (1 or 2).
        stem_block_size: space-to-depth block size at the input (i-RevNet's ``init_ds``: 2 for
            ImageNet, 1 for none); zero channels then make up the first stage's width.
        drop_rate: dropout before the classifier (timm's meaning).
        block_drop_rate: dropout inside every block's F (i-RevNet's ``dropout_rate``), replayed
            exactly in backward.
        memory: a :class:`~revnets.plan.MemoryPlan` or a preset's name (module docstring).
        num_classes, in_chans, global_pool: as in timm.
    """

    def __init__(
        self,
        units: Sequence[int],
        channels: Sequence[int],
        strides: Sequence[int],
        stem_block_size: int = 1,
        num_classes: int = 1000,
        in_chans: int = 3,
        drop_rate: float = 0.0,
        block_drop_rate: float = 0.0,
        memory: MemoryPlan | str | None = None,
        global_pool: str = "avg",
    ) -> None:
        super().__init__()
        if not len(units) == len(channels) == len(strides):
            raise ValueError(
                f"IRevNet: units, channels and strides need one value per stage, got "
                f"{len(units)}, {len(channels)} and {len(strides)}"
            )
        check_pool("IRevNet", global_pool)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        stem_channels = in_chans * stem_block_size**2
        stem: list[nn.Module] = []
        if stem_block_size > 1:
            stem.append(SpaceToDepth(stem_block_size))
        half = channels[0] // strides[0] ** 2
        if 2 * half < stem_channels:
            raise ValueError(
                f"IRevNet: the stem gives {stem_channels} channels, more than the first stage's "
                f"two streams take ({2 * half}); widen channels[0]"
            )
        if 2 * half > stem_channels:
            stem.append(PadStreams(stem_channels, half))
        self.stem = nn.Sequential(*stem)

        blocks: list[nn.Module] = []
        self.stage_ends: list[int] = []
        self.feature_info = []
        reduction = stem_block_size
        for index, (count, width, stride) in enumerate(zip(units, channels, strides)):
            if half * stride**2 != width:
                raise ValueError(
                    f"IRevNet: stage {index} has {width} channels per stream, but its input's "
                    f"{half} channels become {half * stride**2} at stride {stride} (space to "
                    "depth keeps every value); use that width"
                )
            transforms = [
                irevnet_bottleneck(
                    half if j == 0 else width,
                    width,
                    stride if j == 0 else 1,
                    preactivate=(index, j) != (0, 0),
                    drop_rate=block_drop_rate,
                )
                for j in range(count)
            ]
            blocks += irevnet_stage(transforms, stride)
            self.stage_ends.append(len(blocks))
            half = width
            reduction *= stride
            tap = f"blocks.blocks.{len(blocks) - 1}"
            self.feature_info.append(dict(num_chs=2 * width, reduction=reduction, module=tap))
        self.blocks = ReversibleSequence(blocks)
        self.num_features = self.head_hidden_size = 2 * half
        self.final_act = nn.Sequential(nn.BatchNorm2d(2 * half), nn.ReLU(inplace=True))
        self.head_drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(2 * half, num_classes) if num_classes else nn.Identity()
        self._init_weights()
        self.family = "i-RevNet"
        self.memory = PRESETS["none"]
        self.set_memory(memory or "reversible")

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    # -- input size ---------------------------------------------------------------------------
    def input_size_problem(self, height: int, width: int) -> str | None:
        """Why an input of ``height`` x ``width`` pixels cannot pass, or None (what a trainer
        checks before a step fails in ``SpaceToDepth``): space to depth, at the stem and at each
        stride-2 stage, splits the image into blocks, so both sides must be multiples of the
        reduction those steps add up to."""
        reduction = self.feature_info[-1]["reduction"]
        if height % reduction == 0 and width % reduction == 0:
            return None
        above = -(-max(height, width) // reduction) * reduction
        return (f"an input of {height}x{width} pixels does not split into its space-to-depth "
                f"blocks: its sides must be multiples of {reduction} (the smallest is "
                f"{reduction}; {above} is the nearest above)")

    # -- memory plan --------------------------------------------------------------------------
    def memory_problem(self, plan: MemoryPlan) -> str | None:
        if not isinstance(plan.rest, Store):
            return ("its stem stores nothing and its head only the classifier's input: there is "
                    "nothing outside the blocks to checkpoint (rest must be Store())")
        return None

    def apply_memory(self, plan: MemoryPlan) -> None:
        self.blocks.set_memory(plan.stages)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's switch. Every block is reconstructed already; checkpointing would only add
        recomputation, so ``enable`` switches to ``checkpoint`` and back to ``reversible``, with
        the options its reconstruction had."""
        if isinstance(self.memory.stages, Reconstruct):
            self._reconstruction = self.memory.stages
        stages = Checkpoint() if enable else getattr(self, "_reconstruction", Reconstruct())
        self.set_memory(MemoryPlan(stages, Store()))

    # -- timm interface -----------------------------------------------------------------------
    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(
            stem=r"^stem",
            blocks=[(r"^blocks\.blocks\.(\d+)", None), (r"^final_act", (99999,))],
        )

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return set()

    def forward_features(self, x: Tensor) -> Tensor:
        return self.final_act(self._run_blocks(self.stem(x)))

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's intermediate features: each stage's output (all by default, the last
        ``indices`` if an int, else those listed), run reversibly between the taps; ``norm``
        applies the final BatchNorm-ReLU to the last stage's."""
        if output_fmt != "NCHW":
            raise ValueError(f"IRevNet: only output_fmt='NCHW' is supported, got {output_fmt!r}")
        take, max_index = feature_take_indices(len(self.stage_ends), indices)
        intermediates = []
        x = self.stem(x)
        start = 0
        last_stage = len(self.stage_ends) - 1
        for index in sorted(take):
            x = self._run_blocks(x, start, self.stage_ends[index])
            start = self.stage_ends[index]
            tap = self.final_act(x) if norm and index == last_stage else x
            intermediates.append(tap)
        if intermediates_only:
            return intermediates
        stop = self.stage_ends[max_index] if stop_early else len(self.blocks)
        if start < stop:
            x = self._run_blocks(x, start, stop)
        return self.final_act(x), intermediates

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the blocks behind the last requested tap (timm's feature_cls='getter' calls
        this), and the final BatchNorm-ReLU with them or if ``prune_norm``."""
        take, max_index = feature_take_indices(len(self.stage_ends), indices)
        stop = self.stage_ends[max_index]
        if stop < len(self.blocks):
            self.blocks = self.blocks.sliced(0, stop)
        self.stage_ends = self.stage_ends[: max_index + 1]
        if prune_norm or max_index < len(self.feature_info) - 1:
            self.final_act = nn.Identity()
        if prune_head:
            self.reset_classifier(0)
        return take

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def _create(variant: str, pretrained: bool, defaults: dict[str, Any], **kwargs: Any) -> IRevNet:
    if pretrained:
        raise ValueError(
            f"no pretrained weights are bundled for {variant}: create it with pretrained=False"
        )
    kwargs = {**defaults, **kwargs}
    # By default every stage's output (timm assumes five taps; these nets have three or four).
    taps = tuple(range(len(kwargs["units"])))
    return build(
        IRevNet,
        variant,
        pretrained,
        feature_cfg=dict(feature_cls="getter", out_indices=taps),
        **kwargs,
    )


default_cfgs = generate_default_cfgs(
    {
        "irevnet301.untrained": imagenet_cfg(first_conv="blocks.blocks.1.f.transform.0"),
        "irevnet163.untrained": cifar_cfg(first_conv="blocks.blocks.0.f.0"),
        "irevnet1000.untrained": cifar_cfg(first_conv="blocks.blocks.0.transform.0"),
    }
)

# The public code's CIFAR plan: no space to depth at the input, 16 channels per stream.
_CIFAR = dict(channels=(16, 64, 256), strides=(1, 2, 2), stem_block_size=1, num_classes=10)


@register_model
def irevnet301(pretrained: bool = False, **kwargs: Any) -> IRevNet:
    """i-RevNet-301 for ImageNet: 6-16-72-6 blocks, 24-96-384-1536 channels per stream, space to
    depth at the input (3x224x224 -> 12x112x112), bijective up to the head's 3072x7x7."""
    args = dict(units=(6, 16, 72, 6), channels=(24, 96, 384, 1536), strides=(2, 2, 2, 2),
                stem_block_size=2)
    return _create("irevnet301", pretrained, args, **kwargs)


@register_model
def irevnet163(pretrained: bool = False, **kwargs: Any) -> IRevNet:
    """A CIFAR i-RevNet as the public code configures one: 18-18-18 blocks (3 x 54 + 1 = 163
    layers), 16-64-256 channels per stream, invertible downsampling between the stages."""
    return _create("irevnet163", pretrained, dict(_CIFAR, units=(18, 18, 18)), **kwargs)


@register_model
def irevnet1000(pretrained: bool = False, **kwargs: Any) -> IRevNet:
    """A 1000-layer fully invertible CIFAR network: 111-111-111 blocks (3 x 333 + 1 layers),
    16-64-256 channels per stream."""
    return _create("irevnet1000", pretrained, dict(_CIFAR, units=(111, 111, 111)), **kwargs)
