"""The fixed train/val split, each rank's shards, and the batches it trains on.

The shared pieces are in train/data/batches.py. Two paths, chosen by the data set (not by a flag):
- the built-in sets (train/data/datasets.py) are held in memory; batches are gathered by index,
  converted and normalised on the training device (and kept there, data.on_device, on a GPU);
- imagefolder and custom sets are streamed (train/data/streaming.py): DataLoader workers read and
  decode each batch; nothing holds the whole set.
Training shards come from DistributedSampler (padded so every rank takes the same number of
steps); validation shards are strided slices that cover the validation set exactly once over all
ranks, so validation metrics do not depend on the world size. An epoch can start at a batch
offset (resuming mid-epoch): the samples before it are never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from train.config.groups import DataConfig
from train.data.batches import (
    Batches,
    DataBundle,
    ShardOrder,
    Split,
    default_num_workers,
    describe_tensors,
    loader,
    split,
)
from train.data.datasets import DATASETS, test_set
from train.distributed import devices

STREAMED = ("imagefolder", "custom")
"""Data sets read from disk batch by batch (train/data/streaming.py); the others are in memory."""


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
        order = devices.to_device(order, self.device)
        size = self.order.batch_size
        for start in range(0, len(order), size):
            rows = self.subset.idx[order[start:start + size]]
            yield self.subset.images[rows], self.subset.labels[rows]


def build(cfg: DataConfig, rank: int, world_size: int, local_world_size: int,
          device: torch.device, seed: int, channels_last: bool = False,
          resident: bool | None = None, micro_batches: int = 1) -> DataBundle:
    """This rank's shards, in batches of data.batch_size / (world size x `micro_batches`), the
    micro-batch of trainer.accumulate_grad_batches (validation reads the same size: it fits
    where training does); `resident` (default: data.on_device on a GPU) keeps an in-memory
    data set on `device` and batches it there."""
    if cfg.name in STREAMED:
        from train.data import streaming

        return streaming.build(cfg, rank, world_size, local_world_size, device, seed,
                               channels_last, micro_batches)
    data = DATASETS[cfg.name](cfg)
    parts = split(len(data.labels), cfg.val_fraction, cfg.split_seed)
    train_images = data.images[parts.train_idx].float().div_(data.scale)
    # Per-channel statistics of the training split: the same on every rank.
    mean = train_images.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)
    std = train_images.std(dim=(0, 2, 3)).clamp_min(1e-6).view(1, -1, 1, 1)
    del train_images

    keep_on_device = (devices.keep_data_on_device(cfg.on_device, device) if resident is None
                      else resident)
    images, labels = data.images, data.labels
    train_index = parts.train_idx  # the record describes the split on the host
    if keep_on_device:
        images, labels = images.to(device), labels.to(device)
        parts = Split(parts.train_idx.to(device), parts.val_idx.to(device))
    workers = 0 if keep_on_device else (
        cfg.num_workers if cfg.num_workers is not None else default_num_workers(local_world_size))
    per_rank = cfg.batch_size // (world_size * micro_batches)

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
    test, num_test = None, 0
    if (tests := test_set(cfg)) is not None:  # strided too: every test sample exactly once
        t_images, t_labels = tests.images, tests.labels
        if keep_on_device:
            t_images, t_labels = t_images.to(device), t_labels.to(device)
        shard = torch.arange(rank, len(t_labels), world_size, device=t_labels.device)
        test = batches(_Subset(t_images, t_labels, shard), None, False)
        num_test = len(t_labels)
    return DataBundle(
        test=test, num_test=num_test,
        train=batches(train_set, sampler, cfg.augment),
        val=batches(val_set, None, False),
        num_train=len(parts.train_idx), num_val=len(parts.val_idx),
        class_names=data.class_names, input_shape=tuple(map(int, data.images.shape[1:])),
        describe=lambda: describe_tensors(data.images, data.labels, train_index))
