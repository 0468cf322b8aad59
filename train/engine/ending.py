"""How a rank's job ends when it does not finish: stopped by a signal, or failed. The rules
that decide what happens next live here, each deciding its own rank-0 part:
- the run ends KILLED (stopped) or FAILED (with the first failing rank's error);
- under Slurm, a stop before the time limit requeues the job (cluster.max_requeues); one that
  will not be requeued says how to resume, in the terminal and in the run;
- a job whose peer died silently cancels its Slurm job (Slurm would requeue it by itself);
- the last job of a sweep left unwaited ends the sweep's parent run.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from train.config.groups import TrainConfig
from train.distributed import process_group as distributed
from train.distributed import rankfiles, slurm, stacks, watch
from train.distributed.env import DistEnv
from train.distributed.stopping import Preempted
from train.engine import checkpoint_folder
from train.errors import FAILURE_REASON, SILENT_RANKS, USER_TRACE, FailureRecord
from train.report.runlog import RunLogger
from train.tracking import records, sweep
from train.tracking.backend import RUN_FILE

log = logging.getLogger("train")
RUN_WAIT_S = 60.0
"""How long a rank that failed of its own error waits, before it leaves, for rank 0's MLflow run
to exist (see JobEnding._leave_once_the_run_exists)."""


class JobEnding:
    def __init__(self, cfg: TrainConfig, env: DistEnv, out: Path, command: str,
                 logger: RunLogger) -> None:
        self.cfg, self.env, self.out, self.command, self.logger = cfg, env, out, command, logger

    def stopped(self, stopped: Preempted) -> None:
        """After the ranks agreed on a stop and saved their checkpoint."""
        log.warning("rank %d: %s", self.env.rank, stopped)
        budget = slurm.requeue_budget(self.cfg.cluster, self.env.launcher)
        final = budget is None or not slurm.will_requeue(stopped.signal_name,
                                                         self.logger.restarts, budget)
        main = self.env.is_main
        if main and budget is not None and stopped.signal_name == "SIGUSR2" and final:
            newest = checkpoint_folder.candidates(checkpoint_folder.directory(self.out))
            note = slurm.time_limit_note(newest[0] if newest else None, self.command)
            log.error("%s", note)
            self.logger.run.set_tags({"stop_reason": note})
        self.logger.finish(stopped_by=stopped.signal_name)
        if main and final:
            self._end_sweep_if_last(f"stopped by {stopped.signal_name}")
        if main and budget is not None:
            slurm.requeue_after_stop(stopped.signal_name, self.logger.restarts, budget)

    def failed(self, exc: BaseException, ending_run: Callable[[], None] | None) -> None:
        """Any other way out: the run FAILED with the first failing rank's error, which the
        exception carries on (errors.FAILURE_REASON) for the launcher's one line. Its whole
        traceback goes to train.log first: the root cause's is there before any peer reads
        the cause it publishes, and so in the run, which rank 0 gives the log."""
        self._log_traceback(exc)
        reason, silent = distributed.failure_reason(self.env, exc, slurm.node_of_rank)
        trace = None if silent else stacks.user_traceback(exc)
        with contextlib.suppress(AttributeError, TypeError):  # a built-in without __dict__
            setattr(exc, FAILURE_REASON, reason)
            setattr(exc, SILENT_RANKS, tuple(silent))
            setattr(exc, USER_TRACE, trace)
        main = self.env.is_main
        if main:
            self._log_stacks()
            self._keep_failure(reason, trace)
        elif 0 in silent and not self._cause_kept():  # rank 0 is stuck, or died unheard
            self._write_failure(reason, trace)
        if main and ending_run is not None:
            ending_run()
        self.logger.finish(error=reason)
        if main:
            self._end_sweep_if_last(reason)
        if main and silent and self.cfg.cluster is not None:
            slurm.end_job_after_lost_peer(reason)
        if not main and not silent:
            self._leave_once_the_run_exists(exc)

    def _leave_once_the_run_exists(self, exc: BaseException) -> None:
        """A Slurm job's rank that fails of its own error ends the job as soon as its process
        leaves: srun's --kill-on-bad-exit then gives rank 0 KillWait seconds before SIGKILL,
        too few to import MLflow and open the store on a busy node when rank 0 had not created
        its run yet - the job left no run at all. So this rank stays, up to RUN_WAIT_S, until
        the run exists (rank 0's mlflow_run.json in the job's directory, which a Slurm job's
        ranks share); ending it FAILED then takes rank 0 one request. Not before the ranks
        started their logger (rank 0 is then held up in the same collective, its run not asked
        for), nor when rank 0 is gone. Outside Slurm the local launcher waits for rank 0's
        ending itself; torchrun's ranks may each have a directory of their own."""
        if (self.cfg.cluster is None or not self.cfg.tracking.enabled
                or not self.logger.started or distributed.lost_a_peer(exc)
                or (self.out / RUN_FILE).exists() or not distributed.main_answers()):
            return
        log.warning("rank %d: waiting up to %.0f s for rank 0 to create the job's MLflow run "
                    "before leaving, so that the run records this failure", self.env.rank,
                    RUN_WAIT_S)
        deadline = time.monotonic() + RUN_WAIT_S
        while (not (self.out / RUN_FILE).exists() and time.monotonic() < deadline
               and distributed.main_answers()):
            time.sleep(0.2)

    def _log_traceback(self, exc: BaseException) -> None:
        """This rank's traceback into the job's train.log, not the terminal (which shows the
        cause in one line)."""
        text = "".join(traceback.format_exception(exc)).rstrip("\n")
        with contextlib.suppress(OSError), (self.out / "train.log").open("a") as f:
            f.write(f"[rank {self.env.rank}] traceback of its error:\n{text}\n")

    def _keep_failure(self, reason: str, trace: str | None) -> None:
        """The cause in the output directory (FAILURE_FILE) and train.log, the tracebacks of
        the ranks that failed first, in the run."""
        self._write_failure(reason, trace)
        if not self.logger.started:  # failed before its run was asked for: none to take them
            return
        if (self.out / "train.log").exists():
            self.logger.run.log(records.ArtifactFile(str(self.out / "train.log")))
        self.logger.rank_files(self.out / rankfiles.MEMORY_DIR, "rank-*.pickle")

    def _write_failure(self, reason: str, trace: str | None) -> None:
        """The cause in the output directory (FailureRecord): what the login node shows of a
        Slurm job, and how it ends a run whose rank 0 could not (train/launch/follow.py)."""
        FailureRecord.now(reason, trace, self.env.rank).write(self.out)

    def _cause_kept(self) -> bool:
        """Whether this start of the job has its cause in FailureRecord already: rank 0 that
        failed of a peer's error wrote it, ended its run and left before this rank found it
        gone (and took it for silent). Without a watch (its start time), any record counts."""
        own, kept = watch.current(), FailureRecord.read(self.out)
        if kept is None:
            return False
        return own is None or kept.at >= own.started - watch.START_SKEW_S

    def _log_stacks(self) -> None:
        """The ranks' stacks (dumped after a collective timed out) as the run's artifacts."""
        if self.logger.started:
            self.logger.rank_files(self.out / rankfiles.STACKS_DIR, "rank-*.txt")

    def finished(self) -> None:
        """After the run ended FINISHED: an earlier start's cause (FailureRecord) is no longer
        the job's; the last job of an unwaited sweep ends its parent."""
        if self.env.is_main:
            FailureRecord.remove(self.out)
            sweep.end_parent_if_last(self.cfg.tracking, self.cfg.trainer.objective,
                                     self.cfg.trainer.objective_direction)

    def _end_sweep_if_last(self, ended: str) -> None:
        """A sweep left unwaited counts this job as ended (also one that failed before its run
        existed) and its last job ends the parent."""
        cfg = self.cfg
        sweep.end_parent_if_last(cfg.tracking, cfg.trainer.objective,
                                 cfg.trainer.objective_direction,
                                 None if self.logger.run.run_id else (str(self.out), ended))
