"""The tracking group's typed config (MLflow): where and how a job records its run."""

from __future__ import annotations

from dataclasses import dataclass


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
