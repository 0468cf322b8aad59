"""data=arrow's samples: one split of a sharded Arrow data set (train/data/arrow.py finds and
checks it; train/data/arrow_split.py maps it) as a map-style Dataset, opened in each process
that reads it - a DataLoader worker maps the shards itself - and read a batch of rows at a
time."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from train.data import shard_guard
from train.data.arrow import shard_files
from train.data.arrow_split import ArrowSplit, is_image


class ArrowSamples(Dataset):
    """One split's (input, target) samples; the split is opened in each process that reads it
    (a DataLoader worker maps the shards itself)."""

    def __init__(self, path: Path, input_column: str, target_column: str,
                 transform: Any = None, encoder: Any = None) -> None:
        self.path, self.input_column, self.target_column = path, input_column, target_column
        self.transform, self.encoder = transform, encoder
        """`encoder`: a text column's tokenizer (train/data/tokenize.py TextEncoder)."""
        self._data: ArrowSplit | None = None
        self.files = shard_files(path)
        shard_guard.opened(self.files)  # a shard changed under the job is named
        self.length = len(self.data)
        self.is_image = is_image(self.data.features[input_column])

    @property
    def data(self) -> ArrowSplit:
        if self._data is None:
            self._data = ArrowSplit(self.files)
        return self._data

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_data": None}  # reopened (memory-mapped) in each worker

    def with_transform(self, transform: Any) -> ArrowSamples:
        view = copy.copy(self)  # the same split, opened again where it is read
        view._data, view.transform = None, transform
        return view

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch's samples from one read of the Arrow table (the DataLoader asks for a batch
        at a time): reading rows one by one costs a table and a conversion per row."""
        from train.data.streaming import Unreadable, decode_bytes

        rows = self.data.rows(indices, (self.input_column, self.target_column))
        if self.encoder is not None and self.encoder.by_words:  # words and a tag each
            ids, tags = map(torch.from_numpy, self.encoder.words(rows[self.input_column],
                                                                 rows[self.target_column]))
            return list(zip(ids, tags, strict=True))
        if self.encoder is not None:  # a batch of texts tokenized at once
            ids = torch.from_numpy(self.encoder(rows[self.input_column]))
            return [(row, _tensor_or_number(t))
                    for row, t in zip(ids, rows[self.target_column], strict=True)]
        samples: list[Any] = []
        for index, value, target in zip(indices, rows[self.input_column],
                                        rows[self.target_column], strict=True):
            if not self.is_image:
                samples.append((_tensor_or_number(value), _tensor_or_number(target)))
                continue
            try:
                image = decode_bytes(value["bytes"])
            except Exception as e:  # noqa: BLE001 - whatever PIL raises for broken bytes
                samples.append(Unreadable(f"{self.path} row {index}", str(e).splitlines()[0]))
                continue
            samples.append((self.transform(image).as_subclass(torch.Tensor),
                            _tensor_or_number(target)))
        return samples


def _tensor_or_number(value: Any) -> Any:
    """A stored value as the model and the task take it: numbers as they are, arrays as
    tensors - float64 ones (pandas' and Python's floats, stored as written) as float32."""
    if isinstance(value, (int, float)):
        return value
    tensor = torch.as_tensor(np.asarray(value))
    return tensor.float() if tensor.dtype == torch.float64 else tensor
