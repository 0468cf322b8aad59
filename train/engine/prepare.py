"""What one rank builds before training, in the order its job needs it (train/engine/job.py
runs it): the MLflow run started before anything that can fail on one node, the task and the
data, the model's state (restored when resuming), the job's outputs, the monitor and the rest
of the loop's duties. Every rank runs the same code; what only rank 0 does is decided by the
part that owns it (job.py's docstring lists them).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from train import tracking
from train.config.groups import TrainConfig
from train.config.task import classes_problem, metric_problem
from train.data import build as data_lib
from train.distributed import env as distenv
from train.distributed import phase, slurm
from train.distributed import process_group as distributed
from train.distributed.devices import device_name
from train.distributed.stopping import StopSignals
from train.engine import (
    checkpoint,
    checkpoint_folder,
    checkpoint_match,
    fsdp,
    loop,
    profiling,
    recompute,
)
from train.engine import monitor as monitor_lib
from train.engine import state as train_state
from train.engine.outputs import JobOutputs
from train.engine.stragglers import Stragglers
from train.engine.trial import TrialReporter
from train.errors import ConfigError
from train.models import build as models
from train.report import flops
from train.report.runlog import RunLogger
from train.tasks import build as tasks
from train.tasks.base import Task, summed


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
    host_memory_kept: bool = False
    """Whether distributed.keep_host_memory took effect in this rank (glibc only)."""


@dataclass(frozen=True)
class Prepared:
    """What `prepare` built: what `loop.fit` trains with, and what the job's end reads after it
    (the monitor, the checkpointer and the trial are the duties')."""

    state: train_state.TrainState
    bundle: data_lib.DataBundle
    task: Task
    outputs: JobOutputs
    duties: loop.Duties


def _rank_info(job: Job) -> dict[str, str]:
    return {"host": socket.gethostname(), "device": device_name(job.device),
            "host_memory": "kept" if job.host_memory_kept else "allocator defaults"}


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


def _start_run(job: Job, logger: RunLogger) -> checkpoint_folder.Resumed | None:
    """The checkpoint this job resumes from (None: none), checked before the run is touched,
    then the run started (or continued) with every rank's host and device."""
    cfg, out = job.cfg, job.out
    resumed = checkpoint_folder.find(cfg.trainer.resume, out)
    if resumed is not None:  # before the run: a checkpoint it cannot use touches no run
        checkpoint_match.check_compatible(resumed, job.config, job.env.world_size)
    # The run exists before anything that can fail on one node (data, model): such a failure
    # then shows in MLflow as a FAILED run with the failing rank's error.
    ranks = distributed.gather_to_all(_rank_info(job))
    # Applied silently and by glibc only: the run says whether each rank's setting took.
    tags = {"command": job.command, "output_dir": str(out),
            "host_memory": ",".join(sorted({r["host_memory"] for r in ranks})),
            **slurm.slurm_tags([r["host"] for r in ranks])}
    logger.start(job.config, ranks, job.env, job.backend, tags, OmegaConf.to_yaml(job.config),
                 _previous_run(cfg, out, resumed))
    return resumed


def set_up_task(cfg: TrainConfig, task: Task, bundle: data_lib.DataBundle,
            device: torch.device) -> models.InputSpec:
    """The task set up with the data (its loss as a SUM, the classes) and the model's input
    and output sizes; a monitor the task never logs is refused here, where a custom data set's
    classes or a custom task's metrics are known at last."""
    classes = (cfg.task.num_classes if task.name == "segmentation" and cfg.task.num_classes
               else bundle.vocab_size or bundle.num_classes)
    if problem := classes_problem(task.name, classes, cfg.data.name):
        raise ConfigError(problem)
    task.setup(summed(models.build_loss(cfg.trainer.loss, device)), classes, bundle.class_names)
    if bundle.vocab_size is not None:  # token data: what a task that writes text decodes with
        task.tokenizer, task.seq_len = bundle.tokenizer, bundle.input_shape[0]
    top5_classes = classes if task.name == "classification" else None
    if problem := metric_problem(cfg.trainer.monitor, task.name, tuple(task.metrics),
                                 "trainer.monitor", top5_classes):
        raise ConfigError(problem)
    return models.InputSpec.of(bundle.input_shape,
                               task.outputs_per_sample(bundle.target_shape, classes),
                               vocab_size=bundle.vocab_size, text=bundle.text,
                               class_names=tuple(bundle.class_names or ()))


def prepare(job: Job, logger: RunLogger, stop: StopSignals) -> Prepared:
    """Every rank: the run started, then everything `loop.fit` needs, built in this order."""
    cfg, env, out, device = job.cfg, job.env, job.out, job.device
    resumed = _start_run(job, logger)
    accumulate = cfg.trainer.accumulate_grad_batches
    task = tasks.build(cfg.task)
    phase.enter("data")  # building the data reads the user's first samples
    bundle = data_lib.build(cfg.data, env, device, cfg.trainer.seed,
                            channels_last=cfg.trainer.channels_last, micro_batches=accumulate,
                            classes=getattr(task, "class_targets", False))
    spec = set_up_task(cfg, task, bundle, device)
    logger.log_data(bundle, spec.num_classes,
                    task.output_card(bundle.target_shape, bundle.input_shape))
    torch.manual_seed(cfg.trainer.seed)  # identical initial weights on every rank
    phase.enter("model")  # DDP's constructor waits for every rank
    steps_per_epoch = -(-len(bundle.train) // accumulate)  # optimiser steps: the schedule's
    state = train_state.build(cfg, spec, steps_per_epoch, device, resumed is not None)
    # FSDP: counted from the shapes of a meta-device copy, not from this rank's shards.
    shapes = fsdp.meta_copy(cfg, spec) if fsdp.is_sharded(state.module) else state.module
    logger.log_model_params(shapes)
    if state.initialised_on is not None:  # whether its initial weights are a DDP job's
        logger.run.set_tags({"fsdp.init_on": state.initialised_on})
    if recomputed := recompute.applied(state.module):
        logger.run.set_tags({"activation_checkpointing": recomputed})
    logger.training.throughput = flops.Throughput(
        shapes, bundle.input_shape, device, cfg.trainer.precision, cfg.trainer.peak_tflops,
        env.world_size, tokens=bundle.vocab_size is not None or bundle.text is not None)
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
    profiler = None
    if cfg.trainer.profile.enabled:
        profiler = profiling.StepProfiler(cfg.trainer.profile, out, env.rank, device,
                                          logger.run.set_tags)
    duties = loop.Duties(logger.training, checkpointer, stop, env.rank, env.local_rank, monitor,
                         job.fail_at, stragglers, reporter, profiler=profiler)
    return Prepared(state, bundle, task, outputs, duties)
