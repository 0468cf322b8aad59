"""Single requests for a sweep's parent run (train/tracking/sweep.py): create it, read it and its
child runs back, log its summary, end it, and register the model of its best job. Each is one
request through train/tracking/client.py's bounded one-try client."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from train.tracking import registry
from train.tracking.client import RunClient, one_try_client
from train.tracking.errors import describe
from train.tracking.records import Batch


@dataclass
class RunSummary:
    run_id: str
    experiment_id: str
    status: str
    tags: dict[str, str]
    metrics: dict[str, float]


def _summary(run: Any) -> RunSummary:
    return RunSummary(run_id=run.info.run_id, experiment_id=str(run.info.experiment_id),
                      status=run.info.status, tags=dict(run.data.tags),
                      metrics=dict(run.data.metrics))


def create_run(uri: str, experiment_id: str, run_name: str | None,
               tags: dict[str, str]) -> str:
    from train.tracking.attribution import run_tags

    run = one_try_client(uri).create_run(experiment_id, run_name=run_name,
                                         tags={**run_tags(uri), **tags})
    return str(run.info.run_id)


def get_run(uri: str, run_id: str) -> RunSummary:
    return _summary(one_try_client(uri).get_run(run_id))


def child_runs(uri: str, experiment_id: str, parent_run_id: str) -> list[RunSummary]:
    runs = one_try_client(uri).search_runs(
        [experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=10000)
    return [_summary(run) for run in runs]


def log_values(uri: str, run_id: str, metrics: Mapping[str, float] | None = None,
               tags: Mapping[str, str] | None = None, step: int = 0) -> None:
    """Metrics (at `step`, stamped now) and tags in one request."""
    now = int(time.time() * 1000)
    RunClient(uri, run_id).send_rows(Batch(
        metrics=[(k, float(v), now, step) for k, v in (metrics or {}).items()],
        tags=[(k, str(v)) for k, v in (tags or {}).items()]))


def reopen_run(uri: str, run_id: str, experiment_id: str, drop_prefix: str) -> bool:
    """A resumed sweep's parent RUNNING again, its tags starting with `drop_prefix` removed;
    False where the store no longer holds it in `experiment_id` (deleted, another store)."""
    mlflow_client = one_try_client(uri)
    try:
        run = mlflow_client.get_run(run_id)
    except Exception:  # noqa: BLE001 - gone (or never in this store): a new parent then
        return False
    if str(run.info.experiment_id) != str(experiment_id) or run.info.lifecycle_stage != "active":
        return False
    for key in [k for k in run.data.tags if k.startswith(drop_prefix)]:
        mlflow_client.delete_tag(run_id, key)
    mlflow_client.update_run(run_id, status="RUNNING")
    return True


def end_run(uri: str, run_id: str, status: str) -> None:
    one_try_client(uri).set_terminated(run_id, status)


def register_model(uri: str, run_id: str, name: str) -> dict[str, str]:
    """A finished run's logged model as a new version of `name` (a sweep's best job); the tags
    that say how it went (train/tracking/registry.py). Never raises."""
    try:
        mlflow_client = one_try_client(uri)
    except Exception as e:  # noqa: BLE001 - as registry.register: an outcome, not an exception
        return {registry.ERROR_TAG: describe(e)}
    return registry.register(uri, mlflow_client, run_id, name)
