"""One rank of a training job, from environment to finished (or failed) MLflow run.

`run_rank` is what every process runs, however it was started: by the local launcher, by
torchrun, by srun or by submitit. Every rank runs the same code; what only rank 0 does is
decided by the part that owns it, never by an `if` here:
- MLflow: `tracking.open_run` gives rank 0 its MlflowRun and every other rank the do-nothing
  NullRun (the RunLogger talks to either);
- the story: rank 0 logs at INFO, the others warnings and errors only (`setup_logging`);
- files: checkpoints (train/engine/checkpoint.py gathers every rank's state to rank 0),
  best.pt, model.pt, the figures and summary.json (train/engine/outputs.py, `JobOutputs`);
- a stop or a failure: the requeue, the time-limit note, the sweep's end
  (train/engine/ending.py, `JobEnding`).
This file reads top to bottom as the job's script.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from train import tracking
from train.config.groups import TrainConfig
from train.config.schema import to_typed
from train.config.task import metric_problem
from train.data import build as data_lib
from train.distributed import env as distenv
from train.distributed import process_group as distributed
from train.distributed import slurm, watch
from train.distributed.devices import device_name
from train.distributed.stopping import Preempted, StopSignals
from train.engine import (
    checkpoint,
    checkpoint_folder,
    checkpoint_match,
    drill,
    evaluation,
    fsdp,
    loop,
)
from train.engine import monitor as monitor_lib
from train.engine import state as train_state
from train.engine.ending import JobEnding
from train.engine.outputs import JobOutputs
from train.engine.stragglers import Stragglers
from train.engine.trial import TrialReporter
from train.errors import ConfigError
from train.models import build as models
from train.report import flops
from train.report.metrics import Reduced
from train.report.progress import Progress
from train.report.runlog import RunLogger
from train.tasks import build as tasks
from train.tasks.base import Task, summed

log = logging.getLogger("train")


DATE_FORMAT = "%H:%M:%S"
"""conf/train.yaml's job_logging (the launching process's lines) uses the same."""


def rank_format(rank: int) -> logging.Formatter:
    """One format for a rank's lines, one rank or many: `[20:06:31][rank 0][INFO] ...`."""
    return logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s",
                             DATE_FORMAT)


def setup_logging(rank: int, log_file: Path) -> None:
    """Rank 0 tells the story; the other ranks speak only about problems. On stderr, and in the
    job's log file beside its outputs (Hydra's train.log), which every rank appends to."""
    level = logging.INFO if rank == 0 else logging.WARNING
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr),
                                       logging.FileHandler(log_file, mode="a")]
    for handler in handlers:
        handler.setFormatter(rank_format(rank))
    logging.basicConfig(level=level, force=True, handlers=handlers)


@contextlib.contextmanager
def rank_log_format(rank: int) -> Iterator[None]:
    """A rank run inside the launching process (one local rank) keeps Hydra's handlers (stderr,
    the job's train.log) but writes its lines as every rank does; put back afterwards."""
    handlers = logging.getLogger().handlers
    before = [h.formatter for h in handlers]
    for handler in handlers:
        handler.setFormatter(rank_format(rank))
    try:
        yield
    finally:
        for handler, formatter in zip(handlers, before, strict=True):
            handler.setFormatter(formatter)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank_info(device: torch.device) -> dict[str, str]:
    return {"host": socket.gethostname(), "device": device_name(device)}


def _previous_run(cfg: TrainConfig, out: Path,
                  resumed: checkpoint_folder.Resumed | None) -> tuple[str, int] | None:
    """(run id, restarts so far) of an earlier start of this job: a Slurm requeue, or the same
    output directory again. Its run continues instead of a new one being made. A checkpoint
    from another directory (trainer.resume=<path>) gives its weights, not its run: that job's
    run is not this job's to reopen."""
    own = resumed is not None and checkpoint_folder.is_own(resumed, out)
    if own and resumed is not None and resumed.state.get("run_id"):
        return str(resumed.state["run_id"]), int(resumed.state.get("restarts") or 0)
    if cfg.trainer.resume != "never" and (run_id := tracking.recorded_run_id(out)):
        return run_id, 0
    return None


def _final_model_and_test(cfg: TrainConfig, out: Path, state: train_state.TrainState,
                          bundle: data_lib.DataBundle, device: torch.device,
                          logger: RunLogger, task: Task) -> Reduced | None:
    """Every rank: the final model (best.pt's weights with trainer.test_on=best, else the
    last), then its one evaluation on the test split, where the data set has one."""
    distributed.barrier()  # rank 0's best.pt is complete before anyone reads it
    best = checkpoint_folder.directory(out) / checkpoint_folder.BEST
    use_best = cfg.trainer.test_on == "best" and best.is_file()
    if use_best:
        best_weights = checkpoint_folder.load_best(checkpoint_folder.directory(out))["model"]
        if fsdp.is_sharded(state.module):
            fsdp.load_full(state.module, None, best_weights)
        else:
            state.module.load_state_dict(best_weights)
    logger.run.set_tags({"final_weights": "best" if use_best else "last"})
    if cfg.trainer.test_on == "none":
        return None
    if bundle.test is None:
        log.info("data=%s has no test split: no test phase", cfg.data.name)
        return None
    tested = evaluation.test(state.module, bundle.test, device, cfg.trainer.precision, task,
                       filler=state.filler)
    logger.training.test(state.epoch, tested)
    return tested


def finished_already(cfg: TrainConfig, out: Path) -> dict[str, Any] | None:
    """summary.json of this output directory if its job already trained trainer.epochs epochs,
    or up to trainer.max_steps (the same command again); None otherwise."""
    if cfg.trainer.resume != "auto":
        return None
    try:
        summary = json.loads((out / "summary.json").read_text())
        done, limit = int(summary.get("epochs", 0)), summary.get("max_steps")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    wanted = cfg.trainer.max_steps
    as_far = limit is None or (wanted is not None and wanted <= int(limit))
    return summary if done >= cfg.trainer.epochs and as_far else None


def _set_up(cfg: TrainConfig, task: Task, bundle: data_lib.DataBundle,
            device: torch.device) -> models.InputSpec:
    """The task set up with the data (its loss as a SUM, the classes) and the model's input
    and output sizes; a monitor the task never logs is refused here, where a custom data set's
    classes or a custom task's metrics are known at last."""
    classes = (cfg.task.num_classes if task.name == "segmentation" and cfg.task.num_classes
               else bundle.vocab_size or bundle.num_classes)
    task.setup(summed(models.build_loss(cfg.trainer.loss, device)), classes, bundle.class_names)
    if bundle.vocab_size is not None:  # token data: what a task that writes text decodes with
        task.tokenizer, task.seq_len = bundle.tokenizer, bundle.input_shape[0]
    top5_classes = classes if task.name == "classification" else None
    if problem := metric_problem(cfg.trainer.monitor, task.name, tuple(task.metrics),
                                 "trainer.monitor", top5_classes):
        raise ConfigError(problem)
    return models.InputSpec.of(bundle.input_shape,
                               task.outputs_per_sample(bundle.target_shape, classes),
                               vocab_size=bundle.vocab_size)


@dataclass(frozen=True)
class Job:
    """What one rank knows of its job before training: the config (typed, and as composed),
    its place in the job, its output directory, the command that started it, its device."""

    cfg: TrainConfig
    config: dict[str, Any]
    env: distenv.DistEnv
    out: Path
    command: str
    device: torch.device
    backend: str
    fail_at: int | None = None
    """This rank's failure drill (train/engine/drill.py, TRAIN_FAIL_DRILL); None = none."""


def _train(job: Job, logger: RunLogger, stop: StopSignals,
           ending: JobEnding) -> dict[str, float]:
    cfg, env, out, device = job.cfg, job.env, job.out, job.device
    if (done := _final_metrics_if_done(cfg, out, logger)) is not None:
        return done
    resumed = checkpoint_folder.find(cfg.trainer.resume, out)
    if resumed is not None:  # before the run: a checkpoint it cannot use touches no run
        checkpoint_match.check_compatible(resumed, job.config, env.world_size)
    # The run exists before anything that can fail on one node (data, model): such a failure
    # then shows in MLflow as a FAILED run with the failing rank's error.
    ranks = distributed.gather_to_all(_rank_info(device))
    tags = {"command": job.command, "output_dir": str(out),
            **slurm.slurm_tags([r["host"] for r in ranks])}
    logger.start(job.config, ranks, env, job.backend, tags, OmegaConf.to_yaml(job.config),
                 _previous_run(cfg, out, resumed))
    accumulate = cfg.trainer.accumulate_grad_batches
    task = tasks.build(cfg.task)
    watch.enter("data")  # building the data reads the user's first samples
    bundle = data_lib.build(cfg.data, env, device, cfg.trainer.seed,
                            channels_last=cfg.trainer.channels_last, micro_batches=accumulate,
                            classes=task.name == "classification")
    spec = _set_up(cfg, task, bundle, device)
    logger.log_data(bundle, spec.num_classes,
                    task.output_card(bundle.target_shape, bundle.input_shape))
    torch.manual_seed(cfg.trainer.seed)  # identical initial weights on every rank
    watch.enter("model")  # DDP's constructor waits for every rank
    steps_per_epoch = -(-len(bundle.train) // accumulate)  # optimiser steps: the schedule's
    state = train_state.build(cfg, spec, steps_per_epoch, device, resumed is not None)
    # FSDP: counted from the shapes of a meta-device copy, not from this rank's shards.
    shapes = fsdp.meta_copy(cfg, spec) if fsdp.is_sharded(state.module) else state.module
    logger.log_model_params(shapes)
    logger.training.throughput = flops.Throughput(
        shapes, bundle.input_shape, device, cfg.trainer.precision, cfg.trainer.peak_tflops,
        env.world_size, tokens=bundle.vocab_size is not None)
    torch.manual_seed(cfg.trainer.seed + env.rank)  # different augmentation per rank
    if resumed is not None:
        checkpoint.restore(state, resumed, env.rank, env.world_size)
    outputs = JobOutputs(cfg, env, out, logger, task)
    outputs.spec = spec
    outputs.check_room(state)
    monitor = monitor_lib.Monitor(cfg.trainer, outputs.best_writer(state))
    if resumed is not None:
        monitor.load_state_dict(resumed.state.get("monitor"))
    checkpointer = checkpoint.Checkpointer(
        checkpoint_folder.directory(out), cfg.trainer, env.rank, env.world_size,
        before_write=lambda: logger.run.flush(
            cfg.tracking.checkpoint_flush_s, created_within_s=cfg.distributed.timeout_s / 2),
        run_fields=lambda: {**logger.run_fields(), "monitor": monitor.state_dict()},
        background=cfg.distributed.fsdp.async_checkpoint)
    stragglers = None
    if env.world_size > 1 and cfg.trainer.straggler_intervals > 0:  # 0: the check is off
        stragglers = Stragglers(cfg.trainer.straggler_share, cfg.trainer.straggler_intervals,
                                slurm.node_of_rank, logger.run.set_tags, env.is_main)
    reporter = None
    if cfg.trainer.trial is not None and cfg.trainer.study:
        reporter = TrialReporter(cfg, env.rank)
        reporter.check_params(job.config)
    duties = loop.Duties(logger.training, checkpointer, stop, env.rank, env.local_rank, monitor,
                         job.fail_at, stragglers, reporter)
    try:
        final_val = loop.fit(cfg, state, bundle, device, duties, task)
        checkpointer.finish()  # a checkpoint written in the background is whole
    except Preempted:
        checkpointer.finish()  # the stop's checkpoint, before the job ends
        raise
    finally:
        if reporter is not None:
            reporter.close()
    if reporter is not None and reporter.pruned_at is not None:
        logger.run.set_tags({"pruned_at": str(reporter.pruned_at)})
        logger.stopped_early(str(reporter.stop_reason))
    elif monitor.stop_reason:
        logger.stopped_early(monitor.stop_reason)
    tested = _final_model_and_test(cfg, out, state, bundle, device, logger, task)
    outputs.write_final(state, bundle, final_val, distributed.gather_to_all(peak_rss_mb()),
                        tested)
    logger.finish()
    if reporter is not None:
        reporter.tell(logger.training.final_metrics)
    ending.finished()
    return dict(logger.training.final_metrics)


def _final_metrics_if_done(cfg: TrainConfig, out: Path,
                           logger: RunLogger) -> dict[str, float] | None:
    """The final metrics of a job this output directory finished already (nothing to train,
    nothing to log again: the run and the files stay as they are); None otherwise."""
    if (done := finished_already(cfg, out)) is None:
        return None
    log.info("this job finished already: MLflow run %s, %s epochs (%s). Nothing changed; a "
             "larger trainer.epochs or trainer.max_steps continues it.",
             done.get("run_id") or tracking.recorded_run_id(out), done.get("epochs"),
             out / "summary.json")
    logger.run.finish()  # no run was started: only ends the sender thread
    return {k: float(v) for k, v in (done.get("metrics") or {}).items()}


def run_rank(config: dict[str, Any], output_dir: str, command: str, own_process: bool = True,
             ending_run: Callable[[], None] | None = None) -> dict[str, float]:
    """Train on this rank; returns the final metrics (the same on every rank).

    `own_process=False`: a one-rank job run inside the launching process (a local sweep runs
    several in turn), which keeps Hydra's logging. `ending_run`: called on rank 0 when, after a
    failure, it begins ending its run (the local launcher then waits for it longer).
    """
    env = distenv.detect()
    if own_process:
        setup_logging(env.rank, Path(output_dir) / "train.log")
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: ranks sharing a node share its CPUs instead of each taking all.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // env.local_world_size))
    cfg: TrainConfig = to_typed(config)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)  # Hydra makes it; torchrun or a test may not
    device = distributed.select_device(cfg.distributed.device, env.local_rank,
                                         env.local_world_size)
    backend = distributed.select_backend(cfg.distributed.backend, device)
    progress = Progress(env.is_main and sys.stderr.isatty(), cfg.trainer.epochs,
                        cfg.data.batch_size)
    logger = RunLogger(cfg, tracking.open_run(cfg.tracking, out, env.is_main), progress)
    logger.output_dir = str(out)
    job = Job(cfg, config, env, out, command, device, backend, drill.fail_at(env.rank, out))
    ending = JobEnding(cfg, env, out, command, logger)
    try:  # from the process group on: a job that fails in it has ended too (sweep, below)
        distributed.init(env, backend, device, cfg.distributed.timeout_s)
        watch.start(out, env.rank, env.world_size)
        drill.check(job.fail_at, 0, env.rank)
        with StopSignals() as stop:
            final = _train(job, logger, stop, ending)
        # Every rank is done with the group before any takes it down: a rank destroying it
        # while a peer still used it ended that peer in C++'s terminate() at exit (an srun step
        # FAILED after its run FINISHED, under load).
        distributed.barrier()
        return final
    except Preempted as stopped:
        ending.stopped(stopped)
        raise
    except BaseException as exc:
        ending.failed(exc, ending_run)
        raise
    finally:
        watch.stop()
        distributed.shutdown()
