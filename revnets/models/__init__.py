"""The model zoo. Importing it registers every model with timm."""

from revnets.models.residual import MEMORY_STRATEGIES, ResidualNet

__all__ = ["MEMORY_STRATEGIES", "ResidualNet"]
