"""One rank of a training job, from environment to finished (or failed) MLflow run.

`run_rank` is what every process runs, however it was started: by the local launcher, by
torchrun, by srun or by submitit. Every rank runs the same code; what only rank 0 does is
decided here and nowhere else:
- it talks to MLflow (`tracking.open_run` gives the other ranks the do-nothing NullRun);
- it prints the story (the other ranks log warnings and errors only: `setup_logging`);
- it writes the job's files: checkpoints (train/engine/checkpoint.py, after gathering every rank's
  state), model.pt, confusion_matrix.svg and summary.json (`_write_outputs`);
- after a stop before a Slurm time limit, it requeues the job; as the last job of an unwaited
  sweep, it ends the sweep's parent run.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from train import tracking
from train.config.groups import TrainConfig
from train.config.schema import to_typed
from train.config.validation import monitor_problem
from train.data import build as data_lib
from train.distributed import env as distenv
from train.distributed import process_group as distributed
from train.distributed import slurm
from train.distributed.devices import device_name
from train.distributed.stopping import Preempted, StopSignals
from train.engine import checkpoint, loop
from train.engine import monitor as monitor_lib
from train.engine import state as train_state
from train.errors import ConfigError
from train.models import build as models
from train.report import flops
from train.report.figures import per_class_accuracy, render_confusion
from train.report.metrics import Reduced
from train.report.progress import Progress
from train.report.runlog import RunLogger
from train.tracking import sweep

log = logging.getLogger("train")


def setup_logging(rank: int, log_file: Path) -> None:
    """Rank 0 tells the story; the other ranks speak only about problems. On stderr, and in the
    job's log file beside its outputs (Hydra's train.log), which every rank appends to."""
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "[%(asctime)s][rank " + str(rank) + "][%(levelname)s] %(message)s"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True,
                        handlers=[logging.StreamHandler(sys.stderr),
                                  logging.FileHandler(log_file, mode="a")])


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank_info(device: torch.device) -> dict[str, str]:
    return {"host": socket.gethostname(), "device": device_name(device)}


def _previous_run(cfg: TrainConfig, out: Path,
                  resumed: checkpoint.Resumed | None) -> tuple[str, int] | None:
    """(run id, restarts so far) of an earlier start of this job: a Slurm requeue, or the same
    output directory again. Its run continues instead of a new one being made. A checkpoint
    from another directory (trainer.resume=<path>) gives its weights, not its run: that job's
    run is not this job's to reopen."""
    own = resumed is not None and checkpoint.is_own(resumed, out)
    if own and resumed is not None and resumed.state.get("run_id"):
        return str(resumed.state["run_id"]), int(resumed.state.get("restarts") or 0)
    if cfg.trainer.resume != "never" and (run_id := tracking.recorded_run_id(out)):
        return run_id, 0
    return None


def _write_outputs(out: Path, state: train_state.TrainState, bundle: data_lib.DataBundle,
                   final_val: Reduced | None, logger: RunLogger, peaks: list[float],
                   tested: Reduced | None = None) -> None:
    """Rank 0's files beside the job's outputs, and the same in the run."""
    files: dict[str, Path] = {}
    table = None
    names = bundle.class_names
    if final_val is not None and final_val.confusion is not None:
        files[""] = render_confusion(final_val.confusion, names, out / "confusion_matrix.svg")
        table = per_class_accuracy(final_val.confusion, names)
    if tested is not None and tested.confusion is not None:
        svg = render_confusion(tested.confusion, names, out / "test_confusion_matrix.svg")
        logger.test_outputs(svg, per_class_accuracy(tested.confusion, names))
    files["weights"] = checkpoint.save_weights(state.module.state_dict(), out / "model.pt",
                                               checkpoint.directory(out))
    example = next(iter(bundle.val))[0][:4].cpu().numpy()  # batch > 1: any size loads back
    logger.log_outputs(files, table, state.module, example)
    (out / "summary.json").write_text(json.dumps(logger.summary(peaks), indent=2))


def _best_writer(cfg: TrainConfig, out: Path, state: train_state.TrainState,
                 logger: RunLogger) -> Any:
    """Rank 0's reaction to a new best evaluation: best.pt (trainer.save_best) and the run's
    best/<monitor> metric and best_epoch tag."""
    def on_best(best: monitor_lib.Best) -> None:
        path = None
        if cfg.trainer.save_best:
            path = checkpoint.save_best(checkpoint.directory(out), state.module.state_dict(),
                                        {"epoch": best.epoch, "step": best.step,
                                         "monitor": best.monitor, "mode": best.mode,
                                         "value": best.value})
        logger.training.best(best.epoch, best.monitor, best.value, path)
    return on_best


def _final_model_and_test(cfg: TrainConfig, out: Path, state: train_state.TrainState,
                          bundle: data_lib.DataBundle, device: torch.device,
                          logger: RunLogger) -> Reduced | None:
    """Every rank: the final model (best.pt's weights with trainer.test_on=best, else the
    last), then its one evaluation on the test split, where the data set has one."""
    distributed.barrier()  # rank 0's best.pt is complete before anyone reads it
    best = checkpoint.directory(out) / checkpoint.BEST
    use_best = cfg.trainer.test_on == "best" and best.is_file()
    if use_best:
        state.module.load_state_dict(checkpoint.load_best(checkpoint.directory(out))["model"])
    logger.run.set_tags({"final_weights": "best" if use_best else "last"})
    if cfg.trainer.test_on == "none":
        return None
    if bundle.test is None:
        log.info("data=%s has no test split: no test phase", cfg.data.name)
        return None
    criterion = loop.build_criterion(cfg, bundle.num_classes, device)
    tested = loop.test(state.module, bundle.test, device, cfg.trainer.precision, criterion)
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


def _train(cfg: TrainConfig, config: dict[str, Any], env: distenv.DistEnv, out: Path,
           command: str, device: torch.device, backend: str, logger: RunLogger,
           stop: StopSignals) -> dict[str, float]:
    if (done := _final_metrics_if_done(cfg, out, logger)) is not None:
        return done
    resumed = checkpoint.find(cfg.trainer.resume, out)
    if resumed is not None:  # before the run: a checkpoint it cannot use touches no run
        checkpoint.check_compatible(resumed, config, env.world_size)
    # The run exists before anything that can fail on one node (data, model): such a failure
    # then shows in MLflow as a FAILED run with the failing rank's error.
    ranks = distributed.gather_to_all(_rank_info(device))
    tags = {"command": command, "output_dir": str(out),
            **slurm.slurm_tags([r["host"] for r in ranks])}
    logger.start(config, ranks, env, backend, tags, OmegaConf.to_yaml(config),
                 _previous_run(cfg, out, resumed))
    accumulate = cfg.trainer.accumulate_grad_batches
    bundle = data_lib.build(cfg.data, env.rank, env.world_size, env.local_world_size, device,
                            cfg.trainer.seed, cfg.trainer.channels_last, micro_batches=accumulate)
    logger.log_data(bundle)
    if problem := monitor_problem(cfg.trainer.monitor, bundle.num_classes):
        raise ConfigError(problem)  # a custom data set's classes, known only now
    torch.manual_seed(cfg.trainer.seed)  # identical initial weights on every rank
    spec = models.InputSpec.of(bundle.input_shape, bundle.num_classes)
    steps_per_epoch = -(-len(bundle.train) // accumulate)  # optimiser steps: the schedule's
    state = train_state.build(cfg, spec, steps_per_epoch, device, resumed is not None)
    logger.log_model_params(state.module)
    logger.training.throughput = flops.Throughput(
        state.module, bundle.channels, bundle.image_size, device, cfg.trainer.precision,
        cfg.trainer.peak_tflops, env.world_size)
    torch.manual_seed(cfg.trainer.seed + env.rank)  # different augmentation per rank
    if resumed is not None:
        checkpoint.restore(state, resumed, env.rank, env.world_size)
    if env.is_main:  # the one writer: refuse now rather than after an epoch's work
        checkpoint.check_room_for_one(checkpoint.directory(out), state)
    monitor = monitor_lib.Monitor(cfg.trainer, _best_writer(cfg, out, state, logger)
                                  if env.is_main else None)
    if resumed is not None:
        monitor.load_state_dict(resumed.state.get("monitor"))
    checkpointer = checkpoint.Checkpointer(
        checkpoint.directory(out), cfg.trainer, env.rank, env.world_size,
        before_write=lambda: logger.run.flush(
            cfg.tracking.checkpoint_flush_s, created_within_s=cfg.distributed.timeout_s / 2),
        run_fields=lambda: {**logger.run_fields(), "monitor": monitor.state_dict()})
    duties = loop.Duties(logger.training, checkpointer, stop, env.rank, env.local_rank, monitor)
    final_val = loop.fit(cfg, state, bundle, device, duties)
    if monitor.stop_reason:
        logger.stopped_early(monitor.stop_reason)
    tested = _final_model_and_test(cfg, out, state, bundle, device, logger)
    peaks = distributed.gather_to_all(peak_rss_mb())
    if env.is_main:
        _write_outputs(out, state, bundle, final_val, logger, peaks, tested)
    logger.finish()
    if env.is_main:
        sweep.end_parent_if_last(cfg.tracking, cfg.trainer.objective,
                                 cfg.trainer.objective_direction)
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
    try:  # from the process group on: a job that fails in it has ended too (sweep, below)
        distributed.init(env, backend, device, cfg.distributed.timeout_s)
        loop.fail_drill(cfg.trainer, 0, env.rank)
        with StopSignals() as stop:
            return _train(cfg, config, env, out, command, device, backend, logger, stop)
    except Preempted as stopped:
        log.warning("rank %d: %s", env.rank, stopped)
        budget = slurm.requeue_budget(cfg.cluster, env.launcher)
        final = budget is None or not slurm.will_requeue(stopped.signal_name, logger.restarts,
                                                         budget)
        if env.is_main and budget is not None and stopped.signal_name == "SIGUSR2" and final:
            newest = checkpoint.candidates(checkpoint.directory(out))
            note = slurm.time_limit_note(newest[0] if newest else None, command)
            log.error("%s", note)
            logger.run.set_tags({"stop_reason": note})
        logger.finish(stopped_by=stopped.signal_name)
        if env.is_main and final:
            _end_sweep_if_last(cfg, logger, out, f"stopped by {stopped.signal_name}")
        if env.is_main and budget is not None:
            slurm.requeue_after_stop(stopped.signal_name, logger.restarts, budget)
        raise
    except BaseException as exc:
        reason, silent = distributed.failure_reason(env, exc, slurm.node_of_rank)
        if env.is_main and ending_run is not None:
            ending_run()
        logger.finish(error=reason)
        if env.is_main:
            _end_sweep_if_last(cfg, logger, out, reason)
        if env.is_main and silent and cfg.cluster is not None:
            slurm.end_job_after_lost_peer(reason)
        raise
    finally:
        distributed.shutdown()


def _end_sweep_if_last(cfg: TrainConfig, logger: RunLogger, out: Path, ended: str) -> None:
    """Rank 0 of a job that failed or stopped for good: a sweep left unwaited counts it as
    ended (also one that failed before its run existed) and its last job ends the parent."""
    sweep.end_parent_if_last(cfg.tracking, cfg.trainer.objective,
                             cfg.trainer.objective_direction,
                             None if logger.run.run_id else (str(out), ended))
