"""What `prepare-data` will write (train/data/shards.py writes it): each split's samples in the
order they are written, cut into shards of about `limit` bytes, from an image folder
(imagefolder's layout and class indices), a folder of WebDataset tars (`<key>.jpg` +
`<key>.cls`) or the user's map-style Dataset (`_target_`).

The training split is written in a mixed order (seeded; `seed=None` keeps the source's): a
folder or a tar set lists its samples class by class, and data=arrow's default shuffle (shard
order, then a window of shards) would make class-skewed batches from shards that each hold one
class. Validation and test keep the source's order.
"""

from __future__ import annotations

import functools
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
LABEL_SUFFIXES = (".cls", ".label")


class PrepareError(ValueError):
    """One line for the user: a source that cannot be read, an OUT that holds another set."""


@dataclass
class Shard:
    split: str
    index: int
    count: int
    items: list[Any]
    """What its rows are made from: (image path, label), (tar path, image offset, image size,
    label), or (start, stop) of the user's Dataset's order (`Plan.order`)."""
    batch_rows: int = 256
    """Rows per Arrow record batch (`batch_rows_for`)."""

    @property
    def name(self) -> str:
        return f"data-{self.index:05d}-of-{self.count:05d}.arrow"


@dataclass
class Plan:
    kind: str
    """images, tars or dataset"""
    source: str
    classes: list[str]
    features: dict[str, Any]
    """datasets.Features.to_dict() of every split"""
    shards: list[Shard]
    dataset: dict[str, Any] | None = None
    """kind=dataset: {_target_: ..., its arguments}"""
    seed: int | None = 0
    """the training split's order: mixed with this seed, or the source's (None)"""

    def indices(self, shard: Shard, n: int) -> list[int]:
        """The user's Dataset's indices that `shard` holds, in the order its rows are written
        (kind=dataset): its slice of the mixed order, read in the Dataset's order (`_shards`).
        The permutation is computed once per process, not once per shard."""
        mixed = _permutation(n, self.seed)
        return [i for start, stop in shard.items for i in sorted(mixed[start:stop])]

    def order(self, n: int) -> list[int]:
        """Every shard's `indices`, in shard order: the rows of the whole split."""
        return [i for shard in self.shards for i in self.indices(shard, n)]


@functools.lru_cache(maxsize=1)
def _permutation(n: int, seed: int | None) -> list[int]:
    return _mixed(list(range(n)), seed)


def _mixed(items: list[Any], seed: int | None) -> list[Any]:
    """`items` in the order seed `seed` gives (the same on every machine and Python), or as
    they are for None."""
    if seed is None:
        return items
    import numpy as np

    return [items[i] for i in np.random.default_rng(seed).permutation(len(items))]


def _chunks(items: list[Any], sizes: list[int], limit: int) -> list[list[Any]]:
    """Contiguous runs of `items` of about `limit` bytes each (at least one item a run)."""
    runs: list[list[Any]] = [[]]
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if runs[-1] and total + size > limit:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += size
    return [run for run in runs if run] or [[]]


RECORD_BATCH_BYTES = 8_000_000
"""About this many bytes of samples per Arrow record batch. A process that maps a shard reads
every record batch's header (datasets does when it opens a split), and the kernel reads the
pages around each such fault: with batches of 256 small images (~256 KB), opening a split
made a quarter of its bytes resident in every process that opened it (52 MB of a 200 MB split),
growing with the set. 8 MB batches make it ~1 %, and a batch's random rows read as fast."""


def batch_rows_for(sample_bytes: float) -> int:
    return max(1, int(RECORD_BATCH_BYTES / max(1.0, sample_bytes)))


def _shards(split: str, items: list[Any], sizes: list[int], limit: int,
            seed: int | None) -> list[Shard]:
    """The training split's items dealt to shards in a mixed order, each shard's read in the
    source's (a directory or a tar front to back, not a seek per image: the order within a
    shard does not matter to data=arrow's shuffles, which mix whole windows of shards)."""
    order = _mixed(list(range(len(items))), seed if split == "train" else None)
    runs = [sorted(run) for run in _chunks(order, [sizes[i] for i in order], limit)]
    rows = batch_rows_for(sum(sizes) / max(1, len(sizes)))
    return [Shard(split, k, len(runs), [items[i] for i in run], rows)
            for k, run in enumerate(runs)]


def _image_features(classes: list[str]) -> dict[str, Any]:
    from datasets import ClassLabel, Features, Image

    return Features({"image": Image(), "label": ClassLabel(names=classes)}).to_dict()


def plan_image_folder(root: Path, limit: int, seed: int | None = 0) -> Plan:
    """imagefolder's layout (train/<class>/..., val/..., test/...; the same class indices)."""
    from train.data import imagefolder

    layout = imagefolder.find(str(root))
    shards: list[Shard] = []
    for split, folder in (("train", layout.train), ("validation", layout.val),
                          ("test", layout.test)):
        if folder is None:
            continue
        paths = [str(folder.path / f) for f in folder.files]
        sizes = [os.stat(p).st_size for p in paths]
        shards += _shards(split, list(zip(paths, folder.labels, strict=True)), sizes, limit,
                          seed)
    return Plan("images", str(root), layout.train.classes,
                _image_features(layout.train.classes), shards, seed=seed)


def _tar_samples(path: Path) -> Iterator[tuple[str, int, int, int]]:
    """(tar, image offset, image bytes, class index) of each sample of one WebDataset tar.
    Offsets, not member names: a member is read with one seek, where tarfile looks a name up
    through the whole member list."""
    members: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        with tarfile.open(path) as tar:
            for info in tar:
                if info.isfile():
                    key, _, suffix = info.name.rpartition(".")
                    members.setdefault(key, {})["." + suffix.lower()] = info
    except tarfile.TarError as e:
        raise PrepareError(f"{path} is no readable tar ({e}): write it again, or move it out "
                           "of the source.") from None
    for key, parts in members.items():
        image = next((parts[s] for s in IMAGE_SUFFIXES if s in parts), None)
        label = next((parts[s] for s in LABEL_SUFFIXES if s in parts), None)
        if image is None:
            raise PrepareError(f"{path}: sample {key!r} has no image ({', '.join(parts)}); a "
                               f"WebDataset sample is <key>.jpg (or {', '.join(IMAGE_SUFFIXES)})"
                               " with <key>.cls holding its class index.")
        if label is None:
            raise PrepareError(f"{path}: sample {key!r} has no .cls (its class index).")
        text = read_at(str(path), label.offset_data, label.size)
        try:
            index = int(text)
        except ValueError:
            raise PrepareError(f"{path}: {label.name} holds {text[:20]!r}, not a class "
                               "index.") from None
        yield str(path), image.offset_data, image.size, index


def plan_tars(root: Path, limit: int, seed: int | None = 0) -> Plan:
    """A folder of WebDataset tars (train/, validation/ or val/, test/ subfolders of them, or
    the tars themselves as the training split); classes named by their index."""
    splits = {"train": root / "train", "validation": root / "val", "test": root / "test"}
    if (root / "validation").is_dir():
        splits["validation"] = root / "validation"
    if not any(d.is_dir() for d in splits.values()):
        splits = {"train": root}
    shards, labels = [], set()
    for split, folder in splits.items():
        tars = sorted(folder.glob("*.tar")) if folder.is_dir() else []
        samples = [s for tar in tars for s in _tar_samples(tar)]
        if samples:
            labels |= {s[3] for s in samples}
            shards += _shards(split, samples, [s[2] for s in samples], limit, seed)
    if not shards:
        raise PrepareError(f"{root} holds no .tar files (nor train/ val/ test/ folders of them).")
    classes = [str(k) for k in range(max(labels) + 1)]
    return Plan("tars", str(root), classes, _image_features(classes), shards, seed=seed)


_open_tar: dict[str, int] = {}
"""The tar read last and its file descriptor: one open at a time (a set may hold thousands of
tars, past a process's limit on open files), and a shard's samples are read tar by tar."""


def read_at(tar: str, offset: int, size: int) -> bytes:
    """`size` bytes at `offset` of a tar."""
    if tar not in _open_tar:
        for fd in _open_tar.values():
            os.close(fd)
        _open_tar.clear()
        _open_tar[tar] = os.open(tar, os.O_RDONLY)
    return os.pread(_open_tar[tar], size, offset)


def plan_dataset(spec: dict[str, Any], limit: int, seed: int | None = 0) -> Plan:
    """The user's map-style Dataset (its samples (input, target)): one split, `train`."""
    from train.data import encode, userdata

    dataset = userdata.build(spec, "prepare-data")
    first = encode.encode(dataset[0])
    features = encode.features_of(dataset, first)
    per_sample = max(1, encode.size_of(first))
    n = len(dataset)  # type: ignore[arg-type]
    step = max(1, limit // per_sample)
    runs = [(start, min(n, start + step)) for start in range(0, n, step)] or [(0, 0)]
    shards = [Shard("train", k, len(runs), [run], batch_rows_for(per_sample))
              for k, run in enumerate(runs)]
    classes = list(getattr(dataset, "classes", None) or [])
    return Plan("dataset", spec["_target_"], classes, features, shards, dataset=spec, seed=seed)
