"""Everything rank 0 shows or records, decided in one place.

`open_reporter` gives rank 0 a Reporter (progress bar or log lines, plus the MLflow run) and
every other rank a NullReporter, so the training loop calls the same methods on every rank and
never asks which rank it is.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from train import system_stats
from train.config import TrackingConfig
from train.distenv import DistEnv
from train.metrics import Reduced
from train.tracking import REPO_ROOT, NullTracker, embedded_uri, flatten, open_tracker

log = logging.getLogger("train")
T = TypeVar("T")


class NullReporter:
    tracker: NullTracker = NullTracker()
    class_names: list[str] = []
    final_metrics: dict[str, float] = {}

    def start(self, **run_info: Any) -> None: ...
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def save_model(self, model: Any, output_dir: Path, input_example: Any) -> None: ...
    def log_dataset(self, name: str, source: Any, train_index: Any) -> None: ...
    def step(self, metrics: Mapping[str, float], step: int) -> None: ...
    def epoch(self, epoch: int, *, train: Reduced | None, val: Reduced | None,
              train_time_s: float, epoch_time_s: float, lr: float,
              nodes: list[Any] | None = None) -> None: ...
    def finish(self, error: str | None = None) -> None: ...
    def first_step_done(self) -> None: ...
    def write_checkpoint(self, checkpointer: Any, build: Any) -> None: ...
    def preempted(self, signal_name: str, max_requeues: int) -> None: ...
    def write_summary(self, output_dir: Path, peak_rss_mb: list[float] | None) -> None: ...

    def progress(self, batches: Iterable[T], epoch: int, total: int) -> Iterable[T]:
        return batches

    def postfix(self, **values: float) -> None: ...


class Reporter(NullReporter):
    def __init__(self, tracking: TrackingConfig, epochs: int, output_dir: Path) -> None:
        self.tracker = open_tracker(tracking, output_dir / "mlflow_run.json")
        self.log_model = tracking.log_model
        self.output_dir = output_dir
        self.class_names: list[str] = []
        self.epochs = epochs
        self.interactive = sys.stderr.isatty()
        self.final_metrics = {}
        self.first_step_at: float | None = None
        self.restarts = 0
        self.config_yaml = ""
        self._bar: Any = None

    def start(self, *, config: Mapping[str, Any], ranks: list[dict[str, str]] | None,
              backend: str, env: DistEnv, output_dir: Path, run_name: str | None,
              config_yaml: str, command: str, resume: str, checkpoint_run_id: str | None,
              checkpoint_restarts: int | None) -> None:
        assert ranks is not None, "rank 0 holds every rank's host and device"
        self.config_yaml = config_yaml
        # A restarted job (Slurm requeue, or the same output directory again) continues its run.
        previous = checkpoint_run_id or (None if resume == "never" else recorded_run_id(output_dir))
        if previous:
            self.restarts = (checkpoint_restarts or 0) + 1
        params = flatten(config)
        tags = {"world_size": env.world_size, "launcher": env.launcher, "backend": backend,
                "hostnames": ",".join(sorted({r["host"] for r in ranks})),
                "devices": ",".join(sorted({r["device"] for r in ranks})),
                "torch_version": torch_version(), "git_commit": git_commit(),
                "command": command,
                "output_dir": str(output_dir), "restarts": self.restarts, **slurm_tags(ranks)}
        self.tracker.start(params=params, tags=tags, config_yaml=config_yaml, run_name=run_name,
                           resume_run_id=previous)
        if previous:
            log.info("continuing MLflow run %s (restart %d)", previous, self.restarts)
        log.info("training on %d rank(s) (%s, %s) over %s", env.world_size, backend,
                 tags["devices"], tags["hostnames"])

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.tracker.log_params({k: str(v) for k, v in params.items()})
        log.info("data: %s", ", ".join(f"{k}={v}" for k, v in params.items()))

    def log_dataset(self, name: str, source: Any, train_index: Any) -> None:
        if self.restarts:
            return  # recorded by the first start
        self.tracker.log_dataset(f"{name}-train", source.images[train_index].cpu().numpy(),
                                 source.labels[train_index].cpu().numpy())

    def save_model(self, model: Any, output_dir: Path, input_example: Any) -> None:
        """Final weights beside the job's outputs and in the run, and the model as MLflow model."""
        import torch

        bare = getattr(model, "module", model)
        path = output_dir / "model.pt"
        torch.save(bare.state_dict(), path)
        self.tracker.log_file(path, "weights")
        if self.log_model:
            self.tracker.log_model(bare, input_example)

    def step(self, metrics: Mapping[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step)
        self.postfix(loss=metrics["train/step_loss"])

    def progress(self, batches: Iterable[T], epoch: int, total: int) -> Iterator[T]:
        if not self.interactive:
            yield from batches
            return
        from tqdm import tqdm

        with tqdm(batches, total=total, desc=f"epoch {epoch + 1}/{self.epochs}", leave=False,
                  dynamic_ncols=True, file=sys.stderr) as bar:
            self._bar = bar
            yield from bar
        self._bar = None

    def postfix(self, **values: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)

    def epoch(self, epoch: int, *, train: Reduced | None, val: Reduced | None,
              train_time_s: float, epoch_time_s: float, lr: float,
              nodes: list[Any] | None = None) -> None:
        assert train is not None, "rank 0 always holds the reduced metrics"
        metrics = {"train/loss": train.loss, "train/accuracy": train.accuracy,
                   "train/samples": float(train.samples),
                   "train/samples_per_sec": train.samples / train_time_s,
                   "lr": lr, "epoch_time_s": epoch_time_s}
        if val is not None:
            metrics.update({"val/loss": val.loss, "val/accuracy": val.accuracy,
                            "val/samples": float(val.samples)})
            if val.confusion is not None:
                self.tracker.log_confusion(val.confusion, self.class_names, self.output_dir)
        if nodes:
            self.tracker.log_metrics(system_stats.as_metrics(nodes), step=epoch)
        self.tracker.log_metrics(metrics, step=epoch)
        self.final_metrics.update(metrics)
        shown = "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                          if k in ("train/loss", "train/accuracy", "val/loss", "val/accuracy",
                                   "train/samples_per_sec", "epoch_time_s"))
        log.info("epoch %d/%d  %s", epoch + 1, self.epochs, shown)

    def first_step_done(self) -> None:
        self.first_step_at = time.time()

    def write_checkpoint(self, checkpointer: Any, build: Any) -> None:
        # Everything logged so far reaches MLflow before the checkpoint exists: what a crash
        # can lose is then only what a resume from this checkpoint replays (and logs once).
        self.tracker.flush()
        state = build()
        state.update(run_id=self.tracker.run_id, config=self.config_yaml, restarts=self.restarts)
        path = checkpointer.write(state)
        log.info("checkpoint %s (epoch %d, step %d)", path, state["epoch"], state["step"])

    def preempted(self, signal_name: str, max_requeues: int) -> None:
        """Stopped after a checkpoint: the run waits as KILLED until the job runs again.

        USR2 is Slurm's warning before the time limit: the job requeues itself (same job id).
        TERM comes from a preemption or `scontrol requeue`, where Slurm requeues the job.
        """
        self.tracker.set_tags({"stopped_by": signal_name})
        self.tracker.finish(status="KILLED")
        job = requeue_target()
        if signal_name == "SIGUSR2" and job is not None:
            if self.restarts >= max_requeues:
                log.error("time limit reached %d times (cluster.max_requeues): not requeueing",
                          self.restarts + 1)
                return
            log.warning("requeueing Slurm job %s; it resumes from the checkpoint", job)
            subprocess.run(["scontrol", "requeue", job], check=False, timeout=60)

    def write_summary(self, output_dir: Path, peak_rss_mb: list[float] | None) -> None:
        """summary.json beside the job's outputs: what scripts (and `make bench`) read back."""
        assert peak_rss_mb is not None, "rank 0 holds every rank's peak memory"
        self.tracker.log_metrics({"peak_rss_mb_max": max(peak_rss_mb)}, step=self.epochs)
        self.tracker.flush()
        summary = {"run_id": self.tracker.run_id, "metrics": self.final_metrics,
                   "first_step_at": self.first_step_at, "peak_rss_mb": peak_rss_mb}
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    def finish(self, error: str | None = None) -> None:
        self.tracker.finish(error)
        run_id = self.tracker.run_id
        if run_id and error is None:
            shown = "  ".join(f"{k}={v:.4g}" for k, v in self.final_metrics.items()
                              if k.startswith("val/") or k == "train/loss")
            log.info("MLflow run %s FINISHED  %s\n  view it: %s", run_id, shown,
                     how_to_view(self.tracker.uri, self.tracker.experiment_id, run_id))
        elif run_id:
            log.error("MLflow run %s marked FAILED: %s", run_id, error)


def how_to_view(uri: str, experiment_id: str | None, run_id: str) -> str:
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}"
    if uri == embedded_uri():
        return f"`make ui`, then http://127.0.0.1:5000/{page}"
    return f"`mlflow ui --backend-store-uri {uri}`, then http://127.0.0.1:5000/{page}"


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def recorded_run_id(output_dir: Path) -> str | None:
    """The run an earlier start of this job (same output directory) created, if any."""
    try:
        return str(json.loads((output_dir / "mlflow_run.json").read_text())["run_id"])
    except (OSError, ValueError, KeyError):
        return None


def requeue_target() -> str | None:
    """This Slurm job's id as `scontrol requeue` wants it (array tasks included)."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def slurm_tags(ranks: list[dict[str, str]]) -> dict[str, str]:
    """Where a Slurm job ran; empty outside Slurm."""
    if "SLURM_JOB_ID" not in os.environ:
        return {}
    tags = {"slurm.job_id": os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"]),
            "slurm.nodes": ",".join(sorted({r["host"] for r in ranks})),
            "slurm.partition": os.environ.get("SLURM_JOB_PARTITION", "")}
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        tags["slurm.array_task_id"] = os.environ["SLURM_ARRAY_TASK_ID"]
    return tags


def open_reporter(tracking: TrackingConfig, epochs: int, is_main: bool,
                  output_dir: Path) -> NullReporter:
    return Reporter(tracking, epochs, output_dir) if is_main else NullReporter()
