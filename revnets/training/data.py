"""Data sets and loaders: synthetic CIFAR-shaped data, CIFAR-10/100, ImageNet, and text.

CIFAR uses torchvision's own dataset classes on a local folder and ImageNet torchvision's
ImageFolder; nothing is downloaded unless ``download=true`` is asked for. Text is the standard
library's documentation topics (``pydoc_data.topics``), which ship with Python, as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from revnets.training.settings import DataSettings

__all__ = ["DataMismatchError", "DataNotFoundError", "Loaders", "ResumableSampler", "build_loaders"]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_SIZE = 32
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DataNotFoundError(RuntimeError):
    """The data set is not where the configuration says; the message says how to get it."""


class DataMismatchError(ValueError):
    """The data set on disk contradicts the configuration; the message names the setting."""


@dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    sampler: ResumableSampler
    num_classes: int  # classes, or a text's tokens
    image_size: int | None  # the side of the square images every batch holds; text: None
    tokens: bool = False  # text: samples of token ids, each target the next token


class ResumableSampler(Sampler[int]):
    """A :class:`DistributedSampler` (one replica outside DDP) that can start mid-epoch.

    Every rank, and a single process, draws the same permutation for an epoch, so resuming or
    changing the number of processes replays the same sample order.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        self.inner = DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        self.inner.set_epoch(epoch)
        self.start = start

    def __iter__(self):
        indices = list(self.inner)[self.start :]
        self.start = 0
        return iter(indices)

    def __len__(self) -> int:
        return len(self.inner) - self.start


def synthetic(
    size: int, num_classes: int, image_size: int, seed: int, split: int = 0
) -> TensorDataset:
    """Images of a smooth per-class pattern plus noise: a convolutional net learns them in a few
    dozen steps. The patterns depend on ``seed`` only, the samples on ``seed`` and ``split``."""
    patterns_from = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=patterns_from)
    patterns = torch.nn.functional.interpolate(coarse, size=image_size, mode="bilinear")
    generator = torch.Generator().manual_seed(1_000_003 * (split + 1) + seed)
    labels = torch.randint(0, num_classes, (size,), generator=generator)
    noise = torch.randn(size, 3, image_size, image_size, generator=generator)
    return TensorDataset(patterns[labels] + noise, labels)


def text(sequence_length: int, size: int | None, split: int) -> TensorDataset:
    """Samples of ``sequence_length`` bytes of the standard library's documentation topics,
    each target the byte after its input's: topics in sorted order, every fifth one held out
    for validation (``split`` 1), cut into samples one after another, the first ``size``
    kept."""
    from pydoc_data.topics import topics

    chosen = [topics[k] for i, k in enumerate(sorted(topics)) if (i % 5 == 4) == (split == 1)]
    data = torch.frombuffer(bytearray("\n".join(chosen).encode()), dtype=torch.uint8).long()
    samples = (len(data) - 1) // sequence_length
    if size is not None:
        samples = min(samples, size)
    used = data[:samples * sequence_length + 1]
    x = used[:-1].view(samples, sequence_length)
    y = used[1:].view(samples, sequence_length)
    return TensorDataset(x, y)


def _cifar(cfg: Any, train: bool) -> Dataset:
    from torchvision import datasets
    from torchvision import transforms as T

    cls = datasets.CIFAR10 if cfg.name == "cifar10" else datasets.CIFAR100
    crop = [T.RandomCrop(CIFAR_SIZE, padding=4), T.RandomHorizontalFlip()]
    steps = crop if train and cfg.augment else []
    transform = T.Compose([*steps, T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    root = Path(cfg.root).expanduser()
    try:
        return cls(str(root), train=train, transform=transform, download=cfg.download)
    except RuntimeError as error:
        raise DataNotFoundError(
            f"{cfg.name} was not found in {root.resolve()} (torchvision looked for "
            f"{root.resolve() / cls.base_folder}: {error}). Put the python version of the data "
            f"set there (the folder {cls.base_folder} from {cls.filename}), point data.root at "
            "it, or run once with data.download=true on a machine with internet access."
        ) from None


def _imagenet(cfg: Any, train: bool) -> Dataset:
    from torchvision import datasets
    from torchvision import transforms as T

    folder = Path(cfg.root).expanduser() / ("train" if train else "val")
    if not folder.is_dir():
        raise DataNotFoundError(
            f"imagenet was not found: no folder {folder.resolve()}. ImageFolder expects "
            f"{Path(cfg.root).expanduser().resolve()}/{{train,val}}/<class>/<image>.JPEG; "
            "ImageNet cannot be downloaded automatically (it needs registration at image-net.org)."
        )
    size = cfg.image_size
    if train:
        steps = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(int(size / 0.875)), T.CenterCrop(size)]
    transform = T.Compose([*steps, T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    return datasets.ImageFolder(str(folder), transform=transform)


def _checked_classes(dataset: Dataset, cfg: Any) -> Dataset:
    # Labels past the classifier's outputs would fail deep inside the loss instead.
    if len(dataset.classes) > cfg.num_classes:
        raise DataMismatchError(
            f"{cfg.name} in {Path(cfg.root).expanduser().resolve()} has {len(dataset.classes)} "
            f"classes but data.num_classes={cfg.num_classes}; set "
            f"data.num_classes={len(dataset.classes)}"
        )
    return dataset


def build_datasets(cfg: DataSettings, seed: int) -> tuple[Dataset, Dataset]:
    if cfg.name == "synthetic":
        return (
            synthetic(cfg.train_size, cfg.num_classes, cfg.image_size, seed, split=0),
            synthetic(cfg.val_size, cfg.num_classes, cfg.image_size, seed, split=1),
        )
    if cfg.name in ("cifar10", "cifar100"):
        return _checked_classes(_cifar(cfg, train=True), cfg), _cifar(cfg, train=False)
    if cfg.name == "imagenet":
        return _checked_classes(_imagenet(cfg, train=True), cfg), _imagenet(cfg, train=False)
    if cfg.name == "text":
        if cfg.num_classes != 256:
            raise DataMismatchError(f"data=text is bytes, 256 tokens: set data.num_classes=256 "
                                    f"(not {cfg.num_classes})")
        if cfg.sequence_length is None:
            raise DataMismatchError("data=text is cut into samples of data.sequence_length "
                                    "tokens: set it (e.g. data.sequence_length=128)")
        sets = (text(cfg.sequence_length, cfg.train_size, split=0),
                text(cfg.sequence_length, cfg.val_size, split=1))
        if not len(sets[1]):
            raise DataMismatchError(
                f"data.sequence_length={cfg.sequence_length} leaves the held-out text no "
                f"sample (it has {len(text(1, None, split=1))} bytes); set it lower")
        return sets
    raise ValueError(
        f"unknown data set {cfg.name!r}; valid: 'synthetic', 'cifar10', 'cifar100', 'imagenet', "
        f"'text'"
    )


def build_loaders(cfg: DataSettings, seed: int, world_size: int = 1, rank: int = 0) -> Loaders:
    """Loaders whose ``batch_size`` is the global batch, split evenly across processes."""
    if cfg.batch_size % world_size:
        raise ValueError(
            f"data.batch_size={cfg.batch_size} cannot be split evenly across {world_size} processes"
        )
    train_set, val_set = build_datasets(cfg, seed)
    per_rank = cfg.batch_size // world_size
    if len(train_set) // world_size < per_rank:
        # Incomplete batches are dropped: an epoch would yield no batch, and training loop forever.
        raise DataMismatchError(
            f"the {cfg.name} training set has {len(train_set)} samples, fewer than one batch of "
            f"data.batch_size={cfg.batch_size}"
            + (f" ({per_rank} on each of {world_size} processes)" if world_size > 1 else "")
            + f"; set data.batch_size to at most {len(train_set) // world_size * world_size}"
        )
    sampler = ResumableSampler(train_set, world_size, rank, seed)
    common = dict(num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available())
    # Its own generator: creating an iterator then draws no number from the global RNG, which a
    # resumed run restores exactly (augmentation in the main process and dropout draw from it).
    generator = torch.Generator().manual_seed(seed)
    train = DataLoader(
        train_set, batch_size=per_rank, sampler=sampler, drop_last=True, generator=generator,
        **common,
    )
    val = DataLoader(val_set, batch_size=per_rank, shuffle=False, **common)
    size = CIFAR_SIZE if cfg.name in ("cifar10", "cifar100") else cfg.image_size
    return Loaders(train, val, sampler, cfg.num_classes, size, tokens=cfg.name == "text")
