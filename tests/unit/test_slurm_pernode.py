"""One Slurm task per node (cluster.ranks=per_node) without a cluster: the ranks a node's task
starts, what it refuses, and what Slurm is asked for (issue 13)."""

from __future__ import annotations

import os

import pytest

from train.config.cluster import ClusterConfig, slurm_cpus_per_task, slurm_tasks_per_node
from train.distributed import env as distenv
from train.distributed.env import TORCHRUN_VARS
from train.launch import submit as slurm


def _node_task_env(procid: int, tasks: int = 2, nodes: int = 2) -> dict[str, str]:
    """What srun gives the task of node `procid` in a 2-node job with one task per node."""
    return {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(procid), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


def test_the_second_node_task_starts_ranks_2_and_3_of_4(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("SLURM_") or k in TORCHRUN_VARS]:
        monkeypatch.delenv(key)
    for key, value in _node_task_env(1).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # set by the call: undone after the test
    node = distenv.slurm_node_task(2)
    assert (node.node_rank, node.world_size, node.master_addr) == (1, 4, "node1")
    envs = [node.env(local) for local in range(2)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] \
        == [("2", "0", "4", "2"), ("3", "1", "4", "2")]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] == str(node.master_port)
    assert node.master_port == distenv.job_master_port()  # as a task per rank would derive it
    # The first node's task computes the same master (seeded by the job id).
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert distenv.slurm_node_task(2).master_port == node.master_port


def test_a_node_task_refuses_a_half_set_or_per_rank_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("SLURM_") or k in TORCHRUN_VARS]:
        monkeypatch.delenv(key)
    with pytest.raises(distenv.DistEnvError, match="only inside a Slurm job step"):
        distenv.slurm_node_task(2)
    for key, value in _node_task_env(0, tasks=4).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(distenv.DistEnvError, match="one Slurm task per node, but this step has "
                       "4 task"):
        distenv.slurm_node_task(2)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(distenv.DistEnvError, match="MASTER_PORT set in the node's task"):
        distenv.slurm_node_task(2)


@pytest.mark.parametrize(("overrides", "tasks", "cpus"), [
    ({}, 1, 1),
    ({"tasks_per_node": 2, "cpus_per_task": 3}, 2, 3),
    ({"ranks": "per_node", "tasks_per_node": 2, "cpus_per_task": 3}, 1, 6),
    ({"ranks": "per_node", "gpus_per_node": 4, "cpus_per_task": 8}, 1, 32),
])
def test_what_slurm_is_asked_for_per_node_and_task(overrides: dict, tasks: int,
                                                   cpus: int) -> None:
    request = ClusterConfig(**overrides)
    assert (slurm_tasks_per_node(request), slurm_cpus_per_task(request)) == (tasks, cpus)
    assert slurm.srun_args(["--container-image=x", "--kill-on-bad-exit=1"]) == [
        "--kill-on-bad-exit=1", "--container-image=x"]
