"""A real MLflow tracking server for tests: `python -m train.server` on a free port."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil

from tests.conftest import REPO
from train.distenv import free_port


class Server:
    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root, self.port = root, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> None:
        with open(self.root / "server.log", "ab") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "train.server", "--port", str(self.port),
                 "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
                 "--artifacts-destination", str(self.root / "artifacts")],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
        raise AssertionError(f"the tracking server did not answer within {timeout} s")

    def stop(self) -> None:
        """The whole process tree (gunicorn master and workers), nothing left behind."""
        if self.proc is None:
            return
        tree = [psutil.Process(self.proc.pid)]
        with suppress(psutil.NoSuchProcess):
            tree += tree[0].children(recursive=True)
        for p in tree:
            with suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=10)
        self.proc = None


@contextmanager
def tracking_server(root: Path) -> Iterator[Server]:
    root.mkdir(parents=True, exist_ok=True)
    server = Server(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()
