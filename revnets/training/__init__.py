"""Training: the loop behind train.py, with its data, optimisation and checkpointing."""

from revnets.training.data import DataMismatchError, DataNotFoundError, build_loaders
from revnets.training.factory import create_model
from revnets.training.loop import NonFiniteLossError, Trainer, train
from revnets.training.memory_options import MemoryConfigError
from revnets.training.settings import SettingsError

__all__ = [
    "DataMismatchError",
    "DataNotFoundError",
    "MemoryConfigError",
    "NonFiniteLossError",
    "SettingsError",
    "Trainer",
    "build_loaders",
    "create_model",
    "train",
]
