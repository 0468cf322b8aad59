"""data=arrow: a sharded Arrow data set - any directory Hugging Face `datasets` wrote with
`save_to_disk` (a DatasetDict of splits, or one Dataset), among them those `python -m train
prepare-data` writes (train/data/shards.py).

Read as `load_from_disk` reads it (memory-mapped shards, random access; in the ranks with
pyarrow alone: train/data/arrow_split.py), as a map-style data set through the service's own
sampler - so every sample is seen once per epoch at any world size, validation and test are
exact, and a mid-epoch checkpoint resumes on any world size, as for every streamed set
(train/data/sources.py):
- images (an `Image` column) are decoded from their stored bytes in the DataLoader workers and
  go through the data group's transforms, as imagefolder's files do; other columns come back
  as tensors (inputs; float64 as float32) and numbers or tensors (targets): a split's samples
  are train/data/arrow_samples.py's;
- training order (data.shuffle): `shards` (default) shuffles the shard order, then the samples
  within each window of data.shuffle_window shards - each worker reads a few files at a time
  instead of seeking all over the data set; `global` is one permutation of every sample;
- nothing is written beside the data or to ~/.cache: the directory may be read-only and shared
  by every job on a node (data.stage_to copies it to node-local disk: train/data/staging.py);
- data.root may name a Hub data set (`owner/name[:config]`) that `load_dataset` left in the
  local `datasets` cache on a machine that reaches the Hub - compute nodes never do (python -m
  train sets HF_HUB_OFFLINE unless the user did): its cache directory is read as any other
  (`hub_cache`);
- `check` (pre-flight, before any rank starts): the files the set names are there, whole, and -
  where prepare-data wrote a manifest - of the recorded sizes, a sample of them with the
  recorded checksums. `digest` names the data (the manifest's checksums) for the run and resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.errors import TrainError

log = logging.getLogger("train")
MANIFEST = "manifest.json"  # train/data/shards.py's
SPLITS = {"train": ("train",), "val": ("validation", "val", "valid"), "test": ("test",)}
CHECKED_SHARDS = 3
"""Shards whose sha256 pre-flight compares with the manifest (the first, the last, one between):
reading every shard of a large set would cost minutes on a parallel filesystem."""
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")
"""`name`, `owner/name`, either with `:config`: a data set of the Hub as `datasets` names it."""


class ArrowDataError(TrainError, ValueError):
    """One line naming the file that is missing, truncated or changed, and what to do."""


@dataclass
class Layout:
    root: Path
    splits: dict[str, Path]
    """train / val / test: each a directory holding state.json and its shards"""
    manifest: dict[str, Any] | None


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ArrowDataError(f"{path.parent}: no {path.name} ({what}); "
                             "write the set with `python -m train prepare-data SOURCE OUT` or "
                             "datasets' save_to_disk.") from None
    except (OSError, ValueError) as e:
        raise ArrowDataError(f"{path} cannot be read ({e}): the data set is damaged; write "
                             "it again.") from None


def find(root: str | Path) -> Layout:
    """The splits under `root`: a DatasetDict's (dataset_dict.json), one Dataset's, or those of
    a `datasets` cache directory (a Hub data set `load_dataset` prepared: dataset_info.json
    beside `<name>-<split>[-NNNNN-of-NNNNN].arrow`); `root` may be such a data set's Hub name,
    found in the local cache (hub_cache)."""
    root = Path(root)
    if not root.is_dir():
        if not HUB_NAME.match(str(root)):
            raise ArrowDataError(f"data=arrow data.root={root}: no such directory.")
        root = hub_cache(str(root))
    manifest = _read_json(root / MANIFEST, "") if (root / MANIFEST).exists() else None
    if (root / "dataset_dict.json").exists():
        names = _read_json(root / "dataset_dict.json", "the splits")["splits"]
        found = {role: root / name for role, aliases in SPLITS.items()
                 for name in aliases if name in names}
    elif (root / "state.json").exists():
        found = {"train": root}
    elif (root / "dataset_info.json").exists():  # a cache directory: its splits' files
        names = _read_json(root / "dataset_info.json", "the splits").get("splits") or {}
        found = {role: root / name for role, aliases in SPLITS.items()
                 for name in aliases if name in names}
    else:
        raise ArrowDataError(f"data=arrow data.root={root}: neither dataset_dict.json nor "
                             "state.json is there: not a directory written by datasets' "
                             "save_to_disk or `python -m train prepare-data`.")
    if "train" not in found:
        raise ArrowDataError(f"data=arrow data.root={root}: no training split (train) among "
                             f"{sorted(p.name for p in found.values())}.")
    return Layout(root, found, manifest)


def hub_cache(name: str) -> Path:
    """The directory of the local `datasets` cache ($HF_DATASETS_CACHE) that holds the Hub data
    set `name` (`owner/name[:config]`), as `load_dataset` offline finds it - never downloaded
    (python -m train sets HF_HUB_OFFLINE unless the user did)."""
    import datasets

    path, _, config = name.partition(":")
    try:
        builder = datasets.load_dataset_builder(path, config or None)
    except (ConnectionError, ValueError, FileNotFoundError) as e:
        raise ArrowDataError(f"data=arrow data.root={name}: neither a directory nor a data set "
                             f"in the local datasets cache ({datasets.config.HF_DATASETS_CACHE}"
                             f"): {str(e).splitlines()[0]} - load it once where the Hub can be "
                             "reached (datasets.load_dataset), or give a directory.") from None
    folder = Path(builder.cache_dir)
    if not list(folder.glob("*.arrow")):
        raise ArrowDataError(f"data=arrow data.root={name}: the datasets cache has no Arrow "
                             f"files for it ({folder}): load it once with datasets.load_dataset.")
    return folder


def shard_files(split: Path) -> list[Path]:
    """A split's Arrow files: those its state.json lists (save_to_disk), or in a cache
    directory (`split` = the directory / the split's name) `*-<split>.arrow` or its shards.
    A split of none (a state.json emptied by hand or an interrupted copy) is named."""
    if not split.is_dir():
        files = (sorted(split.parent.glob(f"*-{split.name}.arrow"))
                 or sorted(split.parent.glob(f"*-{split.name}-[0-9]*-of-[0-9]*.arrow")))
    else:
        state = _read_json(split / "state.json", "the list of the split's shards")
        files = [split / f["filename"] for f in state["_data_files"]]
    if not files:
        raise ArrowDataError(f"{split}: the split lists no shards: write the data set again.")
    return files


def read_shard(path: Path, batches: bool = True) -> tuple[Any, list[Any]]:
    """A shard's schema and (`batches`) its record batches, memory-mapped: nothing is copied,
    and the map stays open as long as one of its batches lives (as `datasets` keeps it). A
    missing, truncated or damaged shard is named."""
    import pyarrow as pa

    if not path.is_file():
        raise ArrowDataError(f"{path} is missing: the data set is incomplete; write it again.")
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        return reader.schema, list(reader) if batches else []
    except (pa.ArrowInvalid, OSError) as e:
        raise ArrowDataError(f"{path} is truncated or damaged ({e}); write the data set "
                             "again.") from None


def shard_rows(files: list[Path]) -> list[int]:
    """Each shard's row count, from its Arrow stream; a missing, truncated or damaged shard is
    named."""
    return [sum(b.num_rows for b in read_shard(path)[1]) for path in files]


def every_shard(layout: Layout) -> list[Path]:
    return [path for split in layout.splits.values() for path in shard_files(split)]


def check(root: str | Path) -> Layout:
    """Pre-flight: every shard there and whole; against the manifest (where there is one) the
    sizes of all and the sha256 of a sample."""
    from train.data.shards import sha256

    layout = find(root)
    for split in layout.splits.values():
        shard_rows(shard_files(split))
    for info in (layout.manifest or {}).get("splits", {}).values():
        shards = info["shards"]
        for record in shards:
            path = layout.root / record["file"]
            if path.stat().st_size != record["bytes"]:
                raise ArrowDataError(f"{path} changed since it was prepared ({path.stat().st_size}"
                                     f" bytes, {MANIFEST} says {record['bytes']}): prepare the "
                                     "data set again.")
        for record in {id(r): r for r in (shards[0], shards[len(shards) // 2], shards[-1])
                       }.values() if shards else ():
            if sha256(layout.root / record["file"]) != record["sha256"]:
                raise ArrowDataError(f"{layout.root / record['file']} changed since it was "
                                     f"prepared (its sha256 is not {MANIFEST}'s): prepare the "
                                     "data set again.")
    return layout


def digest(layout: Layout) -> str:
    """8 hex digits naming the data: the manifest's shard checksums, else each shard's name
    and size (a resume on other data is refused by the checkpoint's record of it)."""
    h = hashlib.sha256()
    if layout.manifest is not None:
        for info in layout.manifest["splits"].values():
            h.update("".join(r["sha256"] for r in info["shards"]).encode())
    else:
        for split in layout.splits.values():
            for path in shard_files(split):
                h.update(f"{path.relative_to(layout.root)}\0{path.stat().st_size}\0".encode())
    return h.hexdigest()[:8]


def open_split(path: Path) -> Any:
    """One split as a `datasets.Dataset` (memory-mapped); its image columns left encoded: for
    `datasets`' own work on it (data.tokenize=map's `map`); the job reads with arrow_split."""
    import datasets

    if path.is_dir():
        dataset = datasets.load_from_disk(str(path), keep_in_memory=False)
    else:  # a cache directory's split: its files memory-mapped, as load_dataset reads them
        dataset = datasets.concatenate_datasets([datasets.Dataset.from_file(str(f))
                                                 for f in shard_files(path)])
    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(name, datasets.Image(decode=False))
    return dataset
