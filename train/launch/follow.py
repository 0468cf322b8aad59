"""The login node after submission: follow the jobs, then tell how each ended.

Used by the Hydra launcher (hydra_plugins/train_launcher/slurm_launcher.py). A job ends in one
of three ways, each told the way a local job tells it: finished (its run id, final metrics and
how to view it, read from the files its rank 0 wrote: summary.json and mlflow_run.json), stopped
at its time limit without a requeue (where its checkpoint is and the command that resumes it),
or failed (the block a local job shows: the cause, what was kept and the command that resumes,
from the failure.json its rank 0 - or the rank that found rank 0 silent - wrote; the end of the
failing rank's log where no rank could write one). Light: no torch or mlflow.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.config.groups import typed_by_user
from train.distributed.slurm import time_limit_note
from train.errors import FailureRecord, StoppedBySignal
from train.launch.joblock import squeue_states
from train.launch.outcomes import failure_block

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE")
POLL_S = 2.0
ENDING_S = 120.0
"""After Slurm has named a job's end, how long its processes may still take to end (squeue's
COMPLETING): a cancelled job's ranks are then saving their stop checkpoint and marking their run
KILLED. The follower returns once they have ended, so that the run says how the job ended
when the command does - not RUNNING for another second."""


def is_shown(key: str) -> bool:
    """A job's final metrics on its closing line, as a local job shows them (report/runlog.py)."""
    return key.startswith(("val/", "test/")) or key == "train/loss"


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


def _log_paths(job: Any) -> tuple[Path, Path]:
    task0 = job.task(0)
    return task0.paths.stdout, task0.paths.stderr


def announce(jobs: Sequence[Any], world_size: int | str, nodes: int | str,
             per_node: bool = False) -> None:
    """The job ids and log paths; `world_size` and `nodes` are ranges ("2-4") for an elastic
    job (cluster.min_nodes)."""
    first = jobs[0]
    ids = first.job_id.split("_")[0] + (f"_[0-{len(jobs) - 1}]" if len(jobs) > 1 else "")
    print(f"Submitted Slurm job {ids}: {len(jobs)} job(s), each {world_size} rank(s) on "
          f"{nodes} node(s).", flush=True)
    stdout, stderr = _log_paths(first)
    print(f"  rank 0 logs: {stdout}\n               {stderr}", flush=True)
    # cluster.ranks=per_node: a node's ranks share its task's files.
    each = "node, for all of its ranks" if per_node else "rank"
    print(f"  all ranks:   {stdout.parent}/  (one .out/.err per {each})", flush=True)
    print(f"  follow with: squeue -j {ids.split('_')[0]}; sacct -j {ids.split('_')[0]}",
          flush=True)


def follow(jobs: Sequence[Any]) -> list[str]:
    """Print each job's state changes until every job has ended; returns the final states.
    UNKNOWN (Slurm's accounting has no record yet) is not a state of the job: not shown."""
    last: dict[str, str] = {}
    while True:
        for job in jobs:
            state = job.get_info(mode="force").get("State", "UNKNOWN").split()[0]
            if state != "UNKNOWN" and state != last.get(job.job_id):
                print(f"[{_stamp()}] job {job.job_id}: {state}", flush=True)
                last[job.job_id] = state
        if len(last) == len(jobs) and all(s in TERMINAL_STATES for s in last.values()):
            _until_their_processes_end(jobs)
            return [last[job.job_id] for job in jobs]
        time.sleep(POLL_S)


def _until_their_processes_end(jobs: Sequence[Any]) -> None:
    """Wait (at most ENDING_S) while squeue still lists one of `jobs` as COMPLETING. Best
    effort: a squeue that fails or no longer knows the jobs ends the wait."""
    ids = ",".join(sorted({job.job_id.split("_")[0] for job in jobs}))
    deadline = time.monotonic() + ENDING_S
    while time.monotonic() < deadline and "COMPLETING" in (squeue_states(ids, 30) or []):
        time.sleep(0.25)


def still_running(jobs: Sequence[Any]) -> str:
    """The one line for Ctrl-C while following: the jobs go on without this command."""
    job = jobs[0].job_id.split("_")[0]
    return (f"job {job} still runs: `scancel {job}` to stop it, `squeue -j {job}` to watch "
            "(its run is ended by the job itself)")


def failing_log_tail(job: Any, lines: int = 40) -> str:
    """The end of the first rank's log that shows an error (ranks in order)."""
    fallback = ""
    for rank in range(job.num_tasks):
        path = job.task(rank).paths.stderr
        if not path.exists():
            continue
        text = path.read_text(errors="replace").splitlines()
        tail = f"--- {path} (last {lines} lines) ---\n" + "\n".join(text[-lines:])
        if any(_own_error(line) for line in text):
            return tail
        fallback = fallback or tail
    return fallback or "(no rank log found)"


def _own_error(line: str) -> bool:
    """Whether a rank's log line is an error of its own: srun and slurmstepd write into the
    first rank's log that a peer exited and the step was cancelled, which says nothing of why."""
    if line.startswith(("srun:", "slurmstepd")):
        return False
    return "Error" in line or "Traceback" in line or "error:" in line


@dataclass
class Outcomes:
    """How the jobs ended: rank 0's return of each finished one, the notes of those stopped at
    their time limit, and the failed jobs."""

    returns: list[Any] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    failed: list[Any] = field(default_factory=list)


def collect(jobs: Sequence[Any], states: Sequence[str],
            tasks_per_node: int | None = None) -> Outcomes:
    """A job fails when Slurm says so, or when one of its ranks raised: Hydra (inside each
    task) turns most errors into a FAILED JobReturn, so Slurm can report COMPLETED for it. A
    stop at the time limit that was not requeued is neither: it is told apart.
    `tasks_per_node`: an elastic job's (final_tasks); None reads every task's result."""
    from hydra.core.utils import JobStatus

    outcomes = Outcomes()
    for job, state in zip(jobs, states, strict=True):
        try:
            if state != "COMPLETED":
                raise RuntimeError(state)
            ranks = [job.task(i).result() for i in range(final_tasks(job, tasks_per_node))]
        except Exception:  # noqa: BLE001 - also submitit's FailedJobError and friends
            outcomes.failed.append(job)
            continue
        if (note := time_limit_stop(ranks[0])) is not None:
            print(f"[{_stamp()}] job {job.job_id}: {note}", flush=True)
            outcomes.stopped.append(note)
        elif any(r.status == JobStatus.FAILED for r in ranks):
            outcomes.failed.append(job)
            print(f"[{_stamp()}] job {job.job_id}: FAILED (a rank raised; Slurm reports "
                  "COMPLETED)", flush=True)
        else:
            outcomes.returns.append(ranks[0])
    return outcomes


def final_tasks(job: Any, tasks_per_node: int | None) -> int:
    """The tasks of a job's last attempt: all of them, unless an elastic job (cluster.min_nodes:
    `tasks_per_node` given) got fewer nodes than it asked for, as Slurm's accounting says. The
    tasks of the nodes it no longer had left no result, or one of an earlier attempt: unread."""
    import subprocess

    if tasks_per_node is None:
        return int(job.num_tasks)
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "NNodes", "-j", job.job_id],
                             capture_output=True, text=True, timeout=30).stdout.split()
        nodes = int(out[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return int(job.num_tasks)
    return min(int(job.num_tasks), nodes * tasks_per_node)


def output_dir(ret: Any) -> Path:
    """A job's output directory, from the Hydra config its JobReturn carries (its working_dir
    is the directory it ran in, which Hydra does not change)."""
    try:
        return Path(str(ret.hydra_cfg.hydra.runtime.output_dir))
    except AttributeError:
        return Path(ret.working_dir)


def time_limit_stop(rank0: Any) -> str | None:
    """The note of a job that stopped at its time limit (USR2) and was not requeued."""
    error = getattr(rank0, "_return_value", None)
    # Preempted from a rank; JobStoppedError from a per-node task (cluster.ranks=per_node).
    if not isinstance(error, StoppedBySignal) or error.signal_name != "SIGUSR2":
        return None
    out = output_dir(rank0)
    newest = sorted((out / "checkpoints").glob("step-*.pt"),
                    key=lambda p: int(p.stem.split("-")[1]) if p.stem[5:].isdigit() else -1)
    command = " ".join(["python -m train", *typed_by_user(rank0.overrides or [])])
    return time_limit_note(newest[-1] if newest else None, command)


def report_finished(returns: Sequence[Any]) -> None:
    """As a local job ends: the run id, its final metrics and how to view it."""
    from train.tracking import how_to_view

    for ret in returns:
        out = output_dir(ret)
        try:
            summary = json.loads((out / "summary.json").read_text())
            where = json.loads((out / "mlflow_run.json").read_text())
        except (OSError, ValueError):
            print(f"job outputs in {out} (no run recorded)", flush=True)
            continue
        shown = "  ".join(f"{k}={v:.4g}" for k, v in summary.get("metrics", {}).items()
                          if is_shown(k))
        run_id = summary["run_id"]
        view = how_to_view(where["tracking_uri"], where.get("experiment_id"), run_id)
        print(f"MLflow run {run_id} FINISHED  {shown}\n  outputs: {out}\n  view it: {view}",
              flush=True)


def run_error(job: Any) -> str | None:
    """The cause a node's launcher recorded on the run for a rank 0 that died without a word
    (cluster.ranks=per_node; "MLflow run X marked FAILED: ...", train/tracking/abandoned.py):
    it can lie above the last lines of a log, under the tracebacks that followed it."""
    path = job.task(0).paths.stderr
    text = path.read_text(errors="replace") if path.exists() else ""
    found = [line for line in text.splitlines() if "marked FAILED:" in line]
    return found[-1].split("] ", 1)[-1].strip() if found else None


@dataclass(frozen=True)
class JobPlace:
    """Where a job wrote (its output directory) and how to run it again in the same place."""

    out: Path
    command: str
    """`python -m train` and the user's overrides for this job."""
    placed: list[str]
    """The overrides that put it in `out` again: its sweep directory and subdirectory."""


def report_failures(jobs: Sequence[Any], failed: Sequence[Any],
                    place: Callable[[int], JobPlace | None], since: float) -> None:
    """Each failed job as one block (what a local job shows: outcomes.failure_block) where its
    rank 0 recorded the cause; else the end of the failing rank's log. `place`: job index ->
    where it wrote; `since`: the submission's time (an older failure.json is an earlier run's)."""
    for job in failed:
        block = _failure_block(job, place(list(jobs).index(job)), since)
        if block is not None:
            print(f"\njob {job.job_id}: {block}", file=sys.stderr)
            continue
        print(f"\njob {job.job_id} failed.\n{failing_log_tail(job)}", file=sys.stderr)
        if (error := run_error(job)) is not None:
            print(f"\njob {job.job_id}: {error}", file=sys.stderr)
    if failed:
        print(f"\nerror: {len(failed)} of {len(jobs)} Slurm job(s) failed.", file=sys.stderr)


def _failure_block(job: Any, where: JobPlace | None, since: float) -> str | None:
    record = None if where is None else FailureRecord.read(where.out)
    if where is None or record is None or record.at < since:
        return None
    if record.rank != 0:  # kept by another rank: rank 0 could not end its run
        _end_run_left_running(where.out, since, record.cause)
    return failure_block(record.cause, where.out, where.command, record.trace, where.placed,
                         logs=f"{_log_paths(job)[0].parent}/", since=since)


def _end_run_left_running(out: Path, since: float, cause: str) -> None:
    """The run of a job whose rank 0 was stuck or dead when another rank kept the cause
    (failure.json): still RUNNING, as the job was ended under it. Rank 0 alone talks to MLflow
    in a job; the login node, which outlives the job, ends the run FAILED with that cause and
    the ranks' stacks."""
    from train.distributed.rankfiles import STACKS_DIR
    from train.tracking import abandoned

    abandoned.end_with_cause(out, since, cause, replace_error=False, stacks=out / STACKS_DIR,
                             announce=False)  # the failure's block shows the cause and run
