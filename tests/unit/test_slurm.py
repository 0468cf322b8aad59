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
