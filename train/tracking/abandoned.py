"""A run whose rank 0 died without ending it: the local launcher, which outlives its ranks, ends
it with the real cause.

Rank 0 alone talks to MLflow. When it is killed (SIGKILL, the OOM killer) nobody ends its run,
which would stay RUNNING; when another rank is killed, rank 0 only sees a closed connection and
marks the run FAILED with that. The launcher knows which rank died and how (its exit status),
and the job's output directory names the run (mlflow_run.json).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from train.tracking.backend import RUN_FILE

log = logging.getLogger("train")

ERROR_TAG = "error"


def job_run(output_dir: Path, since: float) -> tuple[str, str] | None:
    """(tracking URI, run id) of the run this start of the job logs to: mlflow_run.json written
    at or after `since` (time.time()); None without tracking or before rank 0 made the run."""
    recorded = recorded_run(output_dir, since)
    return (recorded["tracking_uri"], recorded["run_id"]) if recorded else None


def recorded_run(output_dir: Path, since: float) -> dict[str, str] | None:
    """mlflow_run.json (run_id, experiment_id, tracking_uri) if written at or after `since`."""
    path = Path(output_dir) / RUN_FILE
    try:
        if path.stat().st_mtime < since:
            return None  # an earlier start's run, not touched by this one
        recorded = json.loads(path.read_text())
        return {key: str(recorded[key]) for key in ("run_id", "experiment_id", "tracking_uri")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def end_with_cause(output_dir: Path, since: float, cause: str, *, replace_error: bool = True,
                   stacks: Path | None = None, announce: bool = True) -> str | None:
    """Mark the job's run FAILED with `cause` if it is still RUNNING; if rank 0 already marked
    it FAILED with what it saw (a peer's closed connection), `cause` replaces that error unless
    `replace_error` is false. A run FINISHED or KILLED is left as it is. `stacks`: the ranks'
    stack dumps, logged as the run's artifacts when it was left RUNNING (rank 0 logs them when
    it ends the run itself). `announce`: log that the run was marked (not where the caller
    shows the cause itself). Returns the run id changed, if any. Best effort: the job has
    failed already; an unreachable store only costs the tag."""
    found = job_run(output_dir, since)
    if found is None:
        return None
    uri, run_id = found
    try:
        from mlflow import MlflowClient

        mlflow_client = MlflowClient(tracking_uri=uri)
        status = mlflow_client.get_run(run_id).info.status
        if status != "RUNNING" and (status != "FAILED" or not replace_error):
            return None
        mlflow_client.set_tag(run_id, ERROR_TAG, cause)
        if status == "RUNNING":
            for dump in sorted(stacks.glob("rank-*.txt")) if stacks is not None else []:
                mlflow_client.log_artifact(run_id, str(dump), stacks.name)
            mlflow_client.set_terminated(run_id, "FAILED")
    except Exception as e:  # noqa: BLE001 - never hide the job's own failure behind this
        log.warning("could not mark MLflow run %s FAILED (%s): %s", run_id, cause, e)
        return None
    if announce:
        log.error("MLflow run %s marked FAILED: %s", run_id, cause)
    return run_id
