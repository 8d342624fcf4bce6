"""revnets: reversible networks and checkpointing for models that do not fit in memory."""

from revnets.checkpoint import Checkpointed, checkpoint_segments
from revnets.memory import MemoryReport, MemoryTracker, measure_memory, predict_memory
from revnets.reconstruction import BlockDrift, ReconstructionReport, check_reconstruction
from revnets.reversible import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    ReversibleBlock,
    ReversibleSequence,
)

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "BlockDrift",
    "Checkpointed",
    "Coupling",
    "MemoryReport",
    "MemoryTracker",
    "ReconstructionReport",
    "ReversibleBlock",
    "ReversibleSequence",
    "check_reconstruction",
    "checkpoint_segments",
    "measure_memory",
    "predict_memory",
]
__version__ = "0.1.0"
