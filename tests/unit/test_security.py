"""Issue 12, a security reviewer's checks, in process: passwords redacted and moved out of URIs
and argv, the server's secrets generated once and private, control characters refused, the
credentials file, a planted pickle. With real processes (a server with logins, a job, another
user): tests/e2e/test_security.py."""

from __future__ import annotations

import os
import pickle
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from train import server
from train.__main__ import private_by_default
from train.distributed.env import free_port
from train.security import server_auth
from train.security.redact import redact


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
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
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
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # on argv it would be in `ps` already: refused
        server.parse(["--backend-store-uri", "postgresql://ml:dbpw@db/mlflow"])
    assert refused.value.code == 2  # argparse's usage error, not a crash or a plain exit
    said = capsys.readouterr().err
    assert "error: --backend-store-uri holds a password" in said and "~/.pgpass" in said
    assert "dbpw" not in said


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


class Payload:
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
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": Payload(marker)}))
    with pytest.raises(datasets.DataMissingError, match="asks to call posix.system"):
        datasets.check_available(DataConfig(name="cifar10", root=str(tmp_path)))
    assert not marker.exists()
