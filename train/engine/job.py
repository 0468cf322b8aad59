"""One rank of a training job, from environment to finished (or failed) MLflow run.

`run_rank` is what every process runs, however it was started: by the local launcher, by
torchrun, by srun or by submitit. Every rank runs the same code; what only rank 0 does is
decided by the part that owns it, never by an `if` here:
- MLflow: `tracking.open_run` gives rank 0 its MlflowRun and every other rank the do-nothing
  NullRun (the RunLogger talks to either);
- the story: rank 0 logs at INFO, the others warnings and errors only
  (train/engine/ranklog.py, `setup_logging`);
- files: checkpoints (train/engine/checkpoint.py gathers every rank's state to rank 0),
  best.pt, model.pt, the figures and summary.json (train/engine/outputs.py, `JobOutputs`);
- a stop or a failure: the requeue, the time-limit note, the sweep's end
  (train/engine/ending.py, `JobEnding`).
This file reads top to bottom as the job's script; what a rank builds before training (the run
started, the data, the model, the loop's duties) is train/engine/prepare.py.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from train import tracking
from train.config.groups import TrainConfig
from train.config.schema import to_typed
from train.data import build as data_lib
from train.data import shard_guard
from train.distributed import env as distenv
from train.distributed import host_memory, phase, process_end, watch
from train.distributed import process_group as distributed
from train.distributed.stopping import Preempted, StopSignals
from train.engine import checkpoint_folder, drill, evaluation, fsdp, loop, profiling
from train.engine import state as train_state
from train.engine.ending import JobEnding
from train.engine.prepare import Job, Prepared, prepare
from train.engine.ranklog import setup_logging
from train.report import figures
from train.report.breakdown import PHASES
from train.report.metrics import Reduced
from train.report.progress import Progress
from train.report.runlog import RunLogger
from train.tasks.base import Task
from train.tracking import records

log = logging.getLogger("train")
STEP_TIME_FIGURE = "step_time.svg"
"""Each rank's stacked bar of where its training time went (train/report/breakdown.py)."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def _average_for_good(state: train_state.TrainState, main: bool) -> dict[str, Any] | None:
    """trainer.ema: the average becomes the model (its test, model.pt, the logged model); the
    trained weights are returned, whole on rank 0 (a collective under FSDP), for
    model_raw.pt. None without trainer.ema."""
    if state.ema is None:
        return None
    if fsdp.is_sharded(state.module):  # copies: at world 1 they may be the shards themselves
        raw = {k: v.clone() for k, v in fsdp.full_state_dict(state.module)[0].items()}
    else:
        raw = {k: v.detach().cpu().clone() for k, v in state.module.state_dict().items()} \
            if main else {}
    state.ema.apply()
    return raw


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


def _train(job: Job, logger: RunLogger, stop: StopSignals,
           ending: JobEnding) -> dict[str, float]:
    """Every rank: a job this output directory finished already is left as it is; any other is
    set up (train/engine/prepare.py), trained and finished. A job of `python -m train eval` or
    `predict` evaluates a finished run or writes its outputs instead (train/engine/evaluate.py,
    predict.py)."""
    if job.cfg.eval.run_id is not None and job.cfg.eval.purpose == "predict":
        from train.engine.predict import predict_run

        return predict_run(job)
    if job.cfg.eval.run_id is not None:
        from train.engine.evaluate import evaluate_run

        return evaluate_run(job)
    if (done := _final_metrics_if_done(job.cfg, job.out, logger)) is not None:
        return done
    return _fit_and_finish(job, logger, ending, prepare(job, logger, stop))


def _fit_and_finish(job: Job, logger: RunLogger, ending: JobEnding,
                    prepared: Prepared) -> dict[str, float]:
    """Every rank: `loop.fit`, then why it stopped early (if it did), the final model and its
    test, the files, the run's end; returns the final metrics."""
    cfg, state, bundle, task = job.cfg, prepared.state, prepared.bundle, prepared.task
    checkpointer, reporter = prepared.duties.checkpointer, prepared.duties.trial
    try:
        final_val = loop.fit(cfg, state, bundle, job.device, prepared.duties, task)
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
    elif prepared.duties.monitor.stop_reason:
        logger.stopped_early(prepared.duties.monitor.stop_reason)
    raw = _average_for_good(state, job.env.is_main)
    tested = _final_model_and_test(cfg, job.out, state, bundle, job.device, logger, task)
    prepared.outputs.write_final(state, bundle, final_val,
                                 distributed.gather_to_all(peak_rss_mb()), tested, raw)
    breakdown = prepared.duties.breakdown
    if job.env.is_main and breakdown.totals:
        svg = figures.render_breakdown(breakdown.totals, PHASES, job.out / STEP_TIME_FIGURE,
                                       "where each rank's training time went (this start)")
        logger.run.log(records.ArtifactFile(str(svg)))
    if prepared.duties.profiler is not None:  # after write_final's gather: every rank wrote
        logger.rank_files(job.out / profiling.FOLDER, "rank-*")
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
    shard_guard.forget()  # an earlier job's shards, in a local sweep's process
    if own_process:
        setup_logging(env.rank, Path(output_dir) / "train.log")
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: ranks sharing a node share its CPUs instead of each taking all.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // env.local_world_size))
    cfg: TrainConfig = to_typed(config)
    kept = host_memory.keep_host_memory(cfg.distributed.keep_host_memory)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)  # Hydra makes it; torchrun or a test may not
    device = distributed.select_device(cfg.distributed.device, env.local_rank,
                                         env.local_world_size)
    backend = distributed.select_backend(cfg.distributed.backend, device)
    profiling.record_memory_history(cfg.trainer.memory_snapshot, device)
    progress = Progress(env.is_main and sys.stderr.isatty(), cfg.trainer.epochs,
                        cfg.data.batch_size)
    logger = RunLogger(cfg, tracking.open_run(cfg.tracking, out, env.is_main), progress)
    logger.output_dir = str(out)
    job = Job(cfg, config, env, out, command, device, backend, drill.fail_at(env.rank, out), kept)
    ending = JobEnding(cfg, env, out, command, logger)
    try:  # from the process group on: a job that fails in it has ended too (sweep, below)
        distributed.init(env, backend, device, cfg.distributed.timeout_s, fsdp.offloads(cfg))
        watch.start(out, env.rank, env.world_size, cfg.distributed.timeout_s)
        phase.use_device_clock(device)  # a GPU's phases on its own clock (time/*)
        drill.check(job.fail_at, 0, env.rank)
        with StopSignals(own_process) as stop:
            final = _train(job, logger, stop, ending)
        # Every rank is done with the group before any takes it down: a rank destroying it
        # while a peer still used it ended that peer in C++'s terminate() at exit (an srun step
        # FAILED after its run FINISHED, under load). Watchdogs first: one still asking rank
        # 0's store for stack requests once rank 0 has taken it down fills train.log with
        # c10d's "recvValue failed".
        watch.stop()
        distributed.barrier()
        if own_process:  # its process ends without the interpreter's teardown (~2-3 s)
            process_end.end_quickly_under_submitit()
        return final
    except Preempted as stopped:
        ending.stopped(stopped)
        raise
    except BaseException as exc:
        if cfg.trainer.memory_snapshot:
            profiling.keep_memory_snapshot(exc, out, env.rank)
        named = shard_guard.named(exc)  # a DataLoader worker dead of a changed shard
        ending.failed(named, ending_run)
        if named is not exc:
            raise named from exc
        raise
    finally:
        watch.stop()
        distributed.shutdown()
