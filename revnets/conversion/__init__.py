"""Pretrained networks made reversible: :func:`make_reversible` runs a stack of a network's
layers (timm's ViT blocks, a Hugging Face decoder's layers, a ResNet's identity-shortcut blocks)
as one reversible stage reusing their weights, so that its activation memory does not grow with
its depth.

- ``construction.py``: how the converted stack writes its two streams (:class:`Difference`,
  revnets' own; :class:`Momentum`; :class:`MEFT`), one recurrence with four numbers.
- ``drift.py``: how far reconstruction drifts (:func:`amplification`), predicted when a stack
  is converted, and the :class:`ReconstructionDriftWarning` where float32 gradients would not
  be the network's.
- ``stack.py``: the stack run as one stage (:class:`ReversibleLayers`), its layers where they
  were; what the model's own loop over its layers meets.
"""

# NOTE [ Reversible conversion ]
# A pretrained stack computes z_n = L_n(z_{n-1}), n = 1..N (L(z) = z + F(z) for a residual
# layer). No reversible network computes it: L_n forgets (z_{n-1} is not a function of z_n),
# so a conversion changes the function, and says by how much.
# 1. Two streams, z_0 = x the stack's input and z_{-1} = start * x (start = 1 but for MEFT's
#    1 / beta); layer n reads the stream written last and writes the other one, by a
#    construction (construction.py):
#        z_n = stream * z_{n-2} + layer * L_n(z_{n-1}) + skip * z_{n-1}
#    the coupling y = stream * x1 + h(x2) with h = layer * L + skip * id (stack.LayerUpdate);
#    layers 2k and 2k + 1 are f and g of reversible block k (an odd last layer's g is zero),
#    and the stack's output is the stream written last. Difference(scale) (make_reversible's
#    scale): z_n = L_n(z_{n-1}) + scale * (z_{n-2} - z_{n-1}). scale = 1: the RevNet coupling,
#    z_n = z_{n-2} + F_n(z_{n-1}); scale -> 0: the pretrained recurrence. In between, the first
#    layer is exact and each later one differs from the pretrained one by scale times the
#    previous layer's update. Momentum(gamma): the update is (1 - gamma) F_n plus gamma times
#    the previous one (the first layer's scaled too). MEFT(lam, beta): each layer adds
#    lam * beta times the hidden state two layers back. Each gap is linear in its parameter
#    (measured at step 0 by tests/test_conversion.py and benchmarks/conversion.py).
# 2. The inverse, z_{n-2} = (z_n - h(z_{n-1})) / stream, divides by stream: round-off in
#    reconstruction grows by 1 / |stream| per layer. stream = 1 is as stable as any additive
#    block; a small one drifts (check_reconstruction reports it), |stream|^-(N - 1) over N
#    layers, and keep_input_every=k bounds it at |stream|^-(2k - 2) for depth / k stored
#    inputs. Converting warns where that passes 1e4, float32 gradients erring by about 6e-4
#    (drift.py). Nothing else is kept: no side information, 0 bits per element per layer.
# 3. The layers stay where they were, under their names (ReversibleLayers is the stack's
#    nn.ModuleList, key for key, a named nn.Sequential's names kept); the reversible sequence
#    over them is held unregistered, so state_dict, parameters, peft's injection, moves and
#    casts see the model as it was. The stack runs whole when called (timm: ``self.blocks(x)``,
#    every layer given the call's other arguments). Where the model's code loops over its
#    layers (Hugging Face: ``for layer in self.layers[:n]: h = layer(h, ...)``), iterating or
#    indexing the stack gives stand-ins that record each layer's own arguments (Qwen2's and
#    Gemma's per-layer masks) and hand on a token (stack.Pending) in place of the hidden state;
#    the last layer's call runs the run as one stage and returns its output. So no value the
#    stage does not compute is ever handed out: anything done with the token but passing it on
#    (a layer called alone and its output read, a write between layers, timm's intermediate
#    features), a layer skipped or called out of order (LayerDrop), and transformers'
#    output_hidden_states, which records the layers' own outputs, are refused by name.
#    ``stack.layer(i)`` is the layer itself; attributes read or set on a stand-in are its.
#    The layers' own submodules keep the modes set on them (a frozen BatchNorm).
# 4. exact=True runs the stage on the fixed-point grid (NOTE [ Exact reversibility ]):
#    reconstruction exact to the bit in float32, bfloat16 and float16 autocast, for a stream
#    scale +-2^-k (k = 0..8: scale 1, 0.5, 0.25; Momentum(0.5); MEFT(0.5, 0.5)); a scale below
#    1 keeps the k bits per element its scaling drops, one byte per element per layer (rule 7
#    there), which measure_memory counts and predict_memory predicts. Other scales are refused.
# 5. A Hugging Face cache is filled by the layers' calls. The reversible path runs each layer
#    again in backward, so a training step with gradients runs them without an empty cache it
#    is given, saying so (as transformers' checkpointing turns use_cache off), and refuses one
#    already filled (a prefix, a second chunk), which it could not read again; without
#    gradients (evaluation, generate()) the layers run once each, with it.

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from revnets.conversion.construction import MEFT, Construction, Difference, Momentum, real
from revnets.conversion.drift import ReconstructionDriftWarning, amplification
from revnets.conversion.stack import ReversibleLayers
from revnets.plan import Reconstruct, Store

__all__ = ["MEFT", "Construction", "Difference", "Momentum", "ReconstructionDriftWarning",
           "ReversibleLayers", "amplification", "find_stack", "make_reversible"]


def make_reversible(
    model: nn.Module,
    layers: str | Sequence[str] | None = None,
    scale: float = 1.0,
    *,
    construction: Construction | None = None,
    dim: int = -1,
    exact: bool = False,
    memory: Reconstruct | Store = Reconstruct(),
) -> nn.Module:
    """Run the stack of layers ``layers`` of ``model`` (a dotted name, several, or None: the
    longest run of alike layers, :func:`find_stack`) as one reversible stage reusing their
    weights, in place; returns ``model``.

    The converted stack keeps two streams of its hidden state, both its input at the start,
    and layer n computes ``z_n = scale * z_{n-2} + layer_n(z_{n-1}) - scale * z_{n-1}`` (NOTE
    [ Reversible conversion ]): ``scale=1`` is the RevNet coupling, a smaller scale stays
    closer to the pretrained function and reconstructs with round-off grown by ``1 / scale``
    per layer. ``construction``: another recurrence over the two streams (:class:`Momentum`,
    :class:`MEFT`; ``scale`` is ``Difference(scale)``). ``dim``: where the two streams are
    stacked (-1: a transformer's width; 1: a ResNet's channels). ``exact``: reconstruction
    exact to the bit under any autocast precision (``scale=1``). ``memory=Store()``: the same
    converted function with ordinary autograd (the reference, and the baseline of its memory).
    Warns (:class:`ReconstructionDriftWarning`) where float32 reconstruction would amplify
    round-off more than 1e4 times (drift.py), naming the fixes.
    Each layer must map a tensor to a tensor of its
    shape; called whole, the stack gives every layer its other arguments, and in the model's
    own loop each layer gets those of its own call (masks, rotary embeddings).
    """
    if isinstance(scale, Construction) or (isinstance(scale, type)
                                           and issubclass(scale, Construction)):
        name = scale.__name__ if isinstance(scale, type) else repr(scale)
        raise TypeError(f"make_reversible: {name} was given as scale, the third positional "
                        f"argument (a number: Difference(scale)); give a construction by "
                        f"keyword: make_reversible(model, layers, construction={name})")
    scale = real("make_reversible", "scale", scale)
    if construction is None:
        construction = Difference(scale)
    elif scale != 1.0:
        raise ValueError(f"make_reversible: scale={scale} and construction={construction} both "
                         f"say how the streams are written; give one (scale is Difference(scale))")
    names = [layers] if isinstance(layers, str) else (
        [find_stack(model)] if layers is None else list(layers))
    if not names:
        raise ValueError("make_reversible: layers=[] names no stack; name one, or None to find it")
    for name in names:
        if not name:
            raise ValueError(
                f"make_reversible: the model itself ({type(model).__name__}) is the stack; "
                f"convert a model holding it (nn.Sequential(stem, stack, head), or name the "
                f"stack inside it), since a module cannot be replaced in place")
        try:
            stack = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"make_reversible: {type(model).__name__} has no module {name!r}; "
                             f"name a stack of its layers (an nn.ModuleList or nn.Sequential), "
                             f"e.g. {find_stack(model)!r}") from None
        if isinstance(stack, ReversibleLayers):
            raise ValueError(f"make_reversible: {name} is converted already")
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)) or len(stack) < 1:
            raise ValueError(f"make_reversible: {name} is a {type(stack).__name__}, not a stack "
                             f"of layers (an nn.ModuleList or nn.Sequential of them)")
        converted = ReversibleLayers(list(stack._modules.items()), construction, dim, memory,
                                     exact)
        converted.training = stack.training  # its layers keep their own modes
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, converted)
    return model


def find_stack(model: nn.Module) -> str:
    """The name of ``model``'s stack of layers: of its nn.ModuleList and nn.Sequential modules
    holding two or more layers of one class, the one with the most parameters (a converted
    stack included)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if len({type(layer) for layer in module._modules.values()}) == 1:
            found.append((sum(p.numel() for p in module.parameters()), name))
    if not found:
        raise ValueError(f"make_reversible: {type(model).__name__} has no stack of alike layers "
                         f"(an nn.ModuleList or nn.Sequential of one class); name one: layers=")
    return max(found)[1]
