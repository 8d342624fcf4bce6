"""What each step of a chain costs: its profile (layer_profile.py, profile.py: sizes on the
meta device, meta_memo.py and meta_attention.py there), the gradients its backward makes
(gradients.py), its forward times (step_times.py). Imports revnets.graph, nothing of
revnets.planning above it (docs/layout.md)."""
