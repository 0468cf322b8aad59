"""Slurm from the login node: the checks before anything is submitted, the request, the dry
run's script, the srun arguments.

Used by the Hydra launcher in hydra_plugins/train_launcher (what `+cluster=slurm` selects) and
by the pre-flight (train/launch/preflight.py). What a rank does inside a job (requeue, tags,
cancelling a job whose peer died) is train/distributed/slurm.py's; following submitted jobs
and telling how they ended is train/launch/follow.py's. Light on purpose: no torch or mlflow.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from train.config.cluster import ClusterConfig, elastic, ranks_per_node, slurm_tasks_per_node
from train.config.groups import TrainConfig
from train.errors import ConfigError
from train.errors import SubmitError as SubmitError  # re-exported

log = logging.getLogger("train")


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
    """Ranks of one Slurm job: nodes x ranks per node (the most, for an elastic job)."""
    return cluster.nodes * ranks_per_node(cluster)


def smallest_world_size(cluster: ClusterConfig) -> int:
    """The fewest ranks the job may run on: cluster.min_nodes' (cluster.nodes' without it)."""
    return (cluster.min_nodes or cluster.nodes) * ranks_per_node(cluster)


def node_request(cluster: ClusterConfig) -> str:
    """The nodes asked for, as told to the user: "2", or "1-2" for an elastic job."""
    return f"{cluster.min_nodes}-{cluster.nodes}" if elastic(cluster) else str(cluster.nodes)


def elastic_tasks_per_node(cluster: ClusterConfig) -> int | None:
    """An elastic job's Slurm tasks per node (what its results are counted by); None else."""
    return slurm_tasks_per_node(cluster) if elastic(cluster) else None


def rank_request(cluster: ClusterConfig) -> str:
    """The ranks of the job, as told to the user: "4", or "2-4" for an elastic job."""
    most, fewest = job_world_size(cluster), smallest_world_size(cluster)
    return f"{fewest}-{most}" if fewest != most else str(most)


def with_all_tasks(executor: Any, jobs: list[Any], cluster: ClusterConfig) -> list[Any]:
    """submitit counts a job's tasks from sbatch's --ntasks-per-node, which an elastic job does
    not give (train/config/cluster.py slurm_sbatch_extra): the jobs again, with the tasks of
    all the nodes asked for (their logs and results; follow.py reads those of the nodes the
    job got)."""
    if not elastic(cluster):
        return jobs
    tasks = list(range(cluster.nodes * slurm_tasks_per_node(cluster)))
    folder = executor._executor.folder
    return [type(job)(folder=folder, job_id=job.job_id, tasks=tasks) for job in jobs]


def check_request(cfg: TrainConfig) -> int:
    """Refuse an inconsistent resource request; returns the job's world size. (The rest of
    the config is validated against that world size by the pre-flight.)"""
    assert cfg.cluster is not None
    c = cfg.cluster
    problems = []
    if c.nodes < 1:
        problems.append("cluster.nodes must be at least 1.")
    if c.min_nodes is not None and not 1 <= c.min_nodes <= c.nodes:
        problems.append(f"cluster.min_nodes={c.min_nodes} must be from 1 to cluster.nodes="
                        f"{c.nodes} (the most the job asks for), or null.")
    if c.gpus_per_node < 0:
        problems.append("cluster.gpus_per_node cannot be negative.")
    per_node = ranks_per_node(c)
    if c.gpus_per_node > 0 and per_node != c.gpus_per_node:
        problems.append(f"cluster.tasks_per_node={per_node} but cluster.gpus_per_node="
                        f"{c.gpus_per_node}: a GPU job runs one rank per GPU.")
    d = cfg.distributed  # what only CUDA serves, on nodes asked for no GPU
    # (train/distributed/devices.py)
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
