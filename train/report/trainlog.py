"""What the training loop reports as it goes, on every rank alike: the progress bar, logging
steps, fp16's loss scale, epoch metrics, a new best evaluation and the test phase's metrics.

Part of the job's run logger (train/report/runlog.py holds one as `RunLogger.training`), over the
same
backend: rank 0's MlflowRun, every other rank's do-nothing NullRun. It keeps what summary.json
reports of training (the final metrics, each epoch's throughput, the first step's time).

MLflow steps: an epoch's metrics (train/*, val/*, best/*, test/*, system/*) are logged at the
epoch's 1-based number, as the log's `epoch 3/10` and the best_epoch tag; a logging step's
(train/step_*, time/* - where the step time went -, fp16's train/loss_scale) at its optimiser
step. The loop counts epochs from 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from train.config.groups import TrainConfig
from train.report import flops, system_stats
from train.report.breakdown import Verdict
from train.report.metrics import Reduced, StepSync
from train.report.progress import Progress
from train.tracking import NullRun

log = logging.getLogger("train")
T = TypeVar("T")
SHOWN = ("train/loss", "train/accuracy", "val/loss", "val/accuracy", "val/mse", "val/r2",
         "val/miou", "val/perplexity", "train/samples_per_sec", "train/tokens_per_sec",
         "train/mfu", "epoch_time_s")


class TrainingLog:
    def __init__(self, cfg: TrainConfig, run: NullRun, progress: Progress) -> None:
        self.cfg, self.run, self.bar = cfg, run, progress
        self.throughput: flops.Throughput | None = None
        """Set once the model exists (train/engine/prepare.py): train/tflops_per_sec, train/mfu."""
        self.final_metrics: dict[str, float] = {}
        self.by_epoch: list[dict[str, float]] = []  # each epoch this start trained
        self.first_step_at: float | None = None

    def progress(self, batches: Iterable[T], epoch: int) -> Iterator[T]:
        return self.bar.over(batches, epoch, len(batches))  # type: ignore[arg-type]

    def first_step(self) -> None:
        self.first_step_at = time.time()
        self.run.begin_sending()  # training is under way: MLflow may take its share now

    def step(self, step: int, sync: StepSync, grad_norm: float | None = None,
             times: dict[str, float] | None = None) -> None:
        """A logging step; `grad_norm`: the total gradient norm before clipping
        (optim.grad_clip), None without clipping; `times`: where the interval's step time
        went (train/report/breakdown.py's time/* metrics)."""
        values = {"train/step_loss": sync.mean_loss, "train/step_time_max_s": sync.slowest_s,
                  "train/step_time_min_s": sync.fastest_s, **(times or {})}
        if grad_norm is not None:
            values["train/grad_norm"] = grad_norm
        self.run.log_metrics(values, step)
        self.bar.show(loss=sync.mean_loss)

    def bottleneck(self, verdict: Verdict) -> None:
        """At the end of training: what held it back (the `bottleneck` tag) and what to try."""
        self.run.set_tags({"bottleneck": verdict.bottleneck, "bottleneck_hint": verdict.line})
        log.info("bottleneck: %s - %s", verdict.bottleneck, verdict.line)

    def grad_scaler(self, step: int, skipped_steps: int, loss_scale: float) -> None:
        """fp16: optimiser steps skipped so far (their gradients overflowed) and the loss scale."""
        self.run.log_metrics({"train/skipped_steps": float(skipped_steps),
                              "train/loss_scale": loss_scale}, step)

    def epoch(self, epoch: int, *, train: Reduced, val: Reduced | None, train_time_s: float,
              epoch_time_s: float, lrs: dict[str, float], train_cpu_s: float = 0.0,
              nodes: list[Any] | None = None, profiled: tuple[int, float] = (0, 0.0),
              val_time_s: float = 0.0) -> None:
        """`lrs`: `lr` and each optim.param_groups group's `lr/<prefix>` (TrainState);
        `val_time_s`: how long the evaluation took (val/samples_per_sec);
        `train_cpu_s`: this process's CPU time while it trained (summary.json only);
        `profiled`: the samples and seconds of the steps trainer.profile watched, left out of
        the rates (profiling slows them)."""
        rate_samples, rate_s = train.samples - profiled[0], train_time_s - profiled[1]
        if rate_samples <= 0 or rate_s <= 0:  # the whole epoch was profiled
            rate_samples, rate_s = train.samples, train_time_s
        values = {**_named("train", train.values), "train/samples": float(train.samples),
                  "train/samples_per_sec": rate_samples / rate_s,
                  **lrs, "epoch_time_s": epoch_time_s,
                  **(self.throughput.metrics(rate_samples, rate_s) if self.throughput else {})}
        values.update(_items(train, "train", rate_s * train.samples / rate_samples))
        if val is not None:
            values.update({**_named("val", val.values), "val/samples": float(val.samples),
                           **_items(val, "val")})
            if val_time_s > 0:  # what `python -m train eval` is compared with (bench/)
                values["val/samples_per_sec"] = val.samples / val_time_s
        if nodes:
            self.run.log_metrics(system_stats.as_metrics(nodes), step=epoch + 1)
        self.run.log_metrics(values, step=epoch + 1)
        self.final_metrics.update(values)
        self.by_epoch.append({"samples_per_sec": values["train/samples_per_sec"],
                              "epoch_time_s": epoch_time_s, "train_cpu_s": train_cpu_s,
                              "tracking_thread_cpu_s": self.run.cpu_seconds})
        shown = "  ".join(f"{k}={v:.4g}" for k, v in values.items() if k in SHOWN)
        log.info("epoch %d/%d  %s", epoch + 1, self.cfg.trainer.epochs, shown)

    def best(self, epoch: int, monitor: str, value: float, path: Path | None) -> None:
        """A new best evaluation after the 0-based `epoch` (written to `path` with
        trainer.save_best); logged and tagged 1-based, as the log line says."""
        self.run.log_metrics({f"best/{monitor}": value}, step=epoch + 1)
        self.run.set_tags({"best_epoch": str(epoch + 1)})
        log.info("best %s so far: %.4g at epoch %d%s", monitor, value, epoch + 1,
                 f" ({path})" if path else "")

    def test(self, epoch: int, result: Reduced) -> None:
        """The test phase's metrics, once, at the last epoch's step: `epoch` is the number of
        epochs trained, which is the last one's 1-based number."""
        values = {**_named("test", result.values), "test/samples": float(result.samples),
                  **_items(result, "test")}
        self.run.log_metrics(values, step=epoch)
        self.final_metrics.update(values)
        log.info("test: %s", "  ".join(f"{k}={v:.4g}" for k, v in values.items()))


def _items(reduced: Reduced, split: str, seconds: float | None = None) -> dict[str, float]:
    """`<split>/tokens` (and train/tokens_per_sec) where the task counts its items by name."""
    if reduced.items_name is None:
        return {}
    name = f"{split}/{reduced.items_name}"
    return {name: float(reduced.items),
            **({f"{name}_per_sec": reduced.items / seconds} if seconds else {})}


def _named(split: str, values: dict[str, float]) -> dict[str, float]:
    """A phase's metrics under their split's prefix: loss -> val/loss."""
    return {f"{split}/{name}": float(value) for name, value in values.items()}
