"""The local launcher without a training job: root-cause reporting, staying light at import, and
ranks that end with their launcher. Fast: no torch in the processes started here."""

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
from train.distributed import stopping
from train.launch import local as launch
from train.launch.local import RankOutcome, root_cause


def _error(rank: int, at: float, last_line: str) -> RankOutcome:
    """What a rank sends back when it raises: its traceback, and when."""
    text = ("Traceback (most recent call last):\n"
            '  File "train/engine/loop.py", line 94, in train_epoch\n'
            f"{last_line}\n")
    return RankOutcome(rank, "error", text, at)


def test_the_earliest_python_error_is_the_root_cause() -> None:
    """Rank 1 raised first; rank 0 then saw its closed connection (and sent later)."""
    outcomes = [_error(0, 100.8, "RuntimeError: Connection closed by peer"),
                _error(1, 100.2, "train.engine.loop.FailureDrill: failing on purpose at step 3")]
    cause = root_cause({0: 1, 1: 1}, outcomes, stopped=set())
    assert cause.startswith("rank 1 failed first:\nTraceback (most recent call last):")
    assert cause.rstrip().endswith("FailureDrill: failing on purpose at step 3")
    assert "Connection closed" not in cause


def test_a_rank_killed_by_a_signal_is_the_root_cause() -> None:
    """A SIGKILLed rank sends nothing; the others' errors only say they lost it."""
    outcomes = [_error(0, 100.5, "RuntimeError: Connection reset by peer")]
    cause = root_cause({0: 1, 1: -signal.SIGKILL}, outcomes, stopped=set())
    assert cause == ("rank 1 was killed by SIGKILL; "
                     "then rank 0 stopped: RuntimeError: Connection reset by peer")


def test_ranks_the_launcher_stopped_are_not_the_root_cause() -> None:
    """Rank 0 hung after rank 1's error and was stopped with SIGTERM by the launcher."""
    outcomes = [_error(1, 100.0, "ValueError: bad batch")]
    cause = root_cause({0: -signal.SIGTERM, 1: 1}, outcomes, stopped={0})
    assert cause.startswith("rank 1 failed first:\n")
    assert cause.rstrip().endswith("ValueError: bad batch")


def test_errors_at_the_same_time_go_to_the_lower_rank() -> None:
    outcomes = [_error(2, 100.0, "OSError: two"), _error(1, 100.0, "OSError: one")]
    assert root_cause({1: 1, 2: 1}, outcomes, stopped=set()).startswith("rank 1 failed first")


def test_without_an_error_or_a_signal_the_exit_codes_are_the_root_cause() -> None:
    assert root_cause({0: 0, 1: 3}, [], stopped=set()) == "rank 1 exited with code 3"


def test_the_launcher_imports_no_torch() -> None:
    """`--help` and refused configurations answer fast: torch is imported by the ranks."""
    code = "import sys, train.launch.local; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"


ORPHAN = """
import multiprocessing, os, sys, time
from train.distributed import stopping
from train.launch import local as launch

def rank(launcher, report):
    launch._end_with(launcher)
    with stopping.StopSignals() as stop:
        print(os.getpid(), flush=True)
        deadline = time.monotonic() + 120
        while stop.received is None and time.monotonic() < deadline:
            time.sleep(0.05)  # as the training loop: the flag is read at step boundaries
    with open(report, "w") as f:
        f.write(str(stop.received))

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=rank, args=(os.getpid(), sys.argv[1]))
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
    """SIGKILL leaves the launcher no chance to stop its ranks: the kernel sends them TERM,
    their coordinated stop, even from a launcher started with the stop signals ignored."""
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


def test_the_first_stop_signal_names_the_stop_and_a_second_ctrl_c_aborts() -> None:
    """A closed terminal sends HUP to the group, the launcher passes TERM on: HUP it was. A
    second Ctrl-C does not wait for the checkpoint."""
    with stopping.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGHUP"
        assert str(stop.preempted()) == "stopped by SIGHUP after saving a checkpoint"
    with stopping.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs before this ends
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # the previous handlers are back


def test_a_stop_job_exits_as_a_shell_reports_the_signal() -> None:
    stopped = launch.JobStoppedError("SIGTERM", "/tmp/out")
    assert stopped.exit_code == 143
    assert str(stopped) == ("stopped by SIGTERM after saving a checkpoint in /tmp/out/checkpoints;"
                            " the same command with hydra.run.dir=/tmp/out resumes it")


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
