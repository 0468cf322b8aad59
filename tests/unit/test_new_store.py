"""A new SQLite store (train/tracking/new_store.py): built once, complete, private, kept when
another process made one first; and a run whose store is locked says what it waits on."""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import runs_in
from tests.unit.test_tracking import tracker
from train.tracking import new_store


def open_and_log(uri: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What MLflow logs while opening the store and making an experiment in it."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlflow"):
        MlflowClient(tracking_uri=uri).create_experiment("after")
    return [r.getMessage() for r in caplog.records if r.name.startswith("mlflow")]


def test_a_new_store_is_complete_private_and_leaves_nothing_behind(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    old = os.umask(0o077)  # as every entry point sets it
    try:
        new_store.initialise(uri)
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.lock"]
    assert db.stat().st_mode & 0o777 == 0o600
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert con.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # SQLite's default
    # MLflow finds every table at the latest schema: it creates and migrates nothing.
    messages = open_and_log(uri, caplog)
    assert not [m for m in messages if "database tables" in m or "Running upgrade" in m]
    names = {e.name for e in MlflowClient(tracking_uri=uri).search_experiments()}
    assert names == {"Default", "after"}


def test_an_empty_file_is_replaced_by_the_store(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "mlflow.db"
    db.touch()  # e.g. `sqlite3 mlflow.db .quit`, or a copy that failed
    new_store.initialise(f"sqlite:///{db}")
    assert db.stat().st_size > 0
    assert open_and_log(f"sqlite:///{db}", caplog) == []


def test_a_relative_uri_gets_its_store_where_mlflow_looks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # MLFLOW_TRACKING_URI=sqlite:///mlflow.db, as users write it
    new_store.initialise("sqlite:///mlflow.db")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.lock"]
    assert open_and_log("sqlite:///mlflow.db", caplog) == []


def test_a_store_another_process_made_meanwhile_is_kept(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "mlflow.db"
    build = new_store._migrate_unsynced

    def while_building(scratch: Path) -> None:
        build(scratch)
        with sqlite3.connect(db) as con:  # one that does not take the lock, e.g. `mlflow ui`
            con.execute("CREATE TABLE theirs (x)")

    monkeypatch.setattr(new_store, "_migrate_unsynced", while_building)
    new_store.initialise(f"sqlite:///{db}")
    with sqlite3.connect(db) as con:
        tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master")}
    assert tables == {"theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.lock"]


def test_a_run_waiting_on_a_locked_store_says_what_it_waits_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    new_store.initialise(uri)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another program writing to the file, for a while
    try:
        run = tracker(uri, tmp_path / "job", flush_timeout_s=60.0)
        run.start(tags={}, run_name="waited")
        run.begin_sending()
        with caplog.at_level(logging.WARNING, logger="train.tracking.run"):
            assert run.flush(timeout_s=2) is False
        [warning] = [r.getMessage() for r in caplog.records if "has not taken" in r.getMessage()]
        assert "on MLflow for CreateRun, at " in warning, warning
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert run.finish() is True  # nothing lost: the run is created and ended once it can be
    [stored] = runs_in(uri, "unit")
    assert (stored.info.run_name, stored.info.status) == ("waited", "FINISHED")
