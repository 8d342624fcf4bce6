"""The model zoo. Importing it registers every model with timm."""

from revnets.models.irevnet import IRevNet
from revnets.models.residual import ResidualNet
from revnets.models.reversible_vit import ReversibleVisionTransformer

__all__ = ["IRevNet", "ResidualNet", "ReversibleVisionTransformer"]
