"""A new SQLite store opened by four processes at once: every one gets it, complete."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from mlflow import MlflowClient

from tests.conftest import REPO


def test_jobs_opening_one_new_store_together_all_get_it(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = ("import sys; from train.tracking.client import one_try_client; "
              "one_try_client(sys.argv[1]).create_experiment(sys.argv[2])")
    jobs = [subprocess.Popen([sys.executable, "-c", script, uri, f"job{i}"], cwd=REPO,
                             stderr=subprocess.PIPE, text=True) for i in range(4)]
    errors = [job.communicate(timeout=120)[1] for job in jobs]
    assert [job.returncode for job in jobs] == [0] * 4, errors
    names = {e.name for e in MlflowClient(tracking_uri=uri).search_experiments()}
    assert names == {"Default", "job0", "job1", "job2", "job3"}
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
