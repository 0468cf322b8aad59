"""A rank stuck on the local 2-node Slurm cluster (issue 29): the error names the node and the
user's line; every rank's stacks are the run's artifacts; the job ends soon after the
collective's timeout. The same hang locally, and its helpers: tests/e2e/test_hang.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.cluster.conftest import job_id, slurm_job
from tests.conftest import REPO, runs_in, wait_until
from tests.e2e.test_hang import ENDS_WITHIN_S, STUCK, TIMEOUT_S, USERPKG, _sleep_line


@pytest.mark.parametrize(("rank", "after", "caller"), [
    (1, 0, "called from train/data/userdata.py"),  # the first read, before training
    (1, 20, "called from DataLoader"),  # mid-epoch: 20 samples read, the third step
    # Rank 0, which alone talks to MLflow, stuck: rank 1 keeps the cause, and the login node
    # ends the run that rank 0 could not.
    (0, 20, "called from DataLoader"),
], ids=["before-training", "mid-epoch", "rank-0-mid-epoch"])
def test_a_stuck_rank_on_another_node_is_named_with_its_node_and_line(
        cluster: None, store: dict[str, str], tmp_path: Path, rank: int, after: int,
        caller: str) -> None:
    started = time.monotonic()
    result = slurm_job(tmp_path, *(o for o in STUCK if "nproc_per_node" not in o),
                       f"+data.train.after={after}", f"+data.train.rank={rank}",
                       "cluster.nodes=2", "cluster.tasks_per_node=1", "cluster.cpus_per_task=1",
                       env={**store, **USERPKG}, timeout=300)
    took, ended = time.monotonic() - started, time.time()
    assert result.returncode == 1, result.stdout + result.stderr
    stuck = (f"rank {rank} on node{rank + 1} stuck ",
             f" s in userpkg/data.py:{_sleep_line()} __getitem__ (time.sleep), {caller}")
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    error = run.data.tags["error"]
    assert run.info.status == "FAILED" and error.startswith(stuck[0]) and stuck[1] in error, error
    assert f"job {job_id(result.stdout)}: the training job failed; {error}" in result.stderr
    artifacts = MlflowClient(store["MLFLOW_TRACKING_URI"]).list_artifacts(run.info.run_id,
                                                                         "stacks")
    assert sorted(a.path for a in artifacts) == ["stacks/rank-0.txt", "stacks/rank-1.txt"]
    assert took < TIMEOUT_S + 120, f"{took:.0f} s from submission to the job's end"
    # From the read the rank got stuck in (its stacks file's header) to the follower's last
    # line: the local bound, plus Slurm's ending of the step and the follower's polling.
    hung_at = json.loads((tmp_path / "sweep" / "0" / "stacks" / f"rank-{rank}.txt")
                         .read_text().split("\n")[0][2:])["since"]
    assert ended - hung_at < ENDS_WITHIN_S + 20, f"ended {ended - hung_at:.0f} s after the hang"


def test_status_and_stacks_of_a_running_slurm_job_by_its_id(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    """Rank 1 stuck on node2 (the collective's timeout far off): train.status and train.stacks
    with the Slurm job id show it in "data" at the user's line; the job goes on until
    scancel."""
    overrides = [o for o in STUCK if "nproc_per_node" not in o and "timeout_s" not in o]
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", "+cluster=slurm", "cluster.partition=debug",
         "cluster.time_min=10", f"hydra.sweep.dir={tmp_path}/sweep", *overrides,
         "+data.train.after=20", "distributed.timeout_s=300", "cluster.nodes=2",
         "cluster.tasks_per_node=1", "cluster.cpus_per_task=1"], cwd=REPO,
        env={**os.environ, **store, **USERPKG}, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    job = ""
    try:
        assert proc.stdout is not None
        job = wait_until(lambda: re.search(r"Submitted Slurm job (\d+)", proc.stdout.readline()),
                         120, "the job's id")[1]
        beat = tmp_path / "sweep" / "0" / "ranks" / "rank-1.json"
        wait_until(lambda: '"phase": "data"' in _text(beat) and '"step": 0' not in _text(beat),
                   240, "rank 1 stuck in data")
        status = _inspect("status", job)
        assert re.search(r"^rank 1 on \S+ \(pid \d+\): step \d+, data for", status, re.M), status
        stacks = _inspect("stacks", job)
        assert f"rank 1: userpkg/data.py:{_sleep_line()} __getitem__ (time.sleep)" in stacks
        assert proc.poll() is None
    finally:
        if job:
            subprocess.run(["scancel", job], check=False)
        proc.kill()
        proc.wait()


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _inspect(command: str, target: str) -> str:
    done = subprocess.run([sys.executable, "-m", "train", command, target], cwd=REPO,
                          env={**os.environ, **USERPKG}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout
