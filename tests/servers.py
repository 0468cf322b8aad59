"""A real MLflow tracking server for tests: `python -m train.server` on a free port.

`tracking_server(root)` starts it with its backend store and artifacts under `root`, waits until
GET /health answers 200, yields the URL, and afterwards stops the whole process tree (the
`mlflow server` wrapper, gunicorn's master and its workers). Logins are on, as for users: while
a server runs, this process's environment holds the admin login the server generated
(MLFLOW_TRACKING_USERNAME/PASSWORD, read from its 0600 server-auth.env), so MlflowClient calls
and the jobs the tests start authenticate the way a user's would. `ServerProcess` is the same with
explicit start()/stop(), for tests that take the server away while a job runs. `wait_until`
polls for what a test waits on, with a deadline (no bare sleeps).
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil

from tests.conftest import REPO, history, runs_in
from train.distributed.env import free_port
from train.security import server_auth

LOGIN_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


class ServerProcess:
    def __init__(self, root: Path, host: str = "127.0.0.1", port: int | None = None,
                 extra_args: tuple[str, ...] = (), store_env: dict[str, str] | None = None,
                 ) -> None:
        """`store_env`: a backend store given through the environment (a PostgreSQL URI in
        MLFLOW_BACKEND_STORE_URI, its password in PGPASSWORD) instead of root/server.db."""
        self.root, self.host, self.port = root, host, port or free_port()
        self.store_env = store_env or {}
        self.tls = "--certfile" in extra_args
        self.url = f"http{'s' if self.tls else ''}://127.0.0.1:{self.port}"
        self.extra_args = extra_args
        self.log = root / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.saved_env: dict[str, str | None] = {}
        root.mkdir(parents=True, exist_ok=True)

    @property
    def login(self) -> dict[str, str]:
        """The admin login the server generated (empty with --no-auth)."""
        path = server_auth.secrets_path(self.root)
        if "--no-auth" in self.extra_args or not path.exists():
            return {}
        return {k: v for k, v in server_auth.read_env_file(path).items() if k in LOGIN_VARS}

    def start(self, timeout: float = 120) -> str:
        env = {k: v for k, v in os.environ.items()
               if k != "MLFLOW_TRACKING_URI" and k not in LOGIN_VARS}
        with open(self.log, "ab") as log:  # the child keeps its own handle
            # Its own session, so stop() can also catch a worker that lost its parent.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "train", "server", "--host", self.host,
                 "--port", str(self.port),
                 *([] if self.store_env else
                   ["--backend-store-uri", f"sqlite:///{self.root / 'server.db'}"]),
                 "--auth-dir", str(self.root),
                 "--artifacts-destination", str(self.root / "artifacts"), *self.extra_args],
                cwd=REPO, env={**env, **self.store_env}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2,
                                            context=self._ssl()) as r:
                    if r.status == 200:
                        self._use_login()
                        return self.url
            except OSError:
                time.sleep(0.2)
            if self.proc.poll() is not None:
                raise AssertionError(f"the tracking server exited:\n{self.tail()}")
        self.stop()
        raise AssertionError(f"the tracking server did not answer within {timeout} s:\n"
                             f"{self.tail()}")

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        cert = self.extra_args[self.extra_args.index("--certfile") + 1]
        return ssl.create_default_context(cafile=cert)

    def _use_login(self) -> None:
        """This process (and the jobs it starts) log in as the server's admin."""
        for name, value in self.login.items():
            self.saved_env.setdefault(name, os.environ.get(name))
            os.environ[name] = value

    def _forget_login(self) -> None:
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.saved_env = {}

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def processes(self) -> list[psutil.Process]:
        """Every live process of the server: the tree under it and anything in its session."""
        if self.proc is None:
            return []
        found: dict[int, psutil.Process] = {}
        with suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.proc.pid)
            found = {p.pid: p for p in [root, *root.children(recursive=True)]}
        for p in psutil.process_iter():
            with suppress(psutil.Error):
                if p.pid not in found and os.getsid(p.pid) == self.proc.pid:
                    found[p.pid] = p
        return list(found.values())

    def stop(self) -> None:
        """Kill the whole tree at once (no graceful drain needed in tests) and reap it."""
        if self.proc is None:
            return
        tree = self.processes()
        for p in tree:
            with suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=15)
        self.proc.wait(timeout=15)
        left = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        self.proc = None
        self._forget_login()
        assert not left, f"tracking server processes left behind: {left}"


@contextmanager
def tracking_server(root: Path, host: str = "127.0.0.1",
                    extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    """A running server with its store under `root`; yields its URL, stops it afterwards."""
    server = ServerProcess(root, host=host, extra_args=extra_args)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


# Logged once per epoch with step = epoch (0-based).
EPOCH_METRICS = ("train/loss", "train/accuracy", "train/samples", "train/samples_per_sec",
                 "val/loss", "val/accuracy", "val/samples", "lr", "epoch_time_s")


def jobs_at_once(url: str, experiment: str, out_dir: Path, jobs: int = 8) -> list:
    """`jobs` 2-epoch jobs started together against the server at `url`, all started before any
    has created `experiment` (they race to create it); each must succeed and land complete:
    one FINISHED run per job, every epoch metric at steps 0 and 1 exactly once. Returns the
    runs."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": url}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "train", "trainer.epochs=2", "model=mlp",
         "tracking.log_model=false", "trainer.checkpoint_every=0",
         f"tracking.experiment={experiment}", f"tracking.run_name=job{i}",
         f"hydra.run.dir={out_dir}/job{i}"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i in range(jobs)]
    errors = [p.communicate(timeout=500)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * jobs, "\n".join(e[-2000:] for e in errors)
    runs = runs_in(url, experiment)
    assert sorted(r.info.run_name for r in runs) == [f"job{i}" for i in range(jobs)]
    for run in runs:
        assert run.info.status == "FINISHED", run.info.run_name
        for key in EPOCH_METRICS:  # every epoch exactly once, none lost or doubled
            steps = [s for s, _ in history(url, run.info.run_id, key)]
            assert steps == [1, 2], (run.info.run_name, key, steps)
        assert run.data.params["tracking.experiment"] == experiment
    return runs
