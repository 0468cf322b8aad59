"""A Slurm job's rank that fails of its own error leaves only once rank 0's MLflow run exists:
srun's --kill-on-bad-exit ends rank 0 KillWait seconds after that rank's exit, and a run still
being created then was never created. Two real gloo ranks (issue 39's CI failure:
`test_a_failing_rank_ends_the_job_promptly` found no run on a busy machine)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from train.config.cluster import ClusterConfig
from train.config.groups import TrainConfig
from train.distributed import process_group as distributed
from train.distributed import watch
from train.distributed.env import DistEnv
from train.engine.drill import FailureDrill
from train.engine.ending import RUN_WAIT_S, JobEnding
from train.errors import FAILURE_FILE
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


def _rank_after_rank_0_left(rank: int, port: int, out: Path, rank_0_writes: bool,
                            watching: mp.Event, gone: mp.Event) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = DistEnv(rank, rank, 2, 2, "127.0.0.1", port, "slurm")
    distributed.init(env, "gloo", torch.device("cpu"), 5)  # the store's reconnects: 5 s
    if rank == 0:  # failed of a peer's error: kept the cause, ended its run and left
        watching.wait(30)  # as in a job, rank 1's watch started while the store lived
        if rank_0_writes:
            (out / FAILURE_FILE).write_text(json.dumps(
                {"cause": "rank 3 on node2: FailureDrill", "at": time.time(), "rank": 0}))
        gone.set()
        os._exit(0)
    watch.start(out, rank, 2, 60)  # its start time tells this start's cause from an earlier one's
    watching.set()
    gone.wait(30)
    while distributed.main_answers():  # until rank 0's process (the store) is gone
        time.sleep(0.05)
    cfg = TrainConfig(cluster=ClusterConfig())
    logger = RunLogger(cfg, NullRun(), Progress(False, 1, 1))
    JobEnding(cfg, env, out, "python -m train", logger).failed(
        RuntimeError("Connection closed by peer [127.0.0.1]:1234"), None)
    os._exit(0)


@pytest.mark.parametrize("rank_0_writes", [True, False], ids=["kept-by-rank-0", "earlier-one"])
def test_a_rank_that_finds_rank_0_gone_keeps_the_cause_only_if_rank_0_did_not(
        tmp_path: Path, rank_0_writes: bool) -> None:
    """Rank 0 gone when rank 1 fails of a lost peer: if rank 0 kept this start's cause before it
    left, that stays (the login node shows it); else rank 1 keeps its own, over the cause of an
    earlier start."""
    earlier = {"cause": "an earlier start's", "at": time.time() - 3600, "rank": 0}
    (tmp_path / FAILURE_FILE).write_text(json.dumps(earlier))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    watching, gone = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_rank_after_rank_0_left,
                         args=(r, port, tmp_path, rank_0_writes, watching, gone))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    kept = json.loads((tmp_path / FAILURE_FILE).read_text())
    if rank_0_writes:
        assert kept["cause"] == "rank 3 on node2: FailureDrill" and kept["rank"] == 0
    else:
        assert kept["rank"] == 1 and kept["cause"].startswith("rank 0 on ")
        assert "stopped answering" in kept["cause"]
