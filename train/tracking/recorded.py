"""A finished run read back as plain data, for `python -m train rerun` and `diff`
(train/launch/rerun.py): its tags, params, composed config (config.yaml) and the code files it
recorded (code/*: train/report/code.py). One-try requests: a command, not a job, is waiting.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from train.security.redact import redact
from train.tracking import client
from train.tracking.errors import TrackingError
from train.tracking.store import sqlite_path

RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What MLflow's run ids look like (32 hex digits here; other stores use other forms)."""


@dataclass
class RecordedRun:
    run_id: str
    status: str
    tags: dict[str, str]
    params: dict[str, str]
    config: dict[str, Any]
    """The composed config the job ran (its config.yaml artifact)."""
    files: dict[str, str] = field(default_factory=dict)
    """The run's code/ artifacts: artifact path -> text."""


def _texts(mlflow_client: Any, run_id: str, path: str, into: Path) -> dict[str, str]:
    """Every file under the artifact directory `path`, as text."""
    texts: dict[str, str] = {}
    for item in mlflow_client.list_artifacts(run_id, path):
        if item.is_dir:
            texts.update(_texts(mlflow_client, run_id, item.path, into))
        else:
            local = mlflow_client.download_artifacts(run_id, item.path, str(into))
            texts[item.path] = Path(local).read_text(encoding="utf-8", errors="replace")
    return texts


def read_run(uri: str, run_id: str) -> RecordedRun:
    """The run `run_id` of the store at `uri`; a TrackingError (one line) if there is none."""
    if not RUN_ID.match(run_id):
        raise TrackingError(f"{run_id!r} is not a run id: give the 32-character id the MLflow "
                            "UI shows (or summary.json's run_id).")
    # The command's output is its answer, not MLflow's progress bars.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    where = redact(uri)
    db = sqlite_path(uri)
    if db is not None and not db.is_file():  # not made here: a lookup creates nothing
        raise TrackingError(f"no tracking store at {db}: set MLFLOW_TRACKING_URI to the store "
                            "that holds the run.")
    mlflow_client = client.one_try_client(uri)
    try:
        run = mlflow_client.get_run(run_id)
    except Exception as e:  # noqa: BLE001 - any answer but a run is the same refusal
        raise TrackingError(
            f"no run {run_id} in the tracking store {where} ({client.describe(e)}): check the "
            "id, and MLFLOW_TRACKING_URI if the run was logged elsewhere.") from None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            config_file = mlflow_client.download_artifacts(run_id, "config.yaml", tmp)
            config = yaml.safe_load(Path(config_file).read_text())
        except Exception as e:  # noqa: BLE001
            raise TrackingError(f"run {run_id} in {where} holds no config.yaml "
                                f"({client.describe(e)}): it was not made by this service, or "
                                "it failed before it was recorded.") from None
        files = _texts(mlflow_client, run_id, "code", Path(tmp))
    return RecordedRun(run_id, run.info.status, dict(run.data.tags), dict(run.data.params),
                       config, files)
