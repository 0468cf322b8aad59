"""Control characters refused where a value reaches a shell, a script or a path.

`cluster.*` strings end up as `#SBATCH` lines and in the job script submitit writes (a newline
in cluster.job_name started a new script line: a shell command ran and the later #SBATCH lines
were silently dropped); the experiment, run and registered model names reach MLflow, the UI
and file names. One pre-flight check (train/launch/preflight.py's validate), before anything is
submitted or started.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Iterator
from typing import Any

from train.config.groups import TrainConfig


def has_control(text: str) -> bool:
    """Any C0/C1 control or Unicode line/paragraph separator (newline, CR, TAB, ESC, NUL...)."""
    return any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in text)


def _strings(value: Any, name: str) -> Iterator[tuple[str, str]]:
    """(dotted name, text) for every string in a config value, keys of mappings included."""
    if isinstance(value, str):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(str(key), f"{name} key")
            yield from _strings(item, f"{name}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _strings(item, f"{name}[{i}]")


def control_character_problems(cfg: TrainConfig) -> list[str]:
    """One message per value holding a control character (empty: all clean)."""
    checked: list[tuple[str, Any]] = [("tracking.experiment", cfg.tracking.experiment),
                                      ("tracking.run_name", cfg.tracking.run_name),
                                      ("tracking.register_model", cfg.tracking.register_model)]
    if cfg.cluster is not None:
        checked += [(f"cluster.{f.name}", getattr(cfg.cluster, f.name))
                    for f in dataclasses.fields(cfg.cluster)]
    return [f"{name}={text!r} holds a control character (newline, tab, escape...), which would "
            "reach a job script or a file name: use plain text."
            for field, value in checked for name, text in _strings(value, field)
            if has_control(text)]
