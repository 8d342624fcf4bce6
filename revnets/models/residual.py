"""Pre-activation ResNets and RevNets for CIFAR and ImageNet, registered with timm.

Architectures follow the official RevNet code (renmengye/revnet-public), so parameter counts match
the RevNet paper's table exactly. One class builds both families; ``reversible=True`` makes the
units RevNet units: the units of a stage that keep the shape run in a
:class:`~revnets.ReversibleSequence`, and the first unit of a stage, where the shape changes, is an
ordinary (non-invertible) :class:`~revnets.layers.RevNetDownsampleUnit`.

How much memory a model saves is a :class:`~revnets.plan.MemoryPlan`, switchable on the same
weights (``set_memory``); its ``stages`` decision is for the units of each stage, its ``rest``
for the stem, the downsampling units and the final activation. The presets:

- ``none``: store every activation (for a RevNet: the same weights under ordinary autograd).
- ``checkpoint``: split every stage into about sqrt(n) checkpointed segments of units (only the
  network's last segment is stored: backward would recompute it at once).
- ``reversible`` (RevNet default): reversible units reconstruct; the stem, downsampling units and
  head are stored.
- ``reversible+checkpoint``: as ``reversible``, with the stem, downsampling units and final
  activation checkpointed too.

Depth is counted as in the papers: every convolution on the main path plus the stem convolution
and the classifier (projection shortcuts not counted). A basic unit has 2 convolutions, a
bottleneck unit 3; a RevNet unit has f and g, so twice that: RevNet-38 = 3 stages x 3 units x 4 + 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from revnets.checkpoint import run_checkpointed_segments
from revnets.layers import (
    ResidualUnit,
    RevNetDownsampleUnit,
    preact_basic,
    preact_bottleneck,
    shortcut,
)
from revnets.models._timm import build
from revnets.models.head import PooledClassifier, check_pool
from revnets.plan import PRESETS, Checkpoint, MemoryPlan, Reconstruct, Store
from revnets.plan.switchable import SwitchableMemory
from revnets.reversible import ReversibleBlock, ReversibleSequence

__all__ = ["ResidualNet"]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class Stage(SwitchableMemory, nn.Module):
    """Units of one resolution: ordinary ``units`` first, then an optional reversible run.

    ``last``: the network's last stage, whose last checkpointed segment is stored (backward
    would recompute it at once); other stages checkpoint every segment."""

    def __init__(self, units: Sequence[nn.Module], reversible: Sequence[ReversibleBlock]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)
        self.reversible = ReversibleSequence(reversible) if reversible else None
        self.memory = PRESETS["none"]
        self.last = True

    def apply_memory(self, plan: MemoryPlan) -> None:
        if self.reversible is not None:
            self.reversible.set_memory(plan.stages)

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.memory.stages, Checkpoint) and self._saving():
            # Reversible blocks run here as ordinary modules, grouped with the other units.
            plain = self.reversible.plain_units() if self.reversible is not None else []
            units = [*self.units, *plain]
            segments = self.memory.stages.segments_for(len(units))
            return run_checkpointed_segments(
                units, x, segments, checkpoint_last=not self.last,
                selective=self.memory.stages.selective,
            )
        for unit in self.units:
            x = self._maybe_checkpoint(unit, x)
        if self.reversible is not None:
            x = self.reversible(x)
        return x


class _Activation(nn.Sequential):
    """BatchNorm-ReLU, checkpointable as one piece."""

    def __init__(self, channels: int) -> None:
        super().__init__(nn.BatchNorm2d(channels), nn.ReLU(inplace=True))


class ResidualNet(SwitchableMemory, PooledClassifier, nn.Module):
    """A pre-activation ResNet (``reversible=False``) or RevNet (``reversible=True``).

    Args:
        units: residual units per stage, e.g. ``(9, 9, 9)``.
        channels: stem channels then the channels of each stage (before the x4 of bottleneck
            units), e.g. ``(32, 32, 64, 128)``.
        bottleneck: bottleneck units (1x1-3x3-1x1, 4x the channels out) instead of basic ones.
        reversible: RevNet units.
        stem: ``"cifar"`` (conv3x3) or ``"imagenet"`` (conv7x7 stride 2, max pool).
        memory: a :class:`~revnets.plan.MemoryPlan` or a preset's name (module docstring);
            default ``reversible`` for a RevNet, ``none`` for a ResNet.
        zero_init_last: start every residual branch (each f and g of a RevNet) at zero by
            zero-initializing its last convolution (timm's keyword, as in its ResNetV2).
        num_classes: as in timm.
        in_chans: as in timm.
        drop_rate: as in timm.
    """

    def __init__(
        self,
        units: Sequence[int],
        channels: Sequence[int],
        bottleneck: bool = False,
        reversible: bool = False,
        stem: str = "cifar",
        memory: MemoryPlan | str | None = None,
        num_classes: int = 10,
        in_chans: int = 3,
        drop_rate: float = 0.0,
        global_pool: str = "avg",
        zero_init_last: bool = False,
    ) -> None:
        super().__init__()
        if len(channels) != len(units) + 1:
            raise ValueError(
                f"ResidualNet: channels needs the stem's plus one per stage ({len(units) + 1} "
                f"values), got {len(channels)}"
            )
        check_pool("ResidualNet", global_pool)
        self.global_pool = global_pool
        self.reversible = reversible
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        expansion = 4 if bottleneck else 1
        self.stem = self._make_stem(stem, in_chans, channels[0])

        strides = [1] + [2] * (len(units) - 1)
        stages = []
        in_ch = channels[0]
        # timm's feature taps (features_only=True): the stem's activation, then every stage.
        reduction = 1 if stem == "cifar" else 2
        self.feature_info = [dict(num_chs=in_ch, reduction=reduction, module="stem.2")]
        reduction *= 1 if stem == "cifar" else 2  # the ImageNet stem's max pooling
        for index, (count, width, stride) in enumerate(zip(units, channels[1:], strides)):
            out_ch = width * expansion
            plain, blocks = [], []
            for j in range(count):
                unit_in, unit_stride = (in_ch, stride) if j == 0 else (out_ch, 1)
                unit = self._make_unit(
                    unit_in, out_ch, unit_stride, bottleneck, preactivate=(index, j) != (0, 0)
                )
                (blocks if isinstance(unit, ReversibleBlock) else plain).append(unit)
            if blocks and plain and len(plain) > 1:
                raise AssertionError("only the first unit of a stage can be non-invertible")
            stages.append(Stage(plain, blocks))
            in_ch = out_ch
            reduction *= stride
            self.feature_info.append(
                dict(num_chs=out_ch, reduction=reduction, module=f"stages.{index}")
            )
        for stage in stages[:-1]:
            stage.last = False
        self.stages = nn.Sequential(*stages)
        self.final_act = _Activation(in_ch)
        self.num_features = self.head_hidden_size = in_ch
        self.head_drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(in_ch, num_classes) if num_classes else nn.Identity()
        self._init_weights(zero_init_last)
        self.family = "RevNet" if reversible else "ResNet"
        self.memory = PRESETS["none"]
        self.set_memory(memory or ("reversible" if reversible else "none"))

    @staticmethod
    def _make_stem(kind: str, in_chans: int, out_ch: int) -> nn.Sequential:
        if kind == "cifar":
            return nn.Sequential(
                nn.Conv2d(in_chans, out_ch, 3, padding=1, bias=False), *_Activation(out_ch)
            )
        if kind == "imagenet":
            return nn.Sequential(
                nn.Conv2d(in_chans, out_ch, 7, stride=2, padding=3, bias=False),
                *_Activation(out_ch),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        raise ValueError(f"ResidualNet: unknown stem {kind!r}; valid: 'cifar', 'imagenet'")

    def _make_unit(
        self, in_ch: int, out_ch: int, stride: int, bottleneck: bool, preactivate: bool
    ) -> nn.Module:
        transform = preact_bottleneck if bottleneck else preact_basic
        if not self.reversible:
            return ResidualUnit(
                transform(in_ch, out_ch, stride, preactivate),
                shortcut(in_ch, out_ch, stride, bottleneck),
            )
        half_in, half_out = in_ch // 2, out_ch // 2
        f = transform(half_in, half_out, stride, preactivate)
        g = transform(half_out, half_out, 1)
        if stride == 1 and in_ch == out_ch:
            return ReversibleBlock(f, g)
        return RevNetDownsampleUnit(
            f,
            g,
            shortcut(half_in, half_out, stride, bottleneck),
            shortcut(half_in, half_out, stride, bottleneck),
        )

    def _init_weights(self, zero_init_last: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                # The official code: normal with std sqrt(2 / (k * k * out_channels)).
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_last:
            for m in self.modules():
                if isinstance(m, ResidualUnit):
                    branches = [m.transform]
                elif isinstance(m, (ReversibleBlock, RevNetDownsampleUnit)):
                    branches = [m.f, m.g]
                else:
                    continue
                for branch in branches:
                    convs = [c for c in branch.modules() if isinstance(c, nn.Conv2d)]
                    nn.init.zeros_(convs[-1].weight)

    # -- memory plan --------------------------------------------------------------------------
    def memory_problem(self, plan: MemoryPlan) -> str | None:
        if isinstance(plan.stages, Reconstruct) and not self.reversible:
            return "a ResNet has no reversible units to reconstruct"
        return None

    def apply_memory(self, plan: MemoryPlan) -> None:
        for stage in self.stages:
            stage.set_memory(plan)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's switch: checkpoint what is stored (RevNet: the stem, downsampling units and
        final activation; ResNet: the stages), or stop checkpointing."""
        if self.reversible:
            self.set_memory(MemoryPlan(self.memory.stages, Checkpoint() if enable else Store()))
        else:
            self.set_memory("checkpoint" if enable else "none")

    # -- timm interface -----------------------------------------------------------------------
    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for layer-wise learning-rate decay, as timm's ResNet names them."""
        if coarse:
            return dict(stem=r"^stem", blocks=r"^stages\.(\d+)")
        # A stage's first unit, then its reversible blocks (numbered from 0 again): after it.
        return dict(stem=r"^stem", blocks=[
            (r"^stages\.(\d+)\.units\.(\d+)", None),
            (r"^stages\.(\d+)\.reversible\.blocks\.(\d+)", (1,)),
            (r"^final_act", (99999,)),
        ])

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Nothing by name: BatchNorm and bias parameters, the 1-D ones, are left out of weight
        decay by timm's optimizer factory already."""
        return set()

    def forward_features(self, x: Tensor) -> Tensor:
        x = self._maybe_checkpoint(self.stem, x)
        x = self.stages(x)
        return self._maybe_checkpoint(self.final_act, x)

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's intermediate features: the taps of ``feature_info`` (the stem, then each stage),
        all of them by default, the last ``indices`` if an int, else those listed. ``norm``
        applies the final BatchNorm-ReLU to the last stage's tap."""
        if output_fmt != "NCHW":
            raise ValueError(
                f"ResidualNet: only output_fmt='NCHW' is supported, got {output_fmt!r}"
            )
        take, max_index = feature_take_indices(len(self.feature_info), indices)
        intermediates = []
        x = self._maybe_checkpoint(self.stem, x)
        if 0 in take:
            intermediates.append(x)
        stages = self.stages[:max_index] if stop_early else self.stages
        last = len(self.stages)
        for index, stage in enumerate(stages, start=1):
            x = stage(x)
            if index == last and norm:
                x = self._maybe_checkpoint(self.final_act, x)
            if index in take:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        if len(stages) == last and not norm:
            x = self._maybe_checkpoint(self.final_act, x)
        return x, intermediates

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop what no requested tap needs (timm's feature_cls='getter' calls this)."""
        take, max_index = feature_take_indices(len(self.feature_info), indices)
        self.stages = self.stages[:max_index]
        if prune_norm or max_index < len(self.feature_info) - 1:
            self.final_act = nn.Identity()
        if prune_head:
            self.reset_classifier(0)
        return take

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def _create(
    variant: str, pretrained: bool, defaults: dict[str, Any], **kwargs: Any
) -> ResidualNet:
    """Build a registered variant; keyword arguments to timm.create_model override its
    ``defaults`` (``channels=...``, ``units=...``)."""
    kwargs = {**defaults, **kwargs}
    if pretrained:
        raise ValueError(
            f"no pretrained weights are published for {variant}: create it with "
            "pretrained=False and train it (python train.py model=...)"
        )
    # By default every tap: the stem and each stage (timm assumes five, CIFAR nets have four).
    taps = tuple(range(len(kwargs["units"]) + 1))
    return build(
        ResidualNet,
        variant,
        pretrained,
        feature_cfg=dict(flatten_sequential=True, out_indices=taps),
        **kwargs,
    )


def cifar_cfg(**kwargs: Any) -> dict[str, Any]:
    """timm's pretrained_cfg for a CIFAR model of the zoo (``kwargs`` override)."""
    return {
        "url": "",
        "num_classes": 10,
        "input_size": (3, 32, 32),
        "pool_size": (8, 8),
        "crop_pct": 1.0,
        "interpolation": "bilinear",
        "mean": CIFAR_MEAN,
        "std": CIFAR_STD,
        "first_conv": "stem.0",
        "classifier": "fc",
        **kwargs,
    }


def imagenet_cfg(**kwargs: Any) -> dict[str, Any]:
    return cifar_cfg(
        num_classes=1000,
        input_size=(3, 224, 224),
        pool_size=(7, 7),
        crop_pct=0.875,
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
        **kwargs,
    )


default_cfgs = generate_default_cfgs(
    {
        "resnet32.untrained": cifar_cfg(),
        "resnet110.untrained": cifar_cfg(),
        "resnet164.untrained": cifar_cfg(),
        "resnet1001.untrained": cifar_cfg(),
        "revnet38.untrained": cifar_cfg(),
        "revnet110.untrained": cifar_cfg(),
        "revnet164.untrained": cifar_cfg(),
        "revnet992.untrained": cifar_cfg(),
        "preact_resnet101.untrained": imagenet_cfg(),
        "revnet104.untrained": imagenet_cfg(),
    }
)

_CIFAR_RESNET = dict(channels=(16, 16, 32, 64), stem="cifar")
_CIFAR_REVNET = dict(channels=(32, 32, 64, 128), stem="cifar", reversible=True)


@register_model
def resnet32(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """ResNet-32 for CIFAR: 5-5-5 basic units, 16-32-64 channels."""
    return _create("resnet32", pretrained, dict(_CIFAR_RESNET, units=(5, 5, 5)), **kwargs)


@register_model
def resnet110(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """ResNet-110 for CIFAR: 18-18-18 basic units, 16-32-64 channels."""
    return _create("resnet110", pretrained, dict(_CIFAR_RESNET, units=(18, 18, 18)), **kwargs)


@register_model
def resnet164(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """ResNet-164 for CIFAR: 18-18-18 bottleneck units, 64-128-256 channels out."""
    args = dict(_CIFAR_RESNET, units=(18, 18, 18), bottleneck=True)
    return _create("resnet164", pretrained, args, **kwargs)


@register_model
def resnet1001(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """ResNet-1001 for CIFAR (He et al. 2016): 111-111-111 pre-activation bottleneck units.

    Its residual branches start at zero (``zero_init_last=True``): untrained, in eval mode
    (BatchNorm's running statistics still 0 and 1, so nothing normalizes), each of the 333
    units would multiply the signal about 1.3x, past float32's range by the third stage."""
    args = dict(_CIFAR_RESNET, units=(111, 111, 111), bottleneck=True, zero_init_last=True)
    return _create("resnet1001", pretrained, args, **kwargs)


@register_model
def revnet38(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """RevNet-38 for CIFAR: 3-3-3 basic units, 32-64-112 channels."""
    args = dict(_CIFAR_REVNET, units=(3, 3, 3), channels=(32, 32, 64, 112))
    return _create("revnet38", pretrained, args, **kwargs)


@register_model
def revnet110(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """RevNet-110 for CIFAR: 9-9-9 basic units, 32-64-128 channels."""
    return _create("revnet110", pretrained, dict(_CIFAR_REVNET, units=(9, 9, 9)), **kwargs)


@register_model
def revnet164(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """RevNet-164 for CIFAR: 9-9-9 bottleneck units, 128-256-512 channels out."""
    args = dict(_CIFAR_REVNET, units=(9, 9, 9), bottleneck=True)
    return _create("revnet164", pretrained, args, **kwargs)


@register_model
def revnet992(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """A 992-layer RevNet for CIFAR: RevNet-164's plan with 55-55-55 bottleneck units
    (6 convolutions a unit: 6 x 165 + 2 = 992), the reversible counterpart of ResNet-1001.

    Its default plan is ``reversible+checkpoint``: the stem and the three downsampling units are
    checkpointed as well, 3 of 165 units recomputed for a quarter less peak memory."""
    args = dict(_CIFAR_REVNET, units=(55, 55, 55), bottleneck=True,
                memory=PRESETS["reversible+checkpoint"])
    return _create("revnet992", pretrained, args, **kwargs)


@register_model
def preact_resnet101(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """Pre-activation ResNet-101 for ImageNet as in the RevNet paper: 3-4-23-3 bottleneck units.

    Named apart from timm's ``resnet101``, a different (post-activation) model.
    """
    args = dict(units=(3, 4, 23, 3), channels=(64, 64, 128, 256, 512), bottleneck=True,
                stem="imagenet")
    return _create("preact_resnet101", pretrained, args, **kwargs)


@register_model
def revnet104(pretrained: bool = False, **kwargs: Any) -> ResidualNet:
    """RevNet-104 for ImageNet: 2-2-11-2 bottleneck units, 512-1024-2048-3328 channels out."""
    args = dict(units=(2, 2, 11, 2), channels=(128, 128, 256, 512, 832), bottleneck=True,
                stem="imagenet", reversible=True)
    return _create("revnet104", pretrained, args, **kwargs)
