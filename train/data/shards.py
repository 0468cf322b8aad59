"""Writing a sharded Arrow data set (`python -m train prepare-data SOURCE OUT`), read back by
`data=arrow` (train/data/arrow.py).

The output is what Hugging Face `datasets`' `save_to_disk` writes - `OUT/<split>/data-KKKKK-of-
NNNNN.arrow`, each split's `state.json` and `dataset_info.json`, `OUT/dataset_dict.json` - so
`datasets.load_from_disk(OUT)` reads it as any other; the shards are written by `datasets`' own
ArrowWriter. What this module adds is how a data set of millions of files gets there:
- from an image folder (imagefolder's layout and class indices), a folder of WebDataset tars
  (`<key>.jpg` + `<key>.cls`), or the user's map-style Dataset (`_target_`): images keep their
  encoded bytes as they are (no re-encoding), arrays their values;
- shards planned up front (~`shard_mb` each, contiguous runs of samples) and written by
  `workers` processes, each shard to a temporary file renamed into place once whole;
- resumable: the plan is kept in OUT/.prepare/plan.json, each finished shard's record beside it;
  a second call with the same source writes only the shards still missing;
- OUT/manifest.json last (`MANIFEST`): samples per split, classes, the source, the command and
  each shard's rows, bytes and sha256, which data=arrow checks at pre-flight and resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
WORK_DIR = ".prepare"
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
    """What its rows are made from: (image path, label), (tar path, member, label member),
    or (start, stop) of the user's Dataset."""

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


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


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


def _shards(split: str, items: list[Any], sizes: list[int], limit: int) -> list[Shard]:
    runs = _chunks(items, sizes, limit)
    return [Shard(split, k, len(runs), run) for k, run in enumerate(runs)]


def _image_features(classes: list[str]) -> dict[str, Any]:
    from datasets import ClassLabel, Features, Image

    return Features({"image": Image(), "label": ClassLabel(names=classes)}).to_dict()


def plan_image_folder(root: Path, limit: int) -> Plan:
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
        shards += _shards(split, list(zip(paths, folder.labels, strict=True)), sizes, limit)
    return Plan("images", str(root), layout.train.classes,
                _image_features(layout.train.classes), shards)


def _tar_samples(path: Path) -> Iterator[tuple[str, str, str | None, int]]:
    """(tar, image member, label member, image bytes) of each sample of one WebDataset tar."""
    members: dict[str, dict[str, tarfile.TarInfo]] = {}
    with tarfile.open(path) as tar:
        for info in tar:
            if info.isfile():
                key, _, suffix = info.name.rpartition(".")
                members.setdefault(key, {})["." + suffix.lower()] = info
    for key, parts in members.items():
        image = next((parts[s] for s in IMAGE_SUFFIXES if s in parts), None)
        label = next((parts[s] for s in LABEL_SUFFIXES if s in parts), None)
        if image is None:
            raise PrepareError(f"{path}: sample {key!r} has no image ({', '.join(parts)}); a "
                               f"WebDataset sample is <key>.jpg (or {', '.join(IMAGE_SUFFIXES)})"
                               " with <key>.cls holding its class index.")
        yield str(path), image.name, None if label is None else label.name, image.size


def plan_tars(root: Path, limit: int) -> Plan:
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
        if not tars:
            continue
        samples = [s for tar in tars for s in _tar_samples(tar)]
        for tar, _, label, _ in samples:
            if label is None:
                raise PrepareError(f"{tar}: a sample has no .cls (its class index).")
        labels |= {int(_read_member(tar, label)) for tar, _, label, _ in samples}
        shards += _shards(split, [s[:3] for s in samples], [s[3] for s in samples], limit)
    if not shards:
        raise PrepareError(f"{root} holds no .tar files (nor train/ val/ test/ folders of them).")
    classes = [str(k) for k in range(max(labels) + 1)]
    return Plan("tars", str(root), classes, _image_features(classes), shards)


_open_tars: dict[str, tarfile.TarFile] = {}


def _read_member(tar: str, member: str) -> bytes:
    """A member's bytes; each tar is opened once per process."""
    if tar not in _open_tars:
        _open_tars[tar] = tarfile.open(tar)  # noqa: SIM115 - kept open: read member by member
    found = _open_tars[tar].extractfile(member)
    if found is None:
        raise PrepareError(f"{tar}: {member} is not a file")
    return found.read()


def plan_dataset(spec: dict[str, Any], limit: int) -> Plan:
    """The user's map-style Dataset (its samples (input, target)): one split, `train`."""
    from train.data import encode, userdata

    dataset = userdata.build(spec, "prepare-data")
    first = encode.encode(dataset[0])
    features = encode.features_of(dataset, first)
    per_sample = max(1, encode.size_of(first))
    n = len(dataset)  # type: ignore[arg-type]
    step = max(1, limit // per_sample)
    runs = [(start, min(n, start + step)) for start in range(0, n, step)] or [(0, 0)]
    shards = [Shard("train", k, len(runs), [run]) for k, run in enumerate(runs)]
    classes = list(getattr(dataset, "classes", None) or [])
    return Plan("dataset", spec["_target_"], classes, features, shards, dataset=spec)


def _rows(plan: Plan, shard: Shard) -> Iterator[dict[str, Any]]:
    if plan.kind == "images":
        for path, label in shard.items:
            yield {"image": {"bytes": Path(path).read_bytes(), "path": None}, "label": label}
    elif plan.kind == "tars":
        for tar, image, label in shard.items:
            yield {"image": {"bytes": _read_member(tar, image), "path": None},
                   "label": int(_read_member(tar, label))}
    else:
        from train.data import encode, userdata

        dataset = userdata.build(dict(plan.dataset or {}), "prepare-data")
        for start, stop in shard.items:
            for i in range(start, stop):
                yield encode.encode(dataset[i])


def write_shard(plan: Plan, shard: Shard, out: Path) -> dict[str, Any]:
    """One shard, whole or not at all: written to a temporary name, renamed into place."""
    from datasets import Features
    from datasets.arrow_writer import ArrowWriter

    target = out / shard.split / shard.name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{shard.name}.{uuid.uuid4().hex[:8]}.tmp")
    writer = ArrowWriter(features=Features.from_dict(plan.features), path=str(partial),
                         writer_batch_size=256)
    try:
        for row in _rows(plan, shard):
            writer.write(row)
        rows, _ = writer.finalize()
    finally:
        writer.close()
    os.replace(partial, target)
    record = {"split": shard.split, "file": f"{shard.split}/{shard.name}", "rows": rows,
              "bytes": target.stat().st_size, "sha256": sha256(target)}
    done = out / WORK_DIR / f"{shard.split}-{shard.index:05d}.json"
    done.write_text(json.dumps(record))
    return record


def _finished(out: Path, shard: Shard) -> dict[str, Any] | None:
    """A shard an earlier call wrote whole (its record, and the file as recorded)."""
    done = out / WORK_DIR / f"{shard.split}-{shard.index:05d}.json"
    try:
        record = json.loads(done.read_text())
    except (OSError, ValueError):
        return None
    path = out / record["file"]
    return record if path.is_file() and path.stat().st_size == record["bytes"] else None


def _keep_plan(plan: Plan, out: Path) -> None:
    """OUT/.prepare/plan.json: the same plan again resumes; another source is refused."""
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    path, text = work / "plan.json", json.dumps(asdict(plan), sort_keys=True)
    if path.exists() and path.read_text() != text:
        raise PrepareError(f"{out} holds an unfinished preparation of other data (its "
                           f"{path} differs from this one's): choose another OUT, or remove it.")
    path.write_text(text)


def prepare(plan: Plan, out: Path, workers: int, command: str,
            progress: Callable[[int], None] = lambda rows: None) -> dict[str, Any]:
    """Every shard of `plan` written (those already finished kept), then each split's state
    and info files, dataset_dict.json and the manifest; returns the manifest."""
    if (out / MANIFEST).exists():
        raise PrepareError(f"{out} holds a prepared data set already ({MANIFEST}): choose "
                           "another OUT, or remove it to prepare again.")
    _keep_plan(plan, out)
    for stale in out.glob("*/.data-*.tmp"):  # an interrupted call's unfinished shards
        stale.unlink()
    records, todo = [], []
    for shard in plan.shards:
        if (record := _finished(out, shard)) is not None:
            records.append(record)
            progress(record["rows"])
        else:
            todo.append(shard)
    if todo and workers > 1:
        import multiprocessing

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for done in as_completed([pool.submit(write_shard, plan, s, out) for s in todo]):
                records.append(done.result())
                progress(records[-1]["rows"])
    else:
        for shard in todo:
            records.append(write_shard(plan, shard, out))
            progress(records[-1]["rows"])
    return _finish(plan, out, records, command, kept=len(plan.shards) - len(todo))


def _finish(plan: Plan, out: Path, records: list[dict[str, Any]], command: str,
            kept: int) -> dict[str, Any]:
    from datasets import DatasetInfo, Features

    splits: dict[str, dict[str, Any]] = {}
    for split in dict.fromkeys(s.split for s in plan.shards):
        shards = sorted((r for r in records if r["split"] == split), key=lambda r: r["file"])
        splits[split] = {"samples": sum(r["rows"] for r in shards), "shards": shards}
        DatasetInfo(features=Features.from_dict(plan.features)).write_to_directory(
            str(out / split), pretty_print=True)
        state = {"_data_files": [{"filename": Path(r["file"]).name} for r in shards],
                 "_fingerprint": hashlib.sha256("".join(r["sha256"] for r in shards)
                                                .encode()).hexdigest()[:16],
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                 "_output_all_columns": False, "_split": split}
        (out / split / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (out / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    manifest = {"source": plan.source, "kind": plan.kind, "command": command,
                "classes": plan.classes, "input_column": "image" if plan.kind != "dataset"
                else "input", "target_column": "label" if plan.kind != "dataset" else "target",
                "splits": splits, "kept_shards": kept,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
