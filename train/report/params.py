"""The run's params: the composed config as MLflow params, with only the keys that apply to the
options chosen, so that the runs table compares what shaped each run.

A key that only another option reads (data.num_samples is the synthetic set's, data.mean the
image folder's, optim.momentum the SGD preset's) is left out; the values the job resolves
(the input shape, the mean and std applied to every batch, the classes) are logged by
RunLogger.log_data once the data exists. A model of the user's own gets `model.name`, its
class's name, like a built-in one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TORCHVISION_SETS = ("mnist", "fashion_mnist", "cifar10")
IN_MEMORY_SETS = ("digits", "synthetic", *TORCHVISION_SETS)
DATA_KEYS: dict[str, tuple[str, ...]] = {
    "on_device": IN_MEMORY_SETS,
    "root": (*TORCHVISION_SETS, "imagefolder", "tokens"),
    "seq_len": ("tokens",),
    "download": TORCHVISION_SETS,
    "num_samples": ("synthetic",),
    "channels": ("synthetic",),
    "num_classes": ("synthetic",),
    "image_size": ("synthetic", "imagefolder"),
    "mean": (),  # the values used are logged from the data (RunLogger.log_data)
    "std": (),
    "train_transforms": ("imagefolder",),
    "eval_transforms": ("imagefolder",),
    "train": ("custom",),
    "val": ("custom",),
    "test": ("custom",),
}
"""data.<key>: the data sets that read it (keys not listed apply to all)."""
TASK_KEYS: dict[str, tuple[str, ...]] = {
    "_target_": ("custom",), "args": ("custom",),
    "ignore_index": ("segmentation", "language_model", "token_classification"),
    "num_classes": ("segmentation",),
    "samples_shown": ("segmentation", "regression", "language_model"),
    "prompt": ("language_model",), "sample_tokens": ("language_model",)}
MODEL_KEYS: dict[str, tuple[str, ...]] = {
    "width": ("cnn", "mlp"), "depth": ("mlp",), "dropout": ("cnn", "mlp", "resnet18")}
"""model.<key> of the built-in models: the models that read it (torchvision's read neither)."""
PRESET_KEYS: dict[str, tuple[str, ...]] = {
    "momentum": ("sgd",), "nesterov": ("sgd",), "betas": ("adamw",)}


def _kept(group: Mapping[str, Any], table: Mapping[str, tuple[str, ...]],
          option: str | None) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in table or option in table[k]}


def _model(model: Mapping[str, Any]) -> dict[str, Any]:
    if "_target_" in model:  # model=custom: its constructor's keys, and a name to compare by
        return {"name": str(model["_target_"]).rsplit(".", 1)[-1], **model}
    return _kept(model, MODEL_KEYS, model.get("name") if model.get("source") != "torchvision"
                 else None)


def _optim(optim: Mapping[str, Any]) -> dict[str, Any]:
    kept = _kept(optim, PRESET_KEYS, None if optim.get("_target_") else optim.get("name"))
    if (kept.get("scheduler") or {}).get("_target_"):  # the built-in schedule is not used
        for key in ("schedule", "warmup_epochs", "min_lr_ratio"):
            kept.pop(key, None)
    else:
        kept.pop("scheduler", None)
        kept.pop("scheduler_interval", None)
    return kept


def applicable(config: Mapping[str, Any]) -> dict[str, Any]:
    """The composed config (a plain dict) without the keys no chosen option reads."""
    out = dict(config)
    if isinstance(data := config.get("data"), Mapping):
        out["data"] = _kept(data, DATA_KEYS, data.get("name"))
    if isinstance(task := config.get("task"), Mapping):
        out["task"] = _kept(task, TASK_KEYS, task.get("name"))
    if isinstance(model := config.get("model"), Mapping):
        out["model"] = _model(model)
    if isinstance(optim := config.get("optim"), Mapping):
        out["optim"] = _optim(optim)
    if out.get("cluster") is None:
        out.pop("cluster", None)
    return out
