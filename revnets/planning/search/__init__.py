"""The searches over a chain's costs: the chain model (chain_model.py: what a plan holds),
one-level plans (chain.py), nested schedules (nested.py), costs under compile
(compiled_costs.py), and the modelled search with exact acceptance (options.py). Imports
revnets.planning.costs and revnets.graph, never the orchestration above (docs/layout.md)."""
