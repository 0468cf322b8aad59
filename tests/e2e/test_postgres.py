"""The tracking server on a real PostgreSQL backend store (Debian's postgresql, started here as
the local Slurm cluster's MariaDB is): eight jobs logging at once lose nothing, and the
database password reaches the server through its environment, never a command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import skip_or_fail
from tests.servers import ServerProcess, jobs_at_once
from train.distributed.env import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")
DB_PASSWORD = "pg-secret-4c1e9a"


def as_postgres(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", "postgres", "--", *cmd], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def postgres() -> Iterator[str]:
    """A fresh PostgreSQL cluster on a free port; yields the store URI (no password in it)."""
    if os.geteuid() != 0 or not (PG_BIN / "initdb").exists():
        skip_or_fail("needs root and Debian's postgresql 15 (apt-get install -y postgresql)")
    try:
        import psycopg  # noqa: F401  (the driver SQLAlchemy picks for postgresql://)
    except ImportError:
        skip_or_fail("psycopg is missing: pip install 'psycopg[binary]' (the dev extra)")
    root = Path(tempfile.mkdtemp(prefix="train-pg-", dir="/tmp"))
    shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    init = as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres",
                       "--auth-local=trust", "--auth-host=scram-sha-256")
    assert init.returncode == 0, init.stderr
    start = as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w",
                        "-o", f"-k {root} -p {port} -c listen_addresses=127.0.0.1", "start")
    assert start.returncode == 0, start.stderr + start.stdout
    try:
        sql = (f"CREATE USER mlflow PASSWORD '{DB_PASSWORD}';"
               "CREATE DATABASE mlflow OWNER mlflow;")
        for statement in sql.split(";")[:-1]:
            made = as_postgres(str(PG_BIN.parent / "bin" / "psql"), "-h", str(root), "-p",
                               str(port), "-U", "postgres", "-c", statement)
            assert made.returncode == 0, made.stderr
        yield f"postgresql://mlflow@127.0.0.1:{port}/mlflow"
    finally:
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


def test_eight_jobs_log_at_once_to_a_postgresql_store(postgres: str, tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "server", store_env={"MLFLOW_BACKEND_STORE_URI": postgres,
                                                           "PGPASSWORD": DB_PASSWORD})
    server.start(timeout=180)
    try:
        assert DB_PASSWORD not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                                 text=True).stdout
        assert DB_PASSWORD not in server.tail(100_000)
        jobs_at_once(server.url, "pg", tmp_path)
    finally:
        server.stop()
