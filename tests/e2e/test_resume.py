"""Checkpoints and resuming on one machine: crashes, corrupt files, divergence."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.conftest import (
    LAUNCHER_VARS,
    composed,
    history,
    kill_job_after_checkpoints,
    new_store,
    rank_processes,
    run_train,
    runs_in,
    wait_until,
)

STEPS_PER_EPOCH = 23  # 1438 samples, 2 ranks, 32 per rank


def _assert_once(uri: str, run_id: str, epochs: int, every: int) -> None:
    for key in ("train/loss", "train/samples", "val/accuracy", "val/samples", "lr"):
        assert [s for s, _ in history(uri, run_id, key)] == list(range(1, epochs + 1)), key
    steps = [s for s, _ in history(uri, run_id, "train/step_loss")]
    assert steps == list(range(every, epochs * STEPS_PER_EPOCH + 1, every))


def test_a_killed_job_resumes_into_the_same_run(store: dict[str, str], tmp_path: Path) -> None:
    out_dir = tmp_path / "job"
    kill_job_after_checkpoints(out_dir, store, 2, "distributed.nproc_per_node=2",
                               "trainer.epochs=6")
    uri = store["MLFLOW_TRACKING_URI"]
    [killed] = runs_in(uri)
    assert killed.info.status == "RUNNING"  # nobody could end it

    result = run_train("distributed.nproc_per_node=2", "trainer.epochs=6",
                       f"hydra.run.dir={out_dir}", env=store)
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr and "continuing MLflow run" in result.stderr
    [run] = runs_in(uri)
    assert run.info.run_id == killed.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    _assert_once(uri, run.info.run_id, 6, 10)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(store: dict[str, str],
                                                                tmp_path: Path) -> None:
    out_dir = tmp_path / "job"
    first = run_train("distributed.nproc_per_node=2", "trainer.epochs=3",
                      f"hydra.run.dir={out_dir}", env=store)
    assert first.returncode == 0, first.stderr
    folder = out_dir / "checkpoints"
    newest, previous = sorted(folder.glob("step-*.pt"), reverse=True)[:2]
    assert (newest.name, previous.name) == ("step-000000069.pt", "step-000000046.pt")
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a full disk
    # An even newer file that would run code if unpickled: it must be refused, not run.
    marker = tmp_path / "pwned"
    torch.save({"model": Exploit(str(marker))}, folder / "step-000000099.pt")

    result = run_train("distributed.nproc_per_node=2", "trainer.epochs=4",
                       f"hydra.run.dir={out_dir}", env=store)
    assert result.returncode == 0, result.stderr
    assert "step-000000099.pt cannot be loaded" in result.stderr
    assert "step-000000069.pt cannot be loaded" in result.stderr
    assert "resumed from" in result.stderr and "step-000000046.pt" in result.stderr
    assert not marker.exists()
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    _assert_once(store["MLFLOW_TRACKING_URI"], run.info.run_id, 4, 10)


class Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def test_resume_never_starts_a_new_run(store: dict[str, str], tmp_path: Path) -> None:
    for resume in ("auto", "never"):
        result = run_train("trainer.epochs=1", f"trainer.resume={resume}",
                           "tracking.log_model=false",
                           f"hydra.run.dir={tmp_path}/job", env=store)
        assert result.returncode == 0, result.stderr
    assert len(runs_in(store["MLFLOW_TRACKING_URI"])) == 2


def test_a_diverging_loss_stops_with_rank_and_step(store: dict[str, str],
                                                   tmp_path: Path) -> None:
    result = run_train("distributed.nproc_per_node=2", "optim.lr=1e12", "trainer.epochs=3",
                       "trainer.log_every_n_steps=1", f"hydra.run.dir={tmp_path}/job", env=store)
    assert result.returncode == 1
    assert "NonFiniteLossError" in result.stderr
    assert "on rank" in result.stderr and "at step" in result.stderr
    # Before the first checkpoint: the block says so and how to start again; no traceback.
    assert (f"  kept: nothing: no checkpoint yet\n  start again: python -m train "
            "distributed.nproc_per_node=2 optim.lr=1e12 trainer.epochs=3 "
            f"trainer.log_every_n_steps=1 hydra.run.dir={tmp_path}/job\n") in result.stderr
    assert "Traceback" not in result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED" and "diverged" in run.data.tags["error"]


def _hold_the_store_until_a_rank_exits(db_path: Path, hold_s: float) -> threading.Thread:
    """Lock the SQLite store (as a busy writer would) until `hold_s` after the first of this
    process's rank processes exited: rank 0's run cannot be created or ended before then."""
    db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    db.execute("BEGIN EXCLUSIVE")

    def ranks() -> list[psutil.Process]:
        return rank_processes(psutil.Process())

    def release() -> None:
        try:
            wait_until(lambda: len(ranks()) == 2, 120, "two ranks started")
            wait_until(lambda: len(ranks()) < 2, 300, "a rank exited")
            threading.Event().wait(hold_s)  # the store stays busy this long: the scenario
        finally:
            db.execute("ROLLBACK")
            db.close()

    holder = threading.Thread(target=release, daemon=True)
    holder.start()
    return holder


def test_rank_0_still_ending_its_run_is_not_stopped_with_the_others(
        tmp_path: Path, store_template: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 fails at the same step as rank 0 and exits at once; rank 0 must still create and
    end its run in a store that stays busy 8 s after rank 1 exited: longer than the others'
    grace (0.5 s here) and the 5 s a stopped rank has from TERM to KILL. The launcher waits for
    it: the run is there, FAILED, with the error and what it logged. Stopped with the others,
    rank 0 left no run at all (seen once in a loaded make test)."""
    from train.app import run
    from train.launch import local as launch

    for key in [*LAUNCHER_VARS, *(k for k in os.environ if k.startswith("SLURM_"))]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    uri = new_store(tmp_path / "mlflow.db", store_template)
    real_start, holders = launch.start_local_ranks, []

    def start_with_the_store_busy(*args: Any, **kwargs: Any) -> dict[str, float]:
        holders.append(_hold_the_store_until_a_rank_exits(tmp_path / "mlflow.db", 8.0))
        return real_start(*args, **kwargs)

    monkeypatch.setattr(launch, "start_local_ranks", start_with_the_store_busy)
    cfg = composed("distributed.nproc_per_node=2", "optim.lr=1e12", "trainer.epochs=3",
                   "trainer.log_every_n_steps=1", f"tracking.uri={uri}")
    with pytest.raises(launch.JobFailedError, match="NonFiniteLossError"):
        run(cfg, str(tmp_path / "job"), "python -m train (test)")
    [holder] = holders
    holder.join(60)
    [failed] = runs_in(uri)
    assert failed.info.status == "FAILED" and "diverged" in failed.data.tags["error"]
    assert failed.data.params["optim.lr"] == str(1e12)
    assert [s for s, _ in history(uri, failed.info.run_id, "train/step_loss")] == [1, 2]
