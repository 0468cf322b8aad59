"""MLflow requests: the only module that imports mlflow (lazily: the import costs ~1.6 s).

- `prepare()` runs in the process that submits a job (Slurm, sweeps), before any rank starts:
  it initialises (migrates) a new SQLite store and creates the experiment once, so that
  parallel jobs never race on either.
- `Sender` makes the requests of one run: rank 0's tracker (train/tracker.py), the sweep's
  parent run (train/sweep.py) and `python -m train.outbox upload` go through it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from train.config import TrackingConfig
from train.outbox import Batch, Record
from train.store import (
    artifact_location,
    check_reachable,
    is_new_sqlite,
    resolve_uri,
    sqlite_path,
)


def initialise(uri: str) -> None:
    """Create and migrate a new SQLite store, once: a lock file beside it makes concurrent
    first users (two jobs started together) wait for the first instead of corrupting it."""
    import fcntl

    from mlflow import MlflowClient

    db = sqlite_path(uri)
    assert db is not None, "only SQLite stores are initialised here"
    with open(db.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # migrates
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(cfg: TrackingConfig) -> str:
    """Check the store, migrate it if new, and return the experiment id (created if needed)."""
    uri = resolve_uri(cfg)
    check_reachable(uri)
    if is_new_sqlite(uri):
        initialise(uri)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return cfg.experiment_id or experiment_id_for(client, cfg.experiment, uri)


def experiment_id_for(client: Any, name: str, uri: str) -> str:
    """The experiment's id, created if it does not exist yet (also when another process
    creates it at the same moment: then its id)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(client.create_experiment(name, artifact_location(uri)))
    except MlflowException:  # created meanwhile by someone else
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


# -- one run, fed by rank 0 ------------------------------------------------------------------

class Sender:
    """Does what a Record or a Batch asks, against one MLflow run (also for `upload`)."""

    def __init__(self, uri: str, run_id: str | None = None) -> None:
        from mlflow import MlflowClient

        if is_new_sqlite(uri):  # the first run into a new store (another may start with it)
            initialise(uri)
        self.uri, self.run_id = uri, run_id
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment_id: str | None = None
        self.logged_until: dict[str, int] = {}
        """Per metric, the last step the run already holds (a resumed run replays steps)."""

    def rows(self, batch: Batch) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics = [m for m in batch.metrics if m[3] > self.logged_until.get(m[0], -1)]
        self.client.log_batch(self.run_id, metrics=[Metric(*m) for m in metrics],
                              params=[Param(k, v[:6000]) for k, v in batch.params],
                              tags=[RunTag(k, v[:5000]) for k, v in batch.tags],
                              synchronous=True)

    def record(self, r: Record) -> None:
        getattr(self, f"_{r.kind}")(**r.data)

    def _create(self, experiment_id: str | None, experiment: str, run_name: str | None,
                tags: dict[str, str]) -> None:
        if experiment_id is None:  # a local job: the launcher left the experiment to rank 0
            experiment_id = experiment_id_for(self.client, experiment, self.uri)
        run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
        self.run_id, self.experiment_id = run.info.run_id, str(experiment_id)

    def _resume(self, run_id: str) -> None:
        run = self.client.get_run(run_id)
        self.run_id, self.experiment_id = run_id, run.info.experiment_id
        for key in run.data.metrics:  # each epoch and step must appear once in each history
            steps = [m.step for m in self.client.get_metric_history(run_id, key)]
            self.logged_until[key] = max(steps, default=-1)
        self.client.update_run(run_id, status="RUNNING")

    def _file(self, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path)

    def _text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def _confusion(self, confusion: list[list[int]], class_names: list[str],
                   out_dir: str) -> None:
        from train.figures import per_class_accuracy, render_confusion

        image = render_confusion(confusion, class_names, Path(out_dir) / "confusion_matrix.svg")
        self.client.log_artifact(self.run_id, str(image))
        self.client.log_table(self.run_id, per_class_accuracy(confusion, class_names),
                              "per_class_accuracy.json")

    def _dataset(self, name: str, images: Any, labels: Any, rows: Any) -> None:
        """The training split as the run's input: name, digest, shapes. Built from views of the
        in-memory data set (no copy of it on the CPU, no numpy/pandas data set object)."""
        import hashlib
        import json

        from mlflow.entities import Dataset, DatasetInput, InputTag

        digest = hashlib.sha256()
        for tensor in (images, labels, rows):  # the data and which rows train: the split
            digest.update(tensor.detach().cpu().contiguous().numpy().data)
        n = len(rows)
        spec = {"features": [{"type": "tensor", "tensor-spec": {
                    "dtype": str(images.dtype).removeprefix("torch."),
                    "shape": [-1, *images.shape[1:]]}}],
                "targets": [{"type": "tensor", "tensor-spec": {"dtype": "int64", "shape": [-1]}}]}
        profile = {"num_rows": n, "features_shape": [n, *images.shape[1:]], "targets_shape": [n]}
        dataset = Dataset(name=name, digest=digest.hexdigest()[:8], source_type="code",
                          source=json.dumps({"dataset": name}),
                          schema=json.dumps({"mlflow_tensorspec": {
                              k: json.dumps(v) for k, v in spec.items()}}),
                          profile=json.dumps(profile))
        context = InputTag(key="mlflow.data.context", value="training")
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(dataset, tags=[context])])

    def _model(self, model: Any, input_example: Any) -> None:
        """An MLflow model that loads back with mlflow.pytorch.load_model. Pickle format: the
        default torch.export format fixes the batch size of the example."""
        import mlflow
        import mlflow.pytorch
        import torch

        # The fluent API wants a tracking URI and an active run; set_tracking_uri also sets
        # MLFLOW_TRACKING_URI, which is put back so that nothing after this job sees it.
        before = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.uri)
        mlflow.start_run(run_id=self.run_id)
        # Its warning about pickle is for models from strangers; this one is our own.
        logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)
        try:
            mlflow.pytorch.log_model(
                model, name="model", serialization_format="pickle", input_example=input_example,
                # explicit: inferring requirements imports the model in a subprocess (slow)
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
        finally:
            mlflow.end_run()  # no active run left behind; "end" sets the real status next
            if before is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = before

    def _end(self, status: str, error: str | None = None) -> None:
        if error is not None:
            self.rows(Batch(tags=[("error", error[-5000:])]))
        self.client.set_terminated(self.run_id, status)
