"""The job's task from the `task` group: a built-in one, or the user's class (task=custom)."""

from __future__ import annotations

from typing import Any

from train.config import usercode
from train.config.task import TaskConfig
from train.errors import ConfigError
from train.tasks.base import Task

KEY = "task._target_"


def build(cfg: TaskConfig) -> Task:
    """The task object (not yet set up with the data: `Task.setup`)."""
    if cfg.name == "classification":
        from train.tasks.classification import Classification

        return Classification()
    if cfg.name == "regression":
        from train.tasks.regression import Regression

        return Regression(cfg.samples_shown)
    if cfg.name == "segmentation":
        from train.tasks.segmentation import Segmentation

        return Segmentation(cfg.ignore_index, cfg.samples_shown)
    if cfg.name == "language_model":
        from train.tasks.language_model import LanguageModel

        return LanguageModel(cfg.ignore_index, cfg.prompt, cfg.sample_tokens, cfg.samples_shown)
    if cfg.name == "token_classification":
        from train.tasks.token_classification import TokenClassification

        return TokenClassification(cfg.ignore_index)
    return _custom(cfg)


def _custom(cfg: TaskConfig) -> Task:
    import torch

    if not cfg._target_:
        raise ConfigError("task=custom needs task._target_=<dotted path of your Task class>.")
    try:
        usercode.locate(cfg._target_, KEY)  # names a missing module or class, and sys.path
        task = usercode.build(cfg._target_, KEY, dict(cfg.args))
    except usercode.UserCodeError as e:
        raise ConfigError(str(e)) from None
    if not all(callable(getattr(task, m, None)) for m in ("step", "finalize")):
        raise ConfigError(f"{KEY}={cfg._target_!r} gave {usercode.describe(task)}, not a task: "
                          "subclass train.tasks.base.Task (step returns the loss SUM and the "
                          "sums; finalize turns the sums into metrics).")
    if isinstance(task, torch.nn.Module) and any(p.requires_grad for p in task.parameters()):
        raise ConfigError(f"{KEY}={cfg._target_!r} holds trainable parameters: they would "
                          "escape DDP (no rank would sync them); put them in the model.")
    metrics = getattr(task, "metrics", ())
    if "loss" not in metrics or not all(isinstance(m, str) for m in metrics):
        raise ConfigError(f"{KEY}={cfg._target_!r}: its `metrics` {metrics!r} must be a tuple "
                          "of names including 'loss' (declared up front, for trainer.monitor).")
    if bad := [m for m in metrics if not _loggable(m)]:
        raise ConfigError(f"{KEY}={cfg._target_!r}: metric name {bad[0]!r} is not one MLflow "
                          "takes (letters, digits, _ - . / and spaces only).")
    return task


def _loggable(name: Any) -> bool:
    import re

    return bool(re.fullmatch(r"[\w\-./ ]{1,200}", name))
