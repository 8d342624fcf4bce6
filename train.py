"""Train a ResNet or RevNet from the zoo.

    python train.py                                   # small default: RevNet-38, synthetic, CPU
    python train.py model=revnet110 data=cifar10 optim.lr=0.05 trainer.max_steps=100
    python train.py experiment=revnet_cifar           # the RevNet paper's CIFAR recipe
    python train.py -m model=resnet32,revnet38        # a sweep
    torchrun --nproc_per_node=2 train.py trainer.distributed=true

Configuration lives in configs/ (Hydra); the loop lives in revnets/training/.
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from revnets.training import DataMismatchError, DataNotFoundError, NonFiniteLossError, train


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        result = train(cfg, HydraConfig.get().runtime.output_dir)
    except (DataNotFoundError, DataMismatchError, NonFiniteLossError) as error:
        raise SystemExit(f"error: {error}") from None
    return result.get("val_accuracy")  # what a Hydra sweeper would optimise


if __name__ == "__main__":
    main()
