"""The backend a run logger writes to, and the one that does nothing with it.

`NullRun` is the ONE do-nothing backend (every rank but 0, and tracking.enabled=false);
train/tracking/run.py's MlflowRun is the one that sends. Also the job's run file: the run an
output directory's job logs to, which a restart of the job continues.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from train.tracking.records import Loggable
from train.tracking.unsent import RUN_FILE

__all__ = ["RUN_FILE", "NullRun", "TrackingIncomplete", "recorded_run_id"]


def recorded_run_id(output_dir: Path) -> str | None:
    """The run an earlier start of this job (same output directory) created, if any."""
    try:
        return str(json.loads((output_dir / RUN_FILE).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class NullRun:
    """The ONE do-nothing backend: every rank but 0, and tracking.enabled=false."""

    run_id: str | None = None
    experiment_id: str | None = None
    uri: str = ""
    cpu_seconds: float = 0.0
    failure: str | None = None
    unsent_path: Path | None = None

    def start(self, tags: Mapping[str, str], run_name: str | None = None,
              resume_run_id: str | None = None) -> None: ...
    def log_params(self, params: Mapping[str, str]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def log(self, record: Loggable) -> None: ...
    def begin_sending(self) -> None: ...

    def flush(self, timeout_s: float | None = None, created_within_s: float = 0.0) -> bool:
        return True

    def finish(self, status: str = "FINISHED", error: str | None = None,
               timeout_s: float | None = None) -> bool:
        return True


class TrackingIncomplete(RuntimeError):
    """The job's work is done but the store does not hold all of it; the message says where the
    rest is and how to deliver it."""
