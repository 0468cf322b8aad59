"""Slurm: the login-node checks, following submitted jobs, and, inside a job, its requeue.

The submitting side is used by the Hydra launcher in hydra_plugins/train_launcher (what
`+cluster=slurm` selects) and by the pre-flight (train/preflight.py); what runs inside a job is
the ordinary training code (train/launch.py -> train/job.py), which reads its place in the job
from SLURM_* through train/distenv.py and calls `requeue_after_stop` and `slurm_tags` here.
Light on purpose: no torch or mlflow.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from train.config import ClusterConfig, ConfigError, TrainConfig, ranks_per_node

log = logging.getLogger("train")

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE")
POLL_S = 2.0


class SubmitError(RuntimeError):
    """The job cannot be submitted as asked; nothing was submitted."""


# -- the login node: before anything is submitted --------------------------------------------

def check_slurm(partitions: Iterable[str | None]) -> None:
    """sbatch is here, the controller answers, and every partition asked for exists."""
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch is not on PATH: run this on a Slurm login node (or `make "
                          "cluster-up` for the local test cluster).")
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SubmitError(f"Slurm does not answer (sinfo: {e}).") from None
    if out.returncode != 0:
        raise SubmitError("No usable Slurm configuration or controller: sinfo says "
                          f"{out.stderr.strip() or out.stdout.strip()!r}. Check SLURM_CONF.")
    existing = [p.rstrip("*") for p in out.stdout.split()]
    for partition in dict.fromkeys(partitions):  # each once, in order
        if partition is not None and partition not in existing:
            raise SubmitError(f"cluster.partition={partition!r} does not exist; partitions: "
                              f"{', '.join(existing)}.")


def job_world_size(cluster: ClusterConfig) -> int:
    """Ranks of one Slurm job: nodes x ranks per node."""
    return cluster.nodes * ranks_per_node(cluster)


def check_request(cfg: TrainConfig) -> int:
    """Refuse an inconsistent resource request; returns the job's world size. (The rest of
    the config is validated against that world size by the pre-flight.)"""
    assert cfg.cluster is not None
    c = cfg.cluster
    problems = []
    if c.nodes < 1:
        problems.append("cluster.nodes must be at least 1.")
    if c.gpus_per_node < 0:
        problems.append("cluster.gpus_per_node cannot be negative.")
    per_node = ranks_per_node(c)
    if c.gpus_per_node > 0 and per_node != c.gpus_per_node:
        problems.append(f"cluster.tasks_per_node={per_node} but cluster.gpus_per_node="
                        f"{c.gpus_per_node}: a GPU job runs one rank per GPU.")
    if c.time_min < 1:
        problems.append("cluster.time_min must be at least 1.")
    if c.max_requeues < 0:
        problems.append("cluster.max_requeues cannot be negative.")
    if problems:
        raise ConfigError("Refusing to submit: " + " ".join(problems))
    return job_world_size(c)


def warn_local_store(uri: str) -> None:
    print(f"warning: tracking store {uri} is a local path: the compute nodes must see it on "
          "a shared filesystem (and SQLite on NFS can lock badly). With many jobs or nodes, "
          "run an MLflow server (`make mlflow-server` or slurm/mlflow-server.sbatch) and set "
          "MLFLOW_TRACKING_URI=http://<host>:<port>.", file=sys.stderr, flush=True)


def show_script(executor: Any, num_jobs: int) -> str:
    """The sbatch script submitit would submit (with the array line for a sweep)."""
    slurm = executor._executor
    parameters = dict(slurm.parameters)
    if num_jobs > 1:
        parameters["map_count"] = num_jobs
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=slurm._submitit_command_str, folder=slurm.folder,
                               **parameters)


def _log_paths(job: Any) -> tuple[Path, Path]:
    task0 = job.task(0)
    return task0.paths.stdout, task0.paths.stderr


def announce(jobs: Sequence[Any], world_size: int, nodes: int) -> None:
    first = jobs[0]
    ids = first.job_id.split("_")[0] + (f"_[0-{len(jobs) - 1}]" if len(jobs) > 1 else "")
    print(f"Submitted Slurm job {ids}: {len(jobs)} job(s), each {world_size} rank(s) on "
          f"{nodes} node(s).", flush=True)
    stdout, stderr = _log_paths(first)
    print(f"  rank 0 logs: {stdout}\n               {stderr}", flush=True)
    print(f"  all ranks:   {stdout.parent}/  (one .out/.err per rank)", flush=True)
    print(f"  follow with: squeue -j {ids.split('_')[0]}; sacct -j {ids.split('_')[0]}",
          flush=True)


def follow(jobs: Sequence[Any]) -> list[str]:
    """Print each job's state changes until every job has ended; returns the final states."""
    last: dict[str, str] = {}
    while True:
        for job in jobs:
            state = job.get_info(mode="force").get("State", "UNKNOWN").split()[0]
            if state != last.get(job.job_id):
                print(f"[{time.strftime('%H:%M:%S')}] job {job.job_id}: {state}", flush=True)
                last[job.job_id] = state
        if all(state in TERMINAL_STATES for state in last.values()):
            return [last[job.job_id] for job in jobs]
        time.sleep(POLL_S)


def failing_log_tail(job: Any, lines: int = 40) -> str:
    """The end of the first rank's log that shows an error (ranks in order)."""
    fallback = ""
    for rank in range(job.num_tasks):
        path = job.task(rank).paths.stderr
        if not path.exists():
            continue
        text = path.read_text(errors="replace").splitlines()
        tail = f"--- {path} (last {lines} lines) ---\n" + "\n".join(text[-lines:])
        if any("Error" in line or "Traceback" in line for line in text):
            return tail
        fallback = fallback or tail
    return fallback or "(no rank log found)"


def collect(jobs: Sequence[Any], states: Sequence[str]) -> tuple[list[Any], list[Any]]:
    """Rank 0's return of every job that succeeded, and the jobs that failed.

    A job fails when Slurm says so, or when one of its ranks raised: Hydra (inside each task)
    turns the error into a FAILED JobReturn and the task ends normally, so Slurm can report
    COMPLETED for a job whose ranks failed.
    """
    from hydra.core.utils import JobStatus

    returns, failed = [], []
    for job, state in zip(jobs, states, strict=True):
        try:
            if state != "COMPLETED":
                raise RuntimeError(state)
            ranks = job.results()
            if any(r.status == JobStatus.FAILED for r in ranks):
                raise RuntimeError("a rank failed")
            returns.append(ranks[0])
        except Exception:  # noqa: BLE001 - also submitit's FailedJobError and friends
            failed.append(job)
            if state == "COMPLETED":
                print(f"[{time.strftime('%H:%M:%S')}] job {job.job_id}: FAILED (a rank raised; "
                      "Slurm reports COMPLETED)", flush=True)
    return returns, failed


def report_failures(jobs: Sequence[Any], failed: Sequence[Any]) -> None:
    for job in failed:
        print(f"\njob {job.job_id} failed.\n{failing_log_tail(job)}", file=sys.stderr)
    if failed:
        print(f"\nerror: {len(failed)} of {len(jobs)} Slurm job(s) failed.", file=sys.stderr)


# -- inside a job ----------------------------------------------------------------------------

def requeue_target() -> str | None:
    """This Slurm job's id as `scontrol requeue` wants it (array tasks included); None outside
    Slurm."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_after_stop(signal_name: str, requeues_so_far: int, max_requeues: int) -> int | None:
    """After a stop and its checkpoint (rank 0): USR2, Slurm's warning before the time limit,
    makes the job requeue itself (`scontrol requeue`, same job id) unless `max_requeues` is
    spent; returns the new count (for the checkpoint), None when nothing was requeued.

    This counter is the job's only requeue budget: submitit's own (max_num_timeout) is pinned
    to 0, since the job's USR2 handler replaces submitit's. TERM (a preemption, or `scontrol
    requeue` from outside) needs nothing here: Slurm requeues the job itself.
    """
    job = requeue_target()
    if signal_name != "SIGUSR2" or job is None:
        return None
    if requeues_so_far >= max_requeues:
        log.error("time limit reached %d times (cluster.max_requeues=%d): not requeueing",
                  requeues_so_far + 1, max_requeues)
        return None
    log.warning("requeueing Slurm job %s; it resumes from the checkpoint", job)
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("could not requeue Slurm job %s: %s", job, e)
        return None
    if done.returncode != 0:
        log.error("could not requeue Slurm job %s: %s", job, done.stderr.strip())
        return None
    return requeues_so_far + 1


def slurm_tags(hosts: list[str]) -> dict[str, str]:
    """Where a Slurm job ran (every rank's host), as run tags; empty outside Slurm."""
    if "SLURM_JOB_ID" not in os.environ:
        return {}
    tags = {"slurm.job_id": os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"]),
            "slurm.nodes": ",".join(sorted(set(hosts))),
            "slurm.partition": os.environ.get("SLURM_JOB_PARTITION", "")}
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        tags["slurm.array_task_id"] = os.environ["SLURM_ARRAY_TASK_ID"]
    return tags
