"""Issue 12, a security reviewer's checks: logins on the tracking server, private files, no
secrets in runs, logs or `ps`, attribution. Another user is `nobody` (runuser), as on a shared
login node; the directories the tests create are opened up (0755) so that only the modes the
project gives its own files stand between that user and the data."""

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

import numpy as np
import pytest
import torch

from tests.conftest import REPO, run_train, runs_in, skip_or_fail
from tests.servers import ServerProcess
from train import server
from train.__main__ import private_by_default
from train.distributed.env import free_port
from train.security import server_auth
from train.security.redact import redact

# ---------------------------------------------------------------- fast: no process started


def test_redact_hides_the_password_of_every_uri() -> None:
    text = "store postgresql://ml:s3cr%40t@db:5432/x and http://admin:pw@host:5000/#/runs"
    assert redact(text) == "store postgresql://ml:***@db:5432/x and http://admin:***@host:5000/#/runs"
    assert redact("sqlite:////tmp/mlflow.db http://host:5000") == \
        "sqlite:////tmp/mlflow.db http://host:5000"


def test_a_password_in_the_tracking_uri_moves_to_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "PGPASSWORD",
                 "TRAIN_GROUP_READABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:pa%3Ass@mlflow.example:5001")
    monkeypatch.setattr(sys, "argv", ["train", "trainer.epochs=1",
                                      "tracking.uri=postgresql+psycopg://ml:dbpw@db/mlflow"])
    before = os.umask(0o022)
    try:
        private_by_default()
        umask = os.umask(before)
    finally:
        os.umask(before)
    assert umask == 0o077
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://mlflow.example:5001"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "alice"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pa:ss"
    assert sys.argv[2] == "tracking.uri=postgresql+psycopg://ml@db/mlflow"
    assert os.environ["PGPASSWORD"] == "dbpw"


def test_server_secrets_are_generated_once_private_and_never_on_argv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    auth = tmp_path / "auth"
    env = server_auth.prepare(auth)
    secrets = server_auth.secrets_path(auth)
    for path in (secrets, auth / server_auth.AUTH_CONFIG):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(auth.stat().st_mode) == 0o700
    assert "default_permission = NO_PERMISSIONS" in (auth / server_auth.AUTH_CONFIG).read_text()
    password = env["MLFLOW_AUTH_ADMIN_PASSWORD"]
    assert len(password) >= 12 and server_auth.read_env_file(secrets)[
        "MLFLOW_TRACKING_PASSWORD"] == password
    assert server_auth.prepare(auth) == env  # the second start keeps the first's secrets
    secrets.chmod(0o640)  # a group member could read (or, 0660, change) it: refused
    with pytest.raises(server_auth.AuthSetupError, match="chmod 600"):
        server_auth.prepare(auth)

    # The store URI (with its database password) is not on the server's command line.
    monkeypatch.setenv("MLFLOW_BACKEND_STORE_URI", "postgresql://ml:dbpw@db:5432/mlflow")
    args = server.parse(["--port", "5999"])
    cmd, server_env = server.build(args)
    assert "dbpw" not in " ".join(cmd) and "--app-name" in cmd
    assert server_env["MLFLOW_BACKEND_STORE_URI"].endswith("ml:dbpw@db:5432/mlflow")
    assert "dbpw" not in server.banner(args, "http://h:5999", cmd, True)
    with pytest.raises(SystemExit):  # on argv it would be in `ps` already: refused
        server.parse(["--backend-store-uri", "postgresql://ml:dbpw@db/mlflow"])


@pytest.mark.parametrize("field", ["cluster.job_name", "cluster.partition", "cluster.setup",
                                   "cluster.sbatch_extra", "tracking.experiment",
                                   "tracking.run_name"])
def test_a_control_character_in_a_name_or_cluster_string_is_refused(field: str) -> None:
    from dataclasses import replace

    from train.config.cluster import ClusterConfig
    from train.config.groups import ConfigError, TrainConfig
    from train.launch.preflight import validate

    evil = "x\nsrun rm -rf ~"
    cfg = TrainConfig(cluster=ClusterConfig(partition="debug"))
    section, name = field.split(".")
    value = {"cluster.setup": [evil], "cluster.sbatch_extra": {"mail-type": evil}}.get(
        field, evil)
    typed = replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    with pytest.raises(ConfigError, match=f"{field}.*control character"):
        validate(typed, 1)
    validate(cfg, 1)  # the same config without it passes


def test_the_credentials_file_is_read_like_mlflow_and_must_be_private(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from train.tracking import TrackingError, auth

    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(auth, "CREDENTIALS_FILE", tmp_path / "credentials")
    (tmp_path / "credentials").write_text(
        "[mlflow]\nmlflow_tracking_username = bob\nmlflow_tracking_password = pw-of-bob\n")
    assert auth.credentials("http://h:1") == ("bob", "pw-of-bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "from-env")  # as MLflow: env first
    assert auth.credentials("http://h:1") == ("bob", "from-env")
    assert auth.credentials("http://eve:pw@h:1") == ("eve", "pw")  # the URI's own, first
    (tmp_path / "credentials").chmod(0o644)
    with pytest.raises(TrackingError, match="chmod 600"):
        auth.check_credentials(f"http://127.0.0.1:{free_port()}")


class _Payload:
    """What a planted pickle holds: a call to run when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_cifar_pickle_does_not_run(tmp_path: Path) -> None:
    from train.config.groups import DataConfig
    from train.data import datasets

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    arrays = {"data": np.zeros((2, 3072), dtype=np.uint8), "labels": [0, 1]}
    for name in datasets.CIFAR10_TRAIN:
        (folder / name).write_bytes(pickle.dumps(arrays, protocol=2))
    marker = tmp_path / "ran"
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": _Payload(marker)}))
    with pytest.raises(datasets.DataMissingError, match="asks to call posix.system"):
        datasets.check_available(DataConfig(name="cifar10", root=str(tmp_path)))
    assert not marker.exists()


# ---------------------------------------------------------------- slow: real processes


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


@pytest.mark.slow
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
        seen_in_ps = []
        while job.poll() is None:  # sampled while the job and its ranks run
            seen_in_ps.append(password in command_lines())
            time.sleep(0.5)
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
        weights.write_bytes(pickle.dumps(_Payload(marker)))
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            load_model(run.info.run_id, srv.url)
        assert not marker.exists()
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_newline_in_the_job_name_is_refused_before_any_script(tmp_path: Path) -> None:
    planted = tmp_path / "ran"
    done = run_train("+cluster=slurm", "cluster.dry_run=true",
                     f"cluster.job_name='job\ntouch {planted}'", cwd=REPO)
    assert done.returncode == 2
    [line] = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith("error: Refusing to start: cluster.job_name=")
    assert "#SBATCH" not in done.stdout + done.stderr and not planted.exists()
