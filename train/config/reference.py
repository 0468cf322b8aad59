"""The configuration reference: every group's keys with their type, default and docstring, read
from the dataclasses themselves (their field docstrings are the documentation), as Markdown.

    python -m train.config.reference > docs/configuration.md

docs/configuration.md is this module's output; tests/unit/test_docs.py fails when it is stale.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from train.config.cluster import ClusterConfig
from train.config.evaluate import EvalConfig, PredictConfig
from train.config.groups import (
    CustomModelConfig,
    DataConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    TrackingConfig,
    TrainerConfig,
)
from train.config.keys import default_of, field_docs
from train.config.task import TaskConfig

GROUPS: tuple[tuple[str, type, str], ...] = (
    ("model", ModelConfig, "the built-in and torchvision models (`model=cnn|mlp|resnet18|"
     "torchvision`)"),
    ("model", CustomModelConfig, "`model=custom`, `model=gpt` and `model=hf`: a `_target_`; every "
     "other `model.*` key is its constructor's (added with `+`)"),
    ("data", DataConfig, "the data set (`data=digits|synthetic|mnist|fashion_mnist|cifar10|"
     "imagefolder|custom|tokens`)"),
    ("optim", OptimConfig, "the optimiser and its schedule (`optim=sgd|adamw`)"),
    ("trainer", TrainerConfig, "the training loop, checkpoints, evaluation"),
    ("task", TaskConfig, "what the model learns (`task=classification|regression|segmentation|"
     "language_model|custom`)"),
    ("distributed", DistributedConfig, "ranks, backend, DDP"),
    ("tracking", TrackingConfig, "MLflow"),
    ("cluster", ClusterConfig, "Slurm (`+cluster=slurm`); not a default group"),
    ("eval", EvalConfig, "`python -m train eval <run_id>`: a finished run evaluated "
     "(docs/evaluation.md)"),
    ("predict", PredictConfig, "`python -m train predict <run_id>`: a finished run's outputs "
     "written (docs/evaluation.md)"),
)


def _cell(value: Any) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(
        value) if isinstance(value, str) else str(value)
    return text.replace("|", "\\|").replace("\n", "\\n")


def group_table(group: str, cls: type) -> list[str]:
    return ["| key | type | default | meaning |", "|---|---|---|---|", *_rows(group, cls)]


def _rows(prefix: str, cls: type) -> list[str]:
    """One row per key; a field that is a dataclass of its own (trainer.profile,
    distributed.fsdp) one row for itself, then one for each of its keys."""
    docs = {k: " ".join(v.split()) for k, v in field_docs(cls).items()}
    rows = []
    for f in dataclasses.fields(cls):
        if f.name == "kwargs":
            continue  # CustomModelConfig: the constructor's own keys
        key = f"{prefix}.{'_target_' if f.name == 'target' else f.name}"
        kind, meaning = (str(text).replace("|", "\\|") for text in (f.type, docs.get(f.name, "")))
        default = default_of(f)
        if dataclasses.is_dataclass(default):
            rows.append(f"| `{key}` | `{kind}` | | {meaning} |")
            rows += _rows(key, type(default))
            continue
        rows.append(f"| `{key}` | `{kind}` | `{_cell(default)}` | {meaning} |")
    return rows


def render() -> str:
    lines = ["# Configuration reference", "",
             "Every key of every config group, with its type, default and meaning, generated from",
             "the dataclasses in `train/config/` (`python -m train.config.reference >",
             "docs/configuration.md`; a test fails when this page is stale). Override any key as",
             "`key=value`; a group's option (`model=resnet18`) sets only what differs from these",
             "defaults. `python -m train --cfg job <overrides>` prints what a job would use.", ""]
    for group, cls, what in GROUPS:
        lines += [f"## `{group}`: {what}", "", *group_table(group, cls), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
