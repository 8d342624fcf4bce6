"""The model zoo. Importing it registers every model with timm."""

from revnets.models.irevnet import IRevNet
from revnets.models.residual import MEMORY_STRATEGIES, ResidualNet
from revnets.models.reversible_vit import ReversibleVisionTransformer

__all__ = ["IRevNet", "MEMORY_STRATEGIES", "ResidualNet", "ReversibleVisionTransformer"]
