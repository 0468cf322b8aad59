"""Which GPU each rank binds to (train/distributed/devices.py), and the requeue budget of a
plain `srun` job: the choice itself, in process and without Slurm. The ranks of real `srun`
steps on the local cluster's fake GPUs, and slurm/train.sbatch's time-limit requeue:
tests/cluster/test_gpu_binding.py.
"""

from __future__ import annotations

import pytest

from train.config.cluster import ClusterConfig
from train.config.distributed import DistributedConfig
from train.distributed.devices import (
    choose_gpu,
    gpu_for_rank,
    group_backend,
    local_gpu_problem,
    select_device,
    visible_gpus,
)
from train.distributed.env import DistEnvError
from train.distributed.slurm import requeue_budget


def test_a_rank_that_sees_all_the_nodes_gpus_takes_its_local_ranks() -> None:
    assert [choose_gpu(["0", "1"], rank, 2) for rank in range(2)] == [0, 1]
    # Slurm's indices of the GPUs it handed out, not 0..N-1 when others hold the first ones
    assert gpu_for_rank(None, 1, 2, {"CUDA_VISIBLE_DEVICES": "2,3"}) == (1, "3", 2)
    assert gpu_for_rank(4, 3, 4, {}) == (3, "3", 4)  # nothing set: every GPU of the machine
    # more GPUs than ranks (torchrun with 2 ranks on an 8-GPU machine): the rest idle
    assert gpu_for_rank(8, 1, 2, {}) == (1, "1", 8)


def test_a_rank_that_sees_one_gpu_takes_it() -> None:
    """--gpus-per-task=1 or --gpu-bind=single:1: every rank sees its own GPU as cuda:0."""
    assert [gpu_for_rank(None, rank, 4, {"CUDA_VISIBLE_DEVICES": str(5 + rank)})
            for rank in range(4)] == [(0, str(5 + rank), 1) for rank in range(4)]
    assert gpu_for_rank(None, 0, 1, {"CUDA_VISIBLE_DEVICES": "GPU-8f6c3e1a"}) == \
        (0, "GPU-8f6c3e1a", 1)


def test_visible_gpus_keeps_only_those_cuda_took() -> None:
    assert visible_gpus(2, "0,1,7") == ["0", "1"]  # CUDA stops at an entry it cannot use
    assert visible_gpus(None, " 4 , 6 ") == ["4", "6"]
    assert visible_gpus(0, "") == [] and visible_gpus(None, None) == []


@pytest.mark.parametrize(("cuda_visible", "local_rank", "local_world"),
                         [("0,1", 2, 4), ("0,1", 0, 4), ("0,1,2", 1, 4), ("", 0, 2)])
def test_other_layouts_are_refused_in_one_line(cuda_visible: str, local_rank: int,
                                               local_world: int) -> None:
    with pytest.raises(DistEnvError) as refused:
        gpu_for_rank(None, local_rank, local_world, {"CUDA_VISIBLE_DEVICES": cuda_visible})
    line = str(refused.value)
    assert "\n" not in line
    shown = cuda_visible or "(none)"
    assert f"local rank {local_rank} of {local_world} ranks on this node" in line
    assert f"CUDA_VISIBLE_DEVICES={shown}" in line
    assert "--gpus-per-task=1" in line and f"--ntasks-per-node={local_world}" in line


def test_the_cpu_needs_no_gpu_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # no layout is checked for the CPU
    assert select_device("cpu", 2, 4).type == "cpu"


# -- the ranks of real srun steps on fake GPUs ------------------------------------------------


# -- slurm/train.sbatch: USR2 before the time limit -> requeue -> the same run finishes ----------

def test_local_ranks_that_would_share_a_gpu_under_nccl_are_refused_before_they_start() -> None:
    """distributed.nproc_per_node=2 on a one-GPU machine with the defaults (device=auto,
    backend=auto: nccl on a GPU) put both ranks on cuda:0, and NCCL refused them once they had
    started ("Duplicate GPU detected"). Pre-flight now says so (the GPU count is the machine's;
    pre-flight passes it as torch counts it)."""
    def problem(gpus: int, nproc: int, **chosen: str) -> str | None:
        return local_gpu_problem(DistributedConfig(nproc_per_node=nproc, **chosen), gpus)

    refused = problem(1, 2)
    assert refused is not None and refused.startswith(
        "distributed.nproc_per_node=2 ranks need as many GPUs with backend=auto device=auto, "
        "but this machine has 1."), refused
    assert "distributed.device=cpu distributed.backend=gloo" in refused
    assert problem(2, 2) is None and problem(8, 2) is None  # a GPU each; extra ones idle
    assert problem(0, 2) is None  # no GPU: auto trains on the CPU
    # gloo moves tensors wherever they are: ranks sharing a GPU is the user's choice there
    assert problem(1, 2, backend="gloo") is None
    assert problem(1, 2, device="cuda", backend="gloo") is not None  # as before: cuda, one each
    assert problem(1, 1) is None


def test_offloaded_shards_get_gloo_beside_nccl_for_their_host_tensors() -> None:
    """FSDP's cpu_offload reduces host tensors (clipping's norm of the offloaded gradients),
    which nccl alone refuses; the CPU's gloo group is left as it is."""
    assert group_backend("nccl", host_tensors=True) == "cuda:nccl,cpu:gloo"
    assert group_backend("nccl", host_tensors=False) == "nccl"
    assert group_backend("gloo", host_tensors=True) == "gloo"


def test_a_plain_srun_job_has_the_default_requeue_budget() -> None:
    """slurm/train.sbatch runs `srun python -m train` with no cluster group: its ranks requeue
    after USR2 as often as `+cluster=slurm` jobs do by default; outside Slurm nothing does."""
    assert requeue_budget(None, "slurm") == ClusterConfig().max_requeues == 3
    assert requeue_budget(ClusterConfig(max_requeues=1), "submitit") == 1
    assert requeue_budget(None, "torchrun") is None
