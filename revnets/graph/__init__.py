"""Any model as a chain of graph steps, and the guards of a traced run: trace.py (the tracer:
as_graph_chain), step.py (GraphStep, one step of the chain), values.py (what a step's
arguments refer to), trace_state.py (what a trace freezes and must leave as it was),
reads.py (what the traced code read), guard.py (the check a planned step runs before a
traced graph). Imported by revnets.planning, never the reverse (docs/layout.md)."""

from revnets.graph.step import GraphStep
from revnets.graph.trace import NotAChainError, as_graph_chain

__all__ = ["GraphStep", "NotAChainError", "as_graph_chain"]
