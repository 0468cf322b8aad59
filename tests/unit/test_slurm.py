"""Slurm without a cluster: train/distributed/slurm.py in a job (requeue after USR2, the run's
tags; `scontrol` a stub that notes its arguments) and train/launch/submit.py's request checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from train.config.cluster import ClusterConfig
from train.config.groups import ConfigError, DistributedConfig, TrainConfig
from train.distributed import slurm as in_job
from train.launch import submit as slurm


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`scontrol` on PATH that writes its arguments to a file; a Slurm job's environment."""
    calls = tmp_path / "scontrol.calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    return calls


def test_a_time_limit_requeues_until_the_budget_is_spent(fake_scontrol: Path) -> None:
    assert in_job.requeue_after_stop("SIGUSR2", 0, 3) == 1
    assert in_job.requeue_after_stop("SIGUSR2", 2, 3) == 3
    assert in_job.requeue_after_stop("SIGUSR2", 3, 3) is None  # spent: not requeued
    assert fake_scontrol.read_text().splitlines() == ["requeue 41", "requeue 41"]


def test_requeue_targets_the_array_task_and_only_after_usr2(
        fake_scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert in_job.requeue_after_stop("SIGTERM", 0, 3) is None  # Slurm requeues it itself
    assert not fake_scontrol.exists()
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    assert in_job.requeue_target() == "40_1"
    assert in_job.requeue_after_stop("SIGUSR2", 0, 1) == 1
    assert fake_scontrol.read_text().splitlines() == ["requeue 40_1"]


def test_outside_slurm_nothing_is_requeued_or_tagged(fake_scontrol: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID")
    assert in_job.requeue_after_stop("SIGUSR2", 0, 3) is None
    assert in_job.slurm_tags(["node1"]) == {}
    assert not fake_scontrol.exists()


def test_slurm_tags_name_the_job_and_its_nodes(fake_scontrol: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_PARTITION", "debug")
    assert in_job.slurm_tags(["node2", "node1", "node2"]) == {
        "slurm.job_id": "41", "slurm.nodes": "node1,node2", "slurm.partition": "debug"}
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    tags = in_job.slurm_tags(["node1"])
    assert tags["slurm.job_id"] == "40" and tags["slurm.array_task_id"] == "0"


def test_the_request_is_checked_with_the_shared_ranks_per_node() -> None:
    cfg = TrainConfig(cluster=ClusterConfig(nodes=2, gpus_per_node=4))
    assert slurm.check_request(cfg) == 8
    cfg.cluster = ClusterConfig(gpus_per_node=2, tasks_per_node=1, time_min=0)
    with pytest.raises(ConfigError, match="a GPU job runs one rank per GPU.*time_min"):
        slurm.check_request(cfg)


def test_cuda_only_options_on_nodes_without_gpus_are_refused_before_submitting() -> None:
    """Issue 17: a job asked for no GPU cannot serve nccl, device=cuda or SyncBatchNorm; the
    request is refused on the login node instead of failing in the job after hours queued."""
    cfg = TrainConfig(cluster=ClusterConfig(gpus_per_node=0),
                      distributed=DistributedConfig(sync_batchnorm=True, backend="nccl"))
    with pytest.raises(ConfigError, match=r"distributed.backend=nccl "
                       r"distributed.sync_batchnorm=true needs GPUs, but cluster.gpus_per_node=0"):
        slurm.check_request(cfg)
    cfg.cluster = ClusterConfig(gpus_per_node=1, tasks_per_node=1)
    assert slurm.check_request(cfg) == 1


def test_an_elastic_request_asks_for_a_node_range_and_lets_srun_start_the_tasks() -> None:
    """cluster.min_nodes: sbatch --nodes=min-max and --mincpus, no sbatch --ntasks-per-node
    (Slurm would then size the range at its minimum), srun's --ntasks-per-node instead."""
    from omegaconf import OmegaConf

    from tests.conftest import composed

    cfg = composed("+cluster=slurm", "cluster.nodes=3", "cluster.min_nodes=2",
                   "cluster.tasks_per_node=2", "cluster.cpus_per_task=3",
                   "+cluster.sbatch_extra.mail-type=END", return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["additional_parameters"] == {"mail-type": "END", "nodes": "2-3",
                                                 "mincpus": 6}
    assert launcher["srun_args"] == ["--ntasks-per-node=2"]
    fixed = composed("+cluster=slurm", "cluster.nodes=3", "cluster.min_nodes=3",
                     return_hydra_config=True)
    assert dict(fixed.hydra.launcher.additional_parameters) == {}
    cluster = ClusterConfig(nodes=3, min_nodes=2, tasks_per_node=2)
    assert slurm.check_request(TrainConfig(cluster=cluster)) == 6
    assert slurm.smallest_world_size(cluster) == 4 and slurm.rank_request(cluster) == "4-6"
    assert slurm.node_request(cluster) == "2-3"
    for wrong in (0, 4):
        with pytest.raises(ConfigError, match=f"cluster.min_nodes={wrong} must be from 1 to "
                                              "cluster.nodes=3"):
            slurm.check_request(TrainConfig(cluster=ClusterConfig(nodes=3, min_nodes=wrong)))


def test_an_elastic_job_is_checked_at_its_smallest_world_size_too() -> None:
    """A global batch that divides over the most ranks but not the fewest is refused before
    submission: the job may resume on cluster.min_nodes."""
    from tests.conftest import typed
    from train.launch.preflight import validate

    cfg = typed("+cluster=slurm", "cluster.nodes=3", "cluster.min_nodes=2",
                "data.batch_size=3")
    validate(cfg, slurm.job_world_size(cfg.cluster))
    with pytest.raises(ConfigError, match="data.batch_size"):
        validate(cfg, slurm.smallest_world_size(cfg.cluster))
