"""Creating a new SQLite store: once, and without a thousand disk syncs.

MLflow creates a store by running its schema migrations one statement at a time: ~1,100
fdatasync calls for one new mlflow.db (counted with strace). On an idle local disk that is 1-3 s;
on a disk busy with other writers (a CI machine, a shared node) or on a network file system
(Lustre, NFS homes) each sync can take a tenth of a second or more, and the first run of a
job would wait minutes to exist. So the store is built in a private file beside the real one
with syncing off (a crash there loses only that file), synced once, and moved into place
under its real name; MLflow then finds it complete and migrates nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import uuid
from pathlib import Path
from typing import Any

from train.tracking.store import is_new_sqlite, sqlite_path


def initialise(uri: str) -> None:
    """Create and migrate the SQLite store at `uri` if it is new, once: a lock file beside it
    makes concurrent first users (two jobs started together) wait for the first instead of
    corrupting it."""
    db = sqlite_path(uri)
    assert db is not None, "only SQLite stores are initialised here"
    with open(db.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_new_sqlite(uri):  # again, under the lock: another job may have made it
                _build(db)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(db: Path) -> None:
    scratch = db.with_name(f".{db.name}.{uuid.uuid4().hex}.new")
    try:
        _migrate_unsynced(scratch)
        with open(scratch, "rb") as f:
            os.fsync(f.fileno())
        _move_into_place(scratch, db)
    finally:
        scratch.unlink(missing_ok=True)


def _migrate_unsynced(scratch: Path) -> None:
    """MLflow's own first opening of a store (tables, migrations, default experiment), with
    every connection to `scratch` unsynced and its journal in memory."""
    from mlflow import MlflowClient
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    opened: list[sqlite3.Connection] = []
    target = os.path.realpath(scratch)  # SQLite names its file absolute: a URI may not

    def unsynced(connection: Any, _record: Any) -> None:
        if not isinstance(connection, sqlite3.Connection):
            return
        files = [row[2] for row in connection.execute("PRAGMA database_list") if row[2]]
        if target in map(os.path.realpath, files):
            connection.execute("PRAGMA synchronous = OFF")
            connection.execute("PRAGMA journal_mode = MEMORY")
            opened.append(connection)

    event.listen(Engine, "connect", unsynced)
    try:
        MlflowClient(tracking_uri=f"sqlite:///{scratch}").search_experiments(max_results=1)
    finally:
        event.remove(Engine, "connect", unsynced)
        for connection in opened:  # MLflow keeps its engine for this URI, never used again
            with contextlib.suppress(sqlite3.Error):
                connection.close()


def _move_into_place(scratch: Path, db: Path) -> None:
    """`db` becomes the built store unless another process (one that does not take the lock,
    e.g. `mlflow ui` on the same file) created a non-empty one meanwhile: that one is kept."""
    if db.exists() and db.stat().st_size == 0:
        os.replace(scratch, db)
    else:
        with contextlib.suppress(FileExistsError):
            os.link(scratch, db)  # unlike a rename, never replaces a file that exists
    directory = os.open(db.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
