"""The local 2-node Slurm cluster (slurm/) for every test in tests/cluster/, and the helpers that
submit to it.

All of tests/cluster/ is one work unit (tests/conftest.py, work_unit): `make test` runs it on
one worker, which starts the cluster once for the session (unless it is up already) and stops
it at the end. Each test that uses the cluster must leave Slurm's queue empty.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, run_train, skip_or_fail, wait_until

ROOT_SKIP = 3  # cluster-up.sh's exit code when it cannot run here (not root)
QUEUE_EMPTIES_S = 30
"""A job whose follower just saw it end may still be completing (state CG) for a moment: the
queue must empty within this, or the job was left behind."""


def cluster_answers() -> bool:
    """The cluster is up: its controller answers and lists nodes, in any state. (Not "some
    node idle": on a shared cluster whose nodes are all busy, that made the fixture start the
    cluster again and then take it down under everyone else's jobs.)"""
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and bool(out.stdout.split())


def cluster_processes() -> list[str]:
    """Live daemons and job steps of the local cluster (zombies are gone in all that matters)."""
    import psutil

    daemons = {"munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "slurmstepd"}
    found = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and (
                p.info["name"] in daemons or "train-slurm" in " ".join(p.info["cmdline"] or [])):
            found.append(f"{p.pid} {p.info['name']}")
    return found


def queued_jobs() -> str:
    """squeue's job ids, one a line ("" when the queue is empty)."""
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                          timeout=20).stdout.strip()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    """The local 2-node cluster: started once for the session, stopped after (unless it was up
    already). Tests ask for `cluster`, which checks the queue after each of them."""
    already_up = cluster_answers()
    if not already_up:
        up = subprocess.run(["bash", str(REPO / "slurm" / "cluster-up.sh")], capture_output=True,
                            text=True, timeout=600)
        if up.returncode == ROOT_SKIP:
            skip_or_fail(f"the local Slurm cluster needs root: {up.stdout}{up.stderr}")
        assert up.returncode == 0, f"cluster-up failed:\n{up.stdout}\n{up.stderr}"
    yield
    if not already_up:
        down = subprocess.run(["bash", str(REPO / "slurm" / "cluster-down.sh")],
                              capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not cluster_processes(), f"left behind by cluster-down: {cluster_processes()}"


@pytest.fixture
def cluster(slurm_cluster: None, request: pytest.FixtureRequest) -> Iterator[None]:
    """The local cluster for one test, which must leave no job behind: the queue is empty
    within QUEUE_EMPTIES_S of its end (else this test's teardown fails, naming the jobs)."""
    yield
    deadline = time.monotonic() + QUEUE_EMPTIES_S
    while (leftover := queued_jobs()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover == "", f"jobs left behind by {request.node.name}: {leftover}"


def job_id(stdout: str) -> str:
    """The Slurm job id the login node announced ("Submitted Slurm job N: ..."; an array's
    "N_0" as N)."""
    return stdout.split("Submitted Slurm job ")[1].split(":")[0].split("_")[0]


def slurm_job(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None,
              timeout: float = 420) -> subprocess.CompletedProcess[str]:
    """`python -m train +cluster=slurm <overrides>` on the debug partition, followed to its
    end; `-m` anywhere in `overrides` makes it a sweep."""
    flags = [o for o in overrides if o == "-m"]  # argparse wants flags before the overrides
    overrides = tuple(o for o in overrides if o != "-m")
    return run_train(*flags, "+cluster=slurm", "cluster.partition=debug", "cluster.time_min=10",
                     f"hydra.sweep.dir={tmp_path}/sweep", *overrides, env=env, timeout=timeout)


def wait_for_job(job_id: str, timeout: float) -> str:
    """The job's final state, polled twice a second (`sbatch --wait` polls every 10 s)."""
    def final_state() -> str | None:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id],
                             capture_output=True, text=True).stdout.split()
        ended = out and out[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
        return out[0] if ended else None

    return wait_until(final_state, timeout, f"job {job_id} ending")


def listed_by_squeue(job_id: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True,
                               text=True).stdout.strip())
