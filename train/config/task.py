"""The `task` config group: what the model learns and how it is scored. A dataclass with a
docstring per field, like train/config/groups.py's (whose TrainConfig holds it), and the metric
names each built-in task logs, known here without torch so that pre-flight (and `--help`) can
check trainer.monitor and trainer.objective against them. The tasks themselves are
train/tasks/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BUILTIN_TASKS = ("classification", "regression", "segmentation", "language_model",
                 "token_classification")
TASK_NAMES = (*BUILTIN_TASKS, "custom")

METRICS: dict[str, tuple[str, ...]] = {
    "classification": ("loss", "accuracy", "accuracy_top5"),
    "regression": ("loss", "mse", "mae", "r2"),
    "segmentation": ("loss", "pixel_accuracy", "miou"),
    "language_model": ("loss", "perplexity"),
    "token_classification": ("loss", "accuracy", "macro_f1"),
}
"""What each built-in task logs as val/<name> (and train/<name>, test/<name>); classification's
accuracy_top5 only with more classes than TOP_K."""
TOP_K = 5
"""accuracy_top5 is counted where there are more than this many classes."""


@dataclass
class TaskConfig:
    name: str = "classification"
    """classification (a class index per sample), regression (float targets of any shape),
    segmentation (an HxW class mask per image), language_model (next-token prediction over
    data=tokens windows), token_classification (a class per token of a text), or custom
    (your own: task._target_)."""
    _target_: str | None = None
    """task=custom: the dotted path of your Task class (train/tasks/base.py says what it
    implements), found on PYTHONPATH like a custom model."""
    args: dict[str, Any] = field(default_factory=dict)
    """task=custom: your Task's constructor arguments, e.g. +task.args.alpha=0.5."""
    ignore_index: int = 255
    """segmentation: the mask value of pixels that count nowhere (borders, unlabelled);
    language_model and token_classification: the target of padded positions (-100, as they
    set it)."""
    num_classes: int | None = None
    """segmentation: the classes of the masks; null = the data set's `classes` (or
    data.num_classes for synthetic data)."""
    samples_shown: int = 4
    """segmentation and regression: validation samples drawn in the task's picture (images
    with their true and predicted masks; regression plots up to 200 x this points);
    language_model: continuations of task.prompt sampled at the end (samples.txt)."""
    prompt: str = "\n"
    """language_model: the text the sampled continuations start from."""
    sample_tokens: int = 200
    """language_model: tokens sampled per continuation (0: none)."""


def metric_problem(name: str, task: str, metrics: tuple[str, ...], key: str,
                   num_classes: int | None = None) -> str | None:
    """Why `name` (a trainer.monitor or trainer.objective) is never logged by this task, or
    None. `num_classes` (where known): top-5 needs more than TOP_K classes."""
    split, _, metric = name.partition("/")
    if split == "val" and metric in metrics:
        if metric == "accuracy_top5" and num_classes is not None and num_classes <= TOP_K:
            return (f"{key}=val/accuracy_top5 needs more than {TOP_K} classes; this data has "
                    f"{num_classes}, so the job never logs it: choose val/accuracy or val/loss.")
        return None
    choices = ", ".join(f"val/{m}" for m in metrics)
    return f"{key}={name!r} is not a metric task={task} logs; choose one of {choices}."


def classes_problem(task: str, num_classes: int | None, data: str) -> str | None:
    """A classifier needs two classes or more: with one, its loss is 0 from the first step and
    its accuracy 1, a run that finishes and means nothing."""
    if task != "classification" or num_classes is None or num_classes >= 2:
        return None
    return (f"data={data} has {num_classes} class: task=classification needs 2 or more (an "
            "image folder: one folder per class).")
