"""Exact validation over real gloo ranks, and failing ranks. The environment the ranks read:
tests/unit/test_distributed.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import REPO, history, process_ended, rank_processes, runs_in, wait_until
from train.distributed import env as distenv

TORCHRUN_KEYS = distenv.TORCHRUN_VARS


def _evaluate_on_rank(rank: int, world_size: int, port: int, results: mp.Queue) -> None:
    """One rank: same seeded weights everywhere, evaluate its shard, reduce to rank 0."""
    for key, value in distenv.torchrun_env(rank, rank, world_size, world_size, "127.0.0.1",
                                           port).items():
        os.environ[key] = value
    from train.config.groups import DataConfig, ModelConfig
    from train.data import build as data
    from train.distributed import process_group as distributed
    from train.engine import evaluation
    from train.models import build as models
    from train.report import metrics
    from train.tasks.base import summed
    from train.tasks.classification import Classification

    env = distenv.detect()
    device = torch.device("cpu")
    distributed.init(env, "gloo", device, timeout_s=60)
    try:
        bundle = data.build(DataConfig(batch_size=30 * world_size), env, device, seed=0)
        torch.manual_seed(0)
        model = models.build(ModelConfig(), models.InputSpec(1, 8, 10))
        task = Classification()
        task.setup(summed(torch.nn.CrossEntropyLoss()), 10, [str(i) for i in range(10)])
        reduced = metrics.reduce(evaluation.evaluate(model, bundle.val, device, "fp32", task),
                                 task.finalize)
        if rank == 0:  # every rank holds the same figures
            results.put((reduced.loss, reduced.values["accuracy"], reduced.samples))
    finally:
        distributed.shutdown()


def test_validation_is_exact_for_any_world_size() -> None:
    """359 validation samples: 2 and 3 ranks don't divide them, yet every metric is equal."""
    ctx = mp.get_context("spawn")
    outcome = {}
    for world_size in (1, 2, 3):
        results = ctx.Queue()
        mp.start_processes(_evaluate_on_rank, args=(world_size, distenv.free_port(), results),
                           nprocs=world_size, start_method="spawn", join=True)
        outcome[world_size] = results.get(timeout=10)
    loss1, acc1, samples1 = outcome[1]
    assert samples1 == 359
    for world_size in (2, 3):
        loss, acc, samples = outcome[world_size]
        assert samples == 359
        assert acc == acc1
        assert loss == pytest.approx(loss1, rel=1e-6)


def _rank_processes(parent: psutil.Process, count: int) -> list[psutil.Process] | None:
    ranks = rank_processes(parent)
    return ranks if len(ranks) >= count else None


def test_a_killed_rank_ends_the_whole_job_and_fails_the_run(store: dict[str, str],
                                                            tmp_path: Path) -> None:
    out_dir = tmp_path / "job"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", "distributed.nproc_per_node=2", "trainer.epochs=200",
         f"hydra.run.dir={out_dir}"], cwd=REPO, env={**os.environ, **store},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = wait_until(lambda: _rank_processes(psutil.Process(proc.pid), 2), 60, "2 ranks")
    # Training is under way (and the run exists) once epoch 1's checkpoint is written.
    wait_until(lambda: any((out_dir / "checkpoints").glob("*")), 120, "the first checkpoint")
    victim = max(ranks, key=lambda p: p.pid)  # started second: rank 1
    victim.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=90)  # promptly, not after a collective timeout
    assert proc.returncode == 1
    assert "the training job failed; rank 1 was killed by SIGKILL" in stderr
    run_id = json.loads((out_dir / "mlflow_run.json").read_text())["run_id"]
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.run_id == run_id
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == f"rank 1 (pid {victim.pid}) killed by SIGKILL"
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_killing_the_launcher_stops_its_ranks_and_the_run(store: dict[str, str],
                                                         tmp_path: Path) -> None:
    """SIGKILL leaves the launcher no chance to stop its ranks: the kernel sends them TERM,
    their coordinated stop (a checkpoint, the run KILLED)."""
    out_dir = tmp_path / "job"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", "distributed.nproc_per_node=2", "trainer.epochs=200",
         f"hydra.run.dir={out_dir}"], cwd=REPO, env={**os.environ, **store},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = wait_until(lambda: _rank_processes(psutil.Process(proc.pid), 2), 60, "2 ranks")
    try:
        wait_until(lambda: any((out_dir / "checkpoints").glob("*")), 120, "the first checkpoint")
        proc.kill()
        proc.wait(timeout=10)
        wait_until(lambda: all(process_ended(p) for p in ranks), 30, "the ranks' end")
    finally:
        for p in ranks:  # this test's own processes, should they have outlived it
            if not process_ended(p):
                p.kill()
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "KILLED" and run.data.tags["stopped_by"] == "SIGTERM"


def test_an_exception_in_one_rank_ends_all_ranks_with_its_error(store: dict[str, str],
                                                               tmp_path: Path) -> None:
    """Two ranks started torchrun-style by hand; rank 1's node cannot read its data."""
    port = distenv.free_port()
    procs = []
    for rank in (0, 1):
        data = ["data=digits"] if rank == 0 else ["data=mnist", f"data.root={tmp_path}/none"]
        env = {**os.environ, **store, **distenv.torchrun_env(rank, rank, 2, 2, "127.0.0.1", port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "train", *data, "trainer.epochs=1",
             f"hydra.run.dir={tmp_path}/rank{rank}"], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] != [0, 0]
    assert all(p.returncode != 0 for p in procs)
    # The rank's own refusal, one line (a TrainError: train/errors.py), not a traceback.
    assert "error: Data set 'mnist' is not under data.root" in errors[1], errors[1]
    assert "Traceback" not in errors[1]
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert "rank 1" in run.data.tags["error"]
    assert "DataMissingError" in run.data.tags["error"]
    assert history(store["MLFLOW_TRACKING_URI"], run.info.run_id, "train/loss") == []


def test_the_local_launcher_shows_the_failing_rank_in_one_line_its_traceback_in_the_log(
        store: dict[str, str], tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "train", "distributed.nproc_per_node=2", "trainer.epochs=3",
         f"hydra.run.dir={tmp_path}/job"],
        cwd=REPO, env={**os.environ, **store, "TRAIN_FAIL_DRILL": "1:3"}, capture_output=True,
        text=True, timeout=120)
    assert result.returncode == 1
    assert ("the training job failed; rank 1 on " in result.stderr
            and ": FailureDrill: TRAIN_FAIL_DRILL: rank 1 failing on purpose" in result.stderr), \
        result.stderr
    assert "Traceback" not in result.stderr
    logged = (tmp_path / "job" / "train.log").read_text()
    assert "Traceback" in logged and "raise FailureDrill" in logged
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("rank 1 on ")
    # What was logged before the failure is kept: the steps before step 3 never reached an epoch
    # end, so there is no epoch metric, but the params are all there.
    assert run.data.params["trainer.epochs"] == "3"
    assert not [k for k in run.data.params if "fail" in k]  # the drill is no user setting
