"""Which GPU each rank binds to (train/distributed/devices.py), and slurm/train.sbatch's time-limit requeue.

First the choice itself, fast and without Slurm; then the ranks of real `srun` steps on the
local cluster, whose nodes carry fake GPUs (Slurm GRES on device files, slurm/cluster-up.sh):
Slurm sets CUDA_VISIBLE_DEVICES per task as on a GPU node and each rank runs the selection
code on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, history, runs_in, skip_or_fail
from tests.test_slurm import _wait_for_job, cluster, on_slurm, wait_until  # noqa: F401
from train.config.cluster import ClusterConfig
from train.distributed.devices import choose_gpu, gpu_for_rank, select_device, visible_gpus
from train.distributed.env import DistEnvError
from train.distributed.slurm import requeue_budget

# -- the choice, no Slurm ---------------------------------------------------------------------


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

PROBE = """
import socket
from train.distributed import devices
from train.distributed import env as distenv
env = distenv.detect()  # as every rank does: LOCAL_RANK, LOCAL_WORLD_SIZE from SLURM_*
try:
    index, name, _ = devices.gpu_for_rank(None, env.local_rank, env.local_world_size)
    print("RANK", env.rank, socket.gethostname(), index, name, flush=True)
except distenv.DistEnvError as e:
    print("RANK", env.rank, socket.gethostname(), "refused", e, flush=True)
"""


def _bound(*srun_options: str) -> dict[int, list[str]]:
    """rank -> [host, index, physical GPU] (or [host, "refused", line...]), as each rank of
    `srun <options>` chose from the environment Slurm gave it."""
    step = subprocess.run(["srun", "--partition=debug", "--time=5", *srun_options,
                           sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert step.returncode == 0, step.stdout + step.stderr
    lines = [line.split()[1:] for line in step.stdout.splitlines() if line.startswith("RANK ")]
    return {int(words[0]): words[1:] for words in lines}


@on_slurm
def test_slurm_gres_layouts_bind_one_gpu_per_rank_or_are_refused(cluster: None) -> None:  # noqa: F811
    gres = subprocess.run(["sinfo", "-h", "-N", "-o", "%G"], capture_output=True, text=True,
                          timeout=30).stdout.split()
    if not gres or any(not g.startswith("gpu:") for g in gres):
        skip_or_fail(f"the running cluster's nodes have no fake GPUs ({gres}): it was started by "
                     "an older slurm/cluster-up.sh; `make cluster-down cluster-up` restarts it")
    # each task sees both GPUs of its node: rank = local rank's GPU, on each of two nodes
    seen = _bound("-N2", "--ntasks-per-node=2", "--gres=gpu:2")
    if any("CUDA_VISIBLE_DEVICES=(none)" in " ".join(words) for words in seen.values()):
        skip_or_fail("Slurm gave the tasks no CUDA_VISIBLE_DEVICES: the cluster's fake GPUs "
                     "need mknod (see slurm/cluster-up.sh's warning)")
    assert seen == {0: ["node1", "0", "0"], 1: ["node1", "1", "1"],
                    2: ["node2", "0", "0"], 3: ["node2", "1", "1"]}

    # one GPU per task: each rank sees only its own, as cuda:0, and no two share one
    seen = _bound("-N1", "-n2", "--gpus-per-task=1")
    assert [seen[r][1] for r in (0, 1)] == ["0", "0"] and seen[0][0] == seen[1][0]
    assert sorted(seen[r][2] for r in (0, 1)) == ["0", "1"]

    # two GPUs for three ranks on the node: every rank refuses, saying how to ask instead
    seen = _bound("-N1", "--ntasks-per-node=3", "--gres=gpu:2")
    assert sorted(seen) == [0, 1, 2]
    for rank, words in seen.items():
        line = " ".join(words[2:])
        assert words[1] == "refused", seen
        assert f"local rank {rank} of 3 ranks on this node sees 2 GPUs " \
               "(CUDA_VISIBLE_DEVICES=0,1)" in line
        assert "--gpus-per-task=1" in line and "--ntasks-per-node=3" in line


# -- slurm/train.sbatch: USR2 before the time limit -> requeue -> the same run finishes ----------

def test_a_plain_srun_job_has_the_default_requeue_budget() -> None:
    """slurm/train.sbatch runs `srun python -m train` with no cluster group: its ranks requeue
    after USR2 as often as `+cluster=slurm` jobs do by default; outside Slurm nothing does."""
    assert requeue_budget(None, "slurm") == ClusterConfig().max_requeues == 3
    assert requeue_budget(ClusterConfig(max_requeues=1), "submitit") == 1
    assert requeue_budget(None, "torchrun") is None


def _newest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / "checkpoints").glob("step-*.pt"))
    return found[-1] if found else None


@on_slurm
def test_the_sbatch_template_requeues_itself_on_usr2_into_the_same_run(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    """The USR2 of `#SBATCH --signal=USR2@...` (sent here at once by `scancel --signal`, which
    reaches the job's steps the same way) stops the ranks with a checkpoint; rank 0 requeues
    the job; the rerun (same job id, same output directory) finishes the same MLflow run."""
    out = tmp_path / "job"
    epochs = 10  # the USR2 lands mid-training: ~1 s after the first checkpoint, even when idle
    env = {**os.environ, **store, "TRAIN_REPO": str(REPO), "TRAIN_OUTPUT_DIR": str(out)}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
         "--partition=debug", str(REPO / "slurm" / "train.sbatch"), f"trainer.epochs={epochs}",
         "tracking.log_model=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    wait_until(lambda: _newest_checkpoint(out), 180, "the first checkpoint", every=0.2)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    state = _wait_for_job(job_id, timeout=300)
    logs = "".join(p.read_text(errors="replace") for p in sorted(out.glob("rank-*.log")))
    assert state == "COMPLETED", logs
    attempts = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-o", "State", "-j", job_id],
                              capture_output=True, text=True, timeout=30).stdout.split()
    assert attempts == ["REQUEUED", "COMPLETED"], attempts
    assert "requeueing Slurm job" in logs and "resumed from" in logs  # both attempts' logs kept
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["slurm.job_id"] == job_id and tags["launcher"] == "slurm"
    assert tags["restarts"] == "1" and tags["stopped_by"] == "SIGUSR2"
    assert [s for s, _ in history(uri, run.info.run_id, "train/loss")] == list(range(epochs))
