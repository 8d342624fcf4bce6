"""What the profile measures of one step of a chain: the record every cost and search reads
(profile.py makes it; gradients.py and the searches read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LayerProfile"]


@dataclass(frozen=True)
class LayerProfile:
    index: int
    name: str
    output_bytes: int  # what a checkpoint at this layer's output keeps
    saved_bytes: int  # what autograd keeps for this layer's backward (model state excluded)
    forward_seconds: float  # NaN when profiled on the meta device
    inplace: bool = False  # modifies its input: a checkpointed segment must not start here
    # The values this layer passes on, by name, with their bytes: one for a plain layer, the live
    # set for a step of a graph chain (values keep their names from step to step, so a planner
    # can tell what a checkpoint adds to those before it).
    state: dict[str, int] = field(default_factory=dict)
    # The index of an earlier layer whose output this one overwrites in place (None: nothing);
    # no checkpoint may be cut in between.
    mutates_from: int | None = None
    # What it saves beyond its own input and output (which are counted as outputs already).
    saved_intermediate_bytes: int = 0
    # What a selective checkpoint keeps of it (NOTE [ Selective recomputation ]): the outputs of
    # its matrix products, convolutions and attention (0: it has none, and is recomputed whole).
    selective_bytes: int = 0
    # Of those, the bytes of the values it passes on, by the value's name: a convolution's
    # output the next layer takes is one storage with what a checkpoint after it keeps (NOTE
    # [ A storage saved twice is held once ]).
    selective_values: dict[str, int] = field(default_factory=dict)
    # None of those outputs is modified in place afterwards, inside the layer or by a later one
    # (a selective checkpoint over it would be refused in backward).
    selective_safe: bool = True
    # Of what it saves, the storages of values passed between layers, keyed by (the name of the
    # value that first carried the storage, its place among that value's storages), with their
    # bytes: two layers saving one storage (ReLU its output, the next convolution its input)
    # save one tensor (NOTE [ A storage saved twice is held once ]).
    saved_values: dict[tuple[str, int], int] = field(default_factory=dict)
    # The parameter gradients its backward makes: of the parameters it uses that need one, those
    # no later layer uses (a parameter two layers share gets its gradient in the later one's
    # backward, which runs first).
    grad_bytes: int = 0
    # Of the last layer only: the most the loss holds while its forward and backward run from
    # this layer's output (what it saves, the gradients it makes, that output's among them),
    # measured on the meta device; 0 where no loss was profiled.
    loss_bytes: int = 0
    # The floating-point operations of the operators a selective checkpoint keeps (torch's
    # formulas, torch.utils.flop_counter), counted on the meta device: what recomputing this
    # layer costs under torch.compile (NOTE [ Compiled costs ]).
    product_flops: int = 0
    # Of the live values it is given, those it reads (a graph step's node's arguments), whose
    # gradients its backward makes; None: all of them.
    takes: frozenset[str] | None = None
    # What its backward makes of those gradients, by value: a new tensor's bytes, or the name of
    # the output whose gradient it passes on (gradients.py); None where unknown: new tensors.
    gradient_parts: dict[str, int | str] | None = None
    # It saves nothing for backward, not even a parameter (an addition, a view): a checkpoint of
    # such steps alone holds nothing of its inputs (a frozen Linear saves its weight, which does).
    saves_nothing: bool = False
