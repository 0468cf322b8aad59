"""Everything rank 0 shows or records, decided in one place.

`open_reporter` gives rank 0 a Reporter (progress bar or log lines, plus the MLflow run) and
every other rank a NullReporter, so the training loop calls the same methods on every rank and
never asks which rank it is.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from train import system_stats
from train.config import TrainConfig
from train.distenv import DistEnv
from train.metrics import Reduced
from train.runinfo import (
    flatten,
    git_commit,
    recorded_run_id,
    requeue_target,
    slurm_tags,
    torch_version,
)
from train.store import how_to_view
from train.tracker import NullTracker, open_tracker

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
    def describe_model(self, model: Any, channels: int, image_size: int, device: Any,
                       precision: str, peak_tflops: float | None, world_size: int) -> None: ...

    def progress(self, batches: Iterable[T], epoch: int, total: int) -> Iterable[T]:
        return batches

    def postfix(self, **values: float) -> None: ...


class Reporter(NullReporter):
    def __init__(self, cfg: TrainConfig, output_dir: Path) -> None:
        self.tracking = cfg.tracking
        self.objective = (cfg.trainer.objective, cfg.trainer.objective_direction)
        self.tracker = open_tracker(cfg.tracking, output_dir / "mlflow_run.json")
        self.log_model = cfg.tracking.log_model
        self.output_dir = output_dir
        self.class_names: list[str] = []
        self.epochs = cfg.trainer.epochs
        self.global_batch = cfg.data.batch_size
        self.interactive = sys.stderr.isatty()
        self.final_metrics = {}
        self.first_step_at: float | None = None
        self.by_epoch: list[dict[str, float]] = []  # each epoch this attempt trained
        self.restarts = 0
        self.config_yaml = ""
        self._bar: Any = None
        self._count_flops: Any = None  # set by describe_model, used once
        self.flops_per_sample: float | None = None
        self.peak_tflops_total: float | None = None

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
        self.tracker.start(tags=tags, run_name=run_name, resume_run_id=previous)
        if previous:
            log.info("continuing MLflow run %s (restart %d)", previous, self.restarts)
        else:  # a resumed run holds them already
            self.tracker.log_params(params)
            self.tracker.log("text", text=config_yaml, artifact_file="config.yaml")
        log.info("training on %d rank(s) (%s, %s) over %s", env.world_size, backend,
                 tags["devices"], tags["hostnames"])

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.tracker.log_params({k: str(v) for k, v in params.items()})
        log.info("data: %s", ", ".join(f"{k}={v}" for k, v in params.items()))

    def log_dataset(self, name: str, source: Any, train_index: Any) -> None:
        if self.restarts:
            return  # recorded by the first start
        self.tracker.log("dataset", name=f"{name}-train", images=source.images,
                         labels=source.labels, rows=train_index)

    def save_model(self, model: Any, output_dir: Path, input_example: Any) -> None:
        """Final weights beside the job's outputs and in the run, and the model as MLflow model."""
        import torch

        bare = getattr(model, "module", model)
        path = output_dir / "model.pt"
        torch.save(bare.state_dict(), path)
        self.tracker.log("file", path=str(path), artifact_path="weights")
        if self.log_model:
            self.tracker.log("model", model=bare, input_example=input_example)

    def describe_model(self, model: Any, channels: int, image_size: int, device: Any,
                       precision: str, peak_tflops: float | None, world_size: int) -> None:
        """What train/tflops_per_sec and train/mfu need; the FLOPs are counted at the first
        epoch end, so that counting (~1 s on a CPU) does not delay the first step."""
        from train import flops

        bare = getattr(model, "module", model)
        self._count_flops = lambda: flops.training_flops_per_sample(bare, channels, image_size)
        peak = flops.peak_tflops(device, precision, peak_tflops)
        self.peak_tflops_total = None if peak is None else peak * world_size

    def throughput(self, samples: int, seconds: float) -> dict[str, float]:
        """Model FLOP rate of all ranks together, and its share of their peak."""
        if self._count_flops is not None:
            self.flops_per_sample, self._count_flops = self._count_flops(), None
        if not self.flops_per_sample or seconds <= 0:
            return {}
        tflops = self.flops_per_sample * samples / seconds / 1e12
        out = {"train/tflops_per_sec": tflops}
        if self.peak_tflops_total:
            out["train/mfu"] = tflops / self.peak_tflops_total
        return out

    def step(self, metrics: Mapping[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step)
        self.postfix(loss=metrics["train/step_loss"])

    def progress(self, batches: Iterable[T], epoch: int, total: int) -> Iterator[T]:
        if not self.interactive:
            yield from batches
            return
        from tqdm import tqdm

        # Counted in samples (the global batch per step), so the rate shown is samples/s.
        with tqdm(batches, total=total, desc=f"epoch {epoch + 1}/{self.epochs}", leave=False,
                  unit="sample", unit_scale=self.global_batch, dynamic_ncols=True,
                  file=sys.stderr) as bar:
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
                   "lr": lr, "epoch_time_s": epoch_time_s,
                   **self.throughput(train.samples, train_time_s)}
        if val is not None:
            metrics.update({"val/loss": val.loss, "val/accuracy": val.accuracy,
                            "val/samples": float(val.samples)})
            if val.confusion is not None:
                self.tracker.log("confusion", confusion=val.confusion,
                                 class_names=self.class_names, out_dir=str(self.output_dir))
        if nodes:
            self.tracker.log_metrics(system_stats.as_metrics(nodes), step=epoch)
        self.tracker.log_metrics(metrics, step=epoch)
        self.final_metrics.update(metrics)
        self.by_epoch.append({"samples_per_sec": metrics["train/samples_per_sec"],
                              "epoch_time_s": epoch_time_s,
                              "tracking_thread_cpu_s": self.tracker.cpu_seconds})
        shown = "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                          if k in ("train/loss", "train/accuracy", "val/loss", "val/accuracy",
                                   "train/samples_per_sec", "train/mfu", "epoch_time_s"))
        log.info("epoch %d/%d  %s", epoch + 1, self.epochs, shown)

    def first_step_done(self) -> None:
        self.first_step_at = time.time()
        self.tracker.begin_sending()  # training is under way: MLflow may take its share now

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
                   "by_epoch": self.by_epoch,
                   "first_step_at": self.first_step_at, "peak_rss_mb": peak_rss_mb}
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    def finish(self, error: str | None = None) -> None:
        self.tracker.finish(error)
        if self.tracking.enabled and self.tracking.parent_run_id:
            self._end_parent_if_last()
        run_id = self.tracker.run_id
        if run_id and error is None:
            shown = "  ".join(f"{k}={v:.4g}" for k, v in self.final_metrics.items()
                              if k.startswith("val/") or k == "train/loss")
            log.info("MLflow run %s FINISHED  %s\n  view it: %s", run_id, shown,
                     how_to_view(self.tracker.uri, self.tracker.experiment_id, run_id))
        elif run_id:
            log.error("MLflow run %s marked FAILED: %s", run_id, error)


    def _end_parent_if_last(self) -> None:
        """A job of a sweep submitted with cluster.wait=false: the last to end ends the parent
        (train/sweep.py); otherwise the submitting process does, and this does nothing."""
        from train.sweep import end_parent_run

        try:
            summary = end_parent_run(self.tracking, self.tracking.parent_run_id or "",
                                     *self.objective, only_if_done=True)
        except Exception as e:  # noqa: BLE001 - the job's own run is complete; say, don't fail
            log.warning("could not summarise the sweep's parent run: %s", e)
            return
        if summary is not None:
            log.info("last job of the sweep: ended parent run %s (%d jobs, %d failed)",
                     self.tracking.parent_run_id, summary["children"], summary["failed"])


def open_reporter(cfg: TrainConfig, is_main: bool, output_dir: Path) -> NullReporter:
    return Reporter(cfg, output_dir) if is_main else NullReporter()
