"""Predictions as files (`python -m train predict`): each rank writes the rows of its strided
shard as they come (a Parquet part, one row group per batch; a segmentation's masks as PNGs),
and rank 0 merges the parts into one Parquet file in the data set's order, a few thousand rows
at a time - so a split larger than memory is never held whole. Every file appears whole or not
at all: the merge writes `<out>.tmp` and renames it, the masks go to `<stem>_masks.tmp/` first.

Rank r holds the split's samples r, r+W, r+2W, ... (train/data/), so its k-th row is global
index r + k*W, and interleaving the ranks' rows round-robin restores the order.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from train.tasks.base import model_output

MERGE_ROWS = 4096
"""Rows read from each rank's part per merge step (memory: this many x world size rows)."""


def masks_dir(out: Path) -> Path:
    return out.with_name(f"{out.stem}_masks")


def _in_progress(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _list_column(values: np.ndarray) -> pa.Array:
    """(rows, k) floats as a list<float32> column."""
    flat = pa.array(values.astype(np.float32).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, values.shape[1]) if values.shape[1] else \
        pa.array([[] for _ in range(len(values))], pa.list_(pa.float32()))


def rows(task: str, output: Any, target: Any, index: np.ndarray, class_names: list[str],
         out: Path) -> pa.RecordBatch:
    """One batch's predictions as rows (the task decides the columns): classification's class
    and probabilities, regression's values, segmentation's mask files, any other task's raw
    output; the target beside them where the data set has one."""
    scores = model_output(output).detach().float().cpu()
    columns: dict[str, pa.Array] = {"index": pa.array(index, pa.int64())}
    if task == "classification":
        probabilities = scores.softmax(-1).numpy()
        predicted = probabilities.argmax(-1)
        columns["prediction"] = pa.array(predicted, pa.int64())
        if class_names:
            columns["class"] = pa.array([class_names[i] for i in predicted])
        columns["probabilities"] = _list_column(probabilities)
    elif task == "segmentation":
        columns["mask"] = pa.array(_write_masks(scores.argmax(1).numpy(), index, out))
    elif task == "regression":
        values = scores.reshape(len(index), -1).numpy()
        columns["prediction"] = (pa.array(values[:, 0].astype(np.float64)) if values.shape[1] == 1
                                 else _list_column(values))
    else:  # a task of the user's own: the model's output as it is, flattened, and its shape
        values = scores.reshape(len(index), -1).numpy()
        columns["output"] = _list_column(values)
        columns["shape"] = pa.array(["x".join(map(str, scores.shape[1:]))] * len(index))
    if isinstance(target, torch.Tensor) and task in ("classification", "regression"):
        kept = target.detach().cpu().reshape(len(index), -1).numpy()
        columns["target"] = (pa.array(kept[:, 0]) if kept.shape[1] == 1 else _list_column(kept))
    return pa.RecordBatch.from_pydict(columns)


def _write_masks(masks: np.ndarray, index: np.ndarray, out: Path) -> list[str]:
    """Each sample's predicted class per pixel as a PNG (8-bit, or 16-bit beyond 256 classes),
    named by its index; the files' names relative to the predictions file."""
    from PIL import Image

    folder = _in_progress(masks_dir(out))
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for mask, i in zip(masks, index, strict=True):
        name = f"{i:08d}.png"
        image = mask.astype(np.uint8 if mask.max(initial=0) < 256 else np.uint16)
        Image.fromarray(image).save(folder / name)
        names.append(f"{masks_dir(out).name}/{name}")
    return names


class Part:
    """This rank's part: its rows appended a batch at a time (a row group each)."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows = path, 0
        self._writer: pq.ParquetWriter | None = None

    def add(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, batch.schema)
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _chunks(parts: list[Path]) -> Iterator[list[pa.RecordBatch]]:
    """MERGE_ROWS rows of each rank's part at a time, rank by rank (a rank without rows - a
    split smaller than the world - contributes none)."""
    readers = [pq.ParquetFile(p).iter_batches(batch_size=MERGE_ROWS) for p in parts if p.exists()]
    while chunk := [b for b in (next(r, None) for r in readers) if b is not None and b.num_rows]:
        yield chunk


def merge(parts: list[Path], out: Path, about: dict[str, Any]) -> int:
    """Rank 0: the ranks' parts (in rank order) as one Parquet file in the data set's order,
    `about` (run, weights, data) in its metadata and in `<out>.json`; returns its rows."""
    tmp, writer, total = _in_progress(out), None, 0
    try:
        for chunk in _chunks(parts):
            counts = [b.num_rows for b in chunk]
            starts = np.cumsum([0, *counts[:-1]])
            order = [int(starts[r]) + k for k in range(max(counts))
                     for r in range(len(chunk)) if k < counts[r]]
            table = pa.Table.from_batches(chunk).take(order)
            if writer is None:
                meta = {f"train.{k}": json.dumps(v) for k, v in about.items()}
                writer = pq.ParquetWriter(tmp, table.schema.with_metadata(meta))
            writer.write_table(table)
            total += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise ValueError("the split holds no samples: nothing to predict")
    finish(out, about | {"rows": total})
    return total


def finish(out: Path, about: dict[str, Any]) -> None:
    """The written files in place (replacing earlier ones under predict.overwrite) and the
    description beside them: `<out>.json`."""
    masks, tmp_masks = masks_dir(out), _in_progress(masks_dir(out))
    if tmp_masks.exists():
        shutil.rmtree(masks, ignore_errors=True)
        tmp_masks.rename(masks)
    _in_progress(out).replace(out)
    out.with_name(out.name + ".json").write_text(json.dumps(about, indent=2) + "\n")


def clear_leftovers(out: Path, parts: Path) -> None:
    """What an earlier, interrupted prediction to `out` left: the parts, the unfinished files."""
    shutil.rmtree(parts, ignore_errors=True)
    shutil.rmtree(_in_progress(masks_dir(out)), ignore_errors=True)
    _in_progress(out).unlink(missing_ok=True)
