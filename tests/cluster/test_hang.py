"""A rank stuck on the local 2-node Slurm cluster (issue 29): the error names the node and the
user's line; every rank's stacks are the run's artifacts; the job ends soon after the
collective's timeout. The same hang locally, and its helpers: tests/e2e/test_hang.py."""

from __future__ import annotations

import time
from pathlib import Path

from mlflow import MlflowClient

from tests.cluster.conftest import slurm_job
from tests.conftest import runs_in
from tests.e2e.test_hang import STUCK, TIMEOUT_S, USERPKG, _sleep_line


def test_a_stuck_rank_on_another_node_is_named_with_its_node_and_line(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    started = time.monotonic()
    result = slurm_job(tmp_path, *(o for o in STUCK if "nproc_per_node" not in o),
                       "cluster.nodes=2", "cluster.tasks_per_node=1", "cluster.cpus_per_task=1",
                       env={**store, **USERPKG}, timeout=300)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    stuck = ("rank 1 on node2 stuck ", f" s in userpkg/data.py:{_sleep_line()} __getitem__ "
             "(time.sleep), called from train/data/userdata.py")
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    error = run.data.tags["error"]
    assert run.info.status == "FAILED" and error.startswith(stuck[0]) and stuck[1] in error, error
    assert error in result.stdout + result.stderr
    artifacts = MlflowClient(store["MLFLOW_TRACKING_URI"]).list_artifacts(run.info.run_id,
                                                                         "stacks")
    assert sorted(a.path for a in artifacts) == ["stacks/rank-0.txt", "stacks/rank-1.txt"]
    assert took < TIMEOUT_S + 120, f"{took:.0f} s from submission to the job's end"
