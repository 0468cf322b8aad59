"""The fixed train/val split, each rank's shards, and the batches it trains on.

Two paths, chosen by the data set (not by a flag):
- the built-in sets (train/datasets.py) are held in memory; batches are gathered by index,
  converted and normalised on the training device (and kept there, data.on_device, on a GPU);
- imagefolder and custom sets are streamed (train/streaming.py): DataLoader workers read and
  decode each batch; nothing holds the whole set.
Training shards come from DistributedSampler (padded so every rank takes the same number of
steps); validation shards are strided slices that cover the validation set exactly once over all
ranks, so validation metrics do not depend on the world size. An epoch can start at a batch
offset (resuming mid-epoch): the samples before it are never read.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from train.config import DataConfig
from train.datasets import DATASETS
from train.tracking import records

STREAMED = ("imagefolder", "custom")
"""Data sets read from disk batch by batch (train/streaming.py); the others are in memory."""


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


def default_num_workers(local_world_size: int, streamed: bool = False) -> int:
    """Leave one CPU per rank for the training loop itself. In-memory batches need few workers;
    streamed ones are decoded by them, so they get at least one and up to 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    spare = cpus // max(1, local_world_size) - 1
    return min(8, max(1, spare)) if streamed else min(4, max(0, spare))


class ShardOrder(Sampler[int]):
    """A rank's sample positions for one epoch: DistributedSampler's shuffled shard (training)
    or the shard in order (validation), from batch `start` on."""

    def __init__(self, sampler: DistributedSampler | None, size: int, batch_size: int) -> None:
        self.sampler, self.size, self.batch_size = sampler, size, batch_size
        self.start = 0

    def epoch_length(self) -> int:
        return len(self.sampler) if self.sampler is not None else self.size

    def __len__(self) -> int:
        return max(0, self.epoch_length() - self.start * self.batch_size)

    def __iter__(self) -> Iterator[int]:
        order = iter(self.sampler) if self.sampler is not None else iter(range(self.size))
        return itertools.islice(order, self.start * self.batch_size, None)


class Batches:
    """Iterates (inputs, labels) batches of one shard on `device`: converted to float, scaled by
    1/`scale` and normalised there, unless `scale` is None (inputs as the Dataset gives them)."""

    def __init__(self, loader: DataLoader | None, order: ShardOrder, device: torch.device,
                 mean: torch.Tensor | None = None, std: torch.Tensor | None = None,
                 scale: float | None = None, augment: bool = False,
                 channels_last: bool = False) -> None:
        self.loader, self.order, self.device = loader, order, device
        self.sampler = order.sampler
        self.mean = mean.to(device) if mean is not None else None
        self.std = std.to(device) if std is not None else None
        self.scale, self.augment, self.channels_last = scale, augment, channels_last

    def __len__(self) -> int:
        """Batches in a whole epoch (also after set_epoch with a start batch)."""
        return math.ceil(self.order.epoch_length() / self.order.batch_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The epoch's order (the same as before a restart), from batch `start_batch` on: the
        batches before it are skipped without being read."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        self.order.start = start_batch

    def raw(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches as stored (uint8 or float, any device)."""
        yield from self.loader  # type: ignore[misc]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for inputs, labels in self.raw():
            x = inputs.to(self.device, non_blocking=True)
            if self.scale is not None:
                x = x.float().div_(self.scale)
                if self.mean is not None and self.std is not None:
                    x = (x - self.mean) / self.std
            if self.augment:
                x = crop_and_flip(x)
            if self.channels_last and x.ndim == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, labels.to(self.device, non_blocking=True)


class ResidentBatches(Batches):
    """A shard of a data set that lives on the training device (data.on_device on a GPU).

    The shard's order for the epoch - DistributedSampler's, or the shard itself for
    validation - goes to the device once per epoch; every batch is then gathered there. No
    loader, no per-step host-to-device copy: a copy from pageable host memory would make the
    host wait for the device at every step.
    """

    def __init__(self, subset: _Subset, order: ShardOrder, device: torch.device,
                 **normalise: Any) -> None:
        super().__init__(None, order, device, **normalise)
        self.subset = subset

    def raw(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.order), dtype=torch.long)
        if self.device.type == "cuda":
            order = order.pin_memory()
        order = order.to(self.device, non_blocking=True)
        size = self.order.batch_size
        for start in range(0, len(order), size):
            rows = self.subset.idx[order[start:start + size]]
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


WORKER_START = "fork" if sys.platform == "linux" else None
"""Workers are forked, whatever started this rank: a local rank is a spawned process, whose
default would spawn them too, and each would import torch again (seconds per worker, and its
memory). They never touch CUDA; what they read (file lists, the data set) they share."""


def loader(dataset: torch.utils.data.Dataset, order: ShardOrder, workers: int,
           device: torch.device, collate: Callable[[Any], Any]) -> DataLoader:
    """Batches of `order` read by `workers` processes (kept for the whole job)."""
    return DataLoader(dataset, batch_sampler=BatchSampler(order, order.batch_size, drop_last=False),
                      collate_fn=collate, num_workers=workers, persistent_workers=workers > 0,
                      pin_memory=device.type == "cuda",
                      multiprocessing_context=WORKER_START if workers > 0 else None)


@dataclass
class DataBundle:
    train: Batches
    val: Batches
    num_train: int
    num_val: int
    class_names: list[str]
    input_shape: tuple[int, ...]
    """One sample's shape as the model gets it, e.g. (3, 64, 64)."""
    describe: Callable[[str], records.DatasetInput] = field(repr=False)
    """What dataset_record returns."""

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def channels(self) -> int:
        return self.input_shape[0]

    @property
    def image_size(self) -> int:
        return self.input_shape[-1]

    def dataset_record(self, name: str) -> records.DatasetInput:
        """The training split as the run's MLflow input: for in-memory sets a digest of the
        tensors, for streamed ones of the file list (ImageFolder) or of the length and first
        samples (custom)."""
        return self.describe(name)


def build(cfg: DataConfig, rank: int, world_size: int, local_world_size: int,
          device: torch.device, seed: int, channels_last: bool = False,
          resident: bool | None = None) -> DataBundle:
    """This rank's shards; `resident` (default: data.on_device on a GPU) keeps an in-memory
    data set on `device` and batches it there."""
    if cfg.name in STREAMED:
        from train import streaming

        return streaming.build(cfg, rank, world_size, local_world_size, device, seed,
                               channels_last)
    data = DATASETS[cfg.name](cfg)
    parts = split(len(data.labels), cfg.val_fraction, cfg.split_seed)
    train_images = data.images[parts.train_idx].float().div_(data.scale)
    # Per-channel statistics of the training split: the same on every rank.
    mean = train_images.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)
    std = train_images.std(dim=(0, 2, 3)).clamp_min(1e-6).view(1, -1, 1, 1)
    del train_images

    keep_on_device = cfg.on_device and device.type == "cuda" if resident is None else resident
    images, labels = data.images, data.labels
    train_index = parts.train_idx  # the record describes the split on the host
    if keep_on_device:
        images, labels = images.to(device), labels.to(device)
        parts = Split(parts.train_idx.to(device), parts.val_idx.to(device))
    workers = 0 if keep_on_device else (
        cfg.num_workers if cfg.num_workers is not None else default_num_workers(local_world_size))
    per_rank = cfg.batch_size // world_size

    def batches(subset: _Subset, sampler: DistributedSampler | None, augment: bool) -> Batches:
        norm = {"mean": mean, "std": std, "scale": data.scale, "channels_last": channels_last,
                "augment": augment}
        order = ShardOrder(sampler, len(subset), per_rank)
        if keep_on_device:
            return ResidentBatches(subset, order, device, **norm)
        return Batches(loader(subset, order, workers, device, _identity), order, device, **norm)

    train_set = _Subset(images, labels, parts.train_idx)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=False)
    # Strided shard: rank r validates samples r, r+W, r+2W, ... - each exactly once, no padding.
    val_set = _Subset(images, labels, parts.val_idx[rank::world_size])
    return DataBundle(
        train=batches(train_set, sampler, cfg.augment),
        val=batches(val_set, None, False),
        num_train=len(parts.train_idx), num_val=len(parts.val_idx),
        class_names=data.class_names, input_shape=tuple(map(int, data.images.shape[1:])),
        describe=lambda name: records.dataset_input(name, data.images, data.labels, train_index))
