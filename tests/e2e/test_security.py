"""Issue 12 with real processes: a tracking server with logins, a job logging in, another user
(`nobody`, through runuser) kept out of its files; a newline in a job name. The directories
the tests create are opened up (0755) so that only the modes the project gives its own files
stand between that user and the data."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import REPO, run_train, runs_in, skip_or_fail, wait_until
from tests.servers import ServerProcess
from tests.unit.test_security import Payload
from train.security import server_auth

JOB_S = 300
"""Time enough for the 2-epoch, 2-rank job here (a few tens of seconds on 2 cores)."""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any user may enter (pytest's own tmp dirs are 0700 and would hide
    everything from `nobody` whatever the project does)."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        skip_or_fail("needs root and runuser to act as a second user (nobody)")
    root = Path(tempfile.mkdtemp(prefix="train-sec-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", "nobody", "--", *cmd], capture_output=True,
                          text=True, timeout=30)


def status_of(request: urllib.request.Request) -> int:
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def command_lines() -> str:
    """Every process's command line, as any user sees them with `ps`."""
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_a_server_refuses_strangers_and_a_job_logs_in_leaving_no_secret_or_readable_file(
        open_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = ServerProcess(open_dir / "server")
    srv.start()
    try:
        login = srv.login
        password = login["MLFLOW_TRACKING_PASSWORD"]
        api = f"{srv.url}/api/2.0/mlflow"
        # Without a login: nothing to read, write or delete.
        assert status_of(urllib.request.Request(f"{api}/experiments/search?max_results=5")) == 401
        put = urllib.request.Request(f"{srv.url}/api/2.0/mlflow-artifacts/artifacts/0/planted.txt",
                                     data=b"x", method="PUT")
        assert status_of(put) == 401
        assert not list((open_dir / "server").rglob("planted.txt"))

        # A wrong password: one line from the pre-flight, at once, and no run.
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
        started = time.monotonic()
        wrong = run_train("trainer.epochs=1", f"hydra.run.dir={open_dir}/refused",
                          env={"MLFLOW_TRACKING_URI": srv.url})
        assert wrong.returncode == 2 and time.monotonic() - started < 60
        [line] = [x for x in wrong.stderr.splitlines() if x.startswith("error:")]
        assert "refused the login of user 'admin' (HTTP 401)" in line
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        assert runs_in(srv.url) == []
        delete = urllib.request.Request(f"{api}/experiments/delete", method="POST",
                                        data=b'{"experiment_id": "0"}',
                                        headers={"Content-Type": "application/json"})
        assert status_of(delete) == 401

        # The password in the URI, nothing in the environment: the job logs in, and the
        # password appears nowhere it records or shows.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
        env["MLFLOW_TRACKING_URI"] = srv.url.replace("http://", f"http://admin:{password}@")
        job_dir = open_dir / "job"
        job = subprocess.Popen(
            [sys.executable, "-m", "train", "trainer.epochs=2", "model=mlp",
             "distributed.nproc_per_node=2", f"hydra.run.dir={job_dir}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen_in_ps: list[bool] = []

        def ended() -> bool:  # `ps` sampled while the job and its ranks run
            seen_in_ps.append(password in command_lines())
            return job.poll() is not None

        try:
            wait_until(ended, JOB_S, "the job's end", every=0.5)
        finally:
            if job.poll() is None:  # past the deadline: this test's job and its ranks
                for p in psutil.Process(job.pid).children(recursive=True):
                    p.kill()
                job.kill()
        out, err = job.communicate()
        assert job.returncode == 0, err[-3000:]
        assert len(seen_in_ps) > 3 and not any(seen_in_ps)
        assert password not in out + err
        [run] = runs_in(srv.url)
        assert run.info.status == "FINISHED"
        recorded = json.dumps([run.data.params, run.data.tags])
        assert password not in recorded and "admin:" not in recorded
        for path in job_dir.rglob("*"):
            if path.is_file():
                assert password.encode() not in path.read_bytes(), path
        # Attribution: the login the server accepted, the Unix user, the commit.
        assert run.info.user_id == "admin" and run.data.tags["mlflow.user"] == "admin"
        assert run.data.tags["unix_user"] == "root"
        assert len(run.data.tags.get("mlflow.source.git.commit", "")) == 40

        # Private files: the job's outputs and the server's store, for the owner alone.
        [checkpoint, *_] = sorted(job_dir.rglob("step-*.pt"))
        for path in [job_dir, *job_dir.rglob("*")]:
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
        for path in (open_dir / "server").rglob("*"):
            if path == srv.log:  # the test's own capture of the server's output
                continue
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
        for path in (checkpoint, open_dir / "server" / "server.db",
                     server_auth.secrets_path(open_dir / "server")):
            refused = as_nobody("cat", str(path))
            assert refused.returncode != 0 and "Permission denied" in refused.stderr, path

        # Another login may not use this user's experiment: one line from the pre-flight.
        from mlflow.server import get_app_client

        get_app_client("basic-auth", tracking_uri=srv.url).create_user("bob", "bob-password-1")
        bob = run_train("trainer.epochs=1", f"hydra.run.dir={open_dir}/bob",
                        env={"MLFLOW_TRACKING_URI": srv.url, "MLFLOW_TRACKING_USERNAME": "bob",
                             "MLFLOW_TRACKING_PASSWORD": "bob-password-1"})
        assert bob.returncode == 2
        assert "user 'bob' may not use experiment 'train'" in bob.stderr
        assert len(runs_in(srv.url)) == 1

        # The model loads back from weights only; a replaced weights file runs nothing.
        from train.load import load_model

        model = load_model(run.info.run_id, srv.url)
        assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
        [weights] = (open_dir / "server" / "artifacts").rglob("weights/model.pt")
        marker = open_dir / "ran"
        weights.write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            load_model(run.info.run_id, srv.url)
        assert not marker.exists()
    finally:
        srv.stop()


def test_a_newline_in_the_job_name_is_refused_before_any_script(tmp_path: Path) -> None:
    planted = tmp_path / "ran"
    done = run_train("+cluster=slurm", "cluster.dry_run=true",
                     f"cluster.job_name='job\ntouch {planted}'", cwd=REPO)
    assert done.returncode == 2
    [line] = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith("error: Refusing to start: cluster.job_name=")
    assert "#SBATCH" not in done.stdout + done.stderr and not planted.exists()
