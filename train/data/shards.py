"""Writing a sharded Arrow data set (`python -m train prepare-data SOURCE OUT`), read back by
`data=arrow` (train/data/arrow.py).

The output is what Hugging Face `datasets`' `save_to_disk` writes - `OUT/<split>/data-KKKKK-of-
NNNNN.arrow`, each split's `state.json` and `dataset_info.json`, `OUT/dataset_dict.json` - so
`datasets.load_from_disk(OUT)` reads it as any other; the shards are written by `datasets`' own
ArrowWriter. What this module adds is how a data set of millions of files gets there:
- from an image folder, a folder of WebDataset tars or the user's map-style Dataset, planned up
  front by train/data/shard_plan.py (the training split in a mixed order, shards of
  ~`shard_mb`): images keep their encoded bytes as they are (no re-encoding), arrays their
  values;
- the shards written by `workers` processes, each to a temporary file renamed into place once
  whole;
- resumable: the plan is kept in OUT/.prepare/plan.json, each finished shard's record beside it;
  a second call with the same source writes only the shards still missing;
- OUT/manifest.json last (`MANIFEST`): samples per split, classes, the source, the command and
  each shard's rows, bytes and sha256, which data=arrow checks at pre-flight and resume.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

from train.data.shard_plan import Plan, PrepareError, Shard, read_at

MANIFEST = "manifest.json"
WORK_DIR = ".prepare"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _rows(plan: Plan, shard: Shard) -> Iterator[dict[str, Any]]:
    if plan.kind == "images":
        for path, label in shard.items:
            yield {"image": {"bytes": Path(path).read_bytes(), "path": None}, "label": label}
    elif plan.kind == "tars":
        for tar, offset, size, label in shard.items:
            yield {"image": {"bytes": read_at(tar, offset, size), "path": None}, "label": label}
    else:
        from train.data import encode

        dataset = _users_dataset(json.dumps(plan.dataset, sort_keys=True))
        for i in plan.indices(shard, len(dataset)):  # type: ignore[arg-type]
            yield encode.encode(dataset[i])


@functools.lru_cache(maxsize=1)
def _users_dataset(spec: str) -> Any:
    """The user's Dataset, built once per writing process (its __init__ may list a directory
    of a million files), not once per shard."""
    from train.data import userdata

    return userdata.build(json.loads(spec), "prepare-data")


def write_shard(plan: Plan, shard: Shard, out: Path) -> dict[str, Any]:
    """One shard, whole or not at all: written to a temporary name, renamed into place."""
    from datasets import Features
    from datasets.arrow_writer import ArrowWriter

    target = out / shard.split / shard.name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{shard.name}.{uuid.uuid4().hex[:8]}.tmp")
    writer = ArrowWriter(features=Features.from_dict(plan.features), path=str(partial),
                         writer_batch_size=shard.batch_rows)
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
                "train_order": "source" if plan.seed is None else f"mixed, seed {plan.seed}",
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
