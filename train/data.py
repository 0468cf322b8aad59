"""Data sets, the fixed train/val split, and per-rank loaders.

Every data set is held in memory as one tensor of images (uint8 where the source is 8-bit, so
CIFAR-10 costs 150 MB per rank, not 600) and one of labels; batches are gathered by index,
converted and normalised on the training device. Training shards come from DistributedSampler
(padded so every rank takes the same number of steps); validation shards are strided slices
that cover the validation set exactly once over all ranks, so validation metrics do not depend
on the world size.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from train.config import DataConfig


class DataMissingError(FileNotFoundError):
    """A data set is not on disk and data.download=false."""


@dataclass
class ImageSet:
    """A whole data set in memory: images (N, C, H, W), integer labels, and how to normalise."""

    images: torch.Tensor
    labels: torch.Tensor
    scale: float
    """Divide raw pixel values by this to get [0, 1]."""
    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[-1])


def _digits(cfg: DataConfig) -> ImageSet:
    # The same file sklearn.datasets.load_digits() reads, without importing scikit-learn
    # (1.6 s per rank here): 1,797 rows of 64 pixel values (0-16) and the label.
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataMissingError("data=digits needs scikit-learn installed (pip install "
                               "scikit-learn).")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32))
    images = table[:, :-1].reshape(-1, 1, 8, 8)
    return ImageSet(images, table[:, -1].long(), 16.0, [str(i) for i in range(10)])


def _synthetic(cfg: DataConfig) -> ImageSet:
    g = torch.Generator().manual_seed(cfg.split_seed)
    shape = (cfg.num_samples, cfg.channels, cfg.image_size, cfg.image_size)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    labels = torch.randint(0, cfg.num_classes, (cfg.num_samples,), generator=g)
    return ImageSet(images, labels, 255.0, [str(i) for i in range(cfg.num_classes)])


def _download_hint(name: str, cls: str, root: str) -> str:
    return (f"Data set {name!r} is not under data.root={root!r} and data.download=false "
            "(compute nodes are often offline). Download it once where there is internet access:"
            f"\n  python -c \"from torchvision.datasets import {cls}; {cls}('{root}', "
            "download=True)\"\nor run with data.download=true; point data.root (or "
            "TRAIN_DATA_ROOT) at a directory all nodes can read.")


def _torchvision(name: str, cls_name: str) -> Callable[[DataConfig], ImageSet]:
    def load(cfg: DataConfig) -> ImageSet:
        import numpy as np
        import torchvision.datasets as tvd

        cls = getattr(tvd, cls_name)
        if cls_name == "CIFAR10":
            cls = _cifar10_files(cls)
        try:
            ds = cls(cfg.root, train=True, download=cfg.download)
        except RuntimeError as e:
            if "not found" in str(e).lower():
                raise DataMissingError(_download_hint(name, cls_name, cfg.root)) from None
            raise
        data = ds.data if isinstance(ds.data, torch.Tensor) else torch.from_numpy(
            np.ascontiguousarray(ds.data))
        images = data.unsqueeze(1) if data.ndim == 3 else data.permute(0, 3, 1, 2)
        labels = torch.as_tensor(ds.targets, dtype=torch.long)
        return ImageSet(images.contiguous(), labels, 255.0, [str(c) for c in ds.classes])

    return load


def _cifar10_files(cifar10: type) -> type:
    """torchvision's CIFAR10 reader without its md5 checks.

    torchvision insists on the md5 of the official files; a site's own copy in the same pickled
    format (or the small files the tests write) is read the same way.
    """
    import pickle

    def check_integrity(self: object) -> bool:
        folder = Path(self.root) / self.base_folder  # type: ignore[attr-defined]
        return all((folder / f).is_file() for f, _ in self.train_list)  # type: ignore[attr-defined]

    def load_meta(self: object) -> None:
        path = Path(self.root) / self.base_folder / self.meta["filename"]  # type: ignore[attr-defined]
        with open(path, "rb") as f:
            names = pickle.load(f, encoding="latin1")[self.meta["key"]]  # type: ignore[attr-defined]
        self.classes = list(names)  # type: ignore[attr-defined]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}  # type: ignore[attr-defined]

    return type("CIFAR10Files", (cifar10,), {"_check_integrity": check_integrity,
                                             "_load_meta": load_meta})


DATASETS: dict[str, Callable[[DataConfig], ImageSet]] = {
    "digits": _digits,
    "synthetic": _synthetic,
    "mnist": _torchvision("mnist", "MNIST"),
    "fashion_mnist": _torchvision("fashion_mnist", "FashionMNIST"),
    "cifar10": _torchvision("cifar10", "CIFAR10"),
}


def check_available(cfg: DataConfig) -> None:
    """Pre-flight: refuse early (before ranks start) when a data set is missing."""
    if cfg.name in ("digits", "synthetic") or cfg.download:
        return
    DATASETS[cfg.name](cfg)


@dataclass
class Split:
    train_idx: torch.Tensor
    val_idx: torch.Tensor


def split(n: int, val_fraction: float, seed: int) -> Split:
    """The same train/val split on every rank and every restart."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(n * val_fraction))
    return Split(train_idx=perm[n_val:], val_idx=perm[:n_val])


class _Subset(torch.utils.data.Dataset):
    """Index-addressable view whose __getitems__ fetches a whole batch in one gather."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor) -> None:
        self.images, self.labels, self.idx = images, labels, idx

    def __len__(self) -> int:
        return len(self.idx)

    def __getitems__(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.idx[torch.as_tensor(positions, device=self.idx.device)]
        return self.images[rows], self.labels[rows]


def _identity(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch


def default_num_workers(local_world_size: int) -> int:
    """Leave one CPU per rank for the training loop itself; in-memory batches need few workers."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return min(4, max(0, cpus // max(1, local_world_size) - 1))


class Batches:
    """Iterates (images, labels) batches of one shard, normalised on `device`."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler | None, device: torch.device,
                 mean: torch.Tensor, std: torch.Tensor, scale: float, augment: bool,
                 channels_last: bool) -> None:
        self.loader, self.sampler, self.device = loader, sampler, device
        self.mean, self.std, self.scale = mean.to(device), std.to(device), scale
        self.augment, self.channels_last = augment, channels_last

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.loader:
            x = images.to(self.device, non_blocking=True).float().div_(self.scale)
            x = (x - self.mean) / self.std
            if self.augment:
                x = crop_and_flip(x)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, labels.to(self.device, non_blocking=True)


def crop_and_flip(x: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Random crop after zero padding and random horizontal flip, per sample, on x's device."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (n, 1, 1), device=x.device)
    ox = torch.randint(0, 2 * pad + 1, (n, 1, 1), device=x.device)
    rows = oy + torch.arange(h, device=x.device).view(1, h, 1)
    cols = ox + torch.arange(w, device=x.device).view(1, 1, w)
    flip = torch.rand(n, 1, 1, device=x.device) < 0.5
    cols = torch.where(flip, ox + (w - 1) - torch.arange(w, device=x.device).view(1, 1, w), cols)
    batch = torch.arange(n, device=x.device).view(n, 1, 1)
    return padded[batch, :, rows, cols].permute(0, 3, 1, 2)


@dataclass
class DataBundle:
    train: Batches
    val: Batches
    num_train: int
    num_val: int
    channels: int
    image_size: int
    class_names: list[str]
    source: ImageSet
    """The whole data set as loaded (for the data set's MLflow input record)."""
    train_index: torch.Tensor
    """Rows of `source` in the training split."""

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def build(cfg: DataConfig, rank: int, world_size: int, local_world_size: int,
          device: torch.device, seed: int, channels_last: bool = False) -> DataBundle:
    data = DATASETS[cfg.name](cfg)
    parts = split(len(data.labels), cfg.val_fraction, cfg.split_seed)
    train_images = data.images[parts.train_idx].float().div_(data.scale)
    # Per-channel statistics of the training split: the same on every rank.
    mean = train_images.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)
    std = train_images.std(dim=(0, 2, 3)).clamp_min(1e-6).view(1, -1, 1, 1)
    del train_images

    keep_on_device = cfg.on_device and device.type == "cuda"
    images, labels = data.images, data.labels
    if keep_on_device:
        images, labels = images.to(device), labels.to(device)
        parts = Split(parts.train_idx.to(device), parts.val_idx.to(device))
    workers = 0 if keep_on_device else (
        cfg.num_workers if cfg.num_workers is not None else default_num_workers(local_world_size))
    per_rank = cfg.batch_size // world_size

    def loader(dataset: _Subset, batches: object) -> DataLoader:
        return DataLoader(dataset, batch_sampler=batches, collate_fn=_identity,
                          num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=device.type == "cuda" and not keep_on_device)

    train_set = _Subset(images, labels, parts.train_idx)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=False)
    train_loader = loader(train_set, BatchSampler(sampler, per_rank, drop_last=False))
    # Strided shard: rank r validates samples r, r+W, r+2W, ... - each exactly once, no padding.
    val_set = _Subset(images, labels, parts.val_idx[rank::world_size])
    val_loader = loader(val_set, BatchSampler(range(len(val_set)), per_rank, drop_last=False))
    norm = {"mean": mean, "std": std, "scale": data.scale, "channels_last": channels_last}
    return DataBundle(
        train=Batches(train_loader, sampler, device, augment=cfg.augment, **norm),
        val=Batches(val_loader, None, device, augment=False, **norm),
        num_train=len(parts.train_idx), num_val=len(parts.val_idx), channels=data.channels,
        image_size=data.image_size, class_names=data.class_names,
        source=data, train_index=parts.train_idx)
