"""The fixed train/val split, each rank's shards, and the batches it trains on.

The shared pieces are in train/data/batches.py. Two paths, chosen by the data set (not by a flag):
- the built-in sets (train/data/datasets.py) are held in memory; batches are gathered by index,
  converted and normalised on the training device (and kept there, data.on_device, on a GPU);
- imagefolder, custom and token sets are streamed (train/data/sources.py, streaming.py):
  DataLoader workers read and decode each batch; nothing holds the whole set.
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
    default_num_workers,
    describe_tensors,
    loader,
    split,
)
from train.data.datasets import DATASETS, test_set
from train.distributed import devices
from train.distributed.env import DistEnv

STREAMED = ("imagefolder", "arrow", "custom", "tokens")
"""Data sets read from disk batch by batch (train/data/sources.py); the others are in memory."""
SHARDED = ("arrow", "tokens")
"""Data read from a few large files (not a file per sample): the bottleneck line does not
suggest a sharded data set to a job on one."""


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


def build(cfg: DataConfig, env: DistEnv, device: torch.device, seed: int, *,
          channels_last: bool = False, resident: bool | None = None,
          micro_batches: int = 1, classes: bool = True) -> DataBundle:
    """This rank's shards (its place in the job: `env`), in batches of data.batch_size /
    (world size x `micro_batches`), the micro-batch of trainer.accumulate_grad_batches
    (validation reads the same size: it fits where training does); `resident` (default:
    data.on_device on a GPU) keeps an in-memory data set on `device` and batches it there."""
    per_rank = cfg.batch_size // (env.world_size * micro_batches)
    if cfg.name in STREAMED:
        from train.data import sources

        return sources.build(cfg, env, device, seed, per_rank, channels_last, classes)
    keep = devices.keep_data_on_device(cfg.on_device, device) if resident is None else resident
    return _in_memory(cfg, env, _Reader(cfg, env, device, per_rank, channels_last, keep), seed)


class _Reader:
    """How an in-memory set's shards become batches on this rank: gathered on the device
    (`keep_on_device`) or read by a DataLoader, normalised by the training split's statistics."""

    def __init__(self, cfg: DataConfig, env: DistEnv, device: torch.device, per_rank: int,
                 channels_last: bool, keep_on_device: bool) -> None:
        self.device, self.per_rank, self.keep_on_device = device, per_rank, keep_on_device
        self.workers = 0 if keep_on_device else (
            cfg.num_workers if cfg.num_workers is not None
            else default_num_workers(env.local_world_size))
        self.normalise: dict[str, Any] = {"channels_last": channels_last}

    def place(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(self.device) if self.keep_on_device else t for t in tensors]

    def batches(self, subset: _Subset, sampler: DistributedSampler | None,
                augment: bool) -> Batches:
        norm = {**self.normalise, "augment": augment}
        order = ShardOrder(sampler, len(subset), self.per_rank)
        if self.keep_on_device:
            return ResidentBatches(subset, order, self.device, **norm)
        return Batches(loader(subset, order, self.workers, self.device, _identity), order,
                       self.device, **norm)


def _in_memory(cfg: DataConfig, env: DistEnv, reader: _Reader, seed: int) -> DataBundle:
    """A built-in set held in memory: DistributedSampler's shard for training, a strided one
    for validation (rank r validates samples r, r+W, r+2W, ...: each once, no padding)."""
    data = DATASETS[cfg.name](cfg)
    parts = split(len(data.labels), cfg.val_fraction, cfg.split_seed)
    train_images = data.images[parts.train_idx].float().div_(data.scale)
    # Per-channel statistics of the training split: the same on every rank.
    reader.normalise.update(
        mean=train_images.mean(dim=(0, 2, 3)).view(1, -1, 1, 1),
        std=train_images.std(dim=(0, 2, 3)).clamp_min(1e-6).view(1, -1, 1, 1), scale=data.scale)
    del train_images
    images, labels, train_idx, val_idx = reader.place(data.images, data.labels,
                                                      parts.train_idx, parts.val_idx)
    train_set = _Subset(images, labels, train_idx)
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank,
                                 shuffle=True, seed=seed, drop_last=False)
    val_set = _Subset(images, labels, val_idx[env.rank::env.world_size])
    test, num_test = _in_memory_test(cfg, env, reader)
    return DataBundle(
        test=test, num_test=num_test,
        train=reader.batches(train_set, sampler, cfg.augment),
        val=reader.batches(val_set, None, False),
        num_train=len(parts.train_idx), num_val=len(parts.val_idx),
        class_names=data.class_names, input_shape=tuple(map(int, data.images.shape[1:])),
        # the description reads the split on the host
        describe=lambda: describe_tensors(data.images, data.labels, parts.train_idx))


def _in_memory_test(cfg: DataConfig, env: DistEnv, reader: _Reader) -> tuple[Batches | None, int]:
    """The test split's strided shard (every test sample on exactly one rank) and its size;
    (None, 0) for a data set without one."""
    if (tests := test_set(cfg)) is None:
        return None, 0
    images, labels = reader.place(tests.images, tests.labels)
    shard = torch.arange(env.rank, len(labels), env.world_size, device=labels.device)
    return reader.batches(_Subset(images, labels, shard), None, False), len(labels)
