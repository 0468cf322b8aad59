"""Slurm: the login-node checks and, inside a job, its requeue and its end after a lost peer.

The submitting side is used by the Hydra launcher in hydra_plugins/train_launcher (what
`+cluster=slurm` selects) and by the pre-flight (train/launch/preflight.py); what runs inside a job is
the ordinary training code (train/launch/local.py -> train/engine/job.py), which reads its place in the job
from SLURM_* through train/distributed/env.py and calls `requeue_after_stop` and `slurm_tags` here.
Following submitted jobs and telling how they ended is train/launch/follow.py's. Light on
purpose: no torch or mlflow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from train.config.cluster import ClusterConfig, ranks_per_node
from train.config.groups import ConfigError, TrainConfig

log = logging.getLogger("train")


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
    d = cfg.distributed  # what only CUDA serves, on nodes asked for no GPU (train/distributed/devices.py)
    cuda_only = [o for o, on in (("distributed.backend=nccl", d.backend == "nccl"),
                                 ("distributed.device=cuda", d.device == "cuda"),
                                 ("distributed.sync_batchnorm=true", d.sync_batchnorm)) if on]
    if c.gpus_per_node == 0 and cuda_only:
        problems.append(f"{' '.join(cuda_only)} needs GPUs, but cluster.gpus_per_node=0: ask for "
                        "them (cluster.gpus_per_node=N) or drop it.")
    if c.ranks not in RANK_LAYOUTS:
        problems.append(f"cluster.ranks={c.ranks!r}; choose one of {list(RANK_LAYOUTS)} (one "
                        "Slurm task per rank, or one per node that starts the node's ranks).")
    if c.python is not None and not c.python.strip():
        problems.append("cluster.python is empty: give the command that runs python on the "
                        "nodes (e.g. 'apptainer exec --nv /images/train.sif python') or null.")
    if c.time_min < 1:
        problems.append("cluster.time_min must be at least 1.")
    if c.max_requeues < 0:
        problems.append("cluster.max_requeues cannot be negative.")
    if c.time_min >= 1 and c.signal_delay_s >= c.time_min * 60:
        problems.append(f"cluster.signal_delay_s={c.signal_delay_s} is not below the time limit "
                        f"(cluster.time_min={c.time_min}, {c.time_min * 60} s): the stop signal "
                        "would come at the start. Lower it or raise cluster.time_min.")
    if problems:
        raise ConfigError("Refusing to submit: " + " ".join(problems))
    warn_time_limit(c)
    return job_world_size(c)


RANK_LAYOUTS = ("per_task", "per_node")
"""cluster.ranks: one Slurm task per rank, or one per node that starts its ranks."""
KILL_ON_BAD_EXIT = "--kill-on-bad-exit=1"


def srun_args(extra: Sequence[str]) -> list[str]:
    """The srun options of the job's step: --kill-on-bad-exit=1 always (one failing task ends
    the step at once instead of leaving the others to time out), then cluster.srun_args."""
    return [KILL_ON_BAD_EXIT, *(a for a in extra if a != KILL_ON_BAD_EXIT)]


def warn_time_limit(c: ClusterConfig) -> None:
    """The stop signal (USR2 `signal_delay_s` before the limit) should leave the job most of
    its time: warn when it would come in the first half."""
    limit_s = c.time_min * 60
    if 0 < limit_s - c.signal_delay_s < limit_s / 2:
        print(f"warning: cluster.signal_delay_s={c.signal_delay_s} is not well below the time "
              f"limit (cluster.time_min={c.time_min}): Slurm will ask the job to checkpoint and "
              f"stop ~{limit_s - c.signal_delay_s} s after it starts. Lower "
              "cluster.signal_delay_s or raise cluster.time_min.", file=sys.stderr, flush=True)


def checked_setup(lines: Sequence[str]) -> list[str]:
    """cluster.setup as lines that end the job, naming the line and its exit code, when one
    fails (a missing venv, a failed `module load`): no rank starts in a broken environment.
    Each line is kept whole (no `set -e`, which would also end the job inside sourced scripts
    that tolerate their own failing commands)."""
    import shlex

    return [f"{line} || {{ rc=$?; echo \"error: cluster.setup line failed (exit $rc):\" "
            f"{shlex.quote(line)} >&2; exit $rc; }}" for line in lines]


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


# -- inside a job ----------------------------------------------------------------------------

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
