"""A local rank's own process, from its first line to its outcome: what the local launcher
(train/launch/local.py) forks from multiprocessing's fork server. It stops with its launcher
(TERM as its death signal), sends C++'s stderr noise to train.log, runs the rank and sends back its
outcome (a result, a stop, or an error with its traceback). Light at import, as the launcher
that imports it: torch and train.engine.job are already imported in a rank (its fork server's).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from train.distributed import rankfiles, stopping
from train.distributed.stopping import Preempted
from train.errors import FAILURE_REASON, SILENT_RANKS, USER_TRACE
from train.launch.outcomes import RankOutcome

if TYPE_CHECKING:
    import multiprocessing as mp
    from multiprocessing.synchronize import Event

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


HELD_SIGNALS = {*stopping.STOP_SIGNALS, rankfiles.STACKS_SIGNAL}
"""Blocked from the fork server on (train/launch/local.py), unblocked once a rank handles them:
a stop that comes while a rank starts is delivered then, not lost."""


def rank_entry(config: dict[str, Any], output_dir: str, command: str, launcher: int,
               env: dict[str, str], umask: int, outcomes: mp.Queue, ending: Event) -> None:
    end_with(launcher)
    os.environ.clear()  # the launcher's environment now, not the fork server's when it started
    os.environ.update(env)
    os.umask(umask)
    rank = int(env["RANK"])
    _native_noise_to_log(Path(output_dir) / "train.log")
    try:
        from train.engine.job import run_rank

        metrics = run_rank(config, output_dir, command, ending_run=ending.set)
        outcome = RankOutcome(rank, "result", metrics, time.time())
    except Preempted as e:
        outcome = RankOutcome(rank, "stopped", e.signal_name, time.time())
    except BaseException as e:
        outcome = RankOutcome(rank, "error", "".join(traceback.format_exception(e)), time.time(),
                              getattr(e, FAILURE_REASON, None), getattr(e, SILENT_RANKS, ()),
                              getattr(e, USER_TRACE, None))
    outcomes.put(outcome)
    # The rank's work is done: spare the interpreter's final garbage collection over every
    # object torch, mlflow and pyarrow made (~2 s on rank 0 here); memory goes back to the OS
    # anyway, and atexit handlers and plain deallocation still run.
    gc.freeze()
    if outcome.kind == "error":
        raise SystemExit(1)


def _native_noise_to_log(log_file: Path) -> None:
    """What C++ writes to this rank's stderr (c10d's warnings with their frames, once a peer
    is gone) goes to the job's train.log; Python's stderr (the log's terminal lines, warnings)
    stays on the terminal, through a copy of the original descriptor."""
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        terminal = os.fdopen(os.dup(2), "w", buffering=1, errors="backslashreplace")
    except OSError:
        return
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = terminal


def end_with(launcher: int) -> None:
    """This rank gets TERM when the launching process dies, even by SIGKILL: the coordinated
    stop (a checkpoint, the run KILLED) instead of training on unsupervised.

    TERM, not INT as before: Python may not heed an INT (a launcher started in the background
    by a non-interactive shell passes INT on as ignored), and an INT made the run FAILED with
    a bare KeyboardInterrupt and no checkpoint. Stop signals that come while the rank starts
    are kept (stopping.note_early) rather than killing it unannounced."""
    stopping.note_early()
    # Until its watch registers faulthandler for it, a stack request must not kill the rank.
    signal.signal(rankfiles.STACKS_SIGNAL, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)  # held since the fork server
    with contextlib.suppress(AttributeError, OSError):  # Linux only; elsewhere: best effort
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # The parent is the fork server, which exits when the launcher does (its pipe closes).
    parent = os.getppid()
    if launcher not in (parent, _parent_of(parent)):  # either died before the line above
        raise SystemExit(1)


def _parent_of(pid: int) -> int:
    """The parent of process `pid`; -1 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces
