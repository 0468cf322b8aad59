"""MLflow tracking: the only module that imports mlflow.

Two halves:
- `prepare()` runs in the process that launches or submits the job, before any rank starts: it
  checks the tracking URI is reachable, initialises (migrates) an embedded SQLite store and
  creates the experiment, so parallel ranks or jobs never race on either.
- `RunTracker` lives on rank 0 only (`open_tracker` decides, in one place). It sends everything
  from one background thread, one batched request per logging point, so the training loop never
  waits on MLflow; a request that fails is retried until the server answers again.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from train.config import TrackingConfig

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_STORE_DIR = REPO_ROOT / "mlruns"
"""The embedded store: mlruns/mlflow.db (runs, params, metrics) and mlruns/artifacts/."""


UNSENT_FILE = "mlflow_unsent.jsonl"
"""Metrics MLflow did not accept before the run ended, for `python -m train.tracking upload`."""


class TrackingError(RuntimeError):
    """The tracking store cannot be used; the message says why and what to do."""


def embedded_uri() -> str:
    return f"sqlite:///{EMBEDDED_STORE_DIR / 'mlflow.db'}"


def resolve_uri(cfg: TrackingConfig) -> str:
    return cfg.uri or embedded_uri()


def is_local_path_uri(uri: str) -> bool:
    """A store that lives in this machine's filesystem (compute nodes must share it)."""
    return uri.startswith(("sqlite:", "file:", "/")) or "://" not in uri


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Refuse an unusable tracking URI before any rank starts (no mlflow import needed)."""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as r:
                if r.status == 200:
                    return
                problem = f"it answered HTTP {r.status}"
        except (urllib.error.URLError, OSError) as e:
            problem = f"it cannot be reached ({getattr(e, 'reason', e)})"
        raise TrackingError(
            f"MLflow tracking server {uri} is not usable: {problem}. Start it (`make "
            "mlflow-server`), fix MLFLOW_TRACKING_URI / tracking.uri, or run with "
            "tracking.enabled=false.")
    if uri.startswith("sqlite:///"):
        directory = Path(uri.removeprefix("sqlite:///")).parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"Cannot create the MLflow store directory {directory}: {e}.") \
                from None
        if not os.access(directory, os.W_OK):
            raise TrackingError(f"The MLflow store directory {directory} is not writable.")


def _artifact_location(uri: str) -> str | None:
    # The embedded store keeps artifacts beside its database, not in the caller's cwd.
    return (EMBEDDED_STORE_DIR / "artifacts").as_uri() if uri == embedded_uri() else None


def prepare(cfg: TrackingConfig) -> str:
    """Check the store, migrate it if new, and return the experiment id (created if needed)."""
    uri = resolve_uri(cfg)
    check_reachable(uri)
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=uri)
    if cfg.experiment_id:
        return cfg.experiment_id
    experiment = client.get_experiment_by_name(cfg.experiment)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(client.create_experiment(cfg.experiment, _artifact_location(uri)))
    except MlflowException:  # created meanwhile by someone else
        experiment = client.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


# -- sweeps: one parent run, created by the submitting process, every job a child -------------

def start_parent_run(cfg: TrackingConfig, experiment_id: str, tags: Mapping[str, str]) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=resolve_uri(cfg))
    run = client.create_run(experiment_id, tags=dict(tags), run_name=cfg.run_name)
    return str(run.info.run_id)


def end_parent_run(cfg: TrackingConfig, parent_run_id: str, objective: str,
                   direction: str) -> dict[str, Any]:
    """Summarise the children on the parent (best objective, failures) and end it."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    client = MlflowClient(tracking_uri=resolve_uri(cfg))
    parent = client.get_run(parent_run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
                                  max_results=10000)
    failed = [c for c in children if c.info.status != "FINISHED"]
    scored = [c for c in children if objective in c.data.metrics]
    summary: dict[str, Any] = {"children": len(children), "failed": len(failed)}
    now = int(time.time() * 1000)
    metrics = [Metric("sweep/children", len(children), now, 0),
               Metric("sweep/failed_children", len(failed), now, 0)]
    tags = []
    if scored:
        pick = max if direction == "maximize" else min
        best = pick(scored, key=lambda c: c.data.metrics[objective])
        summary.update(best_run_id=best.info.run_id, best_value=best.data.metrics[objective])
        metrics.append(Metric(f"best/{objective}", best.data.metrics[objective], now, 0))
        tags.append(RunTag("best_run_id", best.info.run_id))
    client.log_batch(parent_run_id, metrics=metrics, tags=tags)
    client.set_terminated(parent_run_id, "FAILED" if failed or not children else "FINISHED")
    return summary


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 0.1}} -> {"optim.lr": "0.1"}; lists and None as their text."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)
    return flat


class NullTracker:
    """What every rank but 0 (and a run with tracking.enabled=false) gets."""

    run_id: str | None = None
    experiment_id: str | None = None
    uri = ""

    def start(self, **_: Any) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_params(self, params: Mapping[str, str]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_file(self, path: Path, artifact_path: str | None = None) -> None: ...
    def log_dataset(self, name: str, features: Any, targets: Any) -> None: ...
    def log_confusion(self, confusion: list[list[int]], class_names: list[str],
                      out_dir: Path) -> None: ...
    def log_model(self, model: Any, input_example: Any) -> None: ...
    def flush(self) -> None: ...
    def finish(self, error: str | None = None, status: str | None = None) -> None: ...


class RunTracker(NullTracker):
    """One MLflow run, fed from a background thread in the order calls were made."""

    def __init__(self, cfg: TrackingConfig, run_id_file: Path | None) -> None:
        self.cfg = cfg
        self.uri = resolve_uri(cfg)
        self.run_id_file = run_id_file
        self.run_id: str | None = None
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="mlflow-sender", daemon=True)
        self._sender.start()
        self._client: Any = None
        self._started = False
        self._logged_until: dict[str, int] = {}
        # Metric rows not yet accepted by MLflow, by batch: what an outage could still lose.
        self._unsent: dict[int, list[tuple[str, float, int, int]]] = {}
        self._unsent_lock = threading.Lock()
        self._batches = 0

    # -- called by the training loop: never blocks on MLflow --------------------------------
    def start(self, *, params: Mapping[str, str], tags: Mapping[str, Any], config_yaml: str,
              run_name: str | None, resume_run_id: str | None = None) -> None:
        """Create the run, or continue `resume_run_id` (a restarted job) as RUNNING again."""
        self._started = True
        if resume_run_id:
            self._queue.put(lambda: self._resume_run(resume_run_id, tags))
        else:
            self._queue.put(lambda: self._create_run(params, tags, config_yaml, run_name))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from_tags = [(k, str(v)) for k, v in tags.items()]
        self._queue.put(lambda: self._log_batch(tags=from_tags))

    def log_params(self, params: Mapping[str, str]) -> None:
        rows = [(k, v[:6000]) for k, v in params.items()]
        self._queue.put(lambda: self._log_batch(params=rows))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        rows = [(k, float(v), stamp, step) for k, v in metrics.items()]
        with self._unsent_lock:
            self._batches += 1
            batch = self._batches
            self._unsent[batch] = rows

        def send() -> None:
            self._log_batch(metrics=rows)
            with self._unsent_lock:
                del self._unsent[batch]

        self._queue.put(send)

    def log_file(self, path: Path, artifact_path: str | None = None) -> None:
        self._queue.put(lambda: self._client.log_artifact(self.run_id, str(path), artifact_path))

    def log_dataset(self, name: str, features: Any, targets: Any) -> None:
        """The training data as an MLflow input (name, digest, size) - numpy arrays."""
        def send() -> None:
            import mlflow.data
            from mlflow.entities import DatasetInput, InputTag

            dataset = mlflow.data.from_numpy(features, targets=targets, name=name)
            context = InputTag(key="mlflow.data.context", value="training")
            self._client.log_inputs(self.run_id, datasets=[
                DatasetInput(dataset=dataset._to_mlflow_entity(), tags=[context])])

        self._queue.put(send)

    def log_confusion(self, confusion: list[list[int]], class_names: list[str],
                      out_dir: Path) -> None:
        """Confusion-matrix image and per-class accuracy table of the final validation."""
        def send() -> None:
            from train.figures import per_class_accuracy, render_confusion

            png = render_confusion(confusion, class_names, out_dir / "confusion_matrix.png")
            self._client.log_artifact(self.run_id, str(png))
            self._client.log_table(self.run_id, per_class_accuracy(confusion, class_names),
                                   "per_class_accuracy.json")

        self._queue.put(send)

    def log_model(self, model: Any, input_example: Any) -> None:
        """The trained model as an MLflow model that loads back with mlflow.pytorch.load_model.

        Pickle format: the default torch.export format fixes the batch size of the example.
        """
        def send() -> None:
            import mlflow
            import mlflow.pytorch
            import torch

            mlflow.set_tracking_uri(self.uri)
            mlflow.start_run(run_id=self.run_id)
            # Its warning about pickle is for models from strangers; this one is our own.
            logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)
            try:
                mlflow.pytorch.log_model(
                    model, name="model", serialization_format="pickle",
                    input_example=input_example,
                    # explicit: inferring requirements imports the model in a subprocess (slow)
                    pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
            finally:
                # Leaves no active run behind; finish() sets the run's real final status next.
                mlflow.end_run()

        self._queue.put(send)

    def flush(self) -> None:
        """Wait until everything queued so far has been sent (the run id is known after it)."""
        done = threading.Event()
        self._queue.put(done.set)
        if not done.wait(self.cfg.flush_timeout_s):
            log.warning("MLflow has not accepted this run's updates for %.0f s; going on, they "
                        "stay queued", self.cfg.flush_timeout_s)

    def finish(self, error: str | None = None, status: str | None = None) -> None:
        """End the run FINISHED, or FAILED with `error` as a tag (or `status`, e.g. KILLED);
        waits for the queue to drain."""
        if not self._started:
            self._queue.put(None)
            return

        def end() -> None:
            if error is not None:
                self._log_batch(tags=[("error", error[-5000:])])
            self._client.set_terminated(self.run_id, status or ("FAILED" if error else "FINISHED"))

        self._queue.put(end)
        self._queue.put(None)
        self._sender.join(timeout=self.cfg.flush_timeout_s)
        if self._sender.is_alive():
            self._save_unsent(status or ("FAILED" if error else "FINISHED"))

    def _save_unsent(self, status: str) -> None:
        """Keep what MLflow did not take in a local file, with the command that delivers it."""
        with self._unsent_lock:
            rows = [row for batch in sorted(self._unsent) for row in self._unsent[batch]]
        if self.run_id is None or self.run_id_file is None:
            log.error("MLflow never answered: this job has no run, and %d metric values were not "
                      "recorded.", len(rows))
            return
        path = self.run_id_file.parent / UNSENT_FILE
        with open(path, "w") as f:
            f.write(json.dumps({"run_id": self.run_id, "tracking_uri": self.uri,
                                "status": status}) + "\n")
            for row in rows:
                f.write(json.dumps(row) + "\n")
        log.error("MLflow did not accept %d metric values within %.0f s (tracking.flush_timeout_s)"
                  "; they are in %s. Deliver them (and end the run %s) once the server is back:\n"
                  "  python -m train.tracking upload %s", len(rows), self.cfg.flush_timeout_s,
                  path, status, path)

    # -- the sender thread --------------------------------------------------------------------
    def _send_loop(self) -> None:
        while (task := self._queue.get()) is not None:
            delay = 0.5
            while True:
                try:
                    task()
                    break
                except Exception as e:  # noqa: BLE001 - a tracking outage must not stop training
                    log.warning("MLflow request failed (%s); retrying in %.0f s", e, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, 30.0)

    def _create_run(self, params: Mapping[str, str], tags: Mapping[str, Any], config_yaml: str,
                    run_name: str | None) -> None:
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self.uri)
        experiment_id = prepare(self.cfg)
        run_tags = {k: str(v) for k, v in tags.items()}
        if self.cfg.parent_run_id:  # a job of a sweep
            run_tags["mlflow.parentRunId"] = self.cfg.parent_run_id
        run = self._client.create_run(experiment_id, run_name=run_name, tags=run_tags)
        self.run_id, self.experiment_id = run.info.run_id, experiment_id
        self._write_run_id_file(experiment_id)
        items = [(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per request
            self._log_batch(params=items[i:i + 100])
        self._client.log_text(self.run_id, config_yaml, "config.yaml")

    def _resume_run(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self.uri)
        run = self._client.get_run(run_id)
        self.run_id, self.experiment_id = run_id, run.info.experiment_id
        # What the run already holds is not logged again: after a restart the job replays the
        # steps since its last checkpoint, and each step must appear once in each history.
        for key in run.data.metrics:
            steps = [m.step for m in self._client.get_metric_history(run_id, key)]
            self._logged_until[key] = max(steps, default=-1)
        self._client.update_run(run_id, status="RUNNING")
        self._log_batch(tags=[(k, str(v)) for k, v in tags.items()])
        self._write_run_id_file(run.info.experiment_id)

    def _write_run_id_file(self, experiment_id: str) -> None:
        if self.run_id_file is not None:
            self.run_id_file.write_text(json.dumps(
                {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": self.uri}))

    def _log_batch(self, metrics: list[tuple[str, float, int, int]] = (),  # type: ignore[assignment]
                   params: list[tuple[str, str]] = (),  # type: ignore[assignment]
                   tags: list[tuple[str, str]] = ()) -> None:  # type: ignore[assignment]
        from mlflow.entities import Metric, Param, RunTag

        metrics = [m for m in metrics if m[3] > self._logged_until.get(m[0], -1)]
        self._client.log_batch(self.run_id, metrics=[Metric(*m) for m in metrics],
                               params=[Param(*p) for p in params],
                               tags=[RunTag(*t) for t in tags], synchronous=True)


def open_tracker(cfg: TrackingConfig, run_id_file: Path | None) -> NullTracker:
    """For rank 0 (see report.open_reporter): MLflow unless tracking.enabled=false."""
    return RunTracker(cfg, run_id_file) if cfg.enabled else NullTracker()


def upload(path: Path) -> None:
    """Deliver an mlflow_unsent.jsonl: its metrics (in batches), then the run's final status."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    rows = [Metric(*json.loads(line)) for line in lines[1:]]
    client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI",
                                                      header["tracking_uri"]))
    for i in range(0, len(rows), 1000):  # MLflow takes at most 1000 metrics per request
        client.log_batch(header["run_id"], metrics=rows[i:i + 1000])
    client.set_terminated(header["run_id"], header["status"])
    path.rename(path.with_suffix(".uploaded"))
    print(f"delivered {len(rows)} metric values to run {header['run_id']} "
          f"({header['status']})")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m train.tracking")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("upload", help="deliver a job's mlflow_unsent.jsonl").add_argument(
        "file", type=Path)
    upload(parser.parse_args().file)
