"""The fixed train/val split, each rank's shards, and the batches it trains on.

The data sets (train/datasets.py) are held in memory; batches are gathered by index, converted
and normalised on the training device. Training shards come from DistributedSampler (padded so
every rank takes the same number of steps); validation shards are strided slices that cover the
validation set exactly once over all ranks, so validation metrics do not depend on the world
size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from train.config import DataConfig
from train.datasets import DATASETS, ImageSet


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

    def raw(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches as stored (uint8 or float, any device)."""
        yield from self.loader

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.raw():
            x = images.to(self.device, non_blocking=True).float().div_(self.scale)
            x = (x - self.mean) / self.std
            if self.augment:
                x = crop_and_flip(x)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, labels.to(self.device, non_blocking=True)


class ResidentBatches(Batches):
    """A shard of a data set that lives on the training device (data.on_device on a GPU).

    The shard's order for the epoch - DistributedSampler's, or the shard itself for
    validation - goes to the device once per epoch; every batch is then gathered there. No
    loader, no per-step host-to-device copy: a copy from pageable host memory would make the
    host wait for the device at every step.
    """

    def __init__(self, subset: _Subset, sampler: DistributedSampler | None, batch_size: int,
                 device: torch.device, **normalise: Any) -> None:
        super().__init__(None, sampler, device, **normalise)  # type: ignore[arg-type]
        self.subset, self.batch_size = subset, batch_size

    def __len__(self) -> int:
        shard = len(self.sampler) if self.sampler is not None else len(self.subset)
        return math.ceil(shard / self.batch_size)

    def raw(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.sampler) if self.sampler is not None
                             else range(len(self.subset)), dtype=torch.long)
        if self.device.type == "cuda":
            order = order.pin_memory()
        order = order.to(self.device, non_blocking=True)
        for start in range(0, len(order), self.batch_size):
            rows = self.subset.idx[order[start:start + self.batch_size]]
            yield self.subset.images[rows], self.subset.labels[rows]


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
          device: torch.device, seed: int, channels_last: bool = False,
          resident: bool | None = None) -> DataBundle:
    """This rank's shards; `resident` (default: data.on_device on a GPU) keeps the whole data
    set on `device` and batches it there."""
    data = DATASETS[cfg.name](cfg)
    parts = split(len(data.labels), cfg.val_fraction, cfg.split_seed)
    train_images = data.images[parts.train_idx].float().div_(data.scale)
    # Per-channel statistics of the training split: the same on every rank.
    mean = train_images.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)
    std = train_images.std(dim=(0, 2, 3)).clamp_min(1e-6).view(1, -1, 1, 1)
    del train_images

    keep_on_device = cfg.on_device and device.type == "cuda" if resident is None else resident
    images, labels = data.images, data.labels
    if keep_on_device:
        images, labels = images.to(device), labels.to(device)
        parts = Split(parts.train_idx.to(device), parts.val_idx.to(device))
    workers = 0 if keep_on_device else (
        cfg.num_workers if cfg.num_workers is not None else default_num_workers(local_world_size))
    per_rank = cfg.batch_size // world_size

    def batches(subset: _Subset, sampler: DistributedSampler | None, augment: bool) -> Batches:
        norm = {"mean": mean, "std": std, "scale": data.scale, "channels_last": channels_last,
                "augment": augment}
        if keep_on_device:
            return ResidentBatches(subset, sampler, per_rank, device, **norm)
        order = sampler if sampler is not None else range(len(subset))
        loader = DataLoader(subset, batch_sampler=BatchSampler(order, per_rank, drop_last=False),
                            collate_fn=_identity, num_workers=workers,
                            persistent_workers=workers > 0, pin_memory=device.type == "cuda")
        return Batches(loader, sampler, device, **norm)

    train_set = _Subset(images, labels, parts.train_idx)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=False)
    # Strided shard: rank r validates samples r, r+W, r+2W, ... - each exactly once, no padding.
    val_set = _Subset(images, labels, parts.val_idx[rank::world_size])
    return DataBundle(
        train=batches(train_set, sampler, cfg.augment),
        val=batches(val_set, None, False),
        num_train=len(parts.train_idx), num_val=len(parts.val_idx), channels=data.channels,
        image_size=data.image_size, class_names=data.class_names,
        source=data, train_index=parts.train_idx)
