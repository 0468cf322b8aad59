"""A user's samples as Arrow rows (`python -m train prepare-data mypkg.data.Scans OUT`): each
(input, target) becomes {"input": ..., "target": ...} with `datasets` features that keep it as
it was - a tensor or array as an ArrayND of its dtype and shape, a PIL image as its PNG bytes,
a class index as a ClassLabel (the Dataset's `classes`) or an integer, a number as a float.
data=arrow (train/data/arrow.py) gives them back as tensors."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

ARRAYS = {2: "Array2D", 3: "Array3D", 4: "Array4D", 5: "Array5D"}


def _value(value: Any) -> Any:
    """A tensor, array or number as numpy (or a Python number); a PIL image as its bytes."""
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return value if isinstance(value, (int, float)) else np.asarray(value)


def encode(sample: Any) -> dict[str, Any]:
    """One (input, target) sample as a row."""
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ValueError(f"a sample must be (input, target), got {type(sample).__name__}")
    return {"input": _value(sample[0]), "target": _value(sample[1])}


def size_of(row: dict[str, Any]) -> int:
    """Bytes of a row's values (to plan shards of a chosen size)."""
    total = 0
    for value in row.values():
        if isinstance(value, dict):
            total += len(value["bytes"])
        elif isinstance(value, np.ndarray):
            total += value.nbytes
        else:
            total += 8
    return total


def _feature(value: Any, classes: list[str] | None) -> Any:
    import datasets

    if isinstance(value, dict):
        return datasets.Image()
    if isinstance(value, bool):
        return datasets.Value("bool")
    if isinstance(value, int) or (isinstance(value, np.ndarray) and value.ndim == 0
                                  and np.issubdtype(value.dtype, np.integer)):
        return datasets.ClassLabel(names=classes) if classes else datasets.Value("int64")
    if isinstance(value, float) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return datasets.Value("float32")
    dtype = str(value.dtype)
    if value.ndim == 1:
        return datasets.List(datasets.Value(dtype), length=len(value))
    if value.ndim in ARRAYS:
        return getattr(datasets, ARRAYS[value.ndim])(shape=value.shape, dtype=dtype)
    raise ValueError(f"an array of {value.ndim} dimensions cannot be stored (1 to 5)")


def features_of(dataset: Any, row: dict[str, Any]) -> dict[str, Any]:
    """The `datasets` features (as a dict) of rows like `row`."""
    import datasets

    classes = [str(c) for c in getattr(dataset, "classes", None) or []] or None
    return datasets.Features({"input": _feature(row["input"], None),
                              "target": _feature(row["target"], classes)}).to_dict()
