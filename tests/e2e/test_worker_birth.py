"""A DataLoader worker stuck inside its fork (train/distributed/workers.py iter_with_born_workers).

A rank forks its workers while its gloo and MLflow threads run; a child can then wait forever
on a C lock one of them held (seen on the 2-core CI machine: one worker, one thread, futex_wait,
not one Python line run - the job failed after distributed.timeout_s). Real parts: a local job
whose first worker never comes out of its fork - an at-fork handler that runs before the rank's
own, as glibc's and libtorch's do, registered by a sitecustomize on PYTHONPATH - the run read
back from the store. Two ranks and a short distributed.timeout_s: the peer waits in the first
step's all-reduce meanwhile, and the stuck worker is replaced before that wait times out (with
a fixed 10 s it was not: the job failed on the peer's timeout)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil

from tests.conftest import REPO, history, run_train, runs_in
from train.distributed.workers import BIRTH_S, birth_s

STUCK_IN_FORK = '''
import os, sys, time

def _stuck_in_fork():
    """The first DataLoader worker forked anywhere never comes out of its fork."""
    frame = sys._getframe(1)
    while frame is not None and not frame.f_code.co_filename.endswith("dataloader.py"):
        frame = frame.f_back
    if frame is None:
        return
    try:
        os.close(os.open(os.environ["STUCK_FORK_FLAG"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    while True:
        time.sleep(3600)

if os.environ.get("STUCK_FORK_FLAG"):
    os.register_at_fork(after_in_child=_stuck_in_fork)
'''


def test_a_worker_stuck_inside_its_fork_is_replaced_and_the_job_finishes(
        store: dict[str, str], tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STUCK_IN_FORK)
    flag = tmp_path / "stuck-once"
    env = {**store, "STUCK_FORK_FLAG": str(flag),
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    timeout_s = 8
    assert birth_s(timeout_s) < BIRTH_S  # scaled down: the peer would time out first
    result = run_train("data=digits", "trainer.epochs=2", "data.num_workers=1",
                       "distributed.nproc_per_node=2", f"distributed.timeout_s={timeout_s}",
                       "tracking.log_model=false", f"hydra.run.dir={tmp_path}/job", env=env,
                       warm=False, timeout=240)
    assert result.returncode == 0, result.stderr
    assert flag.exists()  # a worker was stuck
    # The first worker forked anywhere is stuck: rank 0's or rank 1's.
    warned = re.search(r"rank [01]: DataLoader worker\(s\) pid (\d+) stuck inside fork\(\) for "
                       rf"{birth_s(timeout_s):.0f} s \(a lock another thread held as they were "
                       r"forked\): their loader's workers are started again", result.stderr)
    assert warned, result.stderr
    assert not psutil.pid_exists(int(warned[1]))  # killed, not left behind
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in history(uri, run.info.run_id, "val/loss")] == [1, 2]
    # Each epoch read every sample once, the first one's too (begun again with new workers).
    every = float(run.data.params["data.num_train"])
    assert history(uri, run.info.run_id, "train/samples") == [(1, every), (2, every)]
