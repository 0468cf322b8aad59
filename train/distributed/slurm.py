"""Inside a Slurm job: a rank's requeue after USR2, the run's Slurm tags, the time-limit note,
which node a rank is on, and cancelling the job once a peer is lost.

Called by the training engine (train/engine/prepare.py, ending.py) on rank 0; also under a
plain `srun` in a batch script of one's own (slurm/train.sbatch). The login node's side
(checks, submission) is train/launch/submit.py's. No torch or mlflow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
from pathlib import Path

from train.config.cluster import ClusterConfig

log = logging.getLogger("train")


def requeue_target() -> str | None:
    """This Slurm job's id as `scontrol requeue` wants it (array tasks included); None outside
    Slurm."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_budget(cluster: ClusterConfig | None, launcher: str) -> int | None:
    """How often this job may still requeue itself after USR2, in all: cluster.max_requeues
    under `+cluster=slurm`; its default for `srun python -m train` in a batch script of one's
    own (slurm/train.sbatch), which has no cluster group; None outside Slurm."""
    if cluster is not None:
        return cluster.max_requeues
    return ClusterConfig().max_requeues if launcher == "slurm" else None


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


def will_requeue(signal_name: str, requeues_so_far: int, max_requeues: int) -> bool:
    """Whether `requeue_after_stop` is going to requeue this job (decided before the run ends,
    so the run can say what happens next)."""
    return (signal_name == "SIGUSR2" and requeue_target() is not None
            and requeues_so_far < max_requeues)


def time_limit_note(checkpoint: Path | None, command: str) -> str:
    """What a job stopped at its time limit and not requeued tells the user (terminal and run)."""
    if checkpoint is None:
        return "time limit reached before any checkpoint was saved; run the command again"
    kept = [word for word in command.split() if not word.startswith("trainer.resume=")]
    return (f"time limit reached, checkpoint {checkpoint} saved; resume with "
            f"{' '.join(kept)} trainer.resume={checkpoint}")


def node_of_rank(rank: int) -> str:
    """The node a rank of this Slurm step runs on (srun's default block distribution: ranks
    fill the first node, then the next); this host's name outside Slurm."""
    # LOCAL_WORLD_SIZE: ranks per node, also where one task per node starts them (per_node).
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(local) if local.isdigit() else _tasks_per_node()
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist or not per_node:
        return socket.gethostname()
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                               text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        names = []
    index = rank // per_node
    return names[index] if index < len(names) else f"node #{index} of {nodelist}"


def _tasks_per_node() -> int | None:
    text = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    digits = text.split("(")[0]  # "2(x2)": 2 on each of 2 nodes
    return int(digits) if digits.isdigit() else None


def end_job_after_lost_peer(reason: str) -> None:
    """Rank 0, once a peer stopped answering and the run is marked FAILED: cancel this job.

    Slurm cannot end a step on a node whose slurmd is gone: srun waits until the node is
    declared down (minutes), and Slurm would then requeue the job by itself, resuming a run
    the user was told had failed. The service decides instead: the job ends now, is not
    requeued, and the terminal says how to resume.
    """
    job = requeue_target()
    if job is None:
        return
    log.error("cancelling Slurm job %s (%s): it is not requeued; resume from its newest "
              "checkpoint with the same command", job, reason)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
