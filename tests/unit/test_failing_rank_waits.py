"""A Slurm job's rank that fails of its own error leaves only once rank 0's MLflow run exists:
srun's --kill-on-bad-exit ends rank 0 KillWait seconds after that rank's exit, and a run still
being created then was never created. Two real gloo ranks (issue 39's CI failure:
`test_a_failing_rank_ends_the_job_promptly` found no run on a busy machine)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import torch

from train.config.cluster import ClusterConfig
from train.config.groups import TrainConfig
from train.distributed import process_group as distributed
from train.distributed.env import DistEnv
from train.engine.drill import FailureDrill
from train.engine.ending import RUN_WAIT_S, JobEnding
from train.report.progress import Progress
from train.report.runlog import RunLogger
from train.tracking.backend import RUN_FILE, NullRun

RUN_AFTER_S = 1.0
"""When rank 0 "creates its run" (writes mlflow_run.json) after the start."""


def _rank(rank: int, port: int, out: Path, slurm: bool, writes_run: bool,
          times: mp.SimpleQueue, done: mp.Event) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = DistEnv(rank, rank, 2, 2, "127.0.0.1", port, "slurm" if slurm else "torchrun")
    distributed.init(env, "gloo", torch.device("cpu"), 60)
    start = time.monotonic()
    if rank == 0:  # hosts the store; "creates its run", or leaves without one
        time.sleep(RUN_AFTER_S)
        if writes_run:
            (out / RUN_FILE).write_text('{"run_id": "r"}')
            times.put(("run", time.monotonic() - start))
            done.wait(RUN_WAIT_S)  # the store stays until rank 1 has left
        os._exit(0)
    cfg = TrainConfig(cluster=ClusterConfig() if slurm else None)
    logger = RunLogger(cfg, NullRun(), Progress(False, 1, 1))
    logger.started = True  # past the ranks' first collective, as a failure in training is
    JobEnding(cfg, env, out, "python -m train", logger).failed(
        FailureDrill("rank 1 failing on purpose"), None)
    times.put(("left", time.monotonic() - start))
    done.set()
    os._exit(0)


def _left_after(tmp_path: Path, slurm: bool, writes_run: bool) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    times, done = ctx.SimpleQueue(), ctx.Event()  # SimpleQueue: put before os._exit
    procs = [ctx.Process(target=_rank, args=(r, port, tmp_path, slurm, writes_run, times,
                                             done)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(RUN_WAIT_S + 30)
        assert p.exitcode == 0, p.exitcode
    return dict(times.get() for _ in range(1 + writes_run))


def test_a_failing_rank_leaves_once_rank_0s_run_exists(tmp_path: Path) -> None:
    times = _left_after(tmp_path, slurm=True, writes_run=True)
    assert times["run"] <= times["left"] < times["run"] + 5, times


def test_a_failing_rank_leaves_at_once_when_rank_0_is_gone(tmp_path: Path) -> None:
    times = _left_after(tmp_path, slurm=True, writes_run=False)
    assert RUN_AFTER_S <= times["left"] < RUN_AFTER_S + 10, times  # not RUN_WAIT_S


def test_outside_slurm_a_failing_rank_leaves_at_once(tmp_path: Path) -> None:
    """The local launcher waits for rank 0's ending itself (train/launch/local.py); torchrun's
    ranks may not share a directory where rank 0's run file would be."""
    times = _left_after(tmp_path, slurm=False, writes_run=True)
    assert times["left"] < times["run"], times
