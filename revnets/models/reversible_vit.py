"""Reversible Vision Transformers (Rev-ViT, Mangalam et al., CVPR 2022), registered with timm.

Built as the official code builds them (facebookresearch/SlowFast, reversible_mvit.py): the patch
tokens plus an absolute position embedding, no class token, are duplicated into two streams
``X1 = X2 = x`` (concatenated on the feature axis to width 2C). Each block is a reversible
coupling ``Y1 = X1 + DropPath(F(X2))``, ``Y2 = X2 + DropPath(G(Y1))`` with F = LayerNorm then
multi-head self-attention and G = LayerNorm then MLP, no residual inside either: the coupling is
the residual. At the end the two streams, still concatenated, go through LayerNorm(2C), a mean
over tokens and a linear head. Parameter counts equal the official ones (22,434,664 for Rev-ViT-S,
87,335,656 for Rev-ViT-B at 1000 classes).

Drop path is per sample, the block's own (``ReversibleBlock(drop_path=...)``): the block draws
F's and G's masks apart (the official code shares one seed between them; timm's ViT draws each
apart), outside F and G, and the reversible engine keeps them for backward (NOTE [ Drop path
outside the transforms ] in revnets/reversible/block.py), so F and G draw nothing and compile
inside the engine.

Memory plans (:class:`~revnets.plan.MemoryPlan`), switchable on the same weights
(``set_memory``), as for the CNN zoo, by preset: ``none`` (ordinary autograd), ``checkpoint``
(about sqrt(depth) checkpointed segments of blocks), ``reversible`` (the default: only the patch
embedding's and the head's activations are stored) and ``reversible+checkpoint`` (the patch
embedding and final norm checkpointed too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    PatchEmbed,
    register_notrace_function,
    resample_abs_pos_embed,
    trunc_normal_,
)
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch import Tensor, _assert, nn

from revnets.models._timm import build
from revnets.models.head import new_classifier
from revnets.plan import PRESETS, Checkpoint, MemoryPlan, Store
from revnets.plan.switchable import SwitchableMemory
from revnets.replay.known import KnownWalk, known_composite
from revnets.replay.known_calls import call_kind
from revnets.reversible import ReversibleBlock, ReversibleSequence

__all__ = ["ReversibleVisionTransformer"]


@register_notrace_function  # torch.fx: the sizes it compares are concrete at run time
@torch.fx.wrap
def resampled_pos_embed(
    pos_embed: Tensor, grid: tuple[int, int], old_grid: tuple[int, int]
) -> Tensor:
    """A ``(1, N, C)`` position embedding for ``old_grid``, resampled to ``grid`` as timm's
    ViT resamples its own (bicubic); unchanged when the grids are equal."""
    return resample_abs_pos_embed(
        pos_embed, new_size=list(grid), old_size=list(old_grid), num_prefix_tokens=0
    )


class TwoStreamPatchEmbed(PatchEmbed):
    """Patches to tokens (timm's PatchEmbed, a strided convolution), plus an absolute position
    embedding, no class token, duplicated into the two streams of a Rev-ViT: ``(B, N, 2C)`` with
    ``X1 = X2``.

    ``dynamic_img_size``: any input size divisible by the patch size, the position embedding
    resampled to its grid (``dynamic_img_pad``: any size, padded to a multiple of the patch);
    otherwise the input must be ``img_size``."""

    def __init__(
        self,
        img_size: int | tuple[int, int],
        patch_size: int,
        in_chans: int,
        embed_dim: int,
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
    ) -> None:
        super().__init__(
            img_size, patch_size, in_chans, embed_dim, output_fmt="NHWC",
            strict_img_size=False, dynamic_img_pad=dynamic_img_pad,
        )
        for size, patch in zip(self.img_size, self.patch_size):
            if size % patch:
                raise ValueError(
                    f"TwoStreamPatchEmbed: img_size {self.img_size} is not a multiple of "
                    f"patch_size {self.patch_size}"
                )
        self.dynamic_img_size = dynamic_img_size
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches, embed_dim))

    def set_input_size(
        self,
        img_size: int | tuple[int, int] | None = None,
        patch_size: int | tuple[int, int] | None = None,
    ) -> None:
        """A new input size (and patch size): the position embedding resampled to the new grid,
        as timm's ViT resamples its own."""
        old_grid = self.grid_size
        super().set_input_size(img_size, patch_size)
        if self.grid_size != old_grid:
            with torch.no_grad():
                resampled = resampled_pos_embed(self.pos_embed, self.grid_size, old_grid)
            self.pos_embed = nn.Parameter(
                resampled, requires_grad=self.pos_embed.requires_grad
            )

    def input_size_problem(self, height: int, width: int) -> str | None:
        """Why an input of ``height`` x ``width`` pixels cannot pass, or None: what ``forward``
        asserts, and timm's PatchEmbed where the size is dynamic but not padded."""
        if not self.dynamic_img_size and (height, width) != tuple(self.img_size):
            return self._fixed_size_message(height, width)
        if self.dynamic_img_size and not self.dynamic_img_pad and (
                height % self.patch_size[0] or width % self.patch_size[1]):
            return (f"an input of {height}x{width} pixels is not a multiple of patch_size "
                    f"{self.patch_size}: resize it, or create the model with dynamic_img_pad=True")
        return None

    def _fixed_size_message(self, height: Any, width: Any) -> str:
        return (f"an input of {height}x{width} pixels; the position embedding is for "
                f"{self.img_size[0]}x{self.img_size[1]}: create the model with "
                f"img_size=({height}, {width}) (the embedding resampled), or dynamic_img_size=True")

    def forward(self, x: Tensor) -> Tensor:
        height, width = x.shape[-2:]
        if not self.dynamic_img_size:
            message = f"TwoStreamPatchEmbed: {self._fixed_size_message(height, width)}"
            _assert(height == self.img_size[0], message)
            _assert(width == self.img_size[1], message)
        grid = super().forward(x)  # (B, H', W', C)
        tokens = grid.flatten(1, 2)
        if self.dynamic_img_size:
            pos_embed = resampled_pos_embed(self.pos_embed, grid.shape[1:3], self.grid_size)
        else:
            pos_embed = self.pos_embed
        tokens = tokens + pos_embed
        return torch.cat((tokens, tokens), dim=-1)


@known_composite()
class Attention(nn.Module):
    """Multi-head self-attention with separate q, k and v projections (as in Rev-ViT), through
    ``F.scaled_dot_product_attention``. Its calls are known (NOTE [ Known layers ]), so a
    reversible block's replay needs no dispatcher watch, and the engine may compile it."""

    def __init__(self, dim: int, num_heads: int, attn_drop: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"Attention: dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = attn_drop

    def _heads(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        return x.view(batch, tokens, self.num_heads, dim // self.num_heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self._dropout())  # head_dim^-0.5
        return self.proj(x.transpose(1, 2).flatten(2))

    def _dropout(self) -> float:
        return self.attn_drop if self.training else 0.0

    def walk_known(self, walk: KnownWalk) -> bool:
        """The calls :meth:`forward` makes, in order: the three projections, each viewed and
        transposed into heads, attention, then transposed, flattened and projected. Each
        projection reads the input itself, whether or not the one before made fresh memory."""
        entry = walk.fresh
        for projection in (self.q, self.k, self.v):
            walk.fresh = entry
            if not walk.module(projection):
                return False
            for method in ("view", "transpose"):
                walk.call(call_kind("call_method", method, (), {}), False, True)
        attention = call_kind("call_function", F.scaled_dot_product_attention, (None,) * 3,
                              {"dropout_p": self._dropout()})
        if walk.call(attention, False, True) is None:
            return False
        for method in ("transpose", "flatten"):
            walk.call(call_kind("call_method", method, (), {}), False, True)
        return walk.module(self.proj)


@known_composite()
class Mlp(nn.Module):
    def __init__(self, dim: int, ratio: float = 4.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, int(dim * ratio))
        self.act = nn.GELU()
        self.fc2 = nn.Linear(int(dim * ratio), dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def walk_known(self, walk: KnownWalk) -> bool:
        return walk.modules((self.fc1, self.act, self.fc2))


@known_composite()
class Sublayer(nn.Module):
    """One transform of a reversible block: LayerNorm, then attention or MLP."""

    def __init__(self, dim: int, body: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.body = body

    def forward(self, x: Tensor) -> Tensor:
        return self.body(self.norm(x))

    def walk_known(self, walk: KnownWalk) -> bool:
        return walk.modules((self.norm, self.body))


def reversible_vit_block(
    dim: int, num_heads: int, mlp_ratio: float = 4.0, drop_path: float = 0.0,
    attn_drop: float = 0.0,
) -> ReversibleBlock:
    """A Rev-ViT block on two streams of width ``dim`` concatenated on the last axis."""
    return ReversibleBlock(
        f=Sublayer(dim, Attention(dim, num_heads, attn_drop)),
        g=Sublayer(dim, Mlp(dim, mlp_ratio)),
        split_dim=-1,
        drop_path=drop_path,
    )


class ReversibleVisionTransformer(SwitchableMemory, nn.Module):
    """Rev-ViT: a ViT whose blocks are reversible couplings of two duplicated token streams.

    Its features are a grid, as timm's Swin gives them (``output_fmt = "NHWC"``): with no class
    token every token is a patch, so ``forward_features`` returns ``(B, H / patch, W / patch,
    2C)`` and ``global_pool=""`` returns that map.

    Args:
        img_size, patch_size, in_chans, num_classes: as in timm's VisionTransformer.
        embed_dim: the width C of each stream (the streams together are 2C wide).
        depth, num_heads, mlp_ratio: blocks, attention heads, MLP expansion.
        drop_rate: dropout before the head. drop_path_rate: stochastic depth, rising linearly
            from 0 over the blocks. attn_drop_rate: dropout on attention weights.
        memory: a :class:`~revnets.plan.MemoryPlan` or a preset's name (module docstring);
            default ``reversible``.
        global_pool: ``"avg"`` (mean over tokens, Rev-ViT's) or ``""`` (no pooling: the map).
        dynamic_img_size: accept any input size divisible by the patch size, the position
            embedding resampled to its grid (timm's ViT keyword); ``dynamic_img_pad`` pads the
            input to such a size.
    """

    output_fmt = "NHWC"

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 384,
        depth: int = 12,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        memory: MemoryPlan | str | None = None,
        global_pool: str = "avg",
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
    ) -> None:
        super().__init__()
        _check_pool(global_pool)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.embed_dim = embed_dim
        self.num_features = self.head_hidden_size = 2 * embed_dim
        self.patch_embed = TwoStreamPatchEmbed(
            img_size, patch_size, in_chans, embed_dim, dynamic_img_size, dynamic_img_pad
        )
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = ReversibleSequence(
            reversible_vit_block(embed_dim, num_heads, mlp_ratio, rate, attn_drop_rate)
            for rate in rates
        )
        self.norm = nn.LayerNorm(2 * embed_dim, eps=1e-6)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(2 * embed_dim, num_classes) if num_classes else nn.Identity()
        reduction = self.patch_embed.feat_ratio()
        self.feature_info = [
            dict(num_chs=2 * embed_dim, reduction=reduction, module=f"blocks.blocks.{i}")
            for i in range(depth)
        ]
        self._init_weights()
        self.family = "Rev-ViT"
        self.memory = PRESETS["none"]
        self.set_memory(memory or "reversible")

    def _init_weights(self) -> None:
        trunc_normal_(self.patch_embed.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    # -- memory plan --------------------------------------------------------------------------
    def apply_memory(self, plan: MemoryPlan) -> None:
        self.blocks.set_memory(plan.stages)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's switch: checkpoint what the blocks' plan does not cover (the patch embedding
        and the final norm), or stop."""
        self.set_memory(MemoryPlan(self.memory.stages, Checkpoint() if enable else Store()))

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for layer-wise learning-rate decay, as timm's ViT names them."""
        return dict(
            stem=r"^patch_embed",
            blocks=[(r"^blocks\.blocks\.(\d+)", None), (r"^norm", (99999,))],
        )

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"patch_embed.pos_embed"}

    def input_size_problem(self, height: int, width: int) -> str | None:
        """The patch embedding's rule (:meth:`TwoStreamPatchEmbed.input_size_problem`)."""
        return self.patch_embed.input_size_problem(height, width)

    # -- timm interface -----------------------------------------------------------------------
    def set_input_size(
        self,
        img_size: int | tuple[int, int] | None = None,
        patch_size: int | tuple[int, int] | None = None,
    ) -> None:
        """Another input resolution (and patch size), as timm's ViT changes its own: the
        position embedding (and the patch projection) resampled."""
        self.patch_embed.set_input_size(img_size, patch_size)
        reduction = self.patch_embed.feat_ratio()
        for info in self.feature_info:
            info["reduction"] = reduction

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new classifier for ``num_classes`` (0: none), on the model's device and dtype;
        ``global_pool=""`` makes the model return its unpooled feature map."""
        if global_pool is not None:
            _check_pool(global_pool)
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = new_classifier(self, self.num_features, num_classes)

    def _grid(self, x: Tensor) -> tuple[int, int]:
        return self.patch_embed.dynamic_feat_size(x.shape[-2:])

    def forward_features(self, x: Tensor) -> Tensor:
        height, width = self._grid(x)
        x = self._maybe_checkpoint(self.patch_embed, x)
        x = self._run_blocks(x)
        x = self._maybe_checkpoint(self.norm, x)
        return x.reshape(x.shape[0], height, width, -1)

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's intermediate features: the output of each block listed (all by default; the
        last ``indices`` if an int), as NCHW or NHWC feature maps of width 2C or NLC tokens."""
        if output_fmt not in ("NCHW", "NHWC", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW', 'NHWC' or 'NLC', got {output_fmt!r}")
        take, max_index = feature_take_indices(len(self.blocks), indices)
        batch = x.shape[0]
        height, width = self._grid(x)
        intermediates = []
        x = self._maybe_checkpoint(self.patch_embed, x)
        last = max_index + 1 if stop_early else len(self.blocks)
        start = 0
        for index in sorted(take):  # run reversibly between the taps
            x = self._run_blocks(x, start, index + 1)
            start = index + 1
            tap = self.norm(x) if norm else x
            if output_fmt != "NLC":
                tap = tap.reshape(batch, height, width, -1)
            if output_fmt == "NCHW":
                tap = tap.permute(0, 3, 1, 2)
            intermediates.append(tap)
        if intermediates_only:
            return intermediates
        if start < last:
            x = self._run_blocks(x, start, last)
        x = self._maybe_checkpoint(self.norm, x)
        return x.reshape(batch, height, width, -1), intermediates

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        take, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks.sliced(0, max_index + 1)
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(1, 2))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def _check_pool(global_pool: str) -> None:
    if global_pool not in ("avg", ""):
        raise ValueError(
            f"ReversibleVisionTransformer: global_pool must be 'avg' or '', got {global_pool!r}"
        )


def _create(variant: str, pretrained: bool = False, **kwargs: Any) -> ReversibleVisionTransformer:
    if pretrained:
        raise ValueError(
            f"no pretrained weights are bundled for {variant}: create it with pretrained=False"
        )
    # features_only: the last three blocks by default, as for timm's ViT.
    return build(
        ReversibleVisionTransformer,
        variant,
        pretrained,
        feature_cfg=dict(feature_cls="getter", out_indices=3),
        **kwargs,
    )


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (14, 14),
        "fixed_input_size": True,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {
        "revvit_small_patch16_224.untrained": _cfg(),
        "revvit_base_patch16_224.untrained": _cfg(),
    }
)


@register_model
def revvit_small_patch16_224(
    pretrained: bool = False, **kwargs: Any
) -> ReversibleVisionTransformer:
    """Rev-ViT-S: 12 blocks, width 384 per stream, 6 heads, drop path 0.1 (22,434,664 params)."""
    args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, drop_path_rate=0.1)
    return _create("revvit_small_patch16_224", pretrained, **{**args, **kwargs})


@register_model
def revvit_base_patch16_224(
    pretrained: bool = False, **kwargs: Any
) -> ReversibleVisionTransformer:
    """Rev-ViT-B: 12 blocks, width 768 per stream, 12 heads, drop path 0.2 (87,335,656 params)."""
    args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, drop_path_rate=0.2)
    return _create("revvit_base_patch16_224", pretrained, **{**args, **kwargs})
