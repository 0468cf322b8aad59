"""A user's own Datasets, as a research project would write them: NOT part of train/, reached
only through PYTHONPATH (tests/ on it: `data.train._target_=userpkg.data.Lines`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, IterableDataset


def _lines(index: int, length: int, size: int, seed: int) -> tuple[torch.Tensor, int]:
    """Sample `index`: a bright horizontal, vertical or diagonal line on noise (the label)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    label = index % 3
    image = torch.rand(1, size, size, generator=g) * 0.3
    at = int(torch.randint(0, size, (1,), generator=g))
    if label == 0:
        image[0, at, :] += 1.0
    elif label == 1:
        image[0, :, at] += 1.0
    else:
        image[0] += torch.eye(size).roll(at, dims=1)
    return image, label


class Lines(Dataset):
    """Grey (1, size, size) float images of three kinds of line, named by `classes`."""

    classes = ["horizontal", "vertical", "diagonal"]

    def __init__(self, length: int = 240, size: int = 16, seed: int = 0) -> None:
        self.length, self.size, self.seed = length, size, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return _lines(index, self.length, self.size, self.seed)


class UnnamedLines(Lines):
    """The same without `classes`: the service counts the classes from the labels."""

    classes = None  # type: ignore[assignment]


class LinesWithTargets(UnnamedLines):
    """Without `classes` but with torchvision's `targets` list: no sample has to be read."""

    def __init__(self, length: int = 240, size: int = 16, seed: int = 0) -> None:
        super().__init__(length, size, seed)
        self.targets = [i % 3 for i in range(length)]


class NotADataset:
    """A class that is no Dataset (no __len__, no __getitem__)."""

    def __init__(self, length: int = 10) -> None:
        self.length = length


class Stream(IterableDataset):
    """An iterable-style Dataset: it cannot be sharded exactly."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        yield torch.zeros(1, 4, 4), 0


class DictSamples(Lines):
    """Returns a dict per sample instead of (input, label)."""

    def __getitem__(self, index: int) -> dict[str, object]:  # type: ignore[override]
        image, label = super().__getitem__(index)
        return {"image": image, "label": label}


class _OnOneRank(Lines):
    """Lines whose reads on one rank go wrong once that rank has read `after` samples."""

    def __init__(self, length: int = 240, size: int = 16, seed: int = 0, rank: int = 1,
                 after: int = 0) -> None:
        super().__init__(length, size, seed)
        self.rank, self.after, self.reads = rank, after, 0

    def _gone_wrong(self) -> bool:
        if int(os.environ.get("RANK", "0")) != self.rank:
            return False
        self.reads += 1
        return self.reads > self.after


class StuckOnRank(_OnOneRank):
    """Lines whose reads block forever on one rank once it has read `after` samples, as a
    stuck NFS read or a deadlocked library does (the rank's process stays alive)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._gone_wrong():
            time.sleep(3600)  # the stuck read
        return super().__getitem__(index)


class SlowOnRank(Lines):
    """Lines read `delay` seconds slower on one rank: a node whose storage is slow."""

    def __init__(self, length: int = 240, size: int = 16, seed: int = 0, rank: int = 1,
                 delay: float = 0.01) -> None:
        super().__init__(length, size, seed)
        self.rank, self.delay = rank, delay

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if int(os.environ.get("RANK", "0")) == self.rank:
            time.sleep(self.delay)
        return super().__getitem__(index)


class HeldLines(Lines):
    """Lines read `delay` seconds each until the file `release` exists: a test sets the pace
    of a job (slow until it writes the file), whatever the machine's speed."""

    def __init__(self, length: int = 240, size: int = 16, seed: int = 0, release: str = "",
                 delay: float = 0.1) -> None:
        super().__init__(length, size, seed)
        self.release, self.delay = release, delay

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.release and not os.path.exists(self.release):
            time.sleep(self.delay)
        return super().__getitem__(index)


class BrokenSampleOnRank(_OnOneRank):
    """Lines with one sample the user's code cannot read (a corrupt file): reading it on one
    rank raises, as a user's bug in __getitem__ does."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._gone_wrong():
            return _decode(index)
        return super().__getitem__(index)


def _decode(index: int) -> tuple[torch.Tensor, int]:
    raise ValueError(f"sample {index}: corrupt header")  # the user's own error
