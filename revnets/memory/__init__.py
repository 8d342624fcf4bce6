"""A step's memory, measured and predicted, split by what it holds.

- ``measure``: :func:`measure_memory` runs a call once and counts its live tensor storage
  (:class:`MemoryTracker`, at the dispatcher; on CUDA the allocator's peak gives the total).
- ``predict``: :func:`predict_memory` runs it on fake tensors of the real device, computing
  nothing (:class:`Predictor` for several calls over the same modules); what it is given is
  copied over fake tensors in ``fake_copies``, the dispatch mode that makes fakes act as the
  device's is ``fake_device``, and ``cpu_kernels`` has the CPU kernels' outputs where their meta
  kernels allocate otherwise.
- ``call_arguments``: what a measured or predicted call is given (its modules and optimizers,
  their device), and containers rebuilt with other elements.
- ``generator_states``: generator states torch copies outside the dispatcher (its
  checkpoint's), shown to the trackers running.
- ``allocator``: :func:`allocator_peak`, the allocator's own peak, which sees compiled code.
- ``timeline``: a step's memory over its operators, by category and module, and its picture.

Import rules: the modules import one another absolutely (``from revnets.memory.measure import
...``), in that order (call_arguments; cpu_kernels; fake_copies; fake_device;
generator_states; measure; predict; timeline; allocator alone), and of the rest of revnets only
:mod:`revnets.replay`; planning, training and the package's face import them, never the other
way.
"""

from revnets.memory.allocator import allocator_peak
from revnets.memory.measure import MemoryReport, MemoryTracker, measure_memory
from revnets.memory.predict import Predictor, predict_memory
from revnets.memory.timeline import (
    MemoryTimeline,
    cuda_allocator_history,
    plot_timelines,
    predict_timeline,
    record_timeline,
)

__all__ = [
    "MemoryReport",
    "MemoryTimeline",
    "MemoryTracker",
    "Predictor",
    "allocator_peak",
    "cuda_allocator_history",
    "measure_memory",
    "plot_timelines",
    "predict_memory",
    "predict_timeline",
    "record_timeline",
]
