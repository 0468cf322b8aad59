"""The local launcher's processes, without a training job: it stays light at import, its ranks
end with it, and a failed rank stops the others after the grace period."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO
from train.launch import local as launch
from train.launch.local import root_cause


def test_the_launcher_imports_no_torch() -> None:
    """`--help` and refused configurations answer fast: torch is imported by the ranks. So do
    the commands that check a run before starting a job (rerun, eval, predict)."""
    code = ("import sys, train.launch.local, train.launch.rank_server, train.launch.rerun, "
            "train.launch.evaluate, train.launch.predict; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"


PREFLIGHT = """
import sys
from tests.conftest import typed
from train.launch.preflight import preflight
preflight([typed("distributed.nproc_per_node=2")], output_dir=sys.argv[1])
print(sorted(m for m in ("torch", "mlflow") if m in sys.modules))
"""


def test_the_pre_flight_of_a_default_job_imports_neither_torch_nor_mlflow(
        tmp_path: Path, store: dict[str, str]) -> None:
    """The launching process of every job runs the pre-flight; torch (1.1 s of CPU) is imported
    by the fork server its ranks come from, mlflow by rank 0: importing them here as well made
    every local job ~1.4 s of CPU dearer and its first step that much later."""
    result = subprocess.run([sys.executable, "-c", PREFLIGHT, str(tmp_path / "job")], cwd=REPO,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, **store})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


ORPHAN = """
import multiprocessing, os, sys, time
from train.distributed import stopping
from train.launch import rank_process, rank_server

def rank(launcher, report):
    rank_process.end_with(launcher)
    with stopping.StopSignals() as stop:
        print(os.getpid(), flush=True)
        deadline = time.monotonic() + 120
        while stop.received is None and time.monotonic() < deadline:
            time.sleep(0.05)  # as the training loop: the flag is read at step boundaries
    with open(report, "w") as f:
        f.write(str(stop.received))

if __name__ == "__main__":
    p = rank_server.rank_context().Process(target=rank, args=(os.getpid(), sys.argv[1]))
    p.start()
    p.join()
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ignore_stop_signals() -> None:
    """As `nohup` or a non-interactive shell's `cmd &` start a process: these ignored, which
    its children inherit."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)


def test_a_rank_stops_when_its_launcher_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves the launcher no chance to stop its ranks: its fork server sees its pipe
    close and exits, and the kernel sends the ranks TERM, their coordinated stop, even from a
    launcher started with the stop signals ignored."""
    script, report = tmp_path / "launcher.py", tmp_path / "received"
    script.write_text(ORPHAN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen([sys.executable, str(script), str(report)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                preexec_fn=_ignore_stop_signals)
    assert launcher.stdout is not None
    rank_pid = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not _gone(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(rank_pid):
        os.kill(rank_pid, signal.SIGKILL)  # this test's own orphan
        raise AssertionError("the rank outlived its launcher")
    assert report.read_text() == "SIGTERM"


LATE_USR2 = """
import os, signal, sys
from train.distributed import stopping

def submitits(signum, frame):  # as submitit's handler: a finished job's USR2 fails it
    raise RuntimeError("Job not requeued because: timed-out too many times.")

# Before the rank's own: submitit's handler, or one that does nothing (Python's finalisation
# then puts back USR2's default action, which ends the process by the signal).
signal.signal(signal.SIGUSR2, submitits if sys.argv[2] == "submitit" else lambda *_: None)
with stopping.StopSignals(own_process=sys.argv[1] == "own") as stop:
    pass  # training, done
os.kill(os.getpid(), signal.SIGUSR2)  # Slurm's time-limit warning, after the work
rank = os.getpid()
if os.fork() == 0:  # and again while the rank's interpreter exits, until it is gone
    os.close(1), os.close(2)
    while os.getppid() == rank:  # reparented once the rank has exited
        os.kill(rank, signal.SIGUSR2)
    os._exit(0)
print("finished", flush=True)
"""


def test_a_time_limit_warning_after_the_work_leaves_a_rank_finished(tmp_path: Path) -> None:
    """A Slurm job that ends within the USR2 lead time of its limit gets the warning after its
    run FINISHED: a rank in its own process ignores it, through the interpreter's exit too
    (where Python puts USR2's default action back), so srun does not mark the step FAILED.
    A one-rank job inside the launching process gets the previous handler back instead."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def rank(process: str, before: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", LATE_USR2, process, before], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    for before in ("submitit", "none"):
        for _ in range(3):  # the exit's window is short: more than once
            own = rank("own", before)
            assert own.returncode == 0 and own.stdout == "finished\n", (before, own.returncode,
                                                                         own.stderr)
    shared = rank("shared", "submitit")
    assert shared.returncode == 1 and "timed-out too many times" in shared.stderr


def test_a_failed_rank_stops_the_others_after_the_grace_period(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Never a hang: rank 0 would sleep for a minute; rank 1 exits with code 3."""
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=os._exit, args=(3,))]
    for p in procs:
        p.start()
    started = time.monotonic()
    launch._supervise(procs)
    stopped = launch._stop(procs)
    assert time.monotonic() - started < 10
    assert stopped == {0}
    assert [p.exitcode for p in procs] == [-signal.SIGTERM, 3]
    exits = {rank: p.exitcode for rank, p in enumerate(procs)}
    assert root_cause(exits, [], stopped) == "rank 1 exited with code 3"


def test_a_rank_ending_its_run_gets_longer_than_the_grace_period(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 has begun ending its run (its event set) and needs 3 s; rank 1 exits with code 3.
    Rank 0 finishes on its own, up to the extension (30 s here), instead of being stopped."""
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(3,)), ctx.Process(target=os._exit, args=(3,))]
    ending = [ctx.Event(), ctx.Event()]
    ending[0].set()
    for p in procs:
        p.start()
    launch._supervise(procs, ending, 30.0)
    assert launch._stop(procs) == set()
    assert [p.exitcode for p in procs] == [0, 3]


def test_the_fork_servers_imports_leave_cuda_alone() -> None:
    """Ranks are forked after train/launch/fork_server.py's imports (and `preloads`'): none
    of them may ask
    CUDA anything (a driver initialised before a fork is unusable in the child). The calls
    that would are counted while the fork server's module is imported."""
    code = """
import torch
calls = []
for module, names in ((torch._C, ("_cuda_getDeviceCount", "_cuda_init")),
                      (torch.cuda, ("is_available", "device_count", "init", "_lazy_init"))):
    for name in names:  # the C entry points, and torch.cuda's (a CPU build answers in Python)
        original = getattr(module, name)
        setattr(module, name, lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a))
import train.launch.fork_server
from train.launch.rank_server import preloads
for name in preloads({"name": "arrow"}):  # what it imports for a job on images as well
    __import__(name)
import sys
print(sorted(calls), "torch._dynamo" in sys.modules, "train.engine.job" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.split() == ["[]", "True", "True"]


def test_a_job_refused_at_pre_flight_leaves_no_process_behind(tmp_path: Path) -> None:
    """The ranks' fork server starts as the launch begins, importing torch while the pre-flight
    runs; a job the pre-flight refuses ends with its one line, and the server with it."""
    missing = tmp_path / "no-such-images"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "train", "data=imagefolder", f"data.root={missing}",
         "distributed.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'job'}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # its processes, and only they, in a session of their own
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert str(missing) in output and "Traceback" not in output, output

    def left() -> list[int]:
        mine = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == launcher.pid and p.status() != psutil.STATUS_ZOMBIE:
                    mine.append(p.pid)
            except (OSError, psutil.Error):
                continue  # gone meanwhile
        return mine

    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    if survivors := left():
        for pid in survivors:  # this test's own orphans
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes of the refused job outlived its launcher: {survivors}")
