"""Train a ResNet or RevNet from the zoo.

    python train.py                                   # small default: RevNet-38, synthetic, CPU
    python train.py model=revnet110 data=cifar10 optim.lr=0.05 trainer.max_steps=100
    python train.py memory=reversible memory.store_last_blocks=2   # a memory plan and its options
    python train.py experiment=revnet_cifar           # the RevNet paper's CIFAR recipe
    python train.py -m model=resnet32,revnet38        # a sweep
    torchrun --nproc_per_node=2 train.py trainer.distributed=ddp   # or fsdp; none is the default

Configuration lives in configs/ (Hydra); the loop lives in revnets/training/.
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from revnets.training import (
    DataMismatchError,
    DataNotFoundError,
    MemoryConfigError,
    NonFiniteLossError,
    SettingsError,
    train,
)
from revnets.training.memory_options import check_memory_overrides


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        result = train(cfg, HydraConfig.get().runtime.output_dir)
    except (DataNotFoundError, DataMismatchError, MemoryConfigError, NonFiniteLossError,
            SettingsError) as error:
        raise SystemExit(f"error: {error}") from None
    return result.get("val_accuracy")  # what a Hydra sweeper would optimise


if __name__ == "__main__":
    try:  # before Hydra, which would name a misspelt memory key but not the valid ones
        check_memory_overrides(sys.argv[1:])
    except MemoryConfigError as error:
        raise SystemExit(f"error: {error}") from None
    main()
