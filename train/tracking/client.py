"""Every MLflow request of the project; mlflow is imported lazily (the import costs ~1.6 s).

- `prepare()` runs in the process that submits jobs (Slurm, sweeps) before any rank starts: it
  initialises (migrates) a new SQLite store and creates the experiment once, so that parallel
  jobs never race on either.
- `RunClient` makes the requests of one run: rank 0's sender thread (train/tracking/run.py) and
  the upload of an unsent file (train/tracking/unsent.py) apply typed records through it.
The single requests about a sweep's parent run and its best job are
train/tracking/parent_run.py's; the logged model and the registry's requests
train/tracking/registry.py's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from train.config.groups import TrackingConfig
from train.tracking import registry
from train.tracking.errors import describe, is_permanent
from train.tracking.new_store import initialise
from train.tracking.records import (
    ArtifactFile,
    Batch,
    CreateRun,
    DatasetInput,
    EndRun,
    Model,
    Record,
    RegisterModel,
    ResumeRun,
    Table,
    Text,
)
from train.tracking.store import (
    TrackingError,
    artifact_location,
    check_reachable,
    check_server_api,
    is_new_sqlite,
    resolve_uri,
    sqlite_path,
)

ONE_TRY_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow's HTTP client would retry one request for ~4 minutes (7 retries, back-off 2, 120 s
timeout each) before our code hears of a failure: a checkpoint or a stop would wait that long.
One try is bounded here instead (10 s); the sender's own loop (train/tracking/run.py) retries
what is transient and gives up at once on what is permanent. A value the user exported wins."""

def _file_identity(uri: str) -> tuple[int, int] | None:
    """(device, inode) of an SQLite store's file; None for other stores or no file."""
    db = sqlite_path(uri)
    try:
        return None if db is None else (db.stat().st_dev, db.stat().st_ino)
    except OSError:
        return None


def one_try_client(uri: str) -> Any:
    """An MlflowClient for `uri`, whose requests try once (ONE_TRY_ENV); a new SQLite store is
    initialised first (the first run into it may start together with another)."""
    for key, value in ONE_TRY_ENV.items():
        os.environ.setdefault(key, value)
    from mlflow import MlflowClient

    if is_new_sqlite(uri):
        initialise(uri)
    return MlflowClient(tracking_uri=uri)


def log_to_finished_run(uri: str, run_id: str, metrics: dict[str, float], step: int,
                        tags: dict[str, str], artifact: Path, artifact_path: str) -> None:
    """Metrics, tags and one file into an existing run, its status left as it is (`python -m
    train eval`); one try, a TrackingError naming where the result still is if it fails."""
    from mlflow.entities import Metric, RunTag

    client = one_try_client(uri)
    stamp = int(time.time() * 1000)
    try:
        client.log_batch(run_id, metrics=[Metric(k, v, stamp, step) for k, v in metrics.items()],
                         tags=[RunTag(k, v) for k, v in tags.items()])
        client.log_artifact(run_id, str(artifact), artifact_path=artifact_path)
    except Exception as e:  # noqa: BLE001 - the result is kept in the file either way
        raise TrackingError(f"the evaluation's result could not be logged to run {run_id} "
                            f"({type(e).__name__}: {str(e)[:200]}); it is in {artifact}.") \
            from None


def check_usable(uri: str, experiment: str) -> None:
    """After check_reachable: one real request, for what only a request finds out. A server is
    asked over plain HTTP (no mlflow import: pre-flight stays fast); an SQLite file is checked
    by check_reachable; any other store (a database, file:, an unknown scheme) goes through
    MLflow itself, which is where a missing driver shows."""
    if uri.startswith(("http://", "https://")):
        check_server_api(uri, experiment)  # a plain HTTP request: no mlflow import
    elif sqlite_path(uri) is None:
        probe(uri, experiment)


def probe(uri: str, experiment: str) -> None:
    """One real request to the store (the experiment looked up by name), as a job's first
    request would be: TrackingError with the reason if it can never succeed (a missing driver,
    an unsupported scheme, a server that is not MLflow, refused credentials)."""
    try:
        one_try_client(uri).get_experiment_by_name(experiment)
    except Exception as e:  # noqa: BLE001 - classified below
        if isinstance(e, ImportError):
            raise TrackingError(f"The MLflow store {uri} needs a database driver that is not "
                                f"installed here ({describe(e)}): install it into this Python "
                                "environment (e.g. pip install 'psycopg[binary]' for "
                                "postgresql://), or use another store.") from None
        if is_permanent(e):
            raise TrackingError(f"The MLflow store {uri} cannot be used: {describe(e)}. Fix "
                                "MLFLOW_TRACKING_URI / tracking.uri, or run with "
                                "tracking.enabled=false.") from None
        raise TrackingError(f"The MLflow store {uri} does not answer ({describe(e)}). Start it "
                            "or fix MLFLOW_TRACKING_URI / tracking.uri, or run with "
                            "tracking.enabled=false.") from None


def prepare(cfg: TrackingConfig) -> str:
    """Check the store, migrate it if new, and return the experiment id (created if needed)."""
    uri = resolve_uri(cfg)
    check_reachable(uri)
    mlflow_client = one_try_client(uri)
    return cfg.experiment_id or _experiment_id(mlflow_client, cfg.experiment, uri)


def _experiment_id(mlflow_client: Any, name: str, uri: str) -> str:
    """The experiment's id, created if it does not exist yet (also when another process
    creates it at the same moment: then its id)."""
    from mlflow.exceptions import MlflowException

    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(mlflow_client.create_experiment(name, artifact_location(uri)))
    except MlflowException:  # created meanwhile by someone else
        experiment = mlflow_client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


# -- one run -------------------------------------------------------------------------------------

class RunClient:
    """Does what a record or a batch of rows asks, against one MLflow run."""

    def __init__(self, uri: str, run_id: str | None = None) -> None:
        self.uri, self.run_id = uri, run_id
        self.experiment_id: str | None = None
        self.logged_until: dict[str, int] = {}
        """Per metric, the last step the run already holds (a resumed run replays steps)."""
        self._mlflow = one_try_client(uri)
        self._db_file = _file_identity(uri)

    def check_stored(self, status: str) -> str | None:
        """None if the store holds this run with `status`; else what is wrong (the SQLite file
        was removed or replaced while the run was logging - its writes went to a file nobody
        will read -, or the run's status differs)."""
        if self._db_file is not None and _file_identity(self.uri) != self._db_file:
            return (f"the database file {sqlite_path(self.uri)} was removed or replaced while "
                    "the run was logging to it")
        try:
            stored = self._mlflow.get_run(self.run_id).info.status
        except Exception as e:  # noqa: BLE001 - any failure means: not confirmed
            return f"reading the run back failed ({describe(e)})"
        return None if stored == status else f"the store says {stored}, not {status}"

    def send_rows(self, batch: Batch) -> None:
        """One log_batch request (the batch within MLflow's limits); the metric steps a resumed
        run already holds are left out."""
        from mlflow.entities import Metric, Param, RunTag

        metrics = [m for m in batch.metrics if m[3] > self.logged_until.get(m[0], -1)]
        self._mlflow.log_batch(self.run_id, metrics=[Metric(*m) for m in metrics],
                               params=[Param(k, v[:6000]) for k, v in batch.params],
                               tags=[RunTag(k, v[:5000]) for k, v in batch.tags],
                               synchronous=True)

    def apply(self, record: Record) -> None:
        match record:
            case CreateRun():
                self._create(record)
            case ResumeRun():
                self._resume(record.run_id)
            case ArtifactFile():
                self._mlflow.log_artifact(self.run_id, record.path, record.artifact_path)
            case Text():
                self._mlflow.log_text(self.run_id, record.text, record.artifact_file)
            case Table():
                self._mlflow.log_table(self.run_id, record.table, record.artifact_file)
            case DatasetInput():
                self._log_dataset(record)
            case Model():
                registry.log_model(self.uri, str(self.run_id), record)
            case RegisterModel():
                if record.outcome is None:
                    record.outcome = registry.register(self.uri, self._mlflow, str(self.run_id),
                                                       record.name)
                self.send_rows(Batch(tags=list(record.outcome.items())))
            case EndRun():
                if record.error is not None:
                    self.send_rows(Batch(tags=[("error", record.error[-5000:])]))
                self._mlflow.set_terminated(self.run_id, record.status)
            case _:
                raise TypeError(f"not a tracking record: {record!r}")

    def held_steps(self, keys: Iterable[str]) -> dict[str, set[int]]:
        """Per metric key, the steps the run holds already."""
        return {key: {m.step for m in self._mlflow.get_metric_history(self.run_id, key)}
                for key in keys}

    def _create(self, record: CreateRun) -> None:
        experiment_id = record.experiment_id
        if experiment_id is None:  # a local job: the launcher left the experiment to rank 0
            experiment_id = _experiment_id(self._mlflow, record.experiment, self.uri)
        run = self._mlflow.create_run(experiment_id, run_name=record.run_name, tags=record.tags)
        self.run_id, self.experiment_id = run.info.run_id, str(experiment_id)

    def _resume(self, run_id: str) -> None:
        run = self._mlflow.get_run(run_id)
        self.run_id, self.experiment_id = run_id, str(run.info.experiment_id)
        for key in run.data.metrics:  # each epoch and step must appear once in each history
            steps = [m.step for m in self._mlflow.get_metric_history(run_id, key)]
            self.logged_until[key] = max(steps, default=-1)
        self._keep_attempt(run)
        self._mlflow.update_run(run_id, status="RUNNING")

    def _keep_attempt(self, run: Any) -> None:
        """How the attempt before this one ended goes into the `attempts` tag (one line each);
        its `error` is history now, not the state of the run."""
        tags = run.data.tags
        ended = run.info.status + (f" (stopped by {tags['stopped_by']})"
                                   if run.info.status == "KILLED" and "stopped_by" in tags else "")
        if "error" in tags:
            ended += f": {tags['error'].strip().splitlines()[0][:300]}"
        history = [*filter(None, tags.get("attempts", "").splitlines()),
                   f"attempt {int(tags.get('restarts') or 0) + 1}: {ended}"]
        self._mlflow.set_tag(self.run_id, "attempts", "\n".join(history)[-5000:])
        if "error" in tags:
            self._mlflow.delete_tag(self.run_id, "error")

    def _log_dataset(self, d: DatasetInput) -> None:
        """The data set as the run's input: name, digest, tensor schema and profile."""
        from mlflow.entities import Dataset, InputTag
        from mlflow.entities import DatasetInput as MlflowDatasetInput

        spec = {"features": [{"type": "tensor", "tensor-spec": {
                    "dtype": d.features_dtype, "shape": [-1, *d.features_shape[1:]]}}],
                "targets": [{"type": "tensor", "tensor-spec": {"dtype": "int64", "shape": [-1]}}]}
        profile = {"num_rows": d.num_rows, "features_shape": d.features_shape,
                   "targets_shape": [d.num_rows]}
        dataset = Dataset(name=d.name, digest=d.digest, source_type="code",
                          source=json.dumps({"dataset": d.name}),
                          schema=json.dumps({"mlflow_tensorspec": {
                              k: json.dumps(v) for k, v in spec.items()}}),
                          profile=json.dumps(profile))
        context = InputTag(key="mlflow.data.context", value=d.context)
        self._mlflow.log_inputs(self.run_id,
                                datasets=[MlflowDatasetInput(dataset, tags=[context])])
