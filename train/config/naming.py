"""A run's default name (tracking.run_name=null): what was trained on what, readable in the runs
table, e.g. `cnn-digits`, `TinyConvNet-cifar10-regression`; a sweep's job adds its number
(its output directory's name) so that the sweep's children can be told apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.config.groups import TrainConfig


def _short(target: Any, fallback: str) -> str:
    """The class name of a dotted `_target_` path (mypkg.models.Net -> Net)."""
    return str(target).rsplit(".", 1)[-1] if target else fallback


def default_run_name(cfg: TrainConfig, output_dir: str | Path | None = None) -> str:
    """`<model>-<data>[-<task>][-<sweep job>]`: the task where it is not classification."""
    model = _short(getattr(cfg.model, "target", None), getattr(cfg.model, "name", "model"))
    data = cfg.data.name
    if data == "custom":
        data = _short((cfg.data.train or {}).get("_target_"), data)
    parts = [model, data]
    if cfg.task.name == "custom":
        parts.append(_short(cfg.task._target_, "task"))
    elif cfg.task.name != "classification":
        parts.append(cfg.task.name)
    if cfg.tracking.parent_run_id and output_dir is not None:
        parts.append(Path(output_dir).name)
    return "-".join(parts)
