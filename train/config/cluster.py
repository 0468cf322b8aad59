"""The `cluster` config group (`+cluster=slurm`): the Slurm resources of a job, and how they
become what Slurm is asked for. A dataclass with a docstring per field, like
train/config/groups.py's
(whose TrainConfig holds it); conf/cluster/slurm.yaml maps it onto submitit's launcher through
the resolvers train/config/schema.py registers from the functions below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClusterConfig:
    """Slurm resources; present only with `+cluster=slurm`, which maps them onto submitit's
    launcher (conf/cluster/slurm.yaml)."""

    nodes: int = 1
    """Nodes per job (the most it asks for, with cluster.min_nodes)."""
    min_nodes: int | None = None
    """The fewest nodes the job runs on (sbatch --nodes=min_nodes-nodes); null = cluster.nodes.
    Below cluster.nodes, a job that Slurm requeues (a lost or drained node, a preemption, its
    time limit) starts again on the nodes it gets, as few as this, and resumes its checkpoint
    at that world size into the same run; the run records each attempt's world size."""
    gpus_per_node: int = 0
    """GPUs per node (one rank each by default)."""
    tasks_per_node: int | None = None
    """Ranks per node; null = gpus_per_node (1 on CPU partitions)."""
    ranks: str = "per_task"
    """How the ranks start: "per_task", one Slurm task per rank (srun starts them all); or
    "per_node", one Slurm task per node that starts its node's ranks itself (torchrun style:
    one srun task per node, as container and MPI-less sites often want)."""
    python: str | None = None
    """The command that runs python on the nodes (submitit's `python`), e.g. `apptainer exec
    --nv /images/train.sif python`; null = this interpreter."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun options for the line that starts the job's tasks, e.g. pyxis's
    --container-image=...; --kill-on-bad-exit=1 is always added."""
    cpus_per_task: int = 1
    """CPUs per rank (with ranks=per_node the node's task gets cpus_per_task x its ranks)."""
    mem_gb: int | None = None
    """Memory per node in GB; null = the partition default."""
    time_min: int = 60
    """Time limit in minutes."""
    partition: str | None = None
    """Slurm partition; null = the cluster default."""
    account: str | None = None
    """Slurm account."""
    qos: str | None = None
    """Slurm QOS."""
    constraint: str | None = None
    """Slurm node constraint."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before srun (module loads, venv activation)."""
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    """Further sbatch options, e.g. {mail-type: END}."""
    job_name: str | None = None
    """Job name; null = the experiment name."""
    snapshot_code: bool = True
    """At submission, copy the project's code and the user packages its `_target_`s name into
    `<sweep dir>/code/`, and have the job (and its requeues) import that copy: a queued job runs
    the code it was submitted with, not the tree as edited meanwhile (train/launch/snapshot.py).
    false = the job imports the tree as it is when it starts."""
    dry_run: bool = False
    """Print the sbatch script that would be submitted and exit."""
    wait: bool = True
    """Follow the job until it ends."""
    array_parallelism: int = 16
    """Sweeps: array tasks running at once."""
    signal_delay_s: int = 120
    """Slurm sends USR2 this long before the time limit: checkpoint, then requeue."""
    max_requeues: int = 3
    """How often a job requeues itself after a time limit (USR2) before it gives up. The only
    requeue budget: submitit's own (max_num_timeout) is pinned to 0, as the job's USR2 handler
    replaces submitit's."""


def ranks_per_node(cluster: ClusterConfig) -> int:
    """Ranks (Slurm tasks) per node: one per GPU unless tasks_per_node says otherwise. The one
    place this is decided: the launcher's tasks_per_node (conf/cluster/slurm.yaml) and the
    request check (train/launch/submit.py) both use it."""
    if cluster.tasks_per_node is not None:
        return cluster.tasks_per_node
    return max(1, cluster.gpus_per_node)


def slurm_tasks_per_node(cluster: ClusterConfig) -> int:
    """What Slurm is asked for per node (`--ntasks-per-node`): one task per rank, or one task
    that starts the node's ranks (ranks=per_node)."""
    return 1 if cluster.ranks == "per_node" else ranks_per_node(cluster)


def slurm_cpus_per_task(cluster: ClusterConfig) -> int:
    """`--cpus-per-task`: cluster.cpus_per_task stays per rank, so a per-node task gets the
    CPUs of all the ranks it starts."""
    per_node = cluster.ranks == "per_node"
    return cluster.cpus_per_task * (ranks_per_node(cluster) if per_node else 1)


def elastic(cluster: ClusterConfig) -> bool:
    """The job may run on fewer nodes than it asks for (cluster.min_nodes below cluster.nodes)."""
    return cluster.min_nodes is not None and cluster.min_nodes < cluster.nodes


def slurm_sbatch_extra(cluster: ClusterConfig) -> dict[str, Any]:
    """cluster.sbatch_extra, plus, for an elastic job, `--nodes=min-max` and the CPUs each node
    needs (`--mincpus`). Slurm sizes a node range by the job's task count, so an elastic job
    asks for no tasks per node (with it, sbatch fixes the tasks at min_nodes' and the range
    always gets min_nodes): srun starts them instead (`slurm_srun_args`)."""
    extra = dict(cluster.sbatch_extra)
    if elastic(cluster):
        extra["nodes"] = f"{cluster.min_nodes}-{cluster.nodes}"
        extra["mincpus"] = slurm_cpus_per_task(cluster) * slurm_tasks_per_node(cluster)
    return extra


def slurm_srun_args(cluster: ClusterConfig) -> list[str]:
    """cluster.srun_args, plus, for an elastic job, srun's --ntasks-per-node: the tasks of
    however many nodes the job got (slurm_sbatch_extra)."""
    extra = [f"--ntasks-per-node={slurm_tasks_per_node(cluster)}"] if elastic(cluster) else []
    return [*cluster.srun_args, *extra]

