"""The local launcher without a training job, in process: root-cause reporting and stop signals.
Its real processes (light at import, ranks that end with it, the grace period):
tests/e2e/test_launch.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

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


def test_the_first_stop_signal_names_the_stop_and_a_second_ctrl_c_aborts() -> None:
    """A closed terminal sends HUP to the group, the launcher passes TERM on: HUP it was.
    Ctrl-C's INT names the stop even after the TERM the launcher made of it. A second Ctrl-C
    does not wait for the checkpoint."""
    before = signal.getsignal(signal.SIGHUP)  # SIG_DFL, or SIG_IGN under nohup
    with stopping.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGHUP"
        assert str(stop.preempted()) == "stopped by SIGHUP after saving a checkpoint"
    with stopping.StopSignals() as stop:  # Ctrl-C: the launcher's TERM handled before the INT
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs before this ends
    assert signal.getsignal(signal.SIGHUP) == before  # the previous handlers are back


def test_a_stop_job_exits_as_a_shell_reports_the_signal() -> None:
    stopped = launch.JobStoppedError("SIGTERM", "/tmp/out")
    assert stopped.exit_code == 143
    assert str(stopped) == ("stopped by SIGTERM after saving a checkpoint in /tmp/out/checkpoints;"
                            " the same command with hydra.run.dir=/tmp/out resumes it")
