"""`python -m train` jobs started from a warm interpreter (tests/conftest.py `run_train`).

A job's process spends most of its CPU importing torch, mlflow, Hydra and the training code
before it reads its first override: of a one-rank digits job's 19 CPU seconds on the 2-core CI
kind, 5 were left when the same job was forked from a process that had imported them
(measured with a cpuacct cgroup, 2026-12-01). The suite runs hundreds of such jobs on two
cores, so each pytest worker keeps one such process (the zygote, `serve`), started at its first
job, and `run` forks each job from it.

What the job runs is what `python -m train ARGS` runs: train/__main__.py as `__main__`, with
the job's argv, environment, working directory, sys.path (the working directory, then its
PYTHONPATH), stdin, stdout and stderr, in a process of its own whose exit code (or signal)
comes back - only the imports happened before it, and its ranks' fork server is a fork of it
as it starts (`_fork_the_fork_server`), not a new interpreter. It starts cold, as a new
interpreter, where that could differ: another module than train, a working directory or
PYTHONPATH from which `train` would be another copy's, a sitecustomize on PYTHONPATH (code a
new interpreter runs first), `warm=False` (what a fresh interpreter does: command lines in
`ps`, import-time behaviour, the fork server's own start) or TRAIN_TESTS_COLD=1 (the whole
suite cold).

The zygote imports nothing whose import reads the environment the job sets (transformers,
datasets, huggingface_hub, the user's packages): those import in the job. Each job is forked
by a waiter (itself forked from the zygote), which reports its pid and its exit status.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, NoReturn

from train.distributed import process_end

REPO = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "torch._dynamo", "torchvision", "mlflow", "mlflow.tracking",
           "mlflow.pytorch", "mlflow.store.tracking.sqlalchemy_store", "hydra", "omegaconf",
           "train.app", "train.engine.job", "train.launch.local", "train.launch.preflight")
"""What nearly every job imports (the optimiser imports torch._dynamo)."""
NOT_PRELOADED = ("transformers", "datasets", "huggingface_hub", "tokenizers")
"""Read the environment at import (HF_* caches, offline flags): each job imports its own."""
COLD = "TRAIN_TESTS_COLD"


def eligible(module: tuple[str, ...], cwd: Path, env: dict[str, str]) -> bool:
    """Whether this `python <module>` job may start warm: `-m train` from the repository, with
    no PYTHONPATH entry that holds another `train` package."""
    if os.environ.get(COLD) == "1" or module != ("-m", "train") or Path(cwd).resolve() != REPO:
        return False
    for entry in map(Path, filter(None, env.get("PYTHONPATH", "").split(os.pathsep))):
        if (entry / "train").is_dir() and entry.resolve() != REPO:
            return False
        # Code a new interpreter runs before anything else (a test's import hooks).
        if any((entry / f"{name}.py").exists() for name in ("sitecustomize", "usercustomize")):
            return False
    return True


# -- the pytest worker's side -----------------------------------------------------------------
_zygote: subprocess.Popen[bytes] | None = None
_socket_path: Path | None = None
_lock = threading.Lock()


def _started() -> Path:
    global _zygote, _socket_path
    with _lock:
        if _zygote is not None and _zygote.poll() is None:
            return _socket_path  # type: ignore[return-value]
        folder = Path(tempfile.mkdtemp(prefix="train-warm-"))  # 0700: this user's alone
        _socket_path = folder / "zygote.sock"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MLFLOW_", "SLURM_", "HF_"))}
        # pyarrow (mlflow imports it) would start jemalloc's background thread: a zygote that
        # forks must hold no thread but its own.
        env["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
        _zygote = subprocess.Popen([sys.executable, "-m", "tests.warm", str(_socket_path)],
                                   cwd=REPO, env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
        assert _zygote.stdout is not None
        if _zygote.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the warm interpreter did not start (exit {_zygote.wait()})")
        atexit.register(_stop)
        return _socket_path


def _stop() -> None:
    if _zygote is not None and _zygote.poll() is None:
        assert _zygote.stdin is not None
        _zygote.stdin.close()  # the zygote ends at its stdin's end
        try:
            _zygote.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _zygote.kill()


def run(args: list[str], env: dict[str, str], cwd: Path,
        timeout: float) -> subprocess.CompletedProcess[str]:
    """As subprocess.run([python, -m, train, *args], capture_output=True, text=True)."""
    path = _started()
    command = [sys.executable, "-m", "train", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            open(os.devnull, "rb") as stdin, socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(path))
        body = json.dumps({"args": args, "env": env, "cwd": str(cwd)}).encode()
        socket.send_fds(conn, [f"{len(body)}\n".encode() + body],
                        [stdin.fileno(), out.fileno(), err.fileno()])
        replies = _Lines(conn)
        pid = replies.next()["pid"]
        conn.settimeout(timeout)
        try:
            status = replies.next()["status"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)  # as subprocess.run kills its child at the timeout
            conn.settimeout(30)
            replies.next()
            raise subprocess.TimeoutExpired(command, timeout, _read(out), _read(err)) from None
        return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status),
                                           _read(out), _read(err))


class _Lines:
    """JSON lines from a socket whose timeout may expire between them."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def next(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            chunk = self.conn.recv(1 << 12)
            if not chunk:
                raise RuntimeError("the warm interpreter's waiter ended without an answer")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)


def _read(f: Any) -> str:
    f.seek(0)
    return f.read().decode("utf-8", errors="replace")


# -- the zygote ---------------------------------------------------------------------------------
def serve(path: str) -> None:
    """Import PRELOAD, then fork a waiter per connection until stdin ends."""
    for name in PRELOAD:
        importlib.import_module(name)
    leaked = [m for m in NOT_PRELOADED if m in sys.modules]
    assert not leaked, f"the zygote imported {leaked}, which read the job's environment"
    base_path = [p for p in sys.path if p not in ("", str(REPO))
                 and p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    events.register(sys.stdin, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in events.select():
            if key.fileobj is sys.stdin:
                return  # the pytest worker is gone
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _wait_for_job(conn, base_path)
                os._exit(0)
            conn.close()


def _wait_for_job(conn: socket.socket, base_path: list[str]) -> None:
    head, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    length, _, body = head.partition(b"\n")
    while len(body) < int(length):
        body += conn.recv(1 << 16)
    request = json.loads(body)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _be_the_job(request, fds, base_path)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):  # the test may have gone (its own timeout)
        conn.sendall(json.dumps({"status": status}).encode() + b"\n")


def _be_the_job(request: dict[str, Any], fds: list[int], base_path: list[str]) -> NoReturn:
    """This process becomes `python -m train ARGS`: its streams, directory, environment and
    path, then train/__main__.py as __main__ and the interpreter's own ending."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # What the imports computed from the zygote's own environment or state: the temporary
    # directory (the job's TMPDIR decides), numpy's global random state (fresh entropy, as
    # a new interpreter's; Python's `random` reseeds itself at fork).
    tempfile.tempdir = None
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *base_path]
    sys.argv = ["-m", *request["args"]]
    _fork_the_fork_server()
    code = 0
    try:  # train/__main__.py ends the process itself (process_end); what escapes it ends here
        runpy.run_module("train", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = process_end.exit_code(e)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught error
        traceback.print_exc()
        code = 1
    process_end.end_process(code)  # threads, atexit and the streams, as the interpreter ends


def _fork_the_fork_server() -> None:
    """The job's fork server (train/launch/rank_server.py, `rank_context`), forked from this
    still clean process now rather than spawned when the job starts its ranks: a spawned one
    is a new interpreter importing torch, torch._dynamo and the training code (2.8 s of CPU,
    124 times in a suite), which this process already holds. Started as rank_context starts
    one - a child of the job, its own listener in the job's temporary folder, the stop
    signals blocked, ended with the job (train/launch/fork_server.py's end_with_launcher),
    no file descriptor but its own and the standard streams - and found running by
    rank_context, which then starts none. A job that starts no ranks leaves it idle until it
    ends (a fork: ~30 ms). Python 3.14's fork server also wants an authentication key: there,
    the job spawns its own as a cold one does."""
    from multiprocessing import connection, forkserver

    from train.distributed import env as distenv
    from train.launch import fork_server, rank_process

    server = forkserver._forkserver  # type: ignore[attr-defined]
    if hasattr(server, "_forkserver_authkey") or server._forkserver_pid is not None:
        return
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    try:
        listener.bind(address)
    except OSError:  # a TMPDIR too long for a socket: the job's own checks say so
        listener.close()
        return
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server ends at its end: when every user has ended
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, rank_process.HELD_SIGNALS)
            keep = sorted({0, 1, 2, listener.fileno(), alive_r})
            for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
                os.closerange(low + 1, high)
            os.environ[distenv.FORK_SERVER_VAR] = str(launcher)
            fork_server.end_with_launcher()
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


if __name__ == "__main__":
    serve(sys.argv[1])
