"""The tracking server's own safety, started the ways users start it: a port in use refused
before anything is created, `slurm/mlflow-server.sbatch`'s private env file (removed when the
job ends), HTTPS with a certificate the test makes (tests/e2e/test_security.py and
tests/unit/test_security.py have the rest)."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, run_train, runs_in, skip_or_fail, wait_until
from tests.e2e.test_security import command_lines, status_of
from tests.servers import ServerProcess
from train.distributed.env import free_port
from train.security import server_auth


def test_a_server_on_a_port_in_use_exits_with_one_line_and_creates_nothing(
        tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "train.server", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{tmp_path / 'store' / 'server.db'}",
             "--artifacts-destination", str(tmp_path / "store" / "artifacts")],
            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use (another server?): stop it or choose "
        "another with --port."]
    assert not (tmp_path / "store").exists()


def test_the_server_job_script_writes_a_private_env_file_and_removes_it(tmp_path: Path) -> None:
    """slurm/mlflow-server.sbatch run as Slurm runs it (bash, a SIGTERM at the end)."""
    port, env_file = free_port(), tmp_path / "mlflow-server.env"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
           "TRAIN_REPO": str(REPO), "MLFLOW_PORT": str(port),
           "MLFLOW_SERVER_ENV_FILE": str(env_file),
           "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{tmp_path / 'store' / 'server.db'}",
           "MLFLOW_ARTIFACTS": str(tmp_path / "store" / "artifacts")}
    script = subprocess.Popen(["bash", str(REPO / "slurm" / "mlflow-server.sbatch")], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        wait_until(env_file.exists, 120, "env file", job=script)
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
        values = server_auth.read_env_file(env_file)
        url = f"http://127.0.0.1:{port}"
        assert values["MLFLOW_TRACKING_URI"] == f"http://{socket.gethostname()}:{port}"

        def who() -> int:
            request = urllib.request.Request(f"{url}/api/2.0/mlflow/users/current")
            if values:
                pair = f"{values['MLFLOW_TRACKING_USERNAME']}:{values['MLFLOW_TRACKING_PASSWORD']}"
                request.add_header("Authorization", "Basic " + base64.b64encode(
                    pair.encode()).decode())
            try:
                return status_of(request)
            except OSError:
                return 0

        wait_until(lambda: who() == 200, 120, "the login accepted", job=script)
        assert values["MLFLOW_TRACKING_PASSWORD"] not in command_lines()
        script.send_signal(signal.SIGTERM)  # what scancel sends the batch shell
        out, _ = script.communicate(timeout=60)
    finally:
        tree = [p for p in psutil.process_iter() if _in_session(p, script.pid)]
        for p in tree:
            p.kill()
        if script.poll() is None:
            script.kill()
            script.wait()
    assert not env_file.exists(), out[-2000:]
    assert stat.S_IMODE((tmp_path / "store" / "server.db").stat().st_mode) == 0o600


def _in_session(process: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(process.pid) == sid
    except (OSError, psutil.Error):
        return False


def test_over_https_a_job_verifies_the_servers_certificate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("openssl") is None:
        skip_or_fail("openssl is needed to make the test's self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    srv = ServerProcess(tmp_path / "server", extra_args=("--certfile", str(cert),
                                                         "--keyfile", str(key)))
    srv.start()
    try:
        assert srv.url.startswith("https://")
        # Not trusted without the certificate: one line from the pre-flight, no retries.
        untrusted = run_train("trainer.epochs=1", f"hydra.run.dir={tmp_path}/untrusted",
                              env={"MLFLOW_TRACKING_URI": srv.url})
        assert untrusted.returncode == 2
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr.replace(" ", "_").upper()
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(cert))
        done = run_train("trainer.epochs=1", "model=mlp", f"hydra.run.dir={tmp_path}/job",
                         env={"MLFLOW_TRACKING_URI": srv.url})
        assert done.returncode == 0, done.stderr[-3000:]
        [run] = runs_in(srv.url)
        assert run.info.status == "FINISHED" and "val/accuracy" in run.data.metrics
    finally:
        srv.stop()
