"""data=arrow's training order with data.shuffle=shards (train/data/arrow.py): reads kept to a
few shards at a time."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from train.data.tokens import WindowSampler


class ShardWindowSampler(WindowSampler):
    """data=tokens' WindowSampler - DistributedSampler's dealing: the same padding, every
    world-th sample to a rank, the order fixed by seed and epoch, hence the same at any world
    size - over an order that keeps
    reads local: the shards in a random order, then the samples of each window of `window`
    consecutive (shuffled) shards in a random order. A worker reading a batch then touches a
    few shards, not a page of every one."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, *, shard_sizes: list[int],
                 window: int = 4) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.starts = np.cumsum([0, *shard_sizes])
        self.window = max(1, window)

    def global_order(self) -> torch.Tensor:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        shards = torch.randperm(len(self.starts) - 1, generator=g).tolist()
        parts = []
        for w in range(0, len(shards), self.window):
            rows = torch.cat([torch.arange(int(self.starts[s]), int(self.starts[s + 1]))
                              for s in shards[w:w + self.window]])
            parts.append(rows[torch.randperm(len(rows), generator=g)])
        return torch.cat(parts) if parts else torch.arange(0)
