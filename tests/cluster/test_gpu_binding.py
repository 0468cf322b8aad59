"""Which GPU the ranks of real `srun` steps bind to on the local cluster, whose nodes carry fake
GPUs (Slurm GRES on device files, slurm/cluster-up.sh): Slurm sets CUDA_VISIBLE_DEVICES per
task as on a GPU node and each rank runs the selection code on it; and slurm/train.sbatch's
time-limit requeue into the same run. The choice itself: tests/unit/test_gpu_binding.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cluster.conftest import wait_for_job
from tests.conftest import REPO, history, runs_in, skip_or_fail, wait_until

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


def test_slurm_gres_layouts_bind_one_gpu_per_rank_or_are_refused(cluster: None) -> None:
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


def _newest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / "checkpoints").glob("step-*.pt"))
    return found[-1] if found else None


def test_the_sbatch_template_requeues_itself_on_usr2_into_the_same_run(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
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
    state = wait_for_job(job_id, timeout=300)
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
    assert [s for s, _ in history(uri, run.info.run_id, "train/loss")] == list(range(1, epochs + 1))
