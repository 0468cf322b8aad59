"""The user's own Dataset classes (`data=custom`): found by dotted path, built, checked.

`data.train` (and optionally `data.val`) is `{_target_: pkg.module.Class, **its own kwargs}`,
built with Hydra's instantiate. Pre-flight builds each once in the launching process and reads
its first sample, so that a path that does not import, a class that is not a map-style Dataset
or a sample that is not `(input, target)` is refused with one line before any rank starts (what
the target must be, the task says: train/tasks/).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from train.config import usercode
from train.errors import ConfigError


def build(spec: dict[str, Any] | None, key: str) -> Any:
    """The Dataset `spec` describes, checked to be map-style; ConfigError otherwise."""
    import torch.utils.data as tud

    spec = dict(spec or {})
    target = spec.pop("_target_", None)
    if not target:
        raise ConfigError(f"data=custom needs {key}._target_=<dotted path of your Dataset class>"
                          f" (its own arguments as +{key}.<name>=<value>).")
    try:
        obj = usercode.locate(target, f"{key}._target_")
        if isinstance(obj, type) and issubclass(obj, tud.IterableDataset):
            raise usercode.UserCodeError(
                f"{key}._target_={target!r} is an IterableDataset: the service needs a "
                "map-style Dataset (__len__ and __getitem__) to shard it exactly.")
        if isinstance(obj, type) and not _map_style(obj):
            raise usercode.UserCodeError(
                f"{key}._target_={target!r} is {usercode.describe(obj)}: not a map-style "
                "torch.utils.data.Dataset (__len__, and __getitem__ by sample position).")
        dataset = usercode.build(target, key, spec)
    except usercode.UserCodeError as e:
        raise ConfigError(str(e)) from None
    if not _map_style(type(dataset)):
        raise ConfigError(f"{key}._target_={target!r} gave {usercode.describe(dataset)}: not a "
                          "map-style torch.utils.data.Dataset (__len__, and __getitem__ by "
                          "sample position).")
    if len(dataset) == 0:
        raise ConfigError(f"{key}: the Dataset {target} is empty.")
    return dataset


def _map_style(cls: type) -> bool:
    """A torch Dataset with a length, or anything indexed by position like one (a Hugging Face
    Dataset, a list); not a dict, whose keys are no sample positions."""
    return (hasattr(cls, "__getitem__") and hasattr(cls, "__len__")
            and not issubclass(cls, Mapping | str | bytes))


def first_sample(dataset: Any, key: str) -> tuple[tuple[int, ...], Any]:
    """(input shape, target) of sample 0, checked to be an (input tensor, target) pair; what
    the target must be is the task's to say (train/tasks/: `target_problem`)."""
    import numpy as np
    import torch

    try:
        sample = dataset[0]
    except Exception as e:  # noqa: BLE001 - the user's __getitem__
        raise ConfigError(f"{key}: reading sample 0 raised {usercode.one_line(e)}") from None
    if not isinstance(sample, Sequence) or len(sample) != 2:
        raise ConfigError(f"{key}: sample 0 is a {type(sample).__name__}, not an (input, target) "
                          "pair: __getitem__ must return (tensor, target), e.g. (image, integer "
                          "class index).")
    inputs, target = sample
    if not isinstance(inputs, torch.Tensor | np.ndarray) or inputs.ndim == 0:
        raise ConfigError(f"{key}: sample 0's input is a {type(inputs).__name__}, not a tensor: "
                          "return a torch.Tensor (e.g. transforms.v2.ToImage + ToDtype for "
                          "images).")
    return tuple(int(d) for d in inputs.shape), target


def target_shape(target: Any) -> tuple[int, ...]:
    """A sample's target shape: () for a plain number."""
    import numpy as np

    return tuple(int(d) for d in np.shape(target))


def class_names(dataset: Any, labels: Any = None) -> list[str] | None:
    """The Dataset's `classes` attribute; else 0..max of its `targets` (or `labels`) attribute
    or of `labels` given; None when neither is known without reading every sample."""
    classes = getattr(dataset, "classes", None)
    if isinstance(classes, Sequence) and not isinstance(classes, str) and len(classes):
        return [str(c) for c in classes]
    if labels is None:
        labels = getattr(dataset, "targets", None)
        labels = getattr(dataset, "labels", None) if labels is None else labels
        if labels is None or isinstance(labels, str) or not hasattr(labels, "__len__"):
            return None
    import torch

    top = int(torch.as_tensor(labels).max()) if len(labels) else -1
    return [str(i) for i in range(top + 1)] if top >= 0 else None


def check(spec_train: dict[str, Any] | None, spec_val: dict[str, Any] | None,
          spec_test: dict[str, Any] | None = None,
          target_problem: Callable[[Any], str | None] | None = None,
          classes: bool = True) -> int | None:
    """Pre-flight: build the Datasets once and check their first samples agree, and that each
    first target is what the task reads (`target_problem`: the task's). Returns the number of
    classes where the training Dataset names them (`class_names`; with `classes`, its
    `targets` count too), else None: counting its labels would read every sample."""
    train = build(spec_train, "data.train")
    shape, target = first_sample(train, "data.train")
    firsts = [("data.train", target)]
    for key, spec in (("data.val", spec_val), ("data.test", spec_test)):
        if not (spec and spec.get("_target_")):
            continue
        other, other_target = first_sample(build(spec, key), key)
        if other != shape:
            raise ConfigError(f"{key}'s inputs have shape {other}, data.train's {shape}: "
                              "both must give the model the same shape.")
        firsts.append((key, other_target))
    for key, first in firsts:
        if target_problem is not None and (problem := target_problem(first)):
            raise ConfigError(f"{key}: {problem}")
    names = class_names(train) if classes else class_names(train, labels=())
    return len(names) if names else None
