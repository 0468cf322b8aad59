"""The tracking group's typed config (MLflow): where and how a job records its run."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

MAX_NAME = 250
"""Longest experiment and run name: MLflow refuses experiment names over 500 characters and
run names over 250, at the first request, after the job has started."""
MAX_MODEL_NAME = 256
"""MLflow stores a registered model's name in a column of 256 characters."""


@dataclass
class TrackingConfig:
    enabled: bool = True
    """Record the job as an MLflow run."""
    uri: str | None = "${oc.env:MLFLOW_TRACKING_URI,null}"
    """Tracking URI; null = the embedded SQLite store at <repo>/mlruns/mlflow.db."""
    experiment: str = "train"
    """MLflow experiment name."""
    experiment_id: str | None = None
    """Handed to every job by the launcher (an override), so jobs never race to create the
    experiment; null = the job finds or creates `experiment` itself."""
    parent_run_id: str | None = None
    """Handed to every job of a sweep by the launcher (an override): its parent run."""
    run_name: str | None = None
    """MLflow run name; null = `<model>-<data>[-<task>]` (train/config/naming.py; a sweep's jobs
    add their number)."""
    rerun_of: str | None = None
    """Set by `python -m train rerun <run_id>` (docs/reproducibility.md): the run this job
    reruns, recorded as the tag `rerun_of`. null = a new job."""
    log_model: bool = True
    """Also log the model with mlflow.pytorch.log_model (the weights are always stored)."""
    register_model: str | None = None
    """Register the job's final model as a new version of this registered model in MLflow's
    Model Registry (needs log_model=true); the run's logged model is then a torch.export program
    that loads without this project (docs/tracking.md, "Model registry"). null = no registration."""
    register_best_of_sweep: bool = False
    """With register_model, in a sweep: register only the best job (trainer.objective,
    trainer.objective_direction) when the sweep ends, instead of every job."""
    system_metrics: bool = False
    """Log CPU, memory and GPU use of every node at every epoch end (system/<node>/...)."""
    batch_interval_s: float = 5.0
    """Metrics, params and tags logged within this many seconds go to MLflow in one request
    (logging every step then costs one request per interval, not one per step); 0 = at once.
    Checkpoints and the end of the run send what is waiting at once."""
    flush_timeout_s: float = 120.0
    """At a checkpoint and at the end, how long to wait for MLflow to accept what is queued;
    what it has not taken by the end is saved to <output dir>/mlflow_unsent.jsonl."""
    checkpoint_flush_s: float = 5.0
    """At a checkpoint and when the job is stopped by a signal, how long to wait for MLflow to
    take what is queued: the other ranks wait in a collective meanwhile (distributed.timeout_s)
    and Slurm kills a stopped job soon. Not taken by then: it stays queued (at a stop, it goes
    to the unsent file)."""

    def problems(self) -> list[str]:
        """What MLflow would refuse only once the job runs (names too long, a registered
        model's name), or cannot be served; each one sentence. Pre-flight's (validation.py)."""
        p = []
        if not 0 < len(self.experiment.strip()) <= MAX_NAME:
            p.append(f"tracking.experiment must be a name of 1 to {MAX_NAME} characters (got "
                     f"{len(self.experiment)}).")
        if self.run_name is not None and len(self.run_name) > MAX_NAME:
            p.append(f"tracking.run_name can have at most {MAX_NAME} characters.")
        if self.checkpoint_flush_s < 0 or self.flush_timeout_s < 0:
            p.append("tracking.checkpoint_flush_s and tracking.flush_timeout_s cannot be "
                     "negative.")
        return p + self._registry_problems()

    def _registry_problems(self) -> list[str]:
        if self.register_model is None:
            return [] if not self.register_best_of_sweep else [
                "tracking.register_best_of_sweep=true needs tracking.register_model=<name>: the "
                "registered model the sweep's best job becomes a version of."]
        p = []
        if (problem := model_name_problem(self.register_model)) is not None:
            p.append(f"tracking.register_model={self.register_model!r} {problem}: give a "
                     "registered model name without / : or ?, e.g. tracking.register_model="
                     "digits-cnn.")
        if not self.log_model:
            p.append("tracking.register_model needs tracking.log_model=true: the registered "
                     "version is the run's logged model.")
        if not self.enabled:
            p.append("tracking.register_model needs tracking.enabled=true: the Model Registry "
                     "is MLflow's.")
        return p


def model_name_problem(name: str) -> str | None:
    """What MLflow's Model Registry (or a models:/<name>/<version> URI) would refuse in a
    registered model's name, else None. MLflow checks it only at registration, after training."""
    if not name.strip():
        return "is empty"
    if len(name) > MAX_MODEL_NAME:
        return f"has {len(name)} characters (at most {MAX_MODEL_NAME})"
    if bad := sorted({c for c in name if c in "/:?"}):
        return f"holds {' '.join(bad)} (a models:/<name>/<version> URI could not name it)"
    if posixpath.normpath(name) != name or name == "." or name.startswith(".."):
        return "would be read as a path (. or ..)"
    return None
