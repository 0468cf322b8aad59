"""One split of a sharded Arrow set as the job reads it: each shard's Arrow stream
memory-mapped with pyarrow - the tables `datasets`' load_from_disk maps, nothing copied - and a
batch of rows gathered at a time, as `datasets` gathers them (a one-row slice of the record
batch that holds each row, then one conversion to Python).

Why not `datasets` itself here: importing it (and pandas, which it imports) took 0.4 s of CPU
at every rank's start, before its first step - more than imagefolder's listing of 220,000
files - and 30-80 MB of each rank's peak memory (docs/benchmarks.md, 2026-12-05). `datasets`
stays the writer (prepare-data, the user's save_to_disk) and the tokenizing map's reader
(train/data/pretokenize.py); the columns' description (`features`) is its own, serialised in
every shard's schema, read here as plain dicts (`{"_type": "Image"}`, `{"_type": "ClassLabel",
"names": [...]}`, ...), which `is_image` and the helpers below take.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from train.data.arrow import ArrowDataError, Layout, read_shard, shard_files


class ArrowSplit:
    """A split's rows, its shards (`files`, in order) memory-mapped in this process."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files  # at least one (arrow.shard_files)
        self._batches: list[Any] = []
        for path in files:
            schema, batches = read_shard(path)
            self._batches.extend(batches)
        self.schema = schema
        self.features = features_of(schema)
        self._starts = np.cumsum([0, *(b.num_rows for b in self._batches)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def rows(self, indices: Sequence[int], columns: Sequence[str]) -> dict[str, list[Any]]:
        """`columns` of the rows at `indices` (in that order), as Python values: an image
        column's {"bytes", "path"} as stored, lists as lists."""
        import pyarrow as pa

        if not len(indices):
            return {column: [] for column in columns}
        rows = np.asarray([int(i) for i in indices], dtype=np.int64)
        if rows.min() < 0 or rows.max() >= len(self):  # a slice past the end is only empty
            raise IndexError(f"rows {rows.min()}..{rows.max()} of a split of {len(self)}")
        where = np.searchsorted(self._starts, rows, side="right") - 1
        picked = [self._batches[b].select(columns).slice(int(i - self._starts[b]), 1)
                  for i, b in zip(rows, where, strict=True)]
        return pa.Table.from_batches(picked).to_pydict()

    def column(self, name: str) -> Any:
        """One column of every row (a pyarrow ChunkedArray over the maps: nothing copied)."""
        import pyarrow as pa

        return pa.chunked_array([b.column(name) for b in self._batches],
                                type=self.schema.field(name).type)


def features_of(schema: Any) -> dict[str, Any]:
    """`datasets`' description of the columns, as it serialised it in the schema's metadata;
    for an Arrow file written without it, the one `datasets` infers from the Arrow types."""
    stored = (schema.metadata or {}).get(b"huggingface")
    if stored is not None:
        features = json.loads(stored).get("info", {}).get("features")
        if features is not None:
            return dict(features)
    import datasets

    return datasets.Features.from_arrow_schema(schema).to_dict()


def read_split(path: Path) -> ArrowSplit:
    """The split at `path` (a directory save_to_disk wrote, or a cache directory's split:
    train/data/arrow.py `shard_files`)."""
    return ArrowSplit(shard_files(path))


def split_features(path: Path) -> dict[str, Any]:
    """The columns of the split at `path`, from its first shard's schema alone (every shard
    of a split has the same): what the column checks need, without mapping every shard."""
    return features_of(read_shard(shard_files(path)[0], batches=False)[0])


def kind(feature: Any) -> str:
    """A column's `datasets` feature type (Image, ClassLabel, Value, List, ...)."""
    return str(feature.get("_type", "")) if isinstance(feature, dict) else ""


def is_image(feature: Any) -> bool:
    return kind(feature) == "Image"


def is_text(feature: Any) -> bool:
    return kind(feature) == "Value" and feature.get("dtype") in ("string", "large_string")


def is_list(feature: Any) -> bool:
    return kind(feature) in ("List", "LargeList", "Sequence")


def is_words(feature: Any) -> bool:
    """A list of strings per row: a text split into words (conll's `tokens`), whose per-word
    targets the tokenizer's pieces inherit (TextEncoder.words)."""
    return is_list(feature) and is_text(feature.get("feature"))


def holds_text(layout: Layout, column: str) -> bool:
    """The training split's `column` is text or words (tokenized: train/data/sources.py)."""
    feature = split_features(layout.splits["train"])[column]
    return is_text(feature) or is_words(feature)


TARGETS = ("label", "labels", "target", "targets", "ner_tags", "tags")
INPUTS = ("image", "input", "pixel_values", "x", "text", "sentence", "tokens")
"""data.target_column=auto and data.input_column=auto: the first of these names a set has."""


def columns(layout: Layout, input_column: str, target_column: str) -> tuple[str, str]:
    """data.input_column and data.target_column, or (auto) the manifest's, else the first image
    column (or of INPUTS) and the first of TARGETS; a column the set lacks is named with those
    it has."""
    features = split_features(layout.splits["train"])
    names = list(features)
    recorded = layout.manifest or {}
    if target_column == "auto":
        target_column = recorded.get("target_column") or next(
            (n for n in TARGETS if n in names), "label")
    if input_column == "auto":
        images = [n for n in names if is_image(features[n])]
        input_column = recorded.get("input_column") or (images[0] if images else next(
            (n for n in INPUTS if n in names),
            next((n for n in names if n != target_column), "input")))
    for key, column in (("data.input_column", input_column), ("data.target_column",
                                                               target_column)):
        if column not in names:
            raise ArrowDataError(f"{key}={column!r} is not a column of {layout.root} (its "
                                 f"columns: {', '.join(names)}).")
    return input_column, target_column


def class_names(split: ArrowSplit, target_column: str) -> list[str] | None:
    """A ClassLabel's names; an integer column's 0..max; None for other targets (regression).
    A list per row (a tag per word) is read by its items' feature."""
    import pyarrow.compute as pc

    feature = split.features[target_column]
    listed = is_list(feature)
    item = feature.get("feature", {}) if listed else feature
    if kind(item) == "ClassLabel":
        return list(item["names"])
    if not str(item.get("dtype", "")).startswith(("int", "uint")):
        return None
    labels = split.column(target_column)
    if listed:
        labels = pc.list_flatten(labels)
    if not len(labels):
        return []
    return [str(k) for k in range(int(pc.max(labels).as_py()) + 1)]
