"""Data sets streamed from disk: read, decoded and transformed batch by batch in DataLoader
workers, never held whole in memory. Chosen by the data set: `data=imagefolder`, `data=custom`.

- imagefolder: the layout under data.root (train/data/imagefolder.py); each worker decodes its
images
  (PIL, as torchvision's ImageFolder does) into uint8 tensors and applies the
  transforms.v2 steps of data.train_transforms / data.eval_transforms (default: ImageNet-style
  RandomResizedCrop + flip for training, Resize + CenterCrop for evaluation). Batches travel as
  uint8 (a quarter of float32's bytes through shared and pinned memory) and are converted and
  normalised with data.mean / data.std on the training device.
- custom: the user's map-style Datasets (train/data/userdata.py); inputs reach the model as the
  Dataset returns them.
- tokens: windows of memory-mapped token files (train/data/tokens.py).

An image that cannot be read (a truncated copy, a file that is no image) is skipped: the rank
that meets it logs a warning naming the file and how many it has skipped, and the epoch's
train/samples and val/samples count only the images read. A worker never dies of it; a batch in
which no image can be read stops the job with the file's name.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data import default_collate as collate_samples

from train.config import usercode
from train.config.groups import DataConfig
from train.data import batches as batching
from train.data import imagefolder
from train.errors import ConfigError

log = logging.getLogger("train")
RESIZE_RATIO = 0.875
"""Evaluation resizes to image_size / 0.875 before the centre crop (ImageNet's 256 -> 224)."""


class Unreadable(NamedTuple):
    path: str
    reason: str


class UnreadableBatchError(RuntimeError):
    """No image of a batch could be read: the data set, not one file, is broken."""


def decode(path: str) -> torch.Tensor:
    """The image at `path` as a contiguous (3, H, W) uint8 tensor, decoded by PIL (as
    torchvision's ImageFolder does; torchvision's own decoders are deprecated since 0.29)."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"))
    # Channels first in memory (one copy, writable): resizing a view of (H, W, 3) is ~2x slower.
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def decode_bytes(encoded: bytes) -> torch.Tensor:
    """An encoded image (a JPEG's bytes as stored in an Arrow shard) as decode() gives it."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(encoded)) as image:
        pixels = np.asarray(image.convert("RGB"))
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


class ImageFiles(Dataset):
    """One ClassFolder's images, decoded and transformed when read (in a DataLoader worker)."""

    def __init__(self, folder: imagefolder.ClassFolder, transform: Callable) -> None:
        self.root = str(folder.path)
        # One numpy block instead of a Python string per file: no per-file objects for forked
        # workers to copy as they touch their reference counts.
        self.files = np.array([os.fsencode(f) for f in folder.files])
        self.labels = np.asarray(folder.labels, dtype=np.int64)
        self.transform = transform

    def with_transform(self, transform: Callable) -> ImageFiles:
        view = copy.copy(self)  # the same file list
        view.transform = transform
        return view

    def __len__(self) -> int:
        return len(self.files)

    def path(self, index: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.files[index]))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | Unreadable:
        path = self.path(index)
        try:
            image = decode(path)
        except Exception as e:  # noqa: BLE001 - whatever the decoders raise for a broken file
            return Unreadable(path, usercode.one_line(e))
        return self.transform(image).as_subclass(torch.Tensor), int(self.labels[index])


class Rows(Dataset):
    """The samples of `dataset` at positions `idx` (one side of a split, one rank's shard)."""

    def __init__(self, dataset: Any, idx: torch.Tensor) -> None:
        # A numpy array: reading one position costs ~0.07 us, a tensor's ~0.9 us (measured),
        # paid for every sample a worker reads.
        self.dataset, self.idx = dataset, idx.numpy()

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.idx[index])]


def collate_readable(samples: list[Any]) -> tuple[Any, Any, list[Unreadable]]:
    """(images, labels, unreadable files) of one batch, without the unreadable ones."""
    bad = [s for s in samples if isinstance(s, Unreadable)]
    good = [s for s in samples if not isinstance(s, Unreadable)]
    if not good:
        return None, None, bad
    images, labels = collate_samples(good)
    return images, labels, bad


def collate_pairs(samples: list[Any]) -> tuple[Any, Any, list[Unreadable]]:
    """A custom Dataset's (input, target) samples as one batch, each side collated by torch's
    default_collate (tensors stacked, numbers as tensors, dicts and tuples kept): the task
    reads the target (train/tasks/)."""
    inputs, targets = collate_samples(samples)
    return inputs, targets, []


class StreamedBatches(batching.Batches):
    """Batches from the workers; each unreadable image is named once in a warning, and counted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped: set[str] = set()

    def raw(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for inputs, labels, unreadable in self.loaded():
            for bad in unreadable:
                if bad.path not in self.skipped:
                    self.skipped.add(bad.path)
                    log.warning("skipped unreadable image %s (%s); %d skipped on this rank",
                                bad.path, bad.reason, len(self.skipped))
            if inputs is None:
                raise UnreadableBatchError(
                    f"no image of a batch could be read, e.g. {unreadable[0].path} "
                    f"({unreadable[0].reason}): check the files under data.root.")
            yield inputs, labels


def transforms(cfg: DataConfig, train: bool) -> Callable:
    """The transforms.v2 pipeline of one side: decoded uint8 image in, uint8 image out."""
    from torchvision.transforms import v2

    steps = cfg.train_transforms if train else cfg.eval_transforms
    key = "data.train_transforms" if train else "data.eval_transforms"
    if steps is None:
        size = cfg.image_size
        built = ([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
                 if train and cfg.augment else
                 [v2.Resize(round(size / RESIZE_RATIO), antialias=True), v2.CenterCrop(size)])
    else:
        built = [_step(step, f"{key}[{i}]") for i, step in enumerate(steps)]
    # uint8 out whatever the steps did: the device converts and normalises (data.mean, data.std)
    return v2.Compose([v2.ToImage(), *built, v2.ToDtype(torch.uint8, scale=True)])


def _step(spec: Any, key: str) -> Any:
    spec = dict(spec) if isinstance(spec, dict) else {}
    target = spec.pop("_target_", None)
    if not target:
        raise ConfigError(f"{key} must be {{_target_: torchvision.transforms.v2.<Name>, ...}}.")
    try:
        usercode.locate(target, key)  # names the missing module or attribute
        return usercode.build(target, key, spec)
    except usercode.UserCodeError as e:
        raise ConfigError(str(e)) from None
