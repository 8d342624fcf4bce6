"""revnets: reversible networks and checkpointing for models that do not fit in memory."""

from revnets import models  # registers the zoo with timm
from revnets.checkpoint import Checkpointed, checkpoint, checkpoint_segments
from revnets.compiling import compile_model, compile_options
from revnets.conversion import ReversibleLayers, make_reversible
from revnets.memory import (
    MemoryReport,
    MemoryTracker,
    allocator_peak,
    measure_memory,
    predict_memory,
)
from revnets.models import ResidualNet
from revnets.plan import (
    PRESETS,
    Checkpoint,
    MemoryPlan,
    PartPlan,
    Reconstruct,
    Store,
    parse_memory_plan,
    plan_from_options,
)
from revnets.planning import ForwardTimes, PlanningError, auto_checkpoint, forward_times
from revnets.reconstruction import BlockDrift, ReconstructionReport, check_reconstruction
from revnets.replay import is_recomputing
from revnets.reversible import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    ExactAdditiveCoupling,
    ExactScaledCoupling,
    ReversibleBlock,
    ReversibleSequence,
    ScaledCoupling,
    SequenceOptions,
)
from revnets.reversible.invertible import InjectivePad, Invertible, SpaceToDepth, check_invertible

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "BlockDrift",
    "Checkpoint",
    "Checkpointed",
    "Coupling",
    "ExactAdditiveCoupling",
    "ExactScaledCoupling",
    "ForwardTimes",
    "InjectivePad",
    "Invertible",
    "MemoryPlan",
    "MemoryReport",
    "MemoryTracker",
    "PRESETS",
    "PartPlan",
    "PlanningError",
    "ResidualNet",
    "Reconstruct",
    "ReconstructionReport",
    "ScaledCoupling",
    "ReversibleBlock",
    "ReversibleLayers",
    "ReversibleSequence",
    "SequenceOptions",
    "SpaceToDepth",
    "Store",
    "allocator_peak",
    "auto_checkpoint",
    "check_invertible",
    "check_reconstruction",
    "checkpoint",
    "checkpoint_segments",
    "compile_model",
    "compile_options",
    "forward_times",
    "is_recomputing",
    "make_reversible",
    "measure_memory",
    "models",
    "parse_memory_plan",
    "plan_from_options",
    "predict_memory",
]
__version__ = "0.1.0"
