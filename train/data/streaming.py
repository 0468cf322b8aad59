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
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torch.utils.data import default_collate as collate_samples

from train.config import usercode
from train.config.groups import DataConfig
from train.data import batches as batching
from train.data import imagefolder, userdata
from train.data.batches import DataDescription
from train.distributed.env import DistEnv
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
        self.dataset, self.idx = dataset, idx

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
        for inputs, labels, unreadable in self.loader:  # type: ignore[union-attr]
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


@dataclass
class Source:
    """A streamed data set's two sides and what the rest of the job needs to know of it."""

    train: Dataset
    val: Dataset
    class_names: list[str]
    input_shape: tuple[int, ...]
    describe: Callable[[], DataDescription]
    summary: str
    collate: Callable[[list[Any]], Any] = collate_readable
    normalise: dict[str, Any] = field(default_factory=dict)
    test: Dataset | None = None
    """The test split (data.test, or imagefolder's test/); None: no test phase."""
    target_shape: tuple[int, ...] = ()
    """One sample's target shape (() for a class index or a number)."""
    vocab_size: int | None = None
    tokenizer: str | None = None
    """data=tokens: the vocabulary and the tokenizer (train/data/tokens.py)."""
    sampler: type[DistributedSampler] = DistributedSampler
    """The training order's sampler (data=tokens: one that keeps it as a tensor)."""


def _first_shape(dataset: Dataset, tries: int = 16) -> tuple[int, ...]:
    for i in range(min(tries, len(dataset))):  # type: ignore[arg-type]
        if not isinstance(sample := dataset[i], Unreadable):
            return tuple(map(int, sample[0].shape))
    raise UnreadableBatchError(f"none of the first {tries} validation images can be read: "
                               "check the files under data.root.")


def imagefolder_source(cfg: DataConfig) -> Source:
    layout = imagefolder.find(cfg.root)
    files = ImageFiles(layout.train, transforms(cfg, train=True))
    digest = hashlib.sha256(layout.train.digest().encode())
    if layout.val is None:
        parts = batching.split(len(files), cfg.val_fraction, cfg.split_seed)
        train: Dataset = Rows(files, parts.train_idx)
        val: Dataset = Rows(files.with_transform(transforms(cfg, train=False)), parts.val_idx)
        digest.update(parts.train_idx.numpy().tobytes())
    else:
        train, val = files, ImageFiles(layout.val, transforms(cfg, train=False))
    shape = _first_shape(val)
    if len(cfg.mean) != shape[0] or len(cfg.std) != shape[0]:
        raise ConfigError(f"data.mean and data.std need {shape[0]} values (one per channel).")
    rows = len(train)  # type: ignore[arg-type]

    def describe() -> DataDescription:
        return DataDescription(digest=digest.hexdigest()[:8], num_rows=rows,
                               features_shape=[rows, *shape], features_dtype="uint8")

    test = (None if layout.test is None
            else ImageFiles(layout.test, transforms(cfg, train=False)))
    return Source(train, val, layout.train.classes, shape, describe, test=test,
                  summary=f"imagefolder {layout.describe()}",
                  normalise={"mean": torch.tensor(cfg.mean).view(1, -1, 1, 1),
                             "std": torch.tensor(cfg.std).view(1, -1, 1, 1), "scale": 255.0})


def _labels_only(samples: list[Any]) -> torch.Tensor:
    return torch.as_tensor([int(label) for _, label in samples])


def _read_labels(datasets: list[Dataset], workers: int) -> torch.Tensor:
    """Every label, read once with the workers (a Dataset without `classes` or `targets`)."""
    batching.check_temp_dir(workers)
    reader = DataLoader(ConcatDataset(datasets), batch_size=256, num_workers=workers,
                        collate_fn=_labels_only,
                        multiprocessing_context=batching.WORKER_START if workers else None)
    return torch.cat(list(reader))


def custom_source(cfg: DataConfig, workers: int, classes: bool = True) -> Source:
    """The user's Datasets; `classes`: the targets are class indices, counted where the Dataset
    does not name its classes (else only its `classes` attribute is read)."""
    train_set = userdata.build(cfg.train, "data.train")
    shape, first_target = userdata.first_sample(train_set, "data.train")
    target = cfg.train["_target_"]
    if cfg.val and cfg.val.get("_target_"):
        val_set = userdata.build(cfg.val, "data.val")
        train, val, whole = train_set, val_set, [train_set, val_set]
    else:
        parts = batching.split(len(train_set), cfg.val_fraction, cfg.split_seed)
        train, val, whole = Rows(train_set, parts.train_idx), Rows(train_set, parts.val_idx), \
            [train_set]
    names = (userdata.class_names(train_set) if classes
             else userdata.class_names(train_set, labels=()) or [])
    if names is None:
        count = sum(len(d) for d in whole)  # type: ignore[arg-type]
        log.info("data: %s has no `classes` or `targets` attribute: reading its %d labels once "
                 "to count the classes", target, count)
        names = userdata.class_names(train_set, _read_labels(whole, workers))
    rows = len(train)  # type: ignore[arg-type]

    def describe() -> DataDescription:
        digest = hashlib.sha256(f"{target}\0{rows}".encode())
        for i in range(min(4, rows)):  # the length and the first samples name the data
            inputs, label = train[i]
            digest.update(np.ascontiguousarray(np.asarray(inputs)).tobytes() + _target_bytes(label))
        return DataDescription(digest=digest.hexdigest()[:8], num_rows=rows,
                               features_shape=[rows, *shape],
                               features_dtype=str(train[0][0].dtype).removeprefix("torch."))

    test = (userdata.build(cfg.test, "data.test") if cfg.test and cfg.test.get("_target_")
            else None)
    return Source(train, val, names or (["0"] if classes else []), shape, describe,
                  collate=collate_pairs, test=test,
                  target_shape=userdata.target_shape(first_target),
                  summary=f"custom {target}: {rows} training, {len(val)} validation samples")


def _target_bytes(target: Any) -> bytes:
    """A target for the data's digest: a class index as its digits (as before tasks), anything
    else by its bytes."""
    value = np.asarray(target)
    if value.ndim == 0 and np.issubdtype(value.dtype, np.integer):
        return b"%d" % int(value)
    return np.ascontiguousarray(value).tobytes()


def build(cfg: DataConfig, env: DistEnv, device: torch.device, seed: int, per_rank: int,
          channels_last: bool = False, classes: bool = True) -> batching.DataBundle:
    """This rank's streamed shards (`per_rank` samples a batch): DistributedSampler's for
    training, a strided slice of the validation set (every sample on exactly one rank) for
    validation."""
    rank, world_size = env.rank, env.world_size
    workers = (cfg.num_workers if cfg.num_workers is not None
               else batching.default_num_workers(env.local_world_size, streamed=True))
    source = _source(cfg, workers, classes)
    sampler = source.sampler(source.train, num_replicas=world_size, rank=rank, shuffle=True,
                             seed=seed, drop_last=False)
    shard = Rows(source.val, torch.arange(rank, len(source.val), world_size))  # type: ignore[arg-type]

    def batches(dataset: Dataset, sampler: DistributedSampler | None) -> StreamedBatches:
        order = batching.ShardOrder(sampler, len(dataset), per_rank)  # type: ignore[arg-type]
        return StreamedBatches(batching.loader(dataset, order, workers, device, source.collate),
                               order, device, channels_last=channels_last, **source.normalise)

    log.info("data: %s; %d DataLoader workers per rank", source.summary, workers)
    test = None if source.test is None else batches(
        Rows(source.test, torch.arange(rank, len(source.test), world_size)), None)  # type: ignore[arg-type]
    return batching.DataBundle(
        test=test, num_test=0 if source.test is None else len(source.test),  # type: ignore[arg-type]
        train=batches(source.train, sampler), val=batches(shard, None),
        num_train=len(source.train), num_val=len(source.val),  # type: ignore[arg-type]
        class_names=source.class_names, input_shape=source.input_shape,
        describe=source.describe, target_shape=source.target_shape,
        vocab_size=source.vocab_size, tokenizer=source.tokenizer)


def _source(cfg: DataConfig, workers: int, classes: bool) -> Source:
    if cfg.name == "imagefolder":
        return imagefolder_source(cfg)
    if cfg.name == "tokens":
        from train.data import tokens

        return tokens.source(cfg)
    return custom_source(cfg, workers, classes)
