"""A user's own models, as a research project would write them: NOT part of train/, reached only
through PYTHONPATH (tests/ on it: `model._target_=userpkg.models.TinyConvNet`)."""

from __future__ import annotations

import os

import torch
from torch import nn


class TinyConvNet(nn.Module):
    """Takes num_classes and in_channels (filled from the data) and its own depth and width."""

    def __init__(self, num_classes: int, in_channels: int, depth: int = 2,
                 width: int = 16) -> None:
        super().__init__()
        self.num_classes, self.in_channels, self.depth = num_classes, in_channels, depth
        layers: list[nn.Module] = []
        channels = in_channels
        for _ in range(depth):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class FlatNet(nn.Module):
    """Takes channels and image_size (filled from the data) to size its first layer."""

    def __init__(self, channels: int, image_size: int, num_classes: int, hidden: int = 32
                 ) -> None:
        super().__init__()
        self.channels, self.image_size, self.num_classes = channels, image_size, num_classes
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size ** 2, hidden),
                                 nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ThreeScores(nn.Module):
    """Wrong for a 10-class data set: always three scores (it does not take num_classes)."""

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.head = nn.Linear(in_channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=(2, 3)))


class ChecksOnTheHost(nn.Module):
    """Reads a value back to the host in forward: cannot run on the meta device, so the
    pre-flight check runs it on the CPU instead."""

    def __init__(self, num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x).all().item():
            raise ValueError("non-finite input")
        return self.head(x.mean(dim=(2, 3)))


def tiny_conv_net(num_classes: int, in_channels: int) -> nn.Module:
    """A factory function works as a target too."""
    return TinyConvNet(num_classes, in_channels, depth=1)


class NotAModel:
    """A class that is no nn.Module."""

    def __init__(self, num_classes: int = 10) -> None:
        self.num_classes = num_classes


class BigramLM(nn.Module):
    """A user's own language model: each token's next-token logits from the token itself and
    the one before it (a causal convolution of width 2). Takes vocab_size (filled from
    data=tokens) and its own width."""

    def __init__(self, vocab_size: int, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Conv1d(width, width, kernel_size=2)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(1, 2)  # (batch, width, seq)
        x = torch.relu(self.mix(nn.functional.pad(x, (1, 0))))  # position t sees t-1 and t
        return self.head(x.transpose(1, 2))


class NamedItsOwnWay(nn.Module):
    """Calls its class count n_classes: not a name the service fills from the data."""

    def __init__(self, n_classes: int, in_channels: int) -> None:
        super().__init__()
        self.head = nn.Linear(in_channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=(2, 3)))


class SpinsOnRank(TinyConvNet):
    """TinyConvNet whose forward never returns on one rank after `after` calls: an endless
    Python loop, as a bug in a model's own code makes one (the rank stays alive)."""

    def __init__(self, num_classes: int, in_channels: int, rank: int = 1, after: int = 2) -> None:
        super().__init__(num_classes, in_channels, width=8)
        self.rank, self.after, self.calls = rank, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        spins = 0
        while int(os.environ.get("RANK", "0")) == self.rank and self.calls > self.after:
            spins += 1  # the endless loop
        return super().forward(x)

class ScaledBigramLM(BigramLM):
    """BigramLM with a learnt output temperature: a parameter of the model's own, which no
    reset_parameters() initialises, so it cannot be built on the meta device and initialised
    shard by shard (distributed.fsdp.init_on=meta names it; init_on=cpu trains it)."""

    def __init__(self, vocab_size: int, width: int = 32) -> None:
        super().__init__(vocab_size, width)
        self.temperature = nn.Parameter(torch.ones(1))  # FSDP2 shards no 0-d parameter

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) / self.temperature


class GreedyOnRank(TinyConvNet):
    """TinyConvNet whose forward asks one rank's GPU for far more memory than it has after
    `after` calls: CUDA's out-of-memory error, as an oversized batch or model gives it."""

    def __init__(self, num_classes: int, in_channels: int, rank: int = 0, after: int = 2) -> None:
        super().__init__(num_classes, in_channels, width=8)
        self.rank, self.after, self.calls = rank, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if int(os.environ.get("RANK", "0")) == self.rank and self.calls > self.after:
            total = torch.cuda.get_device_properties(x.device).total_memory
            x = x + torch.empty(2 * total // 4, dtype=torch.float32, device=x.device).sum()
        return super().forward(x)
