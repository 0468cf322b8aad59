"""One Slurm task per node (cluster.ranks=per_node) and containers (cluster.python,
cluster.srun_args), on the real local 2-node cluster (issue 13). Without a cluster:
tests/unit/test_slurm_pernode.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import slurm_job
from tests.cluster.test_slurm_faults import running_an_epoch
from tests.conftest import history, runs_in

PER_NODE = ("cluster.ranks=per_node", "cluster.nodes=2", "cluster.tasks_per_node=2")


def test_dry_run_shows_the_container_python_and_srun_args(
        cluster: None, tmp_path: Path) -> None:
    apptainer = slurm_job(tmp_path, "cluster.dry_run=true", *PER_NODE, "cluster.cpus_per_task=3",
                          "cluster.python='apptainer exec --nv /images/train.sif python'")
    assert apptainer.returncode == 0, apptainer.stderr
    script = apptainer.stdout
    # One task per node, with the CPUs of the node's two ranks.
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=6"):
        assert line in script
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    assert "--kill-on-bad-exit=1 apptainer exec --nv /images/train.sif python -u -m " \
        "submitit.core._submit" in srun
    pyxis = slurm_job(tmp_path, "cluster.dry_run=true", "cluster.tasks_per_node=2",
                      "cluster.python=python", "cluster.srun_args=['--container-image="
                      "/images/train.sqsh','--container-mounts=/scratch:/scratch']")
    assert pyxis.returncode == 0, pyxis.stderr
    [srun] = [line for line in pyxis.stdout.splitlines() if line.startswith("srun ")]
    assert "--kill-on-bad-exit=1 --container-image=/images/train.sqsh " \
        "--container-mounts=/scratch:/scratch python -u -m submitit.core._submit" in srun
    assert "#SBATCH --ntasks-per-node=2" in pyxis.stdout  # per_task: one task per rank


@pytest.mark.parametrize(("override", "expected"), [
    ("cluster.ranks=per_gpu", "cluster.ranks='per_gpu'; choose one of ['per_task', 'per_node']"),
    ("cluster.python='apptainer exec\ta.sif python'",
     "cluster.python='apptainer exec\\ta.sif python' holds a control character"),
    ("cluster.srun_args=['--container-image=a\nb']", "cluster.srun_args[0]="),
    ("cluster.python=' '", "cluster.python is empty"),
])
def test_bad_layout_or_container_input_is_refused_before_submitting(
        cluster: None, store: dict[str, str], tmp_path: Path,
        override: str, expected: str) -> None:
    result = slurm_job(tmp_path, override, env=store, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert expected in line
    assert "Submitted" not in result.stdout
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


def _python_wrapper(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for a container's python: notes the host it ran on, then runs this venv's."""
    used = tmp_path / "wrapper.used"
    wrapper = tmp_path / "container-python"
    wrapper.write_text(f'#!/bin/sh\necho "$(hostname) $SLURM_PROCID" >> {used}\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, used


def test_one_task_per_node_through_a_container_python_makes_one_run(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    """2 nodes x 2 ranks, each node's one task started through cluster.python, which starts
    its two ranks itself: one run of 4 ranks, ranks 0-1 on node1 and 2-3 on node2."""
    wrapper, used = _python_wrapper(tmp_path)
    result = slurm_job(tmp_path, *PER_NODE, f"cluster.python={wrapper}", "trainer.epochs=1",
                       "data.batch_size=64", "tracking.log_model=false", env=store)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": COMPLETED" in result.stdout
    assert sorted(used.read_text().splitlines()) == ["node1 0", "node2 1"]  # one task per node
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["world_size"] == "4" and tags["launcher"] == "submitit per node"
    assert tags["rank_hostnames"] == "node1,node1,node2,node2"
    assert tags["slurm.nodes"] == "node1,node2"
    assert history(uri, run.info.run_id, "train/samples") == [(1, 1440.0)]
    assert history(uri, run.info.run_id, "val/samples") == [(1, 359.0)]


def test_a_failing_rank_on_one_node_ends_the_per_node_job(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    result = slurm_job(tmp_path, *PER_NODE, "trainer.epochs=50",
                       env={**store, "TRAIN_FAIL_DRILL": "3:2"}, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ": FAILED" in result.stdout
    # The run's root cause heads the terminal's block (node1's ranks only saw a closed
    # connection; node2's task exited non-zero and srun ended node1's); no traceback there.
    assert ": the training job failed; rank 3 on node2: FailureDrill" in result.stderr
    assert "Traceback" not in result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("rank 3 on node2")


def test_the_time_limit_signal_reaches_every_node_s_ranks(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    """USR2 (Slurm's warning before the time limit, sent here with scancel) reaches each node's
    task, which passes it on to its ranks: one checkpoint, the run KILLED, and with no requeue
    left (max_requeues=0) the terminal says how to resume."""
    proc, job = running_an_epoch(tmp_path, store, *PER_NODE, "cluster.max_requeues=0")
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stdout + stderr
    assert "time limit reached, checkpoint" in stdout and "trainer.resume=" in stdout
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "KILLED", run.data.tags.get("error")
    assert run.data.tags["stopped_by"] == "SIGUSR2" and "error" not in run.data.tags
    assert list((tmp_path / "sweep" / "0" / "checkpoints").glob("step-*.pt"))
